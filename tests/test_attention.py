"""Paged attention against a naive per-sequence reference: decode batches of every size, prefill chunks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import cpu_ops
from engine.layers.attention import GatheredAttention, PagedAttention, PrefillSegment, paged_attention

HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 16, 4


def _reference(q, keys, values):
    """q [n, H, D] for the last n positions of a context whose keys/values are [L, KVH, D]."""
    n, length = q.shape[0], keys.shape[0]
    group = HEADS // KV_HEADS
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1).float()
    v = values.repeat_interleave(group, dim=1).transpose(0, 1).float()
    visible = torch.arange(length)[None, :] <= torch.arange(n)[:, None] + (length - n)
    return F.scaled_dot_product_attention(q.transpose(0, 1).float(), k, v, attn_mask=visible).transpose(0, 1)


CPU_OPS = cpu_ops.load()
# the K/V write: index_copy_, or the C++ operators' one call (what the backend hands AttentionMetadata.kv_write)
WRITES = [None, pytest.param(getattr(CPU_OPS, "write_kv_cache", None),
                             marks=pytest.mark.skipif(CPU_OPS is None, reason="no C++ operators"))]


@pytest.mark.parametrize("kv_write", WRITES, ids=["index-copy", "cpu-kv-write"])
@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.float32, torch.bfloat16)], ids=["fp32", "bf16", "fp32-bf16kv"])
@pytest.mark.parametrize("num_decode", [1, 16, 21])
def test_paged_attention_matches_reference(dtype, cache_dtype, num_decode, kv_write):
    """float32 math over a bf16 cache (a bf16 model on a CPU without bf16 matrix math): every query, a fresh
    prompt's included, attends to the keys and values as the cache holds them, to float32's tolerance."""
    torch.manual_seed(num_decode)
    gen = torch.Generator().manual_seed(0)
    contexts = [int(x) for x in torch.randint(1, 30, (num_decode,), generator=gen)]
    # (new tokens, tokens already cached): fresh prompts and chunks with history, short and over many query blocks
    prefills = [(5, 0), (7, 9), (300, 0), (200, 150)]
    num_blocks = 400
    k_cache = torch.zeros(KV_HEADS, num_blocks, BLOCK, DIM, dtype=cache_dtype)  # the engine's head-major layout
    v_cache = torch.zeros_like(k_cache)
    free = iter(torch.randperm(num_blocks).tolist())
    seqs = [(ctx, 1) for ctx in contexts] + [(cached + new, new) for new, cached in prefills]
    tables, full_k, full_v, keys_new, values_new = [], [], [], [], []
    for total, new in seqs:  # history into scattered blocks; the new tokens are paged_attention's to write
        table = [next(free) for _ in range((total + BLOCK - 1) // BLOCK)]
        keys = torch.randn(total, KV_HEADS, DIM).to(dtype)
        values = torch.randn(total, KV_HEADS, DIM).to(dtype)
        for pos in range(total - new):
            k_cache[:, table[pos // BLOCK], pos % BLOCK] = keys[pos]
            v_cache[:, table[pos // BLOCK], pos % BLOCK] = values[pos]
        tables.append(table)
        full_k.append(keys.to(cache_dtype).to(dtype))  # as stored
        full_v.append(values.to(cache_dtype).to(dtype))
        keys_new.append(keys[total - new:])  # paged_attention's to write: in the math's dtype, unrounded
        values_new.append(values[total - new:])
    q_rows, k_rows, v_rows, slots, segments = [], [], [], [], []
    for i, (total, new) in enumerate(seqs):
        q_rows.append(torch.randn(new, HEADS, DIM).to(dtype))
        k_rows.append(keys_new[i])
        v_rows.append(values_new[i])
        slots += [tables[i][p // BLOCK] * BLOCK + p % BLOCK for p in range(total - new, total)]
        if i >= num_decode:
            start = sum(n for _, n in seqs[:i])
            table = torch.tensor(tables[i]) if total > new else None
            segments.append(PrefillSegment(start, new, total, table))
    max_blocks = max(len(t) for t in tables[:num_decode])
    decode_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables[:num_decode]])
    visible = torch.arange(max_blocks * BLOCK)[None, :] < torch.tensor(contexts)[:, None]
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, float("-inf"))[:, None, None, :]
    meta = GatheredAttention(torch.tensor(slots), num_decode, segments, kv_write, decode_block_tables=decode_tables,
                             decode_mask=mask)
    out = paged_attention(torch.cat(q_rows), torch.cat(k_rows), torch.cat(v_rows), (k_cache, v_cache), meta)
    expected = torch.cat([_reference(q, k, v) for q, k, v in zip(q_rows, full_k, full_v)]).flatten(1)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)
    if dtype == cache_dtype == torch.float32 and kv_write is None:  # CUDA's path, its Triton kernel interpreted
        paged = PagedAttention(torch.tensor(slots), num_decode, segments, decode_block_tables=decode_tables,
                               decode_context_lens=torch.tensor(contexts))
        out = paged_attention(torch.cat(q_rows), torch.cat(k_rows), torch.cat(v_rows), (k_cache, v_cache), paged)
        torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)
