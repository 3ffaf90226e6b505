"""Decode attention that reads the paged KV cache in place (CUDA, Triton).

One program per (sequence, KV head) walks the sequence's context in tiles of BLOCK_N tokens: each
token's cache address comes from the block table (block = table[t // block_size], row t % block_size),
so no block is ever gathered into a copy, and the work grows with the context actually held, not with
the widest table. The query heads that share the KV head are the rows of one tile matmul (GQA: K/V are
read once per group), with an online softmax in float32 (flash-decoding without the split: a decode
batch already has sequences x KV heads programs).

Everything the kernel needs is on the device (block tables, context lengths), so the launch is
captured in the decode CUDA graphs unchanged. fp32 inputs use IEEE products (tf32 would break token
equality with fp32 references); bf16/fp16 use the tensor cores with fp32 accumulation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton_dot import dot

BLOCK_N = 64  # context tokens per tile: 4 KV blocks of 16; large enough for the tensor cores, small for registers


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr, scale,
                         stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                         stride_ot, stride_oh, stride_tb,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                         DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                         IEEE: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    context = tl.load(lens_ptr + seq)
    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    best = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
    total = tl.zeros((GROUP_PAD,), tl.float32)
    acc = tl.zeros((GROUP_PAD, DIM_PAD), tl.float32)
    for start in range(0, context, BLOCK_N):
        tokens = start + tl.arange(0, BLOCK_N)
        valid = tokens < context
        blocks = tl.load(tables_ptr + seq * stride_tb + tokens // BLOCK_SIZE, mask=valid, other=0)
        within = tokens % BLOCK_SIZE
        kv_mask = valid[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + blocks[:, None] * stride_kb + within[:, None] * stride_ks + kv_head * stride_kh
                    + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + blocks[:, None] * stride_vb + within[:, None] * stride_vs + kv_head * stride_vh
                    + dims[None, :], mask=kv_mask, other=0.0)
        scores = tl.where(valid[None, :], dot(q, tl.trans(k), IEEE) * scale, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, 1))
        weights = tl.exp(scores - new_best[:, None])
        rescale = tl.exp(best - new_best)
        total = total * rescale + tl.sum(weights, 1)
        acc = acc * rescale[:, None] + dot(weights.to(v.dtype), v, IEEE)  # a no-op cast in fp32
        best = new_best
    out = acc / total[:, None]
    tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """q [B, heads, D]; caches [kv_heads, blocks, block_size, D] (the engine's head-major layout; any strides with
    a contiguous last dimension); block_tables [B, >= ceil(len / block_size)]; context_lens [B] (>= 1, the new token
    included, already written). Returns [B, heads, D]."""
    batch, heads, head_dim = q.shape
    kv_heads, _, block_size, _ = k_cache.shape
    group = heads // kv_heads
    out = torch.empty_like(q)
    _paged_decode_kernel[(batch, kv_heads)](
        q, k_cache, v_cache, out, block_tables, context_lens, head_dim ** -0.5,
        q.stride(0), q.stride(1), k_cache.stride(1), k_cache.stride(2), k_cache.stride(0),
        v_cache.stride(1), v_cache.stride(2), v_cache.stride(0), out.stride(0), out.stride(1),
        block_tables.stride(0),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        DIM_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N,
        IEEE=q.dtype == torch.float32)
    return out
