"""Attention over the paged KV cache for one flat batch of prefill and decode tokens.

The cache of one layer is a pair of tensors [kv_heads, num_blocks, block_size, head_dim]. New keys
and values are written at their slots. The step's metadata, built once by its step backend (engine/backends/),
is the path: `InPlaceAttention`, `GatheredAttention` or `PagedAttention`, each attending as follows. On CPU with
the C++ kernel (engine/kernels/cpu_attention.py),
every decode token and every prompt chunk shorter than IN_PLACE_CHUNK attend in one call that reads
their blocks in place; longer chunks attend one sequence at a time, through the C++ prompt kernel in bf16 on a
CPU with AVX-512 BF16 and no AMX, else through SDPA's flash kernel (_prefill).
On CUDA, decode tokens (one new token per sequence, placed first in the flat batch) attend in one call to a
Triton kernel that reads their blocks in place, and the step's prompt chunks, fresh or after cached tokens, take
the path the backend chose once from the cuda_prefill option (cuda_prefill_kernel): gather + SDPA per chunk (the
default), or one call of a Triton prefill kernel that reads their blocks in place too
(engine/kernels/paged_prefill.py), or of its FlexAttention variant. On CPU without the kernel, decodes take SDPA or
grouped matmuls over gathered copies of the blocks.

Why head-major: a sequence's blocks gathered for one KV head are one contiguous [tokens, head_dim]
run, so the gathered K/V feed the batched matmuls as they are. With the token-major layout
([blocks, block_size, kv_heads, head_dim]) the matmuls ran on a permuted view, much slower than on
contiguous data: measured on CPU (SmolLM2's shapes, bf16, one layer's decode attention), head-major was
faster at every batch and length, the more so the longer the contexts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernels import cpu_attention
from engine.kernels.prefill_batch import PagedPrefill
from engine.transfer import to_device

# (q, k_cache, v_cache, batch, out): every prompt chunk of a step attends, its rows of out written
PrefillKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, PagedPrefill, torch.Tensor], None]


@dataclass
class PrefillSegment:
    start: int  # index of the segment's first token in the flat batch
    length: int  # new tokens in this step
    context_len: int  # tokens in the cache once this step's are written
    # set when earlier tokens of the sequence are already cached, and always for the CPU prompt kernel, which reads
    # the chunk's own keys from the cache too
    block_table: torch.Tensor | None
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
    """A step's attention as its step backend built it (engine/backends/), once for every layer: the subclass is the
    path its decodes take, and these fields are what every path shares: the new tokens' cache slots, the decodes
    (the first num_decode tokens, one each) and the prompt chunks that attend one by one."""
    slot_mapping: torch.Tensor  # [tokens]: cache slot of each new token
    num_decode: int
    prefills: list[PrefillSegment]
    # the step's keys and values go into the cache in one call of the fused operators (C++ on CPU, Triton on CUDA:
    # write_kv_cache(k, v, k_cache, v_cache, slot_mapping)), not two index_copy_; None: index_copy_
    kv_write: Callable[..., None] | None = None
    # long prompt chunks attend in the C++ prompt kernel (cpu_attention.prompt_kernel_usable), not SDPA's
    prompt_kernel: bool = False
    # the in-place kernel that takes every prompt chunk of the step in one call (cuda_prefill_kernel), None for
    # gather + SDPA per chunk; and `prefills` as it reads them (paged_prefill()), built once per step: by the
    # backend, else by the step's first layer for all the others
    prefill_kernel: PrefillKernel | None = None
    paged_prefill: PagedPrefill | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, softcap: float | None, window: int | None) -> torch.Tensor:
        """[T, heads, D] for q [T, heads, D], this step's k and v already in the cache."""
        raise NotImplementedError

    def _prompt_chunks(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, out: torch.Tensor) -> None:
        """The prompt chunks' rows of out: all in the step's prefill kernel, or chunk by chunk."""
        if self.prefills and self.prefill_kernel is not None:
            if self.paged_prefill is None:  # the backend did not build it: the step's first layer does
                self.paged_prefill = paged_prefill(self.prefills, self.slot_mapping, k_cache.shape[2])
            self.prefill_kernel(q, k_cache, v_cache, self.paged_prefill, out)
            return
        for seg in self.prefills:
            rows = slice(seg.start, seg.start + seg.length)
            out[rows] = _prefill(q[rows], k[rows], v[rows], k_cache, v_cache, seg, self.prompt_kernel,
                                 self._after_cached)

    @staticmethod
    def _after_cached(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cached: int) -> torch.Tensor:
        return _after_cached(queries, keys, values, cached)


