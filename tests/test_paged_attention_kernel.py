"""The paged decode-attention kernels against a float64 reference over gathered blocks.

Triton's: on CPU (CI) it runs in Triton's interpreter, so its indexing, masking and online softmax are
checked everywhere; on a CUDA machine the same test runs the compiled kernel, in fp16/bf16 as well.
The C++ CPU kernel: compiled and checked in every dtype it takes.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")  # on CPU, conftest has switched on Triton's interpreter

from engine.kernels.paged_attention import paged_decode_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if DEVICE == "cuda" else [])
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _reference(q, k_cache, v_cache, tables, lens):
    """Caches [kv_heads, blocks, block_size, D]: each sequence's blocks gathered token by token."""
    out = []
    heads, kv_heads, block = q.shape[1], k_cache.shape[0], k_cache.shape[2]
    for i, length in enumerate(lens.tolist()):
        blocks = tables[i, :(length + block - 1) // block]
        keys = k_cache[:, blocks].flatten(1, 2)[:, :length].transpose(0, 1)  # [length, kv_heads, D]
        values = v_cache[:, blocks].flatten(1, 2)[:, :length].transpose(0, 1)
        keys = keys.double().repeat_interleave(heads // kv_heads, dim=1)
        values = values.double().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[i].double(), keys) * q.shape[-1] ** -0.5
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
