"""CPU linears on oneDNN prepacked weights.

Plain `F.linear` on CPU (MKL for fp32) re-lays-out each weight on every call. With model-sized
weights streaming from memory, oneDNN's prepacked format measured faster here in fp32 and in bf16, from batch 1
to 64 (a cache-hot microbenchmark hides the difference).

The engine's own kernels (engine/kernels/cpu) take what they do faster than oneDNN:
- on a CPU with AMX, linears of up to AMX_MAX_ROWS rows (decode steps and short prefill steps), on a second
  packing of the weight, which amx_linear.cpp streams at the memory's rate, faster than oneDNN. Alone, the two
  were even at 128 rows; inside a step the kernel keeps its lead up to about a thousand rows, since oneDNN runs on
  OpenMP's threads and every switch between its linears and the operators' own pool (work_pool.cpp) wakes one set
  of threads while the other still holds the cores. Longer prefill steps stay on oneDNN, whose AMX blocking reuses
  each weight tile across many rows. The price is a second copy of those weights in memory.
- on a CPU with AVX-512 and no AMX (simd_linear.cpp): every bf16 linear, on its own packing alone (oneDNN's is
  not kept), faster than oneDNN at every row count measured, near the dot-product units' rate; float32 linears of
  up to FP32_MAX_ROWS rows (at 512 the two were even, so prefill chunks stay on oneDNN, and those linears keep
  both packings). On a Zen 4 EPYC (512-bit operations in two halves) the bf16 kernel is faster than oneDNN too.
  Where a CPU has AMX, Intel's, oneDNN keeps the float32 linears: the kernel has not been measured there.
- on a CPU with AVX2 and FMA alone (the same kernel with 8-lane vectors): every float32 linear, on its own packing
  alone, faster than oneDNN at every row count measured (at 1 row it streams the weights nearer the memory's rate).
  A bf16 model there computes in float32 (no bf16 matrix math) on weights rounded to bf16, which the kernel keeps
  in bf16 and widens as it reads them: half the bytes to stream, so faster than float32 at few rows and about even
  from 32 rows up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.kernels.cpu_ops import has_cpu_flag

AMX_MAX_ROWS = 1024  # rows up to which the AMX kernel beats oneDNN inside a step (docs/architecture.md)
FP32_MAX_ROWS = 128  # rows up to which the AVX-512 kernel beats oneDNN in float32 (even at 512; AVX2: at any count)


@dataclass(frozen=True)
class OwnKernel:
    """One of the engine's own linear kernels: how it packs a weight, how it runs, and up to how many rows it beats
    oneDNN (None: at any count, so oneDNN's packing is not kept)."""
    name: str
    pack: Callable[[torch.Tensor], torch.Tensor]
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    max_rows: int | None

    def takes(self, x: torch.Tensor) -> bool:
        return self.max_rows is None or x.shape[0] <= self.max_rows


class OneDnnOnly:
    """No own kernels: every linear on oneDNN's prepacked weights."""

    def for_weight(self, weight: torch.Tensor, rows_dtype: torch.dtype | None = None) -> OwnKernel | None:
        return None


class CppLinearKernels(OneDnnOnly):
    def __init__(self, cpu_ops):
        """cpu_ops: the C++ operators, whose linear kernels these are."""
        self.cpu_ops = cpu_ops

    def for_weight(self, weight: torch.Tensor, rows_dtype: torch.dtype | None = None) -> OwnKernel | None:
        """The kernel for a weight [out, in] against rows of `rows_dtype` (default: the weight's): in bf16 AMX where
        the CPU has it; on a CPU without AMX, AVX-512 in bf16 and float32, or AVX2 in float32, with float32 or bf16
        weights; None for other dtypes, and shapes the kernels do not tile."""
        ops, rows_dtype = self.cpu_ops, rows_dtype or weight.dtype
        if weight.dtype not in (torch.bfloat16, torch.float32):
            return None
        if has_cpu_flag("amx_bf16"):
            if weight.dtype == rows_dtype == torch.bfloat16 and ops.amx_linear_usable(*weight.shape):
                return OwnKernel("amx", ops.amx_pack_linear_weight, ops.amx_linear, AMX_MAX_ROWS)
            return None
        widened = weight.dtype == torch.bfloat16 and ops.simd_linear_widens_bf16()
        if ops.simd_linear_usable(weight) and rows_dtype == (torch.float32 if widened else weight.dtype):
            max_rows = FP32_MAX_ROWS if weight.dtype == torch.float32 and has_cpu_flag("avx512f") else None
            return OwnKernel("simd", ops.simd_pack_linear_weight, ops.simd_linear, max_rows)
        return None


LinearKernels = OneDnnOnly | CppLinearKernels
ONEDNN_ONLY = OneDnnOnly()


class PrepackedLinear(nn.Module):
    """`storage_dtype`: a narrower dtype (bf16) whose values the float32 weight holds, kept as the weight's storage
    where an own kernel widens it to float32 rows (AVX2), halving the bytes a decode step streams."""

    def __init__(self, linear: nn.Linear, kernels: LinearKernels = ONEDNN_ONLY,
                 storage_dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().contiguous()
        self.kernel = None
        if storage_dtype == torch.bfloat16 and weight.dtype == torch.float32:
            narrow = weight.to(storage_dtype)
            self.kernel = kernels.for_weight(narrow, rows_dtype=weight.dtype)  # float32 rows, bf16 storage
            if self.kernel is not None:
                weight = narrow
        if self.kernel is None:
            self.kernel = kernels.for_weight(weight)
        onednn = self.kernel is None or self.kernel.max_rows is not None
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, None) if onednn else None)
        self.register_buffer("own_weight", self.kernel.pack(weight) if self.kernel is not None else None)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        self.register_buffer("bias", bias)
        # the own kernels add the bias in float32: converted once here (a no-op for float32), not on every call
        self.register_buffer("own_bias", bias.float() if bias is not None and self.kernel is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.kernel is not None and self.kernel.takes(rows):
            y = self.kernel.run(rows, self.own_weight, self.own_bias)
        else:
            y = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), self.packed_weight, self.bias, "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features)


def prepack_linears(model: nn.Module, kernels: LinearKernels, storage_dtype: torch.dtype | None = None) -> None:
    """Replace every plain nn.Linear in `model` by a PrepackedLinear (in place), with the engine's own kernel where
    `kernels` has one for its weight, on `storage_dtype` weights where it widens them; quantized linears
    (subclasses) stay as they are."""
    for name, child in list(model.named_children()):
        if type(child) is nn.Linear:
            setattr(model, name, PrepackedLinear(child, kernels, storage_dtype))
        else:
            prepack_linears(child, kernels, storage_dtype)
