"""Attention over the paged KV cache for one flat batch of prefill and decode tokens.

The cache of one layer is a pair of tensors [kv_heads, num_blocks, block_size, head_dim]. New keys
and values are written at their slots. On CPU with the C++ kernel (engine/kernels/cpu_attention.py),
every decode token and every prompt chunk shorter than IN_PLACE_CHUNK attend in one call that reads
their blocks in place; longer chunks attend one sequence at a time in tiles of queries that skip the
keys a tile cannot see (_tiled_causal_attention), on oneDNN's bf16 matmuls. On CUDA, decode tokens
(one new token per sequence, placed first in the flat batch) attend in one call to a Triton kernel
that reads their blocks in place, and prompt chunks take SDPA one sequence at a time. On CPU without
the kernel, decodes take SDPA or grouped matmuls over gathered copies of the blocks.

Why head-major: a sequence's blocks gathered for one KV head are one contiguous [tokens, head_dim]
run, so the gathered K/V feed the batched matmuls as they are. With the token-major layout
([blocks, block_size, kv_heads, head_dim]) the matmuls ran on a permuted view, 4x slower than on
contiguous data. Measured on 2 CPU cores, SmolLM2's shapes, bf16, one layer's decode attention:
16 sequences at 2,048 tokens 24.5 -> 5.1 ms, 64 at 1,024 tokens 30.3 -> 10.5 ms, 64 at 64 tokens
0.41 -> 0.37 ms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernels import cpu_attention


@dataclass
class PrefillSegment:
    start: int  # index of the segment's first token in the flat batch
    length: int  # new tokens in this step
    context_len: int  # tokens in the cache once this step's are written
    block_table: torch.Tensor | None  # set only when earlier tokens of the sequence are already cached
    rows: torch.Tensor | None = None  # block_rows() of block_table, once per step for every layer


@dataclass
class InPlaceQueries:
    """The tokens the CPU kernel serves in one call, reading the cache in place: sequence i's queries are rows
    query_starts[i] .. + query_lens[i] of the flat batch, the last positions of its context_lens[i] tokens."""
    block_tables: torch.Tensor  # [S, widest]
    context_lens: torch.Tensor  # [S]
    query_starts: torch.Tensor  # [S]
    query_lens: torch.Tensor  # [S]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens]: cache slot of each new token
    num_decode: int  # the first num_decode tokens are single-token decodes
    decode_block_tables: torch.Tensor | None  # [num_decode, max_blocks]
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, max_blocks * block_size], additive (CPU path)
    prefills: list[PrefillSegment]
    decode_context_lens: torch.Tensor | None = None  # [num_decode], the new token included (CUDA kernel)
    decode_rows: torch.Tensor | None = None  # block_rows() of decode_block_tables (CPU path), once per step
    in_place: InPlaceQueries | None = None  # CPU kernel: the decodes and short chunks; `prefills` the rest


KVCache = tuple[torch.Tensor, torch.Tensor]

# Short fresh prompts on CPU (under MIN_TILED tokens) take explicit grouped matmuls over every score: as fast as
# the tiles there (bf16: 0.18 against 0.20 ms at 64 tokens) and faster than SDPA's causal kernel (0.24 ms).
PROMPT_TILE = 128  # queries per tile of prompt attention on CPU (64 to 256 measured within 10% of it)
MIN_TILED = 64  # fresh prompts from this length, and every chunk after a cached prefix, take the tiles
IN_PLACE_CHUNK = 64  # with the C++ kernel, chunks shorter than this read the cache in place with the decodes


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                    meta: AttentionMetadata, cpu_ops=None) -> torch.Tensor:
    """q: [T, heads, D]; k, v: [T, kv_heads, D]. Returns [T, heads * D]. cpu_ops: the C++ CPU operators
    (engine/kernels/cpu_ops.py), which write K and V into the cache in one call, or None."""
    k_cache, v_cache = cache
    if cpu_ops is not None:
        cpu_ops.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    else:
        _write(k_cache, k, meta.slot_mapping)
        _write(v_cache, v, meta.slot_mapping)
    if meta.in_place is not None:
        return _in_place(q, k, v, k_cache, v_cache, meta).flatten(1)
    if meta.num_decode == q.shape[0]:  # decode-only step: no scatter into a shared output
        return _decode(q, k_cache, v_cache, meta).flatten(1)
    out = torch.empty_like(q)
    if meta.num_decode:
        out[:meta.num_decode] = _decode(q[:meta.num_decode], k_cache, v_cache, meta)
    for seg in meta.prefills:
        rows = slice(seg.start, seg.start + seg.length)
        out[rows] = _prefill(q[rows], k[rows], v[rows], k_cache, v_cache, seg)
    return out.flatten(1)


def _in_place(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              meta: AttentionMetadata) -> torch.Tensor:
    """The kernel's tokens in one call, then the long chunks in tiles, into one [T, heads, D] output."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    batch = meta.in_place
    cpu_attention.paged_attention(q, k_cache, v_cache, batch.block_tables, batch.context_lens, batch.query_starts,
                                  batch.query_lens, out)
    for seg in meta.prefills:
        rows = slice(seg.start, seg.start + seg.length)
        out[rows] = _prefill(q[rows], k[rows], v[rows], k_cache, v_cache, seg)
    return out


