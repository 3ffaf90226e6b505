"""Decode steps replayed as CUDA graphs, one per batch-size bucket.

A decode step launches a few hundred small kernels (per layer: norms, projections, rotary, the cache
write, attention, the LoRA kernels); at small batches their launch gaps cost more than their work.
Each bucket's forward pass is captured once, at start-up, over static input buffers; a step copies
its inputs into the buffers, pads the batch to the next bucket and replays the graph. Prefill steps
(and mixed steps) stay eager: their shapes vary with every prompt.

What makes the forward capturable: attention reads the paged cache in place through block tables and
context lengths held on the device (engine/kernels/paged_attention.py); multi-LoRA takes the tokens
grouped by adapter slot as tensors (engine/lora/triton_kernels.py), so loading another adapter into a slot
changes what a replay computes without a new capture. Padded rows decode one dummy token into a scratch KV
block that no sequence owns, and their outputs are dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.layers.attention import KVCache, PagedAttention
from engine.lora.backends import LoRAStepState
from engine.lora.segments import SlotOrder, slot_order_values
from engine.tokens_in_flight import PendingInputs


@dataclass
class DecodeInputs:
    """A decode-only step on the host: one new token per sequence."""
    input_ids: list[int]
    positions: list[int]  # each token's position (its rotary row: layers/rotary.py)
    slot_mapping: list[int]  # the cache slot each new token's K/V is written to
    block_tables: list[list[int]]  # each sequence's blocks, any width up to the static one
    context_lens: list[int]  # tokens attended, the new one included
    lora_slots: list[int]  # adapter slot per sequence, -1 for the base model
    pending: PendingInputs  # the input tokens still on the device, from the step before (async scheduling)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64 and every 32 beyond, ending at max_batch: a step pads by at most
    a seventh of its size above 8 sequences."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(96, max_batch + 32, 32))
    return sorted({min(size, max_batch) for size in sizes})


class DecodeGraphs:
    def __init__(self, model: nn.Module, kv_caches: list[KVCache], lora_state: LoRAStepState, max_batch: int,
                 max_blocks: int, scratch_block: int, block_size: int, device: torch.device,
                 kv_write: Callable[..., None] | None = None, max_loras: int = 0):
        self.model = model
        self.kv_write = kv_write  # the fused K/V cache write (AttentionMetadata.kv_write), or None
        self.kv_caches = kv_caches
        self.lora_state = lora_state
        self.buckets = batch_buckets(max_batch)
        self.scratch_slot = scratch_block * block_size
        self.scratch_block = scratch_block
        longs = {"dtype": torch.long, "device": device}
        self.input_ids = torch.zeros(max_batch, **longs)
        self.positions = torch.zeros(max_batch, **longs)
        self.slot_mapping = torch.full((max_batch,), self.scratch_slot, **longs)
        self.block_tables = torch.full((max_batch, max_blocks), scratch_block, **longs)
        self.context_lens = torch.ones(max_batch, **longs)
        # the tokens grouped by adapter slot (engine/lora/triton_kernels.py): rows sorted by slot, each slot's start
        # and count
        self.max_loras = max_loras
        self.order_tokens = torch.zeros(max_batch, **longs)
        self.order_slots = torch.zeros(2 * max_loras, **longs)  # starts, then counts (all 0: no adapter token)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def _forward(self, size: int) -> torch.Tensor:
        meta = PagedAttention(self.slot_mapping[:size], size, [], self.kv_write,
                              decode_block_tables=self.block_tables[:size],
                              decode_context_lens=self.context_lens[:size])
        self.lora_state.step = SlotOrder(self.order_tokens[:size], self.order_slots[:self.max_loras],
                                               self.order_slots[self.max_loras:])
        try:
            return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)
        finally:
            self.lora_state.step = None

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest bucket first, all in one memory pool: the smaller graphs reuse the largest one's memory.
        Each bucket runs once eagerly first (Triton compiles its kernels for the shapes outside the capture)."""
        pool = None
        for size in reversed(self.buckets):
            self._forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def run(self, step: DecodeInputs, pending_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [n, hidden] of the step's n sequences; pending_tokens: the step before's tokens, on the
        device, which step.pending places."""
        n = len(step.input_ids)
        size = next(bucket for bucket in self.buckets if bucket >= n)
        self._fill(step, n, size)
        step.pending.fill(self.input_ids, pending_tokens)
        self.graphs[size].replay()
        self.replays += 1
        return self.outputs[size][:n]

    def _fill(self, step: DecodeInputs, n: int, size: int) -> None:
        width = max(len(table) for table in step.block_tables)
        tables = [table + [self.scratch_block] * (width - len(table)) for table in step.block_tables]
        order = slot_order_values(step.lora_slots, self.max_loras)  # n rows, then the slots' starts and counts
        flat = (step.input_ids + step.positions + step.slot_mapping + step.context_lens + order
                + [token for table in tables for token in table])
        host = torch.tensor(flat, dtype=torch.long).pin_memory()
        values = host.to(self.input_ids.device, non_blocking=True)  # one host-to-device copy
        rows = values[:4 * n].view(4, n)
        for buffer, row in zip((self.input_ids, self.positions, self.slot_mapping, self.context_lens), rows):
            buffer[:n].copy_(row)
        self.order_tokens[:n].copy_(values[4 * n:5 * n])
        self.order_slots.copy_(values[5 * n:5 * n + 2 * self.max_loras])
        self.block_tables[:n, :width].copy_(values[5 * n + 2 * self.max_loras:].view(n, width))
        self._pad(n, size)

    def _pad(self, n: int, size: int) -> None:
        """Rows n..size decode a dummy token into the scratch block."""
        if n == size:
            return
        self.slot_mapping[n:size].fill_(self.scratch_slot)
        self.context_lens[n:size].fill_(1)
        self.block_tables[n:size, 0].fill_(self.scratch_block)  # and no slot holds them: no adapter delta
