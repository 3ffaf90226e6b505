"""The paged decode-attention kernels against a float64 reference over gathered blocks.

Triton's: on CPU (CI) it runs in Triton's interpreter, so its indexing, masking and online softmax are
checked everywhere; on a CUDA machine the same test runs the compiled kernel, in fp16/bf16 as well.
The C++ CPU kernel: compiled and checked in every dtype it takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

triton = pytest.importorskip("triton")  # on CPU, conftest has switched on Triton's interpreter

from engine.kernels.paged_attention import paged_decode_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if DEVICE == "cuda" else [])
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _reference(q, k_cache, v_cache, tables, lens, softcap=None, window=None):
    """Caches [kv_heads, blocks, block_size, D]: each sequence's blocks gathered token by token; scores soft-capped
    as transformers' Gemma 2 caps them, where softcap is given; only the last `window` keys, where window is."""
    out = []
    heads, kv_heads, block = q.shape[1], k_cache.shape[0], k_cache.shape[2]
    for i, length in enumerate(lens.tolist()):
        blocks = tables[i, :(length + block - 1) // block]
        keys = k_cache[:, blocks].flatten(1, 2)[:, :length].transpose(0, 1)  # [length, kv_heads, D]
        values = v_cache[:, blocks].flatten(1, 2)[:, :length].transpose(0, 1)
        keys = keys.double().repeat_interleave(heads // kv_heads, dim=1)
        values = values.double().repeat_interleave(heads // kv_heads, dim=1)
        if window is not None:
            keys, values = keys[-window:], values[-window:]
        scores = torch.einsum("hd,lhd->hl", q[i].double(), keys) * q.shape[-1] ** -0.5
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        out.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), values))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, dim, block", [(6, 2, 16, 4), (9, 3, 64, 16), (4, 4, 24, 8)])
def test_kernel_matches_reference(dtype, heads, kv_heads, dim, block):
    gen = torch.Generator().manual_seed(heads * dim + block)
    lens = torch.tensor([1, 5, block, 3 * block + 1, 70, 130])  # one token, partial, full, and several tiles
    width = int((lens.max() + block - 1) // block) + 2  # wider than any sequence needs
    num_blocks = len(lens) * width + 3
    k_cache = torch.randn(kv_heads, num_blocks, block, dim, generator=gen).to(dtype)
    v_cache = torch.randn(kv_heads, num_blocks, block, dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[:len(lens) * width].view(len(lens), width)
    q = torch.randn(len(lens), heads + kv_heads, dim, generator=gen).to(dtype)[:, :heads]  # a strided view
    move = dict(device=DEVICE)
    out = paged_decode_attention(q.to(**move), k_cache.to(**move), v_cache.to(**move), tables.to(**move),
                                 lens.to(**move))
    want = _reference(q, k_cache, v_cache, tables, lens)
    error = (out.cpu().double() - want).norm() / want.norm()
    assert error < TOLERANCE[dtype], f"relative error {error:.2e}"


CPU_SHAPES = [(6, 2, 16, 16), (9, 3, 64, 16), (4, 4, 24, 32), (8, 1, 128, 16)]  # (heads, kv_heads, dim, block)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, kv_heads, dim, block", CPU_SHAPES)
def test_cpu_kernel_matches_reference(dtype, heads, kv_heads, dim, block):
    """The C++ kernel (built here once: CI has a compiler) on the same cases, plus a batch large enough to
    run on both threads."""
    from engine.kernels import cpu_attention

    assert cpu_attention.usable(block, dim), "the CPU kernel did not build, or rejects these shapes"
    gen = torch.Generator().manual_seed(heads * dim + block)
    lens = torch.tensor([1, 5, block, 3 * block + 1, 70, 130] + [300] * 8)
    width = int((lens.max() + block - 1) // block) + 2
    num_blocks = len(lens) * width + 3
    k_cache = torch.randn(kv_heads, num_blocks, block, dim, generator=gen).to(dtype)
    v_cache = torch.randn(kv_heads, num_blocks, block, dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[:len(lens) * width].view(len(lens), width)
    q = torch.randn(len(lens), heads + kv_heads, dim, generator=gen).to(dtype)[:, :heads]
    out = cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens)
    want = _reference(q, k_cache, v_cache, tables, lens)
    error = (out.double() - want).norm() / want.norm()
    assert out.dtype == dtype and error < TOLERANCE[dtype], f"relative error {error:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_decodes_on_both_sides_of_the_two_pass_limit(dtype):
    """A decode of up to 4,096 tokens takes two passes over its context, a longer one folds block by block
    (cpu/paged_attention.cpp): both sides of the limit, beside short decodes in the same call."""
    from engine.kernels import cpu_attention

    heads, kv_heads, dim, block = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(4096)
    lens = torch.tensor([4096, 4097, 4200, 1, 17])
    width = int((lens.max() + block - 1) // block)
    num_blocks = len(lens) * width
    k_cache = torch.randn(kv_heads, num_blocks, block, dim, generator=gen).to(dtype)
    v_cache = torch.randn(kv_heads, num_blocks, block, dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen).view(len(lens), width)
    q = (3 * torch.randn(len(lens), heads, dim, generator=gen)).to(dtype)  # peaked softmaxes: the max matters
    out = cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens)
    want = _reference(q, k_cache, v_cache, tables, lens)
    for i in range(len(lens)):
        error = (out[i].double() - want[i]).norm() / want[i].norm()
        assert error < TOLERANCE[dtype], f"context {lens[i]}: relative error {error:.2e}"


def _causal_reference(q, k_cache, v_cache, tables, lens, starts, contexts, softcap=None, window=None):
    """Each sequence's queries one at a time, as decodes of their own causal prefix."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, (start, length, context) in enumerate(zip(starts.tolist(), lens.tolist(), contexts.tolist())):
        for j in range(length):
            row = start + j
            out[row] = _reference(q[row:row + 1], k_cache, v_cache, tables[i:i + 1],
                                  torch.tensor([context - length + j + 1]), softcap, window)[0]
    return out


@dataclass
class ScatteredCache:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    tables: torch.Tensor  # [sequences, blocks]: each row's blocks, scattered over the cache

    def as_arguments(self) -> list[torch.Tensor]:
        return [self.k_cache, self.v_cache, self.tables]


def _scattered_cache(gen, kv_heads, dim, block, contexts, dtype) -> ScatteredCache:
    """Random keys and values, each sequence's blocks (room for its context and one more) in random places, and two
    blocks of no sequence."""
    width = int((contexts.max() + block - 1) // block) + 1
    num_blocks = len(contexts) * width + 2
    k_cache = torch.randn(kv_heads, num_blocks, block, dim, generator=gen).to(dtype)
    v_cache = torch.randn(kv_heads, num_blocks, block, dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[:len(contexts) * width].view(len(contexts), width)
    return ScatteredCache(k_cache, v_cache, tables)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, dim, block", CPU_SHAPES[:3])
def test_cpu_kernel_attends_prompt_chunks_causally(dtype, heads, kv_heads, dim, block):
    """Decodes and prompt chunks of several sequences in one call: fresh prompts, chunks after a cached prefix,
    chunks longer than one tile of 16 queries; q a strided view, and rows of out outside the call left alone."""
    from engine.kernels import cpu_attention

    gen = torch.Generator().manual_seed(7 * heads + dim)
    lens = torch.tensor([1, 5, 1, 40, 17, 3])  # queries per sequence
    contexts = torch.tensor([9, 5, 3 * block + 2, 40, 17 + 2 * block, 70])  # cached before them: context - len
    starts = torch.cumsum(lens, 0) - lens + 2  # rows 0 and 1 belong to no sequence
    k_cache, v_cache, tables = _scattered_cache(gen, kv_heads, dim, block, contexts, dtype).as_arguments()
    rows = int(starts[-1] + lens[-1])
    q = torch.randn(rows, heads + kv_heads, dim, generator=gen).to(dtype)[:, :heads]
    out = torch.full((rows, heads, dim), 7.0, dtype=dtype)
    cpu_attention.paged_attention(q, k_cache, v_cache, tables, contexts, starts, lens, out)
    want = _causal_reference(q, k_cache, v_cache, tables, lens, starts, contexts)
    error = (out[2:].double() - want[2:]).norm() / want[2:].norm()
    assert error < TOLERANCE[dtype], f"relative error {error:.2e}"
    assert (out[:2] == 7.0).all()


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, kv_heads, dim, block", CPU_SHAPES)
def test_cpu_kernel_reads_float32_queries_over_a_half_cache(cache_dtype, heads, kv_heads, dim, block):
    """A bf16 model computing in float32 (a CPU without bf16 matrix math) keeps its cache in bf16: float32 queries,
    decodes and prompt chunks, over the cache's values widened, to float32's tolerance; a bf16 query over a float32
    cache is refused by name."""
    from engine.kernels import cpu_attention

    gen = torch.Generator().manual_seed(heads + dim + block)
    lens = torch.tensor([1, 1, 20, 1, 3] + [1] * 8)  # queries per sequence
    contexts = torch.tensor([1, 2 * block + 3, 20 + block, 300, 70] + [130] * 8)
    starts = torch.cumsum(lens, 0) - lens
    k_cache, v_cache, tables = _scattered_cache(gen, kv_heads, dim, block, contexts, cache_dtype).as_arguments()
    q = torch.randn(int(lens.sum()), heads + kv_heads, dim, generator=gen)[:, :heads]
    out = torch.empty(q.shape)
    cpu_attention.paged_attention(q, k_cache, v_cache, tables, contexts, starts, lens, out)
    want = _causal_reference(q, k_cache, v_cache, tables, lens, starts, contexts)
    error = (out.double() - want).norm() / want.norm()
    assert error < TOLERANCE[torch.float32], f"relative error {error:.2e}"
    with pytest.raises(RuntimeError, match="unless q is float32"):
        cpu_attention.paged_attention(q.to(cache_dtype), k_cache.float(), v_cache.float(), tables, contexts, starts,
                                      lens, out.to(cache_dtype))


@pytest.mark.parametrize("q_dtype, cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                  (torch.float16, torch.float16), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("heads, kv_heads, dim, block", CPU_SHAPES)
def test_cpu_kernel_soft_caps_scores(q_dtype, cache_dtype, heads, kv_heads, dim, block):
    """Gemma 2's soft-capped scores (cap * tanh(score / cap) before the softmax) on every scoring path of the kernel:
    float32 decodes scored in place, bf16 scored as stored, keys widened and transposed (fp16, and head dims bf16's
    dot products do not take), two-pass decodes and prompt tiles folded block by block, chunks after cached tokens;
    large queries, so that the uncapped scores would attend elsewhere; a negative cap is refused."""
    from engine.kernels import cpu_attention

    gen = torch.Generator().manual_seed(11 * heads + dim)
    lens = torch.tensor([1, 1, 40, 17, 3, 1])  # queries per sequence
    contexts = torch.tensor([1, 2 * block + 3, 40, 17 + 2 * block, 70, 300])
    starts = torch.cumsum(lens, 0) - lens
    k_cache, v_cache, tables = _scattered_cache(gen, kv_heads, dim, block, contexts, cache_dtype).as_arguments()
    q = (4 * torch.randn(int(lens.sum()), heads, dim, generator=gen)).to(q_dtype)
    out = torch.empty(q.shape, dtype=q_dtype)
    cpu_attention.paged_attention(q, k_cache, v_cache, tables, contexts, starts, lens, out, softcap=2.0)
    want = _causal_reference(q, k_cache, v_cache, tables, lens, starts, contexts, softcap=2.0)
    uncapped = _causal_reference(q, k_cache, v_cache, tables, lens, starts, contexts)
    error = (out.double() - want).norm() / want.norm()
    assert error < TOLERANCE[q_dtype], f"relative error {error:.2e}"
    assert (uncapped - want).norm() / want.norm() > 20 * TOLERANCE[q_dtype]  # the cap shows
    with pytest.raises(RuntimeError, match="softcap must be positive"):
        cpu_attention.paged_attention(q, k_cache, v_cache, tables, contexts, starts, lens, out, softcap=-1.0)


@pytest.mark.parametrize("q_dtype, cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                  (torch.float16, torch.float16), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("heads, kv_heads, dim, block", CPU_SHAPES)
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_cpu_kernel_attends_within_a_sliding_window(q_dtype, cache_dtype, heads, kv_heads, dim, block, softcap):
    """A sliding window (Gemma 2's and 3's local layers: the query at p sees keys p - window + 1 .. p): decodes in
    two passes and past their limit (4,096 tokens), prompt chunks whose tiles straddle the window's edge, contexts
    shorter than the window, a window not a whole number of blocks; alone and with soft-capped scores. Without the
    window the result would differ; a negative window is refused."""
    from engine.kernels import cpu_attention

    window = 2 * block + 3
    gen = torch.Generator().manual_seed(13 * heads + dim)
    lens = torch.tensor([1, 1, 40, 17, 3, 1, 1])  # queries per sequence
    contexts = torch.tensor([5, window + 1, 40 + block, 17 + 3 * block, 70, 300, 4200])
    starts = torch.cumsum(lens, 0) - lens
    k_cache, v_cache, tables = _scattered_cache(gen, kv_heads, dim, block, contexts, cache_dtype).as_arguments()
    q = (3 * torch.randn(int(lens.sum()), heads, dim, generator=gen)).to(q_dtype)
    out = torch.empty(q.shape, dtype=q_dtype)
    cpu_attention.paged_attention(q, k_cache, v_cache, tables, contexts, starts, lens, out, softcap, window)
    want = _causal_reference(q, k_cache, v_cache, tables, lens, starts, contexts, softcap, window)
    whole = _causal_reference(q, k_cache, v_cache, tables, lens, starts, contexts, softcap)
    error = (out.double() - want).norm() / want.norm()
    assert error < TOLERANCE[q_dtype], f"relative error {error:.2e}"
    assert (whole - want).norm() / want.norm() > 10 * TOLERANCE[q_dtype]  # the window shows
    with pytest.raises(RuntimeError, match="window must be positive"):
        cpu_attention.paged_attention(q, k_cache, v_cache, tables, contexts, starts, lens, out, softcap, -1)