def _refuse_capped(softcap: float | None, window: int | None) -> None:
    if softcap is not None or window is not None:
        raise RuntimeError("soft-capped or windowed attention takes only the C++ kernel's path: every token in "
                           "InPlaceAttention.in_place")


@dataclass(kw_only=True)
class InPlaceAttention(AttentionMetadata):
    """CPU with the C++ kernel: the decodes and the short chunks in one call that reads the cache in place
    (`in_place`; None when every chunk of the step is long), the long chunks one by one."""
    in_place: InPlaceQueries | None = None

    def attend(self, q, k, v, k_cache, v_cache, softcap, window) -> torch.Tensor:
        if self.prefills:
            _refuse_capped(softcap, window)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        batch = self.in_place
        if batch is not None:
            cpu_attention.paged_attention(q, k_cache, v_cache, batch.block_tables, batch.context_lens,
                                          batch.query_starts, batch.query_lens, out, softcap, window)
        self._prompt_chunks(q, k, v, k_cache, v_cache, out)
        return out


@dataclass(kw_only=True)
class GatheredAttention(AttentionMetadata):
    """The PyTorch reference: each decode's blocks gathered (their cache rows computed once a step) and attended
    under an additive mask."""
    decode_block_tables: torch.Tensor | None = None  # [num_decode, max_blocks]
    decode_mask: torch.Tensor | None = None  # [num_decode, 1, 1, max_blocks * block_size], additive
    decode_rows: torch.Tensor | None = None  # block_rows() of decode_block_tables

    def attend(self, q, k, v, k_cache, v_cache, softcap, window) -> torch.Tensor:
        _refuse_capped(softcap, window)
        if self.num_decode == q.shape[0]:  # decode-only step: no scatter into a shared output
            return _gathered_decode(q, k_cache, v_cache, self)
        out = torch.empty_like(q)
        if self.num_decode:
            out[:self.num_decode] = _gathered_decode(q[:self.num_decode], k_cache, v_cache, self)
        self._prompt_chunks(q, k, v, k_cache, v_cache, out)
        return out


@dataclass(kw_only=True)
class PagedAttention(AttentionMetadata):
    """CUDA: the decodes in one call of the Triton kernel that reads their blocks in place, by block tables and
    context lengths held on the device; a chunk after cached tokens, where no prefill kernel takes it, attends by
    SDPA under a causal mask."""
    decode_block_tables: torch.Tensor | None = None  # [num_decode, max_blocks]
    decode_context_lens: torch.Tensor | None = None  # [num_decode], the new token included

    def attend(self, q, k, v, k_cache, v_cache, softcap, window) -> torch.Tensor:
        _refuse_capped(softcap, window)
        from engine.kernels.paged_attention import paged_decode_attention  # triton may be absent off CUDA

        if self.num_decode == q.shape[0]:
            return paged_decode_attention(q, k_cache, v_cache, self.decode_block_tables, self.decode_context_lens)
        out = torch.empty_like(q)
        if self.num_decode:
            out[:self.num_decode] = paged_decode_attention(q[:self.num_decode], k_cache, v_cache,
                                                           self.decode_block_tables, self.decode_context_lens)
        self._prompt_chunks(q, k, v, k_cache, v_cache, out)
        return out

    @staticmethod
    def _after_cached(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cached: int) -> torch.Tensor:
        return masked_after_cached(queries, keys, values, cached)


KVCache = tuple[torch.Tensor, torch.Tensor]

IN_PLACE_CHUNK = 64  # with the C++ kernel, chunks shorter than this read the cache in place with the decodes


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                    meta: AttentionMetadata, softcap: float | None = None, window: int | None = None) -> torch.Tensor:
    """q: [T, heads, D]; k, v: [T, kv_heads, D]. Returns [T, heads * D]. softcap (Gemma 2's scores, capped by
    tanh) and window (a sliding window, Gemma 2's and 3's): only the C++ kernel computes them, so the CPU backend
    then puts every token in its in-place call, and the other paths refuse them."""
    k_cache, v_cache = cache
    if meta.kv_write is not None:
        meta.kv_write(k, v, k_cache, v_cache, meta.slot_mapping)
    else:
        _write(k_cache, k, meta.slot_mapping)
        _write(v_cache, v, meta.slot_mapping)
    return meta.attend(q, k, v, k_cache, v_cache, softcap, window).flatten(1)


