"""Fused element-wise operators for CUDA (Triton), the same calls as the C++ CPU operators: the model's modules
take either set through one hook (engine.models.use_fused_ops), so the model code has one fused path.

Why: a decode step of a Llama layer ran about nineteen small element-wise kernels in eager PyTorch (the residual
addition, five for each RMSNorm, five for rotary, two cache writes, SiLU and the product), each a launch of its
own inside a CUDA graph: a large share of the time a batch-1 step of the Llama-3.2-1B shape kept an H100 busy.
Fused, a layer runs five: the addition with the norm (twice), rotary, one write of both K and V, SiLU with the
product.

The rounding steps are the eager ops' (transformers' model code), as the C++ operators' are: the residual sum
rounded to the model dtype, the norm in float32 rounded, then times the weight rounded; rotary's two products
each rounded before their sum; SiLU rounded before the product. Compiled, results may still differ from eager by an
ulp: Triton may fuse a product and a sum into one FMA, SiLU's exp is the GPU's fast exponential, and the norm sums
its squares in another order. On an H100 the float32 engine still matched transformers token for token and its bf16
logprobs stayed within the tolerance of the tests (tests/test_hf_equivalence.py with LORA_SERVE_DEVICE=cuda).
Measured there (batch-1 decode, CUDA graphs), fusing shortened each token of the Llama-3.2-1B and Llama-3-8B shapes,
bringing decode nearer the weight-read bound.

Every launch depends on shapes only (one program per token row, or per row and column block), so the kernels are
captured in the decode CUDA graphs unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.kernels.torch_rotary import apply_rotary

COLUMN_BLOCK = 1024  # SiLU-times-up: columns a program takes (an 8B MLP's 14,336 are 14 programs a token)


@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, w_ptr, out_ptr, width, eps, stride_x, stride_d, stride_o,
                     ADD: tl.constexpr, ROUND_NORMED: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < width
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if ADD:  # residual += delta, rounded to the residual's dtype as `residual.add_(delta)` rounds
        x = (x.to(tl.float32) + tl.load(delta_ptr + row * stride_d + cols, mask=ok, other=0.0).to(tl.float32))
        x = x.to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * stride_x + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inverse = 1.0 / tl.sqrt_rn(tl.sum(xf * xf, 0) / width + eps)
    normed = xf * inverse
    if ROUND_NORMED:  # Llama's rounding; a float32 weight beside a narrower row is a Gemma norm's: rounded once
        normed = normed.to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, stride_xt, stride_xh, stride_ct, stride_st, stride_ot,
                   stride_oh, HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    low = tl.arange(0, HALF)
    x_row = x_ptr + token * stride_xt + head * stride_xh
    a = tl.load(x_row + low).to(tl.float32)  # first half
    b = tl.load(x_row + HALF + low).to(tl.float32)  # second half
    cos_a = tl.load(cos_ptr + token * stride_ct + low).to(tl.float32)
    cos_b = tl.load(cos_ptr + token * stride_ct + HALF + low).to(tl.float32)
    sin_a = tl.load(sin_ptr + token * stride_st + low).to(tl.float32)
    sin_b = tl.load(sin_ptr + token * stride_st + HALF + low).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    # rotate_half(x) = [-b, a]; each product rounded to the dtype before the sum, as eager PyTorch rounds
    first = (a * cos_a).to(dtype).to(tl.float32) + (-b * sin_a).to(dtype).to(tl.float32)
    second = (b * cos_b).to(dtype).to(tl.float32) + (a * sin_b).to(dtype).to(tl.float32)
    out_row = out_ptr + token * stride_ot + head * stride_oh
    tl.store(out_row + low, first.to(dtype))
    tl.store(out_row + HALF + low, second.to(dtype))


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, width, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + width + cols, mask=ok, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (silu * up).to(dtype), mask=ok)


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kc_head, stride_vc_head, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    dims = tl.arange(0, DIM_PAD)
    ok = dims < HEAD_DIM
    slot = tl.load(slots_ptr + token).to(tl.int64)  # block * block_size + offset: a row of [slots, head_dim]
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + dims, mask=ok)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + dims, mask=ok)
    tl.store(k_cache_ptr + head * stride_kc_head + slot * HEAD_DIM + dims, k, mask=ok)
    tl.store(v_cache_ptr + head * stride_vc_head + slot * HEAD_DIM + dims, v, mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, width] with a unit stride along the width (a view where it can be)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    width = x.shape[-1]
    if weight.shape != (width,):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not match the width {width}")
    if weight.dtype not in (x.dtype, torch.float32):
        raise ValueError(f"rms_norm: weight {weight.dtype} must be {x.dtype} or float32 (a Gemma norm's 1 + w)")
    rows = x.view(-1, width)  # the residual is updated in place: it must be a view, never a copy
    delta_rows = rows if delta is None else _rows(delta)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, delta_rows, weight, out, width, eps, rows.stride(0),
                                           delta_rows.stride(0), out.stride(0), ADD=delta is not None,
                                           ROUND_NORMED=weight.dtype == x.dtype, BLOCK=triton.next_power_of_2(width),
                                           num_warps=_warps(width))
    return out.view(x.shape)


def _warps(width: int) -> int:
    return 4 if width <= 2048 else 8


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rms_norm(x) over the last dimension, float32 inside (RMSNorm.forward's rounding)."""
    return _norm(x.contiguous(), None, weight, eps)


