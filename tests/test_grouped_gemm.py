"""The Triton grouped expert product (engine/kernels/grouped_gemm.py) against each expert's own matrix product: on
CPU in Triton's interpreter (its tiles, masks and tile-to-expert layout checked everywhere), on a CUDA machine
compiled, in bf16 too."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # set before triton is first imported (tests/conftest.py too)
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from engine.kernels.grouped_gemm import BLOCK_M, grouped_linear, tile_experts

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("counts, out_features, in_features", [
    ([3, 0, 17, 2], 96, 64),  # an expert without rows, one over a tile, outputs over a column block
    ([0, 0, 1, 0], 64, 40),  # one row, depths not a multiple of the depth block
    ([33, 16, 0, 5], 70, 32),  # exactly a tile, columns not a multiple of the block
])
def test_grouped_linear_is_each_experts_product(dtype, counts, out_features, in_features):
    gen = torch.Generator().manual_seed(sum(counts))
    weights = torch.randn(len(counts), out_features, in_features, generator=gen).to(DEVICE, dtype)
    x = torch.randn(sum(counts), in_features, generator=gen).to(DEVICE, dtype)
    offsets = torch.tensor([0, *counts]).cumsum(0).to(DEVICE)
    got = grouped_linear(x, weights, offsets)
    want = torch.cat([x[offsets[e]:offsets[e + 1]].double() @ weights[e].double().T for e in range(len(counts))])
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype and got.shape == want.shape
    assert (got.double() - want).abs().max() <= tolerance * want.abs().max()


def test_tiles_are_laid_out_expert_after_expert():
    """Each expert takes a tile per BLOCK_M of its rows, in expert order; tiles past the last belong to no expert."""
    counts = [BLOCK_M + 1, 0, 1]
    offsets = torch.tensor([0, *counts]).cumsum(0)
    experts, first = tile_experts(offsets, tiles=6)
    assert experts.tolist() == [0, 0, 2, 3, 3, 3] and first.tolist() == [0, 2, 2]


def test_rows_that_do_not_fit_the_weights_are_refused():
    with pytest.raises(ValueError, match="grouped_linear takes rows \\[rows, 8\\] and offsets \\[3\\]"):
        grouped_linear(torch.zeros(4, 6), torch.zeros(2, 16, 8), torch.tensor([0, 2, 4]))
