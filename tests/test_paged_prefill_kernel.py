"""The paged prefill kernels (engine/kernels/paged_prefill.py) against a float64 reference over gathered blocks.

Triton's: on CPU it runs in Triton's interpreter (conftest switches it on), so its indexing, tile skipping, causal
masking and online softmax are checked everywhere; on a CUDA machine the compiled kernel. FlexAttention: compiled on
CUDA; on CPU its eager path, which computes every score from the mask_mod (compiled on CPU, its C++ template wants a
list column for every page of the cache, and takes half a minute), and the block mask's page lists are checked apart
against that mask.
"""

from __future__ import annotations

import functools

import pytest
import torch

triton = pytest.importorskip("triton")

from engine.kernels.paged_prefill import (
    TileConfig,
    cuda_flex_options,
    flex_prefill_attention,
    paged_block_mask,
    paged_prefill_attention,
)
from engine.layers.attention import PrefillSegment, paged_prefill

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] + ([torch.float16] if DEVICE == "cuda" else [])
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}
# (heads, kv_heads, head_dim, block_size): GQA groups of 1, 3 and 4; head dims 64 and 80 and 96 (padded to 128)
SHAPES = [(4, 4, 64, 16), (6, 2, 80, 8), (8, 2, 64, 16), (12, 3, 96, 16)]
# every shape in fp32, the half dtypes on all on CUDA, on two on CPU (where the interpreter takes about a second each)
CASES = [(shape, torch.float32) for shape in SHAPES] + [(shape, dtype) for dtype in DTYPES[1:] for shape in
                                                         (SHAPES if DEVICE == "cuda" else SHAPES[1:3])]
SMALL_TILES = TileConfig(rows=32, block_n=16, num_warps=4, num_stages=1)  # several query and key tiles per segment
# (new tokens, context): fresh prompts (one of a single token, one over several tiles), chunks after cached tokens
# (a cached part that ends mid-block, a short chunk after a long context); none a multiple of the tiles
SEGMENTS = [(37, 37), (1, 1), (20, 65), (40, 56), (3, 50)]
FRESH = 2  # the first two segments are fresh prompts


