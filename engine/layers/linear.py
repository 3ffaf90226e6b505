"""CPU linears on oneDNN prepacked weights.

Plain `F.linear` on CPU (MKL for fp32) re-lays-out each weight on every call. With model-sized
weights streaming from memory, oneDNN's prepacked format measured here 1.7-2.4x faster in fp32
and 1.2-1.7x in bf16, from batch 1 to 64 (a cache-hot microbenchmark hides the difference).

On a CPU with AMX, bf16 linears of up to AMX_MAX_ROWS rows (decode steps) run in the engine's own AMX kernel
(engine/kernels/cpu/amx_linear.cpp) on a second packing of the weight, which it streams at the memory's rate:
SmolLM2's 30 layers of weights took 8.3-8.7 ms at 1-16 rows against oneDNN's 12.1-12.4 ms, and 13.9 against 15.1
at 64 rows (2 cores of a Xeon); at 128 rows the two were even, and longer prefill chunks stay on oneDNN, whose
blocking reuses each weight tile across many rows. The price is a second copy of those weights in memory.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import cpu_has_native_bf16


def prepacking_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN's bf16 linear needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; an AVX2-only CPU (such as some EPYC
    machines) takes plain F.linear in bf16 instead of failing at load."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_has_native_bf16())


AMX_MAX_ROWS = 64  # rows up to which the AMX kernel beats oneDNN (even at 128)


class PrepackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, cpu_ops=None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().contiguous()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, None))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        amx = (cpu_ops is not None and weight.dtype == torch.bfloat16
               and cpu_ops.amx_linear_usable(self.out_features, self.in_features))
        self.amx_ops = cpu_ops if amx else None
        self.register_buffer("amx_weight", cpu_ops.amx_pack_linear_weight(weight) if amx else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.amx_ops is not None and x.dim() == 2 and x.shape[0] <= AMX_MAX_ROWS:
            return self.amx_ops.amx_linear(x, self.amx_weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed_weight, self.bias, "none", [], "")


def prepack_linears(model: nn.Module, cpu_ops=None) -> None:
    """Replace every plain nn.Linear in `model` by a PrepackedLinear (in place), with the AMX kernel's packing too
    where `cpu_ops` (the C++ operators) has AMX; quantized linears (subclasses) stay as they are."""
    for name, child in list(model.named_children()):
        if type(child) is nn.Linear:
            setattr(model, name, PrepackedLinear(child, cpu_ops))
        else:
            prepack_linears(child, cpu_ops)
