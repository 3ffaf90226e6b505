"""LoRA backends: how a step's adapter tokens take their deltas, one class per kernel set, chosen by the step backend
(engine/backends/) when the runner is built and handed to every LoRA linear.

Each backend says how a slot table is stored (its dtype, and whether A is K-major), turns the step's adapter runs
into the one object every linear of the step reads (`LoRAStepState.step`), and adds a linear's delta from it:
- `TorchLoRA`: the tokens as segments of one adapter each (segments.py, `LoRABatch`); per group of segments,
  batched matmuls over their weights, then one index_add into the base output (or, when one group holds every
  token in order, the expand matmul adds into it in place). On CPU its slots are float32: CPU bf16 batched
  matmuls of these shapes are slow.
- `CppLoRA`: each token reads its own slot's weights in place, one C++ call per linear (cpu/lora.cpp, `TokenSlots`),
  A stored K-major for its dot products, and in the model's dtype, since every token reads its slot's weights and
  bf16 halves those bytes. One call per linear, not the grouped path's ten small ops, is what keeps a decode step
  of many adapters near the base model's throughput.
- `TritonLoRA`: the tokens grouped by slot (`SlotOrder`), tiles of one slot's tokens multiplying that slot's
  weights in place (triton_kernels.py), on every CUDA step, a decode graph's capture too.
A mixture of experts' expert LoRA (expert_linear.py) adds per (token, expert) pair through `expert_add_`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.lora.segments import (
    AdapterRun,
    LoRABatch,
    LoRAGroup,
    SlotOrder,
    build_lora_batch,
    per_token_slots,
    slot_order,
    token_slots,
)


@dataclass(frozen=True)
class TokenSlots:
    """Each token's slot (-1: the base model), for the C++ call that indexes by it."""
    slots: torch.Tensor


LoRAStep = LoRABatch | TokenSlots | SlotOrder


class LoRAStepState:
    """What every LoRA linear of a step reads, set by the runner before the forward pass: `step`, the step's adapter
    tokens as its LoRA backend takes them (engine/lora/backends.py; None: no token has an adapter). A decode CUDA
    graph is captured with the graph's own static SlotOrder, which each replay refills. A mixture of experts'
    expert LoRA (engine/lora/expert_linear.py) reads `expert_slots`, each token's slot, on every backend."""

    def __init__(self):
        self.step: LoRAStep | None = None
        self.expert_slots: torch.Tensor | None = None

    def clear(self) -> None:
        self.step = self.expert_slots = None


class LoRASlots(Protocol):
    """What a backend reads of a LoRA linear (engine/lora/linear.py): its slot table and which slots hold weights."""
    a_slots: torch.Tensor
    b_slots: list[torch.Tensor]
    max_rank: int
    expand_dtype: torch.dtype | None
    slots_with_weights: set[int]

    def weights(self, slots: torch.Tensor | slice) -> tuple[torch.Tensor, list[torch.Tensor]]: ...


class TorchLoRA:
    name = "torch"

    def __init__(self, device: torch.device, float32_slots: bool, a_k_major: bool):
        self.device, self.float32_slots, self.a_k_major = device, float32_slots, a_k_major

    def slot_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if self.float32_slots else dtype

    def step(self, runs: list[AdapterRun], max_loras: int, padding: int) -> LoRABatch | None:
        return build_lora_batch(runs, self.device, padding)

    def add(self, linear: LoRASlots, x: torch.Tensor, y: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
        if not linear.slots_with_weights:  # a linear that no resident adapter targets adds nothing
            return y
        group = batch.in_order_group
        if group is not None and x.dtype == y.dtype == linear.expand_dtype:  # expand in place
            a, (b,) = linear.weights(group.slots)
            out = y.view(group.segments, group.longest, -1)
            return out.baddbmm_(_shrink(x, group, a), b).view(y.shape)
        deltas = [_group_delta(linear, x, group) for group in batch.groups]
        delta = deltas[0] if len(deltas) == 1 else torch.cat(deltas)
        if batch.valid_positions is not None:
            delta = delta.index_select(0, batch.valid_positions)
        if batch.token_rows is None:
            return y.add_(delta)
        return y.index_add_(0, batch.token_rows, delta.to(y.dtype))

    def expert_add_(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                    rank: int) -> None:
        """y[i] += x[i] @ a[slots[i]] @ b[slots[i]] for the pairs of slots >= 0, one (slot, expert) at a time: the
        reference path."""
        for row in torch.unique(slots[slots >= 0]).tolist():
            pairs = (slots == row).nonzero().squeeze(1)
            delta = (x[pairs].to(a.dtype) @ a[row]) @ b[row]
            y.index_add_(0, pairs, delta.to(y.dtype))


def _shrink(x: torch.Tensor, group: LoRAGroup, a: torch.Tensor) -> torch.Tensor:
    grouped = x if group.gather_index is None else x.index_select(0, group.gather_index)
    return torch.bmm(grouped.view(group.segments, group.longest, -1).to(a.dtype), a)


def _group_delta(linear: LoRASlots, x: torch.Tensor, group: LoRAGroup) -> torch.Tensor:
    a, bs = linear.weights(group.slots)
    shrunk = _shrink(x, group, a)
    if len(bs) == 1:
        return torch.bmm(shrunk, bs[0]).flatten(0, 1)
    r = linear.max_rank
    return torch.cat([torch.bmm(shrunk[..., i * r:(i + 1) * r], b) for i, b in enumerate(bs)], dim=-1).flatten(0, 1)


class CppLoRA(TorchLoRA):
    name = "cpu"

    def __init__(self, device: torch.device, cpu_ops):
        super().__init__(device, float32_slots=False, a_k_major=True)
        self.cpu_ops = cpu_ops

    def step(self, runs: list[AdapterRun], max_loras: int, padding: int) -> TokenSlots | None:
        slots = token_slots(runs, self.device)
        return None if slots is None else TokenSlots(slots)

    def add(self, linear: LoRASlots, x: torch.Tensor, y: torch.Tensor, step: TokenSlots) -> torch.Tensor:
        if linear.slots_with_weights:  # a linear that no resident adapter targets adds nothing
            self.cpu_ops.lora_add_(y, x, linear.a_slots, linear.b_slots, step.slots, linear.max_rank)
        return y

    def expert_add_(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                    rank: int) -> None:
        self.cpu_ops.lora_add_(y, x, a, [b], slots, rank)


class TritonLoRA(TorchLoRA):
    name = "cuda"

    def __init__(self, device: torch.device):
        super().__init__(device, float32_slots=False, a_k_major=False)

    def step(self, runs: list[AdapterRun], max_loras: int, padding: int) -> SlotOrder:
        return slot_order(per_token_slots(runs), max_loras, self.device)

    def add(self, linear: LoRASlots, x: torch.Tensor, y: torch.Tensor, order: SlotOrder) -> torch.Tensor:
        from engine.lora.triton_kernels import lora_expand_, lora_shrink  # triton may be absent off CUDA

        return lora_expand_(y, lora_shrink(x, linear.a_slots, order), linear.b_slots, order, linear.max_rank)
