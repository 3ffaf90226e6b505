"""A mixture's experts' weights and the kernel that runs every expert of a layer at once.

The stacked weights load flat ([E * 2I, H] gate/up, [E * H, I] down: engine/models/moe.py says why), then
`prepare_experts` hands each layer's experts to the `GroupedKernel` of the step backend's packing
(engine/models/packing.py), where it has one:
- CPU: the C++ operators' grouped_simd_linear (engine/kernels/cpu/simd_linear.cpp), each expert's weights packed
  once for the engine's own linear kernel;
- CUDA, where the cuda_experts option chooses "grouped": the Triton grouped product (engine/kernels/grouped_gemm.py)
  over the stacked weights as they are. It has not run on a GPU yet (docs/gpu.md), so it is opt-in.
Where none serves (CUDA by default, the C++ operators off or not built, widths the CPU kernel does not tile), each
expert's rows become two linears of its own (`Experts.split`), prepacked as a dense model's, and the experts run one
by one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class GroupedKernel:
    """One device's grouped expert product: how it gathers rows, multiplies rows sorted by expert (offsets
    [E + 1]) by their experts' weights, and holds those weights (from the stacked [E, out, in])."""
    gather: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (table, index) -> table[index]
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (rows, weights, offsets) -> out
    pack: Callable[[torch.Tensor], torch.Tensor]  # stacked [E, out, in] -> the weights `run` reads


class Experts(nn.Module):
    """The experts' weights: stacked and stored flat while the checkpoint loads, then either held by a grouped
    kernel (`pack`) or one linear per expert and projection (`split`), which the linears' prepacking puts on the
    engine's own kernels like any other linear."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts * 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts * hidden, intermediate))
        self.gate_up: nn.ModuleList | None = None  # per expert, once split
        self.down: nn.ModuleList | None = None
        self.kernel: GroupedKernel | None = None  # once packed

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The loaded weights, [E, 2I, H] and [E, H, I] (views)."""
        return (self.gate_up_proj.detach().view(self.num_experts, 2 * self.intermediate, self.hidden),
                self.down_proj.detach().view(self.num_experts, self.hidden, self.intermediate))

    def split(self) -> None:
        """One linear per expert over its rows of the stacked weights (views: nothing is copied here)."""
        gate_up, down = self.stacked()
        self.gate_up = nn.ModuleList(_linear(weight) for weight in gate_up)
        self.down = nn.ModuleList(_linear(weight) for weight in down)
        del self.gate_up_proj, self.down_proj

    def pack(self, kernel: GroupedKernel) -> None:
        gate_up, down = self.stacked()
        self.register_buffer("packed_gate_up", kernel.pack(gate_up))
        self.register_buffer("packed_down", kernel.pack(down))
        self.kernel = kernel
        del self.gate_up_proj, self.down_proj

    def grouped_gate_up(self, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """rows sorted by expert (expert e's rows offsets[e]..offsets[e + 1]) times their experts' gate/up."""
        return self.kernel.run(rows, self.packed_gate_up, offsets)

    def grouped_down(self, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.kernel.run(rows, self.packed_down, offsets)


def _linear(weight: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=False)
    return layer


def prepare_experts(model: nn.Module, packing, storage_dtype: torch.dtype | None = None) -> None:
    """Every Experts module of a loaded model held by the backend's grouped kernel (packing: engine/models/packing.py)
    where it takes both its weights, else split into per-expert linears (before the model's linears are laid out).
    storage_dtype: as prepack_linears' (bf16 values held in float32 weights, kept as bf16 where the CPU kernel
    widens them)."""
    for module in model.modules():
        if isinstance(module, Experts):
            kernel = packing.grouped_experts(storage_dtype, module.stacked())
            if kernel is not None:
                module.pack(kernel)
            else:
                module.split()


def cpu_grouped_kernel(cpu_ops, storage_dtype: torch.dtype | None,
                       weights: tuple[torch.Tensor, ...]) -> GroupedKernel | None:
    """The C++ operators' grouped product, where it takes every one of these stacked weights, or None."""
    storages = {cpu_storage(cpu_ops, stacked, storage_dtype) for stacked in weights}
    storage = storages.pop() if len(storages) == 1 else None
    if storage is None:
        return None
    return GroupedKernel(cpu_ops.gather_rows, cpu_ops.grouped_simd_linear,
                         lambda stacked: _packed(cpu_ops, stacked, storage))


def triton_grouped_kernel() -> GroupedKernel:
    """The Triton grouped product over the stacked weights as they are (imported here only: triton is for CUDA)."""
    from engine.kernels import grouped_gemm

    return GroupedKernel(grouped_gemm.gather_rows, grouped_gemm.grouped_linear, torch.Tensor.contiguous)


def cpu_storage(cpu_ops, weights: torch.Tensor, storage_dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype grouped_simd_linear keeps these experts' weights [E, out, in] in, for rows of their dtype: theirs,
    or bf16 for float32 rows (storage_dtype bf16) where it widens bf16; None where it does not take them."""
    widens = cpu_ops.simd_linear_widens_bf16()
    if weights.dtype == torch.bfloat16 and widens:
        return None  # bf16 rows: this build's kernel takes bf16 weights for float32 rows only
    storage = torch.bfloat16 if storage_dtype == torch.bfloat16 and widens else weights.dtype
    return storage if cpu_ops.simd_linear_usable(weights[0].to(storage)) else None


def _packed(cpu_ops, weights: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """[E, out, in] packed expert by expert into one tensor (no second copy of all the experts at once)."""
    first = cpu_ops.simd_pack_linear_weight(weights[0].to(storage))
    packed = first.new_empty((weights.shape[0], *first.shape))
    for expert, weight in enumerate(weights):
        packed[expert].copy_(cpu_ops.simd_pack_linear_weight(weight.to(storage)))
    return packed