def paged_prefill(prefills: list[PrefillSegment], slot_mapping: torch.Tensor, block_size: int) -> PagedPrefill:
    """The prefill kernel's view of a step's segments. A fresh prompt's segment has no block table on CUDA: its
    blocks are those of its own slots, one every block_size rows (its positions start at 0). Two small launches and
    one host-to-device copy, from pinned memory so that the host does not wait for the device's queue (the first
    layer may build it in the middle of the forward pass)."""
    blocks = slot_mapping // block_size
    tables = [seg.block_table if seg.block_table is not None else blocks[seg.start:seg.start + seg.length:block_size]
              for seg in prefills]
    sizes = [table.shape[0] for table in tables]
    lengths = [seg.length for seg in prefills]
    ints = to_device([[sum(sizes[:i]) for i in range(len(sizes))], [seg.start for seg in prefills], lengths,
                      [seg.context_len for seg in prefills]], slot_mapping.device, torch.long)
    return PagedPrefill(torch.cat(tables), *ints, max(lengths), sum(lengths),
                        max(-(-seg.context_len // block_size) for seg in prefills))


def cuda_prefill_kernel(name: str, block_size: int) -> PrefillKernel | None:
    """The in-place prompt kernel that the cuda_prefill option names, None for "sdpa" (gather + SDPA per chunk);
    FlexAttention with CUDA's template options for the cache's blocks. Imported here only: triton may be absent on
    CPU."""
    if name == "sdpa":
        return None
    from engine.kernels import paged_prefill as kernels

    if name == "flex":
        return functools.partial(kernels.flex_prefill_attention, kernel_options=kernels.cuda_flex_options(block_size))
    return kernels.paged_prefill_attention


def _write(cache: torch.Tensor, new: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """new [T, kv_heads, D] into the cache's slots (slot = block * block_size + offset)."""
    kv_heads, head_dim = cache.shape[0], cache.shape[-1]
    cache.view(kv_heads, -1, head_dim).index_copy_(1, slot_mapping, new.transpose(0, 1).to(cache.dtype))


def _gathered_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: GatheredAttention) -> torch.Tensor:
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[0]
    keys = _gather_blocks(k_cache, meta.decode_block_tables, meta.decode_rows).to(q.dtype)  # [kv_heads, B, L, D]
    values = _gather_blocks(v_cache, meta.decode_block_tables, meta.decode_rows).to(q.dtype)
    if q.dtype == torch.float32:  # fp32: SDPA (its decode path beat fp32 grouped matmuls here)
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
    (KV head, block), head-major: the same for every layer, so the runner computes them once per step, which
    shortens every layer's decode attention."""
    heads = torch.arange(kv_heads, device=block_table.device)[:, None] * num_blocks
    return (heads + block_table.flatten()).flatten()


def _gather_blocks(cache: torch.Tensor, block_table: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The cached tokens of the blocks in block_table ([B, blocks] or [blocks]), head-major: [kv_heads, B,
    blocks * block_size, D] or [kv_heads, blocks * block_size, D]. rows: block_rows() of the table, if known.

    The gather is index_select over the rows of the cache seen as a 2-D tensor, its fastest form on CPU: faster
    than index_select on the block axis of the 4-D cache, for one layer's K and for the whole decode step.
    (Advanced indexing was slower still than index_select.) Gathering into buffers kept from step to step
    measured no faster."""
    kv_heads, num_blocks = cache.shape[0], cache.shape[1]
    if rows is None:
        rows = block_rows(block_table, kv_heads, num_blocks)
    gathered = cache.view(kv_heads * num_blocks, -1).index_select(0, rows)
    return gathered.view(kv_heads, *block_table.shape[:-1], -1, cache.shape[-1])


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             seg: PrefillSegment, cpu_kernel: bool = False, after_cached=None) -> torch.Tensor:
    """One prompt chunk: q [L, heads, D] for the last L of the context's positions -> [L, heads, D].

    cpu_kernel: the C++ prompt kernel, one call whether or not tokens are cached (bf16 on AVX-512 BF16 without
    AMX; engine/kernels/cpu_attention.py says why). Otherwise SDPA on 4-D inputs, the query heads of one
    KV head sharing it (enable_gqa): on CPU that is PyTorch's flash kernel, blocked, with an online softmax and
    oneDNN's bf16 micro-kernels (3-D inputs fall back to the math path, which materialises every score). A fresh
    prompt is causal from its first token and skips the upper triangle; a chunk after cached tokens attends to
    them and to itself apart (after_cached: _after_cached on CPU, masked_after_cached on CUDA). On a Xeon with
    AMX (SmolLM2's shapes, one layer) this beat tiles of 128 queries over oneDNN matmuls for long and short fresh
    prompts and for chunks after cached tokens, in bf16 and in fp32."""
    if cpu_kernel:
        return cpu_attention.prompt_attention(q, k_cache, v_cache, seg.block_table, seg.context_len)
    queries = q.transpose(0, 1)[None]  # [1, heads, L, D]
    if seg.block_table is None:  # the whole context is this chunk: plain causal attention
        keys, values = _as_stored(k, k_cache), _as_stored(v, v_cache)
        out = F.scaled_dot_product_attention(queries, keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                                             is_causal=True, enable_gqa=True)
        return out[0].transpose(0, 1)
    keys = _gather_blocks(k_cache, seg.block_table, seg.rows)[None, :, :seg.context_len].to(q.dtype)
    values = _gather_blocks(v_cache, seg.block_table, seg.rows)[None, :, :seg.context_len].to(q.dtype)
    out = (after_cached or _after_cached)(queries, keys, values, seg.context_len - seg.length)
    return out[0].transpose(0, 1)


def _as_stored(new: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """This step's keys or values as the cache holds them: rounded to a bf16 cache under float32 math, so a fresh
    prompt sees what its later tokens (and a request reusing its prefix) read back from the cache, as when the two
    dtypes are one."""
    return new if new.dtype == cache.dtype else new.to(cache.dtype).to(new.dtype)


def _after_cached(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cached: int) -> torch.Tensor:
    """A chunk's queries [1, heads, L, D] over keys/values [1, kv_heads, cached + L, D] on CPU: the cached keys
    (every query sees all of them) and the chunk's own (causal from its first token) in two flash calls, each
    skipping what it can, merged by their log-sum-exps. A shifted causal mask in one call would compute every
    score: slower than two calls for a long chunk after few cached tokens (bf16 and fp32) and for a chunk after as
    many cached; equal from 128 tokens down."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # SDPA's CPU kernel, which returns the LSE
    old, old_lse = flash(queries, keys[:, :, :cached], values[:, :, :cached])
    new, new_lse = flash(queries, keys[:, :, cached:], values[:, :, cached:], is_causal=True)
    top = torch.maximum(old_lse, new_lse)
    old_weight, new_weight = (old_lse - top).exp_()[..., None], (new_lse - top).exp_()[..., None]
    merged = (old.float() * old_weight + new.float() * new_weight) / (old_weight + new_weight)
    return merged.to(queries.dtype)


def masked_after_cached(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cached: int) -> torch.Tensor:
    """A chunk after cached tokens in one SDPA call under a shifted causal mask (CUDA's path)."""
    length, context = queries.shape[2], keys.shape[2]
    return F.scaled_dot_product_attention(queries, keys, values, enable_gqa=True,
                                          attn_mask=_visible(length, context, queries.device))


def _visible(length: int, context: int, device: torch.device) -> torch.Tensor:
    """[length, context]: True where a query among the last `length` positions may see a key (causal)."""
    return (torch.arange(context, device=device)[None, :]
            <= torch.arange(length, device=device)[:, None] + (context - length))


def _explicit_attention(q: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor,
                        bias: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) + bias) v with K already transposed; every operand broadcasts over the query
    heads that share a K/V head, so no K/V copy is made per query head."""
    scores = torch.matmul(q, keys_t) * q.shape[-1] ** -0.5
    return torch.matmul((scores + bias).softmax(-1), values)
