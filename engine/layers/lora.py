"""Batched multi-LoRA linears: one step mixes base-only tokens and tokens of many adapters.

Each wrapped linear keeps stacked, rank-padded slot weights A_t [max_loras, in, R] and
B_t [max_loras, R, out] (scaling folded into B). A fused linear (q/k/v, gate/up) stacks its
sub-modules along R, with each B block writing only its own output columns. Per step the tokens
are grouped by adapter slot into a padded [segments, longest, in] gather; the delta is two
batched matmuls over the segments' weights (one weight copy per adapter, never per token) and one
index_add into the base output. Base-only tokens never enter the LoRA path, and a step without
adapter tokens skips it entirely.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class LoRASubModule:
    key: str  # PEFT module key, e.g. "self_attn.k_proj"
    out_start: int  # first output column of this sub-module inside the (fused) linear
    out_size: int


@dataclass
class LoRABatch:
    """Tokens grouped by adapter slot; built once per step, shared by every LoRA layer."""
    gather_index: torch.Tensor  # [segments, longest]: token rows, padded with row 0
    slots: torch.Tensor | slice  # [segments]; a slice when the slots are contiguous (weights are then a view)
    valid_positions: torch.Tensor | None  # real tokens' positions in the flat [segments * longest]; None: no padding
    token_rows: torch.Tensor  # the token row of each valid position, same order


class LoRAStepState:
    """The runner sets `batch` before each forward pass; every LoRALinear reads it."""

    def __init__(self):
        self.batch: LoRABatch | None = None


def build_lora_batch(token_slots: list[int], device: torch.device) -> LoRABatch | None:
    """token_slots[i]: adapter slot of flat-batch token i, or -1 for base-only tokens."""
    rows_by_slot: dict[int, list[int]] = {}
    for row, slot in enumerate(token_slots):
        if slot >= 0:
            rows_by_slot.setdefault(slot, []).append(row)
    if not rows_by_slot:
        return None
    rows_by_slot = dict(sorted(rows_by_slot.items()))
    longest = max(len(rows) for rows in rows_by_slot.values())
    gather, valid, token_rows = [], [], []
    for s, rows in enumerate(rows_by_slot.values()):
        gather.append(rows + [0] * (longest - len(rows)))
        valid += range(s * longest, s * longest + len(rows))
        token_rows += rows

    def tensor(values):
        return torch.tensor(values, dtype=torch.long, device=device)

    slots = list(rows_by_slot)
    contiguous = slots == list(range(slots[0], slots[0] + len(slots)))
    slot_index = slice(slots[0], slots[-1] + 1) if contiguous else tensor(slots)
    padded = len(valid) < len(slots) * longest
    return LoRABatch(tensor(gather), slot_index, tensor(valid) if padded else None, tensor(token_rows))


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, in_features: int, subs: list[LoRASubModule], state: LoRAStepState,
                 max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.base = base
        self.subs = subs
        self.state = state
        self.max_rank = max_rank
        out_features = sum(s.out_size for s in subs)
        rank_total = max_rank * len(subs)
        if device.type == "cpu":  # CPU bf16 batched matmuls of these small shapes are slow; fp32 ones are not
            dtype = torch.float32
        self.register_buffer("lora_a", torch.zeros(max_loras, in_features, rank_total, dtype=dtype, device=device))
        self.register_buffer("lora_b", torch.zeros(max_loras, rank_total, out_features, dtype=dtype, device=device))
        self.slots_with_weights: set[int] = set()  # a linear no resident adapter targets skips the LoRA path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.state.batch
        if batch is None or not self.slots_with_weights:
            return y
        segments, longest = batch.gather_index.shape
        grouped = x.index_select(0, batch.gather_index.view(-1)).view(segments, longest, -1).to(self.lora_a.dtype)
        delta = torch.bmm(torch.bmm(grouped, self._slot_weights(self.lora_a, batch.slots)),
                          self._slot_weights(self.lora_b, batch.slots))
        delta = delta.flatten(0, 1)
        if batch.valid_positions is not None:
            delta = delta.index_select(0, batch.valid_positions)
        return y.index_add_(0, batch.token_rows, delta.to(y.dtype))

    @staticmethod
    def _slot_weights(stack: torch.Tensor, slots: torch.Tensor | slice) -> torch.Tensor:
        # index_select copies whole rows; advanced indexing of a 3-D tensor was ~2x slower here
        return stack[slots] if isinstance(slots, slice) else stack.index_select(0, slots)

    @torch.no_grad()
    def load_slot(self, slot: int, weights: dict) -> None:
        """weights: module key -> object with lora_a [r, in], lora_b [out, r], scaling; absent keys stay zero."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.slots_with_weights.discard(slot)
        for i, sub in enumerate(self.subs):
            w = weights.get(sub.key)
            if w is None:
                continue
            self.slots_with_weights.add(slot)
            rank = w.lora_a.shape[0]
            ranks = slice(i * self.max_rank, i * self.max_rank + rank)
            self.lora_a[slot, :, ranks] = w.lora_a.t().to(self.lora_a.dtype)
            cols = slice(sub.out_start, sub.out_start + sub.out_size)
            self.lora_b[slot, ranks, cols] = (w.lora_b.t() * w.scaling).to(self.lora_b.dtype)


def wrap_lora_linears(model: nn.Module, state: LoRAStepState, max_loras: int, max_rank: int,
                      dtype: torch.dtype, device: torch.device) -> list[dict[str, LoRALinear]]:
    """Replace each of the model's LoRA-capable linears; returns, per layer, linear path -> LoRALinear."""
    per_layer: list[dict[str, LoRALinear]] = []
    for layer, targets in zip(model.decoder_layers, model.lora_targets()):
        wrapped = {}
        for path, (in_features, subs) in targets.items():
            parent_path, _, name = path.rpartition(".")
            parent = layer.get_submodule(parent_path)
            lora = LoRALinear(getattr(parent, name), in_features, subs, state, max_loras, max_rank, dtype, device)
            setattr(parent, name, lora)
            wrapped[path] = lora
        per_layer.append(wrapped)
    return per_layer
