"""Multi-LoRA on a mixture of experts' stacked parameters (PEFT's target_parameters): each expert of each adapter
has an A and a B of its own for the fused gate/up product and for the down product.

A step's experts run over (token, expert) pairs sorted by expert (engine/models/moe.py). The adapter slots of one
layer hold every expert's weights, slot s's expert e as slot s * experts + e of that layer's slot table, so a pair
reads slot (its token's slot) * experts + (its expert): the same per-row contract as a LoRA linear's tokens, and
on CPU the same C++ call (cpu/lora.cpp, lora_add_), each pair reading its own expert's weights in place, the slot
table's A stored K-major for it and in the model's dtype. Without the C++ operators (and on CUDA, where these models
run eager) each (slot, expert) present in the step adds its rows' delta in a loop: the reference path. Which of the
two, and how the table is stored, is the LoRA backend's (backends.py).
Pairs of base tokens, and of adapters with no expert weights, are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.lora.backends import LoRAStepState, TorchLoRA


@dataclass(frozen=True)
class ExpertParam:
    """Where one expert parameter's A and B sit in each row of the slot table."""
    start: int
    in_features: int
    out_features: int


@dataclass(frozen=True)
class ExpertSlots:
    """One expert parameter's view of the slot table: A [slots * experts, in, R], B [slots * experts, R, out]."""
    a: torch.Tensor
    b: torch.Tensor


class ExpertLoRA(nn.Module):
    def __init__(self, shapes: dict[str, tuple[int, int]], num_experts: int, state: LoRAStepState, max_loras: int,
                 max_rank: int, dtype: torch.dtype, backend: TorchLoRA):
        """shapes: each targetable expert parameter's (in_features, out_features) per expert (its PEFT key)."""
        super().__init__()
        self.num_experts, self.max_rank, self.state, self.backend = num_experts, max_rank, state, backend
        row = sum(max_rank * (i + o) for i, o in shapes.values())
        device = backend.device
        self.register_buffer("packed", torch.zeros(max_loras * num_experts, row, dtype=backend.slot_dtype(dtype),
                                                   device=device))
        self.register_buffer("has_weights", torch.zeros(max_loras, dtype=torch.bool, device=device))
        # offsets, not views: the slot table may be re-seated (engine/backends/huge_pages.py), and views taken from
        # it at each use follow it
        self.params: dict[str, ExpertParam] = {}
        start = 0
        for key, (in_features, out_features) in shapes.items():
            self.params[key] = ExpertParam(start, in_features, out_features)
            start += max_rank * (in_features + out_features)
        self.row_flops = 2 * row

    def _views(self, param: ExpertParam) -> ExpertSlots:
        """The parameter's A and B inside each slot row (A K-major where the backend's kernel reads it so)."""
        r, slots = self.max_rank, self.packed.shape[0]
        middle = param.start + param.in_features * r
        a = self.packed[:, param.start:middle]
        if self.backend.a_k_major:
            a = a.view(slots, r, param.in_features).transpose(1, 2)
        else:
            a = a.view(slots, param.in_features, r)
        b = self.packed[:, middle:middle + r * param.out_features]
        return ExpertSlots(a, b.view(slots, r, param.out_features))

    @torch.no_grad()
    def load_slot(self, slot: int, weights: dict) -> None:
        """weights: module key -> weights; this layer's expert parameters' (ExpertLoRAWeights) are loaded, absent
        ones stay zero."""
        rows = slice(slot * self.num_experts, (slot + 1) * self.num_experts)
        self.packed[rows].zero_()
        found = [(self._views(self.params[key]), w) for key, w in weights.items() if key in self.params]
        self.has_weights[slot] = bool(found)
        for views, w in found:
            rank = w.lora_a.shape[1]
            views.a[rows, :, :rank] = w.lora_a.transpose(1, 2).to(views.a.dtype)
            views.b[rows, :rank] = (w.lora_b.transpose(1, 2) * w.scaling).to(views.b.dtype)

    def pair_slots(self, tokens: torch.Tensor, experts: torch.Tensor) -> torch.Tensor | None:
        """Each pair's row of the slot table (-1: nothing to add), or None when no pair of this step has one."""
        token_slots = self.state.expert_slots
        if token_slots is None:
            return None
        slots = token_slots[tokens]
        adapted = (slots >= 0) & self.has_weights[slots.clamp(min=0)]
        if not bool(adapted.any()):
            return None
        return torch.where(adapted, slots * self.num_experts + experts, -1)

    def add_(self, key: str, y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> None:
        """y[i] += x[i] @ A[slots[i]] @ B[slots[i]] of parameter `key`, in place, for the pairs of slots >= 0."""
        if key not in self.params:
            return
        views = self._views(self.params[key])
        self.backend.expert_add_(y, x, views.a, views.b, slots, self.max_rank)
