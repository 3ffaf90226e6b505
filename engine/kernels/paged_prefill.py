"""Prefill attention that reads the paged KV cache in place (CUDA): a Triton kernel, the default, and a
FlexAttention variant, the measured alternative (benchmarks/gpu/run_gpu_attention.py times both).

Every prompt chunk of a step attends in one launch. Segment i's queries are rows query_starts[i] ..
+ query_lens[i] of the flat batch, the last L of its C context tokens: query j (position C - L + j) sees keys
0 .. C - L + j, the C - L cached before the chunk and the chunk's own up to itself. The chunk's keys and values are
already in the cache (paged_attention() writes them first), so a fresh prompt (C = L) is the same case with
nothing cached. Each key's address comes from the segment's block table (block = table[t // block_size], row
t % block_size), as in the decode kernel: no block is gathered into a copy and no mask is built. The segments come
as a PagedPrefill (engine/kernels/prefill_batch.py, built once per step by attention.py's paged_prefill()):
starts, lengths, context lengths and the block tables as device tensors.

Triton: one program per (tile of queries, KV head, segment) walks the keys in tiles of BLOCK_N with an online
softmax in float32, skipping key tiles above the causal diagonal; only the tiles that cross it are masked. fp32
inputs use IEEE products (token equality with fp32 references), bf16/fp16 the tensor cores with fp32 accumulation.

FlexAttention: the physical cache is FlexAttention's key sequence (one per KV head) and the block mask lists, for
each segment's tile of 128 queries, the physical pages it reads: the fully visible ones as full blocks, the few
that cross the diagonal as partial blocks, whose mask_mod maps a physical key back to its position in the segment.
Pages are the cache's blocks, so its kernel reads keys in tiles of one block (16 tokens by default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.prefill_batch import PagedPrefill
from engine.kernels.triton_dot import dot

LOG2E = 1.4426950408889634  # scores are scaled by log2(e) once, so the softmax takes exp2, the hardware's exponential


@dataclass(frozen=True)
class TileConfig:
    rows: int  # query rows of one program: (the group's query heads) x (queries), padded to a power of two
    block_n: int  # keys per tile
    num_warps: int
    num_stages: int


# Starting points, the benchmark's sweep compares others: 128 rows x 64 keys is the common flash-attention tile for
# head_dim 128 in bf16; fp32 tiles take twice the registers per element, so half the rows.
HALF_TILES = TileConfig(rows=128, block_n=64, num_warps=8, num_stages=2)
FP32_TILES = TileConfig(rows=64, block_n=32, num_warps=4, num_stages=2)


@triton.jit
def _fold_keys(acc, best, total, q, k_base, v_base, table, start, context, positions, dims, dim_ok,
               stride_kb, stride_ks, stride_vb, stride_vs, scale,
               BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr, DIAGONAL: tl.constexpr):
    """One tile of keys start .. + BLOCK_N into the running softmax. DIAGONAL: the tile crosses the causal diagonal
    (or the context's end), so keys are masked per row; below it every row sees every key, unmasked."""
    tokens = start + tl.arange(0, BLOCK_N)
    if DIAGONAL:
        valid = tokens < context
        blocks = tl.load(table + tokens // BLOCK_SIZE, mask=valid, other=0)
        kv_mask = valid[:, None] & dim_ok[None, :]
    else:
        blocks = tl.load(table + tokens // BLOCK_SIZE)
        kv_mask = dim_ok[None, :]  # every key of the tile is in the context
    within = tokens % BLOCK_SIZE
    k = tl.load(k_base + blocks[:, None] * stride_kb + within[:, None] * stride_ks + dims[None, :], mask=kv_mask,
                other=0.0)
    v = tl.load(v_base + blocks[:, None] * stride_vb + within[:, None] * stride_vs + dims[None, :], mask=kv_mask,
                other=0.0)
    scores = dot(q, tl.trans(k.to(q.dtype)), IEEE) * scale  # the cast: fp32 queries over a bf16 cache
    if DIAGONAL:
        scores = tl.where((tokens[None, :] <= positions[:, None]) & valid[None, :], scores, float("-inf"))
    new_best = tl.maximum(best, tl.max(scores, 1))  # finite: every row sees key 0, in the first tile folded
    weights = tl.exp2(scores - new_best[:, None])
    rescale = tl.exp2(best - new_best)
    total = total * rescale + tl.sum(weights, 1)
    acc = acc * rescale[:, None] + dot(weights.to(q.dtype), v.to(q.dtype), IEEE)
    return acc, new_best, total


# GQA: one program per KV head, its rows the group's query heads x BLOCK_M queries (query-major, so a token's
# heads are adjacent rows and one contiguous load). Each K/V tile is then read and its addresses looked up once
# per group rather than once per query head (4x fewer with Llama-3-8B's 32/8 heads), the group's rows share
# positions and so one causal bound, and a short chunk still fills the tensor cores' rows (16 queries of a
# 4-head group are 64 rows), which matters most for a chunk after a long cached context, where K/V reads
# dominate. ROWS = BLOCK_M * GROUP rounded up to a power of two wastes at most GROUP - 1 rows.
@triton.jit
def _paged_prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, table_starts_ptr, query_starts_ptr,
                          query_lens_ptr, context_lens_ptr, scale,
                          stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                          stride_ot, stride_oh,
                          GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
                          DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                          IEEE: tl.constexpr):
    tile, kv_head, seg = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    length = tl.load(query_lens_ptr + seg)
    first = tile * BLOCK_M
    if first >= length:  # the grid covers the longest chunk; this one is shorter
        return
    context = tl.load(context_lens_ptr + seg)
    rows = tl.arange(0, ROWS)
    queries = first + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_M * GROUP) & (queries < length)
    positions = context - length + queries
    dims = tl.arange(0, DIM_PAD)
    dim_ok, token_rows = dims < HEAD_DIM, tl.load(query_starts_ptr + seg) + queries
    q = tl.load(q_ptr + token_rows[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    table = tables_ptr + tl.load(table_starts_ptr + seg)
    k_base, v_base = k_ptr + kv_head * stride_kh, v_ptr + kv_head * stride_vh
    best = tl.full((ROWS,), float("-inf"), tl.float32)
    total = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, DIM_PAD), tl.float32)
    below = (context - length + first + 1) // BLOCK_N * BLOCK_N  # keys every row of the tile sees
    end = tl.minimum(context - length + first + BLOCK_M, context)  # the tile's last query's position + 1
    for start in range(0, below, BLOCK_N):
        acc, best, total = _fold_keys(acc, best, total, q, k_base, v_base, table, start, context, positions, dims,
                                      dim_ok, stride_kb, stride_ks, stride_vb, stride_vs, scale,
                                      BLOCK_SIZE, BLOCK_N, IEEE, False)
    for start in range(below, end, BLOCK_N):  # the tiles that cross the diagonal; none above it
        acc, best, total = _fold_keys(acc, best, total, q, k_base, v_base, table, start, context, positions, dims,
                                      dim_ok, stride_kb, stride_ks, stride_vb, stride_vs, scale,
                                      BLOCK_SIZE, BLOCK_N, IEEE, True)
    out = acc / total[:, None]
    tl.store(out_ptr + token_rows[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedPrefill,
                            out: torch.Tensor, tiles: TileConfig | None = None) -> torch.Tensor:
    """q [T, heads, D] (the flat batch; any strides with a contiguous last dimension); caches [kv_heads, blocks,
    block_size, D], the chunks' own keys already written; batch: the step's segments. Writes the segments' rows of
    out [T, heads, D] (other rows are left as they are) and returns out. Any head_dim: padded to a power of two."""
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads, _, block_size, _ = k_cache.shape
    group = heads // kv_heads
    tiles = tiles or (FP32_TILES if q.dtype == torch.float32 else HALF_TILES)
    rows = max(tiles.rows, triton.next_power_of_2(group))
    block_m = rows // group
    grid = (triton.cdiv(batch.max_len, block_m), kv_heads, batch.query_lens.shape[0])
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, out, batch.tables, batch.table_starts, batch.query_starts, batch.query_lens,
        batch.context_lens, head_dim ** -0.5 * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(1), k_cache.stride(2), k_cache.stride(0),
        v_cache.stride(1), v_cache.stride(2), v_cache.stride(0), out.stride(0), out.stride(1),
        GROUP=group, ROWS=rows, BLOCK_M=block_m, HEAD_DIM=head_dim, DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_N=tiles.block_n, IEEE=q.dtype == torch.float32,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


# ---- The measured alternative: FlexAttention over the same cache and metadata -------------------------------------

FLEX_Q_BLOCK = 128  # queries per block-mask row (FlexAttention's default sparse block)
_compiled_flex = None


def flex_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PagedPrefill,
                           out: torch.Tensor, compiled: bool = True, block_mask=None,
                           kernel_options: dict | None = None) -> torch.Tensor:
    """The same call as paged_prefill_attention, through torch's FlexAttention: segments are its batch (queries
    padded to the longest chunk, a copy of the queries, not of K/V), the cache viewed as one key sequence per KV head
    (it must be contiguous) is shared by every segment. compiled=False: FlexAttention's eager path, which computes
    every score densely from the mask_mod alone (CPU tests). block_mask: paged_block_mask(batch, ...), if already
    built for the step. kernel_options: the compiled kernel's template options (cuda_flex_options on CUDA). The
    cache's dtype must be the queries'."""
    if k_cache.dtype != q.dtype:
        raise ValueError(f"FlexAttention takes queries and cache of one dtype, not {q.dtype} over {k_cache.dtype}")
    from torch.nn.attention.flex_attention import flex_attention

    kv_heads, num_blocks, block_size, head_dim = k_cache.shape
    segment, offset, rows = _segment_rows(batch)
    queries = q.new_zeros(batch.query_lens.shape[0], q.shape[1], batch.max_len, head_dim)
    queries[segment, :, offset] = q[rows]
    keys = k_cache.view(1, kv_heads, num_blocks * block_size, head_dim)
    values = v_cache.view(1, kv_heads, num_blocks * block_size, head_dim)
    attend = _flex_compiled() if compiled else flex_attention
    block_mask = block_mask if block_mask is not None else paged_block_mask(batch, num_blocks, block_size)
    result = attend(queries, keys, values, block_mask=block_mask, enable_gqa=True, kernel_options=kernel_options)
    out[rows] = result[segment, :, offset].to(out.dtype)
    return out


def cuda_flex_options(block_size: int) -> dict:
    """CUDA's template options: BLOCK_N, the kernel reads keys in tiles within one page; FORCE_USE_FLEX_ATTENTION,
    short chunks too take the prefill kernel, not flex decoding, so every shape is measured on one kernel."""
    return {"BLOCK_N": math.gcd(block_size, 64), "FORCE_USE_FLEX_ATTENTION": True}


def _flex_compiled():
    """FlexAttention compiled once per process. Shapes are static at first and become dynamic where a later call's
    differ (torch.compile's default): dynamic=True would make the kernel options' ints symbolic too."""
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex = torch.compile(flex_attention)
    return _compiled_flex


def _segment_rows(batch: PagedPrefill) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For every query of the step: its segment, its index within the segment and its row of the flat batch, computed
    on the device (batch.num_tokens, known on the host, sizes them without a sync)."""
    count = batch.query_lens.shape[0]
    segment = torch.repeat_interleave(torch.arange(count, device=batch.query_lens.device), batch.query_lens,
                                      output_size=batch.num_tokens)
    firsts = torch.cumsum(batch.query_lens, 0) - batch.query_lens
    offset = torch.arange(batch.num_tokens, device=segment.device) - firsts[segment]
    return segment, offset, batch.query_starts[segment] + offset


def padded_tables(batch: PagedPrefill) -> torch.Tensor:
    """[S, widest] block tables from the flat one; entries past a segment's own are another's (never read)."""
    columns = torch.arange(batch.widest, device=batch.tables.device)
    return batch.tables[(batch.table_starts[:, None] + columns).clamp_(max=batch.tables.shape[0] - 1)]


def paged_block_mask(batch: PagedPrefill, num_blocks: int, block_size: int):
    """FlexAttention's BlockMask over the physical cache, built on the device: for segment s's query block i, the
    pages it sees entirely (full: their last key at or before the block's first query's position) and the few past
    them up to its last query's position (partial: the mask_mod decides per key). Forward only: no transposed
    (q-major) lists, which would need a column per page of the cache."""
    from torch.nn.attention.flex_attention import BlockMask

    tables = padded_tables(batch)
    count, widest = tables.shape
    q_blocks = triton.cdiv(batch.max_len, FLEX_Q_BLOCK)
    firsts = torch.arange(q_blocks, device=tables.device)[None, :] * FLEX_Q_BLOCK  # [1, q_blocks]
    lens, cached = batch.query_lens[:, None], (batch.context_lens - batch.query_lens)[:, None]
    live = firsts < lens
    full = torch.where(live, (cached + firsts + 1) // block_size, 0)
    seen = torch.where(live, (cached + torch.minimum(firsts + FLEX_Q_BLOCK, lens) - 1) // block_size + 1, 0)
    partial_width = FLEX_Q_BLOCK // block_size + 1
    partial = (full[..., None] + torch.arange(partial_width, device=tables.device)).clamp_(max=widest - 1)
    partial_pages = tables.gather(1, partial.flatten(1)).view(count, q_blocks, partial_width)
    full_pages = tables[:, None, :].expand(count, q_blocks, widest)
    as_lists = {"dtype": torch.int32, "memory_format": torch.contiguous_format}  # FlexAttention's kernel wants both
    return BlockMask.from_kv_blocks(
        (seen - full)[:, None].to(**as_lists), partial_pages[:, None].to(**as_lists),
        full[:, None].to(**as_lists), full_pages[:, None].to(**as_lists),
        BLOCK_SIZE=(FLEX_Q_BLOCK, block_size), mask_mod=_paged_causal(batch, tables, num_blocks, block_size),
        seq_lengths=(batch.max_len, num_blocks * block_size), compute_q_blocks=False)


def _paged_causal(batch: PagedPrefill, tables: torch.Tensor, num_blocks: int, block_size: int):
    """The mask_mod: a physical key is visible to query q_idx of segment b where its page is one of b's, at a
    position at or before the query's. owner[b, page] is the page's index in b's table (-1: not b's; one spare
    column takes the table's padding), so a block shared by two segments (a cached prefix) maps for each."""
    count, widest = tables.shape
    columns = torch.arange(widest, device=tables.device)
    used = columns[None, :] < (batch.context_lens[:, None] + block_size - 1) // block_size
    owner = torch.full((count, num_blocks + 1), -1, dtype=torch.long, device=tables.device)
    owner.scatter_(1, torch.where(used, tables, num_blocks), columns.expand(count, widest))
    cached = batch.context_lens - batch.query_lens

    def visible(b, h, q_idx, kv_idx):
        logical = owner[b, kv_idx // block_size]
        return (logical >= 0) & (logical * block_size + kv_idx % block_size <= cached[b] + q_idx)

    return visible
