"""Attention over the paged KV cache for one flat batch of prefill and decode tokens.

The cache of one layer is a pair of tensors [num_blocks, block_size, kv_heads, head_dim]. New keys
and values are written at their slots; decode tokens (one new token per sequence, placed first in
the flat batch) attend in one batched call: on CUDA a Triton kernel reads their blocks in place
(engine/kernels/paged_attention.py), on CPU the blocks are gathered for SDPA or grouped matmuls;
prompt chunks attend one sequence at a time, causally, without any padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSegment:
    start: int  # index of the segment's first token in the flat batch
    length: int  # new tokens in this step
    context_len: int  # tokens in the cache once this step's are written
    block_table: torch.Tensor | None  # set only when earlier tokens of the sequence are already cached


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens]: cache slot of each new token
    num_decode: int  # the first num_decode tokens are single-token decodes
    decode_block_tables: torch.Tensor | None  # [num_decode, max_blocks]
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, max_blocks * block_size], additive (CPU path)
    prefills: list[PrefillSegment]
    decode_context_lens: torch.Tensor | None = None  # [num_decode], the new token included (CUDA kernel)


KVCache = tuple[torch.Tensor, torch.Tensor]

# Measured on 2 CPU cores with SmolLM2's shapes (bf16 cache): up to 16 decodes, upcasting to fp32 SDPA is
# 1.1-1.7x faster than bf16 matmuls; at 32 they tie; at 64 the bf16 matmuls are 3x faster.
SMALL_DECODE_BATCH = 16
# Prompt attention on CPU in bf16: explicit grouped matmuls measured 1.3-3.9x faster than SDPA's causal kernel
# (32 to 2,000 tokens); they hold every score, so above this many (heads x queries x keys) SDPA's tiles take over.
MAX_EXPLICIT_SCORES = 1 << 26


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                    meta: AttentionMetadata) -> torch.Tensor:
    """q: [T, heads, D]; k, v: [T, kv_heads, D]. Returns [T, heads * D]."""
    k_cache, v_cache = cache
    kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    if meta.num_decode == q.shape[0]:  # decode-only step: no scatter into a shared output
        return _decode(q, k_cache, v_cache, meta).flatten(1)
    out = torch.empty_like(q)
    if meta.num_decode:
        out[:meta.num_decode] = _decode(q[:meta.num_decode], k_cache, v_cache, meta)
    for seg in meta.prefills:
        rows = slice(seg.start, seg.start + seg.length)
        out[rows] = _prefill(q[rows], k[rows], v[rows], k_cache, v_cache, seg)
    return out.flatten(1)


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    if q.is_cuda:
        from engine.kernels.paged_attention import paged_decode_attention  # Triton: imported on CUDA only

        return paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens)
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    keys = _gather_blocks(k_cache, meta.decode_block_tables)  # [B, L, kv_heads, D]
    values = _gather_blocks(v_cache, meta.decode_block_tables)
    if q.dtype == torch.float32:
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=meta.decode_mask, enable_gqa=True)
        return out.squeeze(2)
    if batch <= SMALL_DECODE_BATCH:  # CPU low precision, few sequences: fp32 SDPA on upcast K/V is fastest
        out = F.scaled_dot_product_attention(q.unsqueeze(2).float(), keys.transpose(1, 2).float(),
                                             values.transpose(1, 2).float(), attn_mask=meta.decode_mask.float(),
                                             enable_gqa=True)
        return out.squeeze(2).to(q.dtype)
    # CPU low precision, many sequences: explicit grouped matmuls beat SDPA's masked path by ~3x.
    grouped = q.view(batch, kv_heads, heads // kv_heads, head_dim)
    out = _explicit_attention(grouped, keys.permute(0, 2, 3, 1), values.transpose(1, 2), meta.decode_mask)
    return out.view(batch, heads, head_dim)


def _gather_blocks(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """The cached tokens of the blocks in block_table ([B, blocks] or [blocks]): [B, blocks * block_size, kv_heads,
    D] or [blocks * block_size, kv_heads, D]. (index_select: advanced indexing measured 3-5x slower on CPU.)"""
    gathered = cache.index_select(0, block_table.flatten())
    return gathered.view(*block_table.shape[:-1], -1, *cache.shape[-2:])


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             seg: PrefillSegment) -> torch.Tensor:
    if seg.block_table is None:  # the whole context is this chunk: plain causal attention
        keys, values = k, v
    else:
        keys = _gather_blocks(k_cache, seg.block_table)[:seg.context_len]
        values = _gather_blocks(v_cache, seg.block_table)[:seg.context_len]
    explicit = not q.is_cuda and q.dtype != torch.float32 and q.shape[1] * seg.length * len(keys) <= MAX_EXPLICIT_SCORES
    if seg.block_table is None and not explicit:
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             is_causal=True, enable_gqa=True)
        return out.transpose(0, 1)
    offset = len(keys) - seg.length
    visible = (torch.arange(len(keys), device=q.device)[None, :]
               <= torch.arange(seg.length, device=q.device)[:, None] + offset)
    if explicit:
        return _grouped_attention(q, keys, values, visible)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                         attn_mask=visible, enable_gqa=True)
    return out.transpose(0, 1)


def _grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       visible: torch.Tensor) -> torch.Tensor:
    """q [L, heads, D], keys/values [C, kv_heads, D], visible [L, C] -> [L, heads, D]; the query heads that share
    a K/V head are one matmul, with no copy of K/V per query head."""
    length, heads, head_dim = q.shape
    kv_heads = keys.shape[1]
    grouped = q.permute(1, 0, 2).reshape(kv_heads, heads // kv_heads, length, head_dim)
    bias = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
    out = _explicit_attention(grouped, keys.permute(1, 2, 0)[:, None], values.permute(1, 0, 2)[:, None], bias)
    return out.reshape(heads, length, head_dim).permute(1, 0, 2)  # from [kv, g, L, D]


def _explicit_attention(q: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor,
                        bias: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) + bias) v with K already transposed; every operand broadcasts over the query
    heads that share a K/V head, so no K/V copy is made per query head."""
    scores = torch.matmul(q, keys_t) * q.shape[-1] ** -0.5
    return torch.matmul((scores + bias).softmax(-1), values)
