"""A mixture's experts as one grouped matrix product on CUDA (Triton): rows sorted by expert, expert e's rows
offsets[e]..offsets[e + 1] times its own weight [out, in] of the stacked weights [experts, out, in], as transformers
5 stacks them (no packing).

Each program computes one tile of BLOCK_M rows of one expert by BLOCK_N output columns, reading that expert's
weight tile by tile along `in`. A step's tiles are laid out expert after expert, each expert taking as many row
tiles as its rows need; which expert a tile belongs to is found on the device (`tile_experts`), so a launch needs
no expert count on the host: the grid is the most tiles any split of the rows can take (a tile per BLOCK_M rows,
plus one partial tile per expert), and tiles past the step's last do nothing. Experts no row chose cost no tile.
The sums are float32 (IEEE products for float32 rows, as engine/kernels/triton_dot.py says why), the output
rounded once to the rows' dtype. CPU tests run it in Triton's interpreter
(tests/test_grouped_gemm.py); its speed on a GPU has not been measured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton_dot import dot

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32  # tl.dot's smallest M tile: a decode step gives an expert a row or two


@triton.jit
def _grouped_kernel(x_ptr, w_ptr, y_ptr, offsets_ptr, tile_expert_ptr, first_tile_ptr, n, k, experts,
                    stride_x, stride_we, stride_wn, stride_y,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < experts:
        row_end = tl.load(offsets_ptr + expert + 1)
        rows = tl.load(offsets_ptr + expert) + (tile - tl.load(first_tile_ptr + expert)) * BLOCK_M
        rows = rows + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        weight = w_ptr + expert.to(tl.int64) * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, k, BLOCK_K):
            depth = start + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + depth[None, :],
                        mask=(rows[:, None] < row_end) & (depth[None, :] < k), other=0.0)
            b = tl.load(weight + cols[None, :] * stride_wn + depth[:, None],
                        mask=(cols[None, :] < n) & (depth[:, None] < k), other=0.0)
            acc += dot(a, b, IEEE)
        tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rows[:, None] < row_end) & (cols[None, :] < n))


def tile_experts(offsets: torch.Tensor, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each of `tiles` row tiles' expert (the expert count for a tile past the last) and each expert's first tile,
    on the device, from offsets [experts + 1]."""
    per_expert = torch.div(offsets[1:] - offsets[:-1] + BLOCK_M - 1, BLOCK_M, rounding_mode="floor")
    ends = torch.cumsum(per_expert, 0)
    experts = torch.searchsorted(ends, torch.arange(tiles, device=offsets.device), right=True)
    return experts.to(torch.int32), ends - per_expert


def grouped_linear(x: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """y [rows, out]: x's rows sorted by expert (offsets int64 [experts + 1], from 0 to x's rows) times their
    experts' weights [experts, out, in]."""
    experts, n, k = weights.shape
    if x.dim() != 2 or x.shape[1] != k or offsets.shape != (experts + 1,):
        raise ValueError(f"grouped_linear takes rows [rows, {k}] and offsets [{experts + 1}], not "
                         f"{tuple(x.shape)} and {tuple(offsets.shape)}")
    x, weights = x.contiguous(), weights.contiguous()
    y = x.new_empty((x.shape[0], n))
    tiles = triton.cdiv(x.shape[0], BLOCK_M) + experts
    tile_expert, first_tile = tile_experts(offsets, tiles)
    grid = (tiles, triton.cdiv(n, BLOCK_N))
    _grouped_kernel[grid](x, weights, y, offsets, tile_expert, first_tile, n, k, experts, x.stride(0),
                          weights.stride(0), weights.stride(1), y.stride(0),
                          BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, IEEE=x.dtype == torch.float32)
    return y


def gather_rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The rows table[index[i]], in order (the C++ operators' gather_rows, on the device)."""
    return table.index_select(0, index)