@pytest.fixture(autouse=True)
def _interpreter_bf16_dot(monkeypatch):
    """Triton 3.6's interpreter holds bf16 as its uint16 bits and its tl.dot multiplies those bits as integers: under
    the interpreter, bf16 operands are widened to float32 first (exact: products are summed in float32 anyway)."""
    if DEVICE == "cuda":
        return
    from triton.runtime import interpreter

    create_dot = interpreter.InterpreterBuilder.create_dot

    def widened(builder, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == triton.language.bfloat16:
            a, b = (builder.cast_impl(x, triton.language.float32) for x in (a, b))
        return create_dot(builder, a, b, d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", widened)


def _case(heads, kv_heads, dim, block, dtype, seed):
    """Caches with every segment's blocks scattered (room for its context and one more), q a strided view whose
    first two rows and the row between segments 2 and 3 belong to no segment, and the segments (fresh ones without
    a table, their blocks named by their slots, as the runner gives them on CUDA)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-context // block) for _, context in SEGMENTS) + 1
    num_blocks = len(SEGMENTS) * width + 2
    k_cache = torch.randn(kv_heads, num_blocks, block, dim, generator=gen).to(dtype)
    v_cache = torch.randn(kv_heads, num_blocks, block, dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[:len(SEGMENTS) * width].view(len(SEGMENTS), width)
    segments, slots, row = [], [0, 0], 2
    for i, (length, context) in enumerate(SEGMENTS):
        positions = torch.arange(context - length, context)
        slots += (tables[i, positions // block] * block + positions % block).tolist()
        segments.append(PrefillSegment(row, length, context, None if i < FRESH else tables[i].to(DEVICE)))
        row += length + (i == 2)
        slots += [0] * (i == 2)
    q = torch.randn(row, heads + kv_heads, dim, generator=gen).to(dtype)[:, :heads]
    return q, k_cache, v_cache, tables, segments, torch.tensor(slots, device=DEVICE)


def _reference(q, k_cache, v_cache, tables, segments):
    """Each segment's queries over its context gathered token by token, with the explicit causal mask, in float64."""
    heads, kv_heads, block = q.shape[1], k_cache.shape[0], k_cache.shape[2]
    out = {}
    for i, seg in enumerate(segments):
        blocks = tables[i, :-(-seg.context_len // block)]
        keys = k_cache[:, blocks].flatten(1, 2)[:, :seg.context_len].double().repeat_interleave(heads // kv_heads, 0)
        values = v_cache[:, blocks].flatten(1, 2)[:, :seg.context_len].double().repeat_interleave(heads // kv_heads, 0)
        queries = q[seg.start:seg.start + seg.length].double().transpose(0, 1)  # [heads, L, D]
        visible = (torch.arange(seg.context_len)[None, :]
                   <= torch.arange(seg.length)[:, None] + seg.context_len - seg.length)
        scores = (queries @ keys.transpose(1, 2) * q.shape[-1] ** -0.5).masked_fill(~visible, float("-inf"))
        out[i] = (scores.softmax(-1) @ values).transpose(0, 1)
    return out


def _check(attend, shape, dtype, seed):
    q, k_cache, v_cache, tables, segments, slots = _case(*shape, dtype, seed)
    batch = paged_prefill(segments, slots, shape[3])
    out = torch.full(q.shape, 7.0, dtype=dtype, device=DEVICE)
    attend(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), batch, out)
    out = out.cpu()
    for i, want in _reference(q, k_cache, v_cache, tables, segments).items():
        seg = segments[i]
        got = out[seg.start:seg.start + seg.length].double()
        error = (got - want).norm() / want.norm()
        assert error < TOLERANCE[dtype], f"segment {i} ({seg.length} after {seg.context_len - seg.length}): {error:.2e}"
    assert (out[[0, 1, segments[3].start - 1]] == 7.0).all()  # rows of no segment are left alone


@pytest.mark.parametrize("shape, dtype", CASES)
def test_triton_kernel_matches_reference(shape, dtype):
    """Default tiles: one query tile per segment for most; GQA packing with groups of 1, 3 and 4."""
    _check(paged_prefill_attention, shape, dtype, sum(shape))


@pytest.mark.parametrize("shape, dtype", [(SHAPES[1], torch.float32), (SHAPES[2], torch.bfloat16)])
def test_triton_kernel_over_many_small_tiles(shape, dtype):
    """Small tiles: many query tiles per segment, the unmasked key tiles below the diagonal and those across it."""
    _check(lambda *args: paged_prefill_attention(*args, tiles=SMALL_TILES), shape, dtype, 3 * sum(shape))


def test_triton_kernel_reads_float32_queries_over_a_bf16_cache():
    shape = SHAPES[2]
    q, k_cache, v_cache, tables, segments, slots = _case(*shape, torch.bfloat16, 5)
    q = torch.randn(q.shape, generator=torch.Generator().manual_seed(6))
    out = torch.empty(q.shape, device=DEVICE)
    paged_prefill_attention(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), paged_prefill(segments, slots, 16),
                            out)
    for i, want in _reference(q, k_cache, v_cache, tables, segments).items():
        seg = segments[i]
        error = (out[seg.start:seg.start + seg.length].cpu().double() - want).norm() / want.norm()
        assert error < TOLERANCE[torch.float32], f"segment {i}: {error:.2e}"


# few cases: on CPU FlexAttention's eager path is slow, on CUDA each shape and dtype is a compilation of its own
@pytest.mark.parametrize("shape, dtype", [(SHAPES[0], torch.float32), (SHAPES[1], torch.bfloat16),
                                          (SHAPES[2], torch.float32 if DEVICE == "cpu" else torch.float16)])
def test_flex_variant_matches_reference(shape, dtype):
    options = cuda_flex_options(shape[3]) if DEVICE == "cuda" else None
    _check(lambda *args: flex_prefill_attention(*args, compiled=DEVICE == "cuda", kernel_options=options), shape,
           dtype, sum(shape))


@pytest.mark.parametrize("block", [8, 16])
def test_flex_block_mask_lists_every_page_a_query_block_sees(block):
    """Against the mask_mod evaluated at every (query, physical key): each full page listed is visible to all of its
    query block, and every page with a visible key is listed, as full or partial (the eager path, which the CPU runs,
    does not read the lists)."""
    from torch.nn.attention.flex_attention import create_mask

    _, k_cache, _, _, segments, slots = _case(4, 2, 16, block, torch.float32, block)
    batch = paged_prefill(segments, slots, block)
    num_blocks = k_cache.shape[1]
    mask = paged_block_mask(batch, num_blocks, block)
    dense = create_mask(mask.mask_mod, len(segments), 1, batch.max_len, num_blocks * block, device=DEVICE)[:, 0]
    pad = -batch.max_len % 128  # rows past the longest chunk: seen by no page, not against a full one

    def pages(value: bool) -> torch.Tensor:  # [S, q_blocks, 128 queries, pages, block keys]
        padded = torch.nn.functional.pad(dense, (0, 0, 0, pad), value=value)
        return padded.unflatten(1, (-1, 128)).unflatten(3, (-1, block))

    seen, whole = pages(False).any(4).any(2), pages(True).all(4).all(2)  # [S, q_blocks, pages]
    listed = torch.zeros_like(seen)
    for kind in ("full_", ""):
        counts, indices = getattr(mask, f"{kind}kv_num_blocks")[:, 0], getattr(mask, f"{kind}kv_indices")[:, 0]
        for s, i in zip(*torch.nonzero(counts, as_tuple=True)):
            chosen = indices[s, i, :counts[s, i]].long()
            if kind:
                assert whole[s, i, chosen].all(), f"segment {s}, query block {i}: a full page is not all visible"
            listed[s, i, chosen] = True
    assert (listed | ~seen).all(), "a page with visible keys is missing from the block mask"


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("kernel", ["triton", "flex"])
def test_engine_tokens_are_unchanged_with_the_kernel(tiny_llama_path, tokenizer, monkeypatch, kernel):
    """cuda_prefill="triton" or "flex" against the default "sdpa" (gather + SDPA per chunk), on the runner's own
    segments: fresh prompts (no table: blocks from their slots), chunks of a chunked prefill, and prompts after a
    cached prefix, none of them block-aligned. On CUDA the option chooses the kernel; on CPU, where the backend takes
    none, the kernel is forced (Triton's in the interpreter, FlexAttention eager), with the C++ kernels off so that
    every chunk takes it. Greedy tokens as the SDPA path's, in float32."""
    from engine import LLM, SamplingParams
    from engine.backends import torch_reference
    from engine.layers.attention import cuda_prefill_kernel
    from tests.helpers import PROMPTS

    base = tokenizer(" ".join(PROMPTS))["input_ids"][:40]
    prompts = [base] + [base[:n] + tokenizer(p)["input_ids"][:5] for n, p in zip((16, 23, 37), PROMPTS)]
    params = SamplingParams(max_tokens=3, temperature=0)
    options = {"dtype": "float32", "log_stats": False, "cpu_kernels": False, "max_num_batched_tokens": 24,
               "kv_cache_bytes": 32 << 20}

    def run(**chosen) -> list[list[int]]:
        llm = LLM(str(tiny_llama_path), **options, **chosen)
        llm.generate(prompts[:1], params, use_tqdm=False)  # caches the shared base
        tokens = [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.stats().prefix_cache_hit_tokens > 0
        return tokens

    want = run()
    if DEVICE == "cpu":  # the CPU backends take no CUDA kernel: forced here
        attend = (cuda_prefill_kernel(kernel, 16) if kernel == "triton"
                  else functools.partial(flex_prefill_attention, compiled=False))
        monkeypatch.setattr(torch_reference.TorchBackend, "_prefill_kernel", lambda self, config: attend)
    segments = []  # the backend builds the kernel's batch only where a kernel takes the step's chunks
    build = torch_reference.paged_prefill
    monkeypatch.setattr(torch_reference, "paged_prefill",
                        lambda prefills, *args: segments.extend(prefills) or build(prefills, *args))
    assert run(cuda_prefill=kernel) == want
    assert any(seg.block_table is None for seg in segments) and any(seg.block_table is not None for seg in segments)
