"""Batched multi-LoRA linears: one step mixes base-only tokens and tokens of many adapters.

Each wrapped linear keeps stacked, rank-padded slot weights: A [in, subs * R] shared by its sub-modules (q/k/v or
gate/up of a fused linear: one shrink matmul), and one B [R, out_sub] per sub-module (scaling folded in), so that no
zero block of a fused B is ever read. How a step's tokens take their deltas from them, and how the slots are
stored for it, is the LoRA backend's (backends.py), the same object for every linear. Base-only tokens never
enter the LoRA path, and a step without adapter tokens skips it entirely.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.distributed.linears import RowParallelLinear
from engine.lora.backends import LoRAStepState, TorchLoRA


@dataclass
class LoRASubModule:
    """One PEFT module inside a (possibly fused) linear; a linear lists them in output-column order."""
    key: str  # PEFT module key, e.g. "self_attn.k_proj"
    out_size: int


@dataclass(frozen=True)
class LoRATarget:
    """A LoRA-capable linear of the engine's model: its input width and the PEFT modules fused into it."""
    in_features: int
    subs: list[LoRASubModule]


def fused_targets(shapes: dict[str, tuple[int, int]],
                  fusions: dict[str, tuple[str, ...]]) -> dict[str, LoRATarget]:
    """The engine's LoRA targets from a model's PEFT module shapes (key -> (in_features, out_features)) and
    which modules each of its linears fuses, in output-column order."""
    return {path: LoRATarget(shapes[keys[0]][0], [LoRASubModule(key, shapes[key][1]) for key in keys])
            for path, keys in fusions.items()}


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module, in_features: int, subs: list[LoRASubModule], state: LoRAStepState,
                 max_loras: int, max_rank: int, dtype: torch.dtype, backend: TorchLoRA):
        """backend: how the step's tokens take their deltas, and how the slots are stored for it."""
        super().__init__()
        self.base = base
        self.subs = subs
        self.state = state
        self.backend = backend
        self.in_features = in_features
        self.max_rank = max_rank
        self.row_flops = 2 * max_rank * len(subs) * in_features + 2 * max_rank * sum(s.out_size for s in subs)
        dtype = backend.slot_dtype(dtype)
        # One row per slot packs A and every B (one storage per linear); a_slots and b_slots are strided views
        # of it, [slots, in, subs * R] and [slots, R, out] per sub-module, that a group gathers directly.
        a_size = in_features * max_rank * len(subs)
        row = a_size + max_rank * sum(s.out_size for s in subs)
        self.register_buffer("packed", torch.zeros(max_loras, row, dtype=dtype, device=backend.device))
        if backend.a_k_major:  # the C++ kernel takes a dot product per column (cpu/lora.cpp)
            self.a_slots = self.packed[:, :a_size].view(max_loras, -1, in_features).transpose(1, 2)
        else:
            self.a_slots = self.packed[:, :a_size].view(max_loras, in_features, -1)
        self.b_slots: list[torch.Tensor] = []
        start = a_size
        for sub in subs:
            end = start + max_rank * sub.out_size
            self.b_slots.append(self.packed[:, start:end].view(max_loras, max_rank, -1))
            start = end
        self.expand_dtype = dtype if len(subs) == 1 else None
        self.slots_with_weights: set[int] = set()  # a linear no resident adapter targets skips the LoRA path

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if name == "base":  # calling forward directly skips nn.Module.__call__, which costs more than tiny math
            self.base_forward = value.forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_forward(x)
        step = self.state.step
        return y if step is None else self.backend.add(self, x, y, step)

    def weights(self, slots: torch.Tensor | slice) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A [n, in, subs * R] and one B [n, R, out] per sub-module of the given slots: gathered copies, or
        views when the slots are a contiguous slice. (index_select: advanced indexing was slower here.)"""
        if isinstance(slots, slice):
            return self.a_slots[slots], [b[slots] for b in self.b_slots]
        return self.a_slots.index_select(0, slots), [b.index_select(0, slots) for b in self.b_slots]

    @torch.no_grad()
    def load_slot(self, slot: int, weights: dict) -> None:
        """weights: module key -> object with lora_a [r, in], lora_b [out, r], scaling; absent keys stay zero."""
        self.packed[slot].zero_()
        self.slots_with_weights.discard(slot)
        a, bs = self.weights(slice(slot, slot + 1))
        for i, (sub, b) in enumerate(zip(self.subs, bs)):
            w = weights.get(sub.key)
            if w is None:
                continue
            self.slots_with_weights.add(slot)
            rank = w.lora_a.shape[0]
            a[0, :, i * self.max_rank:i * self.max_rank + rank] = w.lora_a.t().to(a.dtype)
            b[0, :rank] = (w.lora_b.t() * w.scaling).to(b.dtype)


def wrap_lora_linears(model: nn.Module, state: LoRAStepState, max_loras: int, max_rank: int, dtype: torch.dtype,
                      backend: TorchLoRA) -> list[dict[str, LoRALinear]]:
    """Replace each of the model's LoRA-capable linears; returns, per layer, linear path -> LoRALinear."""
    per_layer: list[dict[str, LoRALinear]] = []
    n = model.tensor_parallel.world_size if getattr(model, "tensor_parallel", None) is not None else 1
    for layer, targets in zip(model.decoder_layers, model.lora_targets()):
        wrapped = {}
        for path, target in targets.items():
            parent_path, _, name = path.rpartition(".")
            site = _rank_site(layer.get_submodule(parent_path), name, target, n)
            lora = LoRALinear(getattr(site.parent, site.name), site.target.in_features, site.target.subs, state,
                              max_loras, max_rank, dtype, backend)
            setattr(site.parent, site.name, lora)
            wrapped[path] = lora
        per_layer.append(wrapped)
    return per_layer


@dataclass(frozen=True)
class LoRASite:
    """Where a LoRA linear replaces a base linear (parent.name), with its shapes on this rank."""
    parent: nn.Module
    name: str
    target: LoRATarget


def _rank_site(parent: nn.Module, name: str, target: LoRATarget, n: int) -> LoRASite:
    """On one of n ranks (engine/lora/shards.py): a row-parallel linear's delta joins its partial
    product over the rank's inputs, before the all-reduce (the LoRA linear wraps the inner linear); a column-
    parallel one's is the rank's outputs. At one rank, the linear and its target as they are."""
    module = getattr(parent, name)
    if isinstance(module, RowParallelLinear):
        return LoRASite(module, "linear", LoRATarget(target.in_features // n, target.subs))
    if n == 1:
        return LoRASite(parent, name, target)
    return LoRASite(parent, name, LoRATarget(target.in_features,
                                             [LoRASubModule(s.key, s.out_size // n) for s in target.subs]))
