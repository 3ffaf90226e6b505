"""The tile matrix product the Triton kernels share: exact float32 for float32 inputs, the tensor cores otherwise.

tl.dot on float32 inputs defaults to tf32 on NVIDIA GPUs, which rounds each operand to 10 bits of mantissa: a
float32 model would then no longer match its float32 reference token for token. IEEE asks for full precision.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """tl.dot in full fp32 precision when IEEE, else as is (bf16/fp16 tensor cores, or tf32 for fp32 inputs)."""
    if IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out