def add_rms_norm(delta: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += delta (in place; residual must be contiguous), then weight * rms_norm(residual)."""
    if not residual.is_contiguous() or delta.shape != residual.shape:
        raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} must be contiguous and match delta "
                         f"{tuple(delta.shape)}")
    return _norm(residual, delta, weight, eps)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim] (unit stride along head_dim), cos/sin [tokens, 1, head_dim] -> a new tensor,
    as engine.layers.rotary.apply_rotary; cos/sin narrower than the head (a partial rotary, Phi-4-mini's) take
    apply_rotary itself."""
    if cos.shape[-1] < x.shape[-1]:
        return apply_rotary(x, cos, sin)
    tokens, heads, head_dim = x.shape
    if x.stride(-1) != 1 or head_dim % 2 or triton.next_power_of_2(head_dim) != head_dim:
        raise ValueError(f"rotary: x {tuple(x.shape)} needs a unit-stride, power-of-2 head dimension")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    cos, sin = cos.reshape(tokens, head_dim), sin.reshape(tokens, head_dim)
    if tokens:
        _rotary_kernel[(tokens, heads)](x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
                                        out.stride(0), out.stride(1), HALF=head_dim // 2, num_warps=1)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dimension -> silu(gate) * up."""
    rows = _rows(x)
    width = rows.shape[1] // 2
    out = torch.empty(rows.shape[0], width, dtype=x.dtype, device=x.device)
    block = min(COLUMN_BLOCK, triton.next_power_of_2(width))
    if rows.shape[0]:
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(width, block))](rows, out, width, rows.stride(0),
                                                                         out.stride(0), BLOCK=block)
    return out.view(*x.shape[:-1], width)


def gelu_and_mul(x: torch.Tensor, tanh: int) -> torch.Tensor:
    """x = [gate | up] along the last dimension -> gelu(gate) * up (tanh: the tanh approximation): the C++
    operators' call, here torch's eager ops (GELU models on CUDA run them as before; no Triton kernel is written)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh" if tanh else "none") * up


def gather_rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """table's rows at index (token embeddings): the C++ operators' call, here torch's own."""
    return table.index_select(0, index)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """k, v [tokens, kv_heads, head_dim] (unit stride along head_dim) into the head-major caches [kv_heads, blocks,
    block_size, head_dim] at each token's slot, both in one launch (two index_copy_ eagerly)."""
    tokens, kv_heads, head_dim = k.shape
    for cache in (k_cache, v_cache):
        if cache.stride(-1) != 1 or cache.stride(2) != head_dim or cache.stride(1) != head_dim * cache.shape[2]:
            raise ValueError("write_kv_cache: each head's blocks must be contiguous [blocks, block_size, head_dim]")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("write_kv_cache: k and v need a unit stride along head_dim")
    if tokens:
        _kv_write_kernel[(tokens, kv_heads)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1),
                                             v.stride(0), v.stride(1), k_cache.stride(0), v_cache.stride(0),
                                             HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim),
                                             num_warps=1)