def _write(cache: torch.Tensor, new: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """new [T, kv_heads, D] into the cache's slots (slot = block * block_size + offset)."""
    kv_heads, head_dim = cache.shape[0], cache.shape[-1]
    cache.view(kv_heads, -1, head_dim).index_copy_(1, slot_mapping, new.transpose(0, 1))


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    if meta.decode_mask is None:  # CUDA: the Triton kernel reads the blocks in place (imported there only)
        from engine.kernels.paged_attention import paged_decode_attention

        return paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens)
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[0]
    keys = _gather_blocks(k_cache, meta.decode_block_tables, meta.decode_rows)  # [kv_heads, B, L, D]
    values = _gather_blocks(v_cache, meta.decode_block_tables, meta.decode_rows)
    if q.dtype == torch.float32:  # fp32: SDPA (its decode path beat fp32 grouped matmuls 1.5-3x here)
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys.transpose(0, 1), values.transpose(0, 1),
                                             attn_mask=meta.decode_mask, enable_gqa=True)
        return out.squeeze(2)
    # bf16/fp16: the query heads of one KV head are the rows of one matmul per (KV head, sequence); this beat
    # SDPA (fp32 upcast or not) at every batch and length measured, 1 to 64 sequences, 64 to 2,048 tokens.
    grouped = q.view(batch, kv_heads, heads // kv_heads, head_dim).transpose(0, 1).contiguous()
    out = _explicit_attention(grouped, keys.transpose(-1, -2), values, meta.decode_mask.transpose(0, 1))
    return out.transpose(0, 1).reshape(batch, heads, head_dim)


def block_rows(block_table: torch.Tensor, kv_heads: int, num_blocks: int) -> torch.Tensor:
    """The rows that hold block_table's blocks ([B, blocks] or [blocks]) in a layer's cache seen as one row per
    (KV head, block), head-major: the same for every layer, so the runner computes them once per step (one
    layer's bf16 decode attention, 1 sequence at 64 tokens: 140 -> 97 us; 16 at 256 tokens: 492 -> 426 us)."""
    heads = torch.arange(kv_heads, device=block_table.device)[:, None] * num_blocks
    return (heads + block_table.flatten()).flatten()


def _gather_blocks(cache: torch.Tensor, block_table: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The cached tokens of the blocks in block_table ([B, blocks] or [blocks]), head-major: [kv_heads, B,
    blocks * block_size, D] or [kv_heads, blocks * block_size, D]. rows: block_rows() of the table, if known.

    The gather is index_select over the rows of the cache seen as a 2-D tensor, its fastest form on CPU: 16
    sequences at 2,000 tokens, bf16, one layer's K 1.6 -> 0.66 ms against index_select on the block axis of the
    4-D cache; the decode step 209 -> 115-140 ms. (Advanced indexing was 3-5x slower than index_select.)
    Gathering into buffers kept from step to step measured no faster."""
    kv_heads, num_blocks = cache.shape[0], cache.shape[1]
    if rows is None:
        rows = block_rows(block_table, kv_heads, num_blocks)
    gathered = cache.view(kv_heads * num_blocks, -1).index_select(0, rows)
    return gathered.view(kv_heads, *block_table.shape[:-1], -1, cache.shape[-1])


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             seg: PrefillSegment) -> torch.Tensor:
    if seg.block_table is None:  # the whole context is this chunk: plain causal attention
        keys, values = k.transpose(0, 1), v.transpose(0, 1)  # [kv_heads, C, D]
    else:
        keys = _gather_blocks(k_cache, seg.block_table, seg.rows)[:, :seg.context_len]
        values = _gather_blocks(v_cache, seg.block_table, seg.rows)[:, :seg.context_len]
    if not q.is_cuda and (seg.block_table is not None or seg.length >= MIN_TILED):
        return _tiled_causal_attention(q, keys, values)
    if not q.is_cuda:  # a short fresh prompt: its scores are few
        return _grouped_attention(q, keys, values, _visible(seg.length, keys.shape[1], q.device))
    if seg.block_table is None:
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, is_causal=True, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, enable_gqa=True,
                                             attn_mask=_visible(seg.length, keys.shape[1], q.device))
    return out.transpose(0, 1)


def _visible(length: int, context: int, device: torch.device) -> torch.Tensor:
    """[length, context]: True where a query among the last `length` positions may see a key (causal)."""
    return (torch.arange(context, device=device)[None, :]
            <= torch.arange(length, device=device)[:, None] + (context - length))


def _tiled_causal_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """q [L, heads, D] for the last L positions of a context of keys/values [kv_heads, C, D] -> [L, heads, D].

    Tiles of PROMPT_TILE queries: a tile attends only to the keys up to its last position (the upper triangle
    is never computed), its scores stay small enough for the caches, and only its diagonal block is masked.
    The query heads of one KV head are the rows of one matmul. Measured on 2 cores (SmolLM2's shapes, one layer,
    a 2,000-token prompt): fp32 51 ms against 203 ms for SDPA's causal kernel and 244 ms for matmuls over every
    score; bf16 (AVX-512 BF16) 27 ms against 227 and 126 ms (at 256 tokens 0.9 against 2.2 and 2.2 ms)."""
    length, heads, head_dim = q.shape
    kv_heads, context = keys.shape[0], keys.shape[1]
    group = heads // kv_heads
    offset = context - length  # tokens cached before this chunk
    grouped = (q * head_dim ** -0.5).view(length, kv_heads, group, head_dim).transpose(0, 1).contiguous()
    keys_t, values = keys.transpose(1, 2).contiguous(), values.contiguous()  # one copy, not one per tile
    out = torch.empty_like(grouped)  # [kv_heads, L, group, D]
    for start in range(0, length, PROMPT_TILE):
        end = min(length, start + PROMPT_TILE)
        rows, seen = end - start, offset + end
        scores = torch.bmm(grouped[:, start:end].reshape(kv_heads, rows * group, head_dim), keys_t[:, :, :seen])
        scores[:, :, seen - rows:].masked_fill_(_future(rows, group, q.device), float("-inf"))
        tile = torch.bmm(scores.softmax(-1), values[:, :seen])
        out[:, start:end] = tile.view(kv_heads, rows, group, head_dim)
    return out.transpose(0, 1).reshape(length, heads, head_dim)


def _future(rows: int, group: int, device: torch.device) -> torch.Tensor:
    """[rows * group, rows]: True where a query (each repeated for its group's heads) would see a later key."""
    positions = torch.arange(rows, device=device)
    return (positions[None, :] > positions[:, None]).repeat_interleave(group, 0)


def _grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       visible: torch.Tensor) -> torch.Tensor:
    """q [L, heads, D], keys/values [kv_heads, C, D], visible [L, C] -> [L, heads, D]; the query heads that share
    a K/V head are one matmul, with no copy of K/V per query head."""
    length, heads, head_dim = q.shape
    kv_heads = keys.shape[0]
    grouped = q.permute(1, 0, 2).reshape(kv_heads, heads // kv_heads, length, head_dim)
    bias = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
    out = _explicit_attention(grouped, keys.transpose(1, 2)[:, None], values[:, None], bias)
    return out.reshape(heads, length, head_dim).permute(1, 0, 2)  # from [kv, g, L, D]


def _explicit_attention(q: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor,
                        bias: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) + bias) v with K already transposed; every operand broadcasts over the query
    heads that share a K/V head, so no K/V copy is made per query head."""
    scores = torch.matmul(q, keys_t) * q.shape[-1] ** -0.5
    return torch.matmul((scores + bias).softmax(-1), values)
