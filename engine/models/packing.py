"""How a step backend lays out a loaded model's weights for its kernels, chosen once with the backend
(engine/backends/): its linears, and a mixture's experts.

- `AsLoaded`: the linears as they are (PyTorch's F.linear: CUDA, and a CPU where oneDNN has no linear for the
  dtype), and each expert split into linears of its own.
- `OneDnnPacked`: on CPU, every linear on oneDNN's prepacked weights (engine/layers/linear.py).
- `CppPacked`: as OneDnnPacked, with the engine's own kernel for each linear the C++ operators have one for, and
  the experts on the operators' grouped product where it takes them.
- `TritonGroupedExperts`: on CUDA, the linears as they are, and every expert of a layer in one Triton grouped
  product (the cuda_experts option "grouped", not yet run on a GPU: opt-in).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.linear import ONEDNN_ONLY, CppLinearKernels, prepack_linears
from engine.models.experts import GroupedKernel, cpu_grouped_kernel, triton_grouped_kernel
from engine.platform import cpu_has_native_bf16


class AsLoaded:
    def pack_linears(self, model: nn.Module, storage_dtype: torch.dtype | None) -> None:
        """The model's linears laid out for this backend's kernels (storage_dtype: bf16 values held in float32
        weights, kept as bf16 where a kernel widens them)."""

    def grouped_experts(self, storage_dtype: torch.dtype | None,
                        weights: tuple[torch.Tensor, ...]) -> GroupedKernel | None:
        """The grouped product that takes every one of a layer's stacked expert weights, or None."""
        return None


class OneDnnPacked(AsLoaded):
    def pack_linears(self, model: nn.Module, storage_dtype: torch.dtype | None) -> None:
        prepack_linears(model, ONEDNN_ONLY, storage_dtype)


class CppPacked(OneDnnPacked):
    def __init__(self, cpu_ops):
        """cpu_ops: the C++ operators, whose own kernels take the linears and experts they serve faster."""
        self.cpu_ops = cpu_ops

    def pack_linears(self, model: nn.Module, storage_dtype: torch.dtype | None) -> None:
        prepack_linears(model, CppLinearKernels(self.cpu_ops), storage_dtype)

    def grouped_experts(self, storage_dtype: torch.dtype | None,
                        weights: tuple[torch.Tensor, ...]) -> GroupedKernel | None:
        return cpu_grouped_kernel(self.cpu_ops, storage_dtype, weights)


class TritonGroupedExperts(AsLoaded):
    def grouped_experts(self, storage_dtype: torch.dtype | None,
                        weights: tuple[torch.Tensor, ...]) -> GroupedKernel | None:
        return triton_grouped_kernel()


def onednn_linear_supported(dtype: torch.dtype) -> bool:
    """oneDNN's bf16 linear needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; an AVX2-only CPU (such as some EPYC
    machines) takes plain F.linear in bf16 instead of failing at load."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_has_native_bf16())
