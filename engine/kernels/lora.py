"""Multi-LoRA for decode steps (CUDA, Triton): every token reads its own adapter slot's weights in place.

In a decode CUDA graph each token carries its adapter slot as a device tensor (-1: base model), so the
kernels index the slot-stacked weights per token (BGMV, as in punica): no weight is gathered or copied,
shapes are static, and loading another adapter into a slot changes what a replay computes without a new
capture. A decode token's delta is two matrix-vector products, memory-bound on reading A and B; rows
of many tokens cannot share one tensor-core tile (each may read other weights), so the kernels multiply
and reduce in registers, in float32 (fp32 weights keep IEEE products, with no tf32 rounding).

shrink: x [T, in] @ A[slot] [in, K] -> float32 [T, K], K = sub-modules x rank (q/k/v side by side).
  Grid (token, K block, split of `in`). A program reads the token's x chunk and the matching rows of its
  slot's A, BLOCK_IN x BLOCK_K at a time, K contiguous (a 128-byte run per row in bf16), and keeps a 2D
  float32 accumulator that it reduces once at the end. A token alone reads all of A (in x K, up to
  14336 x 192), so small batches split `in` until the grid has about SHRINK_PROGRAMS programs; the splits
  write partial sums that one torch sum adds up in a fixed order (deterministic, unlike atomics).
  Base-model tokens write zeros and read nothing.
expand: y [T, N] += shrunk @ B[slot], one B [R, out_i] per sub-module at its column offset of y.
  Grid (token, column block over all sub-modules): a program reads R x BLOCK_N of its sub-module's B
  and the token's R shrunk values, adds the product to y in float32 and rounds once to y's dtype.
  Blocks never straddle two sub-modules, so one launch covers a fused q/k/v or gate/up linear (up to
  three sub-modules a launch). Base-model tokens leave y untouched and read nothing.

Tokens are the grid's fastest axis: programs running side by side read the same rows of A or the same
B tile, so tokens of one adapter share them through L1/L2. Still, each token reads its slot's full A and
B (at rank 64, ~10 MB a Llama-8B layer), mostly from L2: at large batches of high-rank adapters this
outweighs the base weights, the price of needing no sort or per-adapter grouping inside the graph.

Everything is a function of the shapes only (grid, block sizes, splits, the partials buffer), so the
launches are captured in the decode CUDA graphs unchanged: no host sync, no value-dependent allocation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Block sizes from ptxas for sm_90 (4 warps): a 128 x 64 shrink tile takes 126 registers in bf16 (162 in fp32)
# with 16-byte loads and no spill (4 programs an SM, 64 KB of A in flight); twice that tile spills in fp32.
SHRINK_TILE = 8192  # A elements a shrink program holds per step (BLOCK_IN x BLOCK_K)
SHRINK_BLOCK_K = 64  # K columns a program: 3 blocks for a q/k/v rank-64 shrink, no masked lanes
SHRINK_PROGRAMS = 512  # split `in` until a shrink grid has about this many programs (~4 per H100 SM)
EXPAND_TILE = 4096  # B elements an expand program reads (R x BLOCK_N): 64 x 64 at rank 64, 32 registers
EXPAND_MAX_BLOCK_N = 128  # wider blocks leave a 1-token step with too few programs
SUBS_PER_LAUNCH = 3  # q/k/v; a linear with more sub-modules takes several launches
NUM_WARPS = 4


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, out_ptr, in_features, k_size, chunk,
                   stride_xt, stride_xi, stride_as, stride_ai, stride_ak, stride_op, stride_ot,
                   BLOCK_IN: tl.constexpr, BLOCK_K: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    split = tl.program_id(2)
    out = out_ptr + split * stride_op + token * stride_ot + cols
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot < 0:
        tl.store(out, tl.zeros((BLOCK_K,), tl.float32), mask=cols < k_size)
        return
    col_ok = cols < k_size
    start = split * chunk
    acc = tl.zeros((BLOCK_IN, BLOCK_K), tl.float32)
    for step in range(0, chunk, BLOCK_IN):
        rows = start + step + tl.arange(0, BLOCK_IN)
        row_ok = rows < in_features
        x = tl.load(x_ptr + token * stride_xt + rows * stride_xi, mask=row_ok, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + slot * stride_as + rows[:, None] * stride_ai + cols[None, :] * stride_ak,
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        acc += x[:, None] * a
    tl.store(out, tl.sum(acc, 0), mask=col_ok)


@triton.jit
def _expand_block(y_ptr, shrunk_ptr, b_ptr, token, slot, block, out_size, y_offset, shrunk_offset, rank,
                  stride_yt, stride_yn, stride_st, stride_bs, stride_br, stride_bn,
                  BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """y[token, y_offset + cols] += shrunk[token, shrunk_offset:+rank] @ B[slot][:, cols] of one sub-module."""
    ranks = tl.arange(0, BLOCK_R)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    rank_ok = ranks < rank
    col_ok = cols < out_size
    s = tl.load(shrunk_ptr + token * stride_st + shrunk_offset + ranks, mask=rank_ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + slot * stride_bs + ranks[:, None] * stride_br + cols[None, :] * stride_bn,
                mask=rank_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    y = y_ptr + token * stride_yt + (y_offset + cols) * stride_yn
    total = tl.load(y, mask=col_ok, other=0.0).to(tl.float32) + tl.sum(s[:, None] * b, 0)
    tl.store(y, total.to(y_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _expand_kernel(y_ptr, shrunk_ptr, slots_ptr, b0_ptr, b1_ptr, b2_ptr, rank,
                   out0, out1, out2, blocks0, blocks1, y_off0, y_off1, y_off2, s_off0, s_off1, s_off2,
                   stride_yt, stride_yn, stride_st, stride_bs0, stride_bs1, stride_bs2,
                   stride_br0, stride_br1, stride_br2, stride_bn0, stride_bn1, stride_bn2,
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot >= 0:
        if block < blocks0:
            _expand_block(y_ptr, shrunk_ptr, b0_ptr, token, slot, block, out0, y_off0, s_off0, rank,
                          stride_yt, stride_yn, stride_st, stride_bs0, stride_br0, stride_bn0, BLOCK_R, BLOCK_N)
        elif block < blocks0 + blocks1:
            _expand_block(y_ptr, shrunk_ptr, b1_ptr, token, slot, block - blocks0, out1, y_off1, s_off1, rank,
                          stride_yt, stride_yn, stride_st, stride_bs1, stride_br1, stride_bn1, BLOCK_R, BLOCK_N)
        else:
            _expand_block(y_ptr, shrunk_ptr, b2_ptr, token, slot, block - blocks0 - blocks1, out2, y_off2, s_off2,
                          rank, stride_yt, stride_yn, stride_st, stride_bs2, stride_br2, stride_bn2,
                          BLOCK_R, BLOCK_N)


def lora_shrink(x: torch.Tensor, a_slots: torch.Tensor, slot_index: torch.Tensor) -> torch.Tensor:
    """x [T, in] (any float dtype), a_slots [S, in, K] (any strides), slot_index [T] int (-1: none)
    -> float32 [T, K]: row t = x[t] @ a_slots[slot_index[t]], zeros where slot_index[t] < 0."""
    tokens, in_features = _check_shrink(x, a_slots, slot_index)
    k_size = a_slots.shape[2]
    if tokens == 0:
        return torch.zeros(0, k_size, dtype=torch.float32, device=x.device)
    block_k = min(SHRINK_BLOCK_K, triton.next_power_of_2(k_size))
    block_in = min(max(16, SHRINK_TILE // block_k), triton.next_power_of_2(in_features))
    k_blocks = triton.cdiv(k_size, block_k)
    splits = min(triton.cdiv(SHRINK_PROGRAMS, tokens * k_blocks), triton.cdiv(in_features, block_in))
    chunk = triton.cdiv(triton.cdiv(in_features, splits), block_in) * block_in
    splits = triton.cdiv(in_features, chunk)
    partials = torch.empty(splits, tokens, k_size, dtype=torch.float32, device=x.device)
    _shrink_kernel[(tokens, k_blocks, splits)](
        x, a_slots, slot_index, partials, in_features, k_size, chunk,
        x.stride(0), x.stride(1), a_slots.stride(0), a_slots.stride(1), a_slots.stride(2),
        partials.stride(0), partials.stride(1), BLOCK_IN=block_in, BLOCK_K=block_k, num_warps=NUM_WARPS)
    return partials[0] if splits == 1 else partials.sum(0)


def lora_expand_(y: torch.Tensor, shrunk: torch.Tensor, b_slots: list[torch.Tensor], slot_index: torch.Tensor,
                 rank: int) -> torch.Tensor:
    """y [T, N] in place: for sub-module i with b_slots[i] [S, R, out_i] at column offset sum(out_<i):
    y[t, off_i:off_i+out_i] += shrunk[t, i*rank:(i+1)*rank] @ b_slots[i][slot_index[t]], summed in float32
    with y's value and rounded once to y.dtype; rows with slot < 0 untouched. Returns y."""
    _check_expand(y, shrunk, b_slots, slot_index, rank)
    if y.shape[0] == 0:
        return y
    offsets = [sum(b.shape[2] for b in b_slots[:i]) for i in range(len(b_slots))]
    for first in range(0, len(b_slots), SUBS_PER_LAUNCH):
        subs = range(first, min(first + SUBS_PER_LAUNCH, len(b_slots)))
        _expand_launch(y, shrunk, [b_slots[i] for i in subs], slot_index, rank,
                       [offsets[i] for i in subs], [i * rank for i in subs])
    return y


def _expand_launch(y: torch.Tensor, shrunk: torch.Tensor, bs: list[torch.Tensor], slot_index: torch.Tensor,
                   rank: int, y_offsets: list[int], shrunk_offsets: list[int]) -> None:
    """One launch for up to SUBS_PER_LAUNCH sub-modules; absent ones are padded with empty stand-ins that no
    program reaches (their block count is 0)."""
    block_r = triton.next_power_of_2(rank)
    block_n = min(EXPAND_MAX_BLOCK_N, max(16, EXPAND_TILE // block_r))
    blocks = [triton.cdiv(b.shape[2], block_n) for b in bs]
    pad = SUBS_PER_LAUNCH - len(bs)
    bs, blocks = bs + [bs[0]] * pad, blocks + [0] * pad
    y_offsets, shrunk_offsets = y_offsets + [0] * pad, shrunk_offsets + [0] * pad
    _expand_kernel[(y.shape[0], sum(blocks))](
        y, shrunk, slot_index, *bs, rank, *[b.shape[2] for b in bs], blocks[0], blocks[1],
        *y_offsets, *shrunk_offsets, y.stride(0), y.stride(1), shrunk.stride(0),
        *[b.stride(0) for b in bs], *[b.stride(1) for b in bs], *[b.stride(2) for b in bs],
        BLOCK_R=block_r, BLOCK_N=block_n, num_warps=NUM_WARPS)


def _check_shrink(x: torch.Tensor, a_slots: torch.Tensor, slot_index: torch.Tensor) -> tuple[int, int]:
    if x.dim() != 2 or a_slots.dim() != 3 or x.shape[1] != a_slots.shape[1]:
        raise ValueError(f"lora_shrink: x {tuple(x.shape)} and a_slots {tuple(a_slots.shape)} are not "
                         "[T, in] and [S, in, K]")
    if slot_index.shape != (x.shape[0],):
        raise ValueError(f"lora_shrink: slot_index {tuple(slot_index.shape)} is not [T={x.shape[0]}]")
    return x.shape[0], x.shape[1]


def _check_expand(y: torch.Tensor, shrunk: torch.Tensor, b_slots: list[torch.Tensor], slot_index: torch.Tensor,
                  rank: int) -> None:
    if y.dim() != 2 or shrunk.shape != (y.shape[0], len(b_slots) * rank) or slot_index.shape != (y.shape[0],):
        raise ValueError(f"lora_expand_: y {tuple(y.shape)}, shrunk {tuple(shrunk.shape)}, slot_index "
                         f"{tuple(slot_index.shape)} do not match {len(b_slots)} sub-modules of rank {rank}")
    if any(b.dim() != 3 or b.shape[1] != rank for b in b_slots) or sum(b.shape[2] for b in b_slots) != y.shape[1]:
        raise ValueError(f"lora_expand_: b_slots {[tuple(b.shape) for b in b_slots]} are not [S, {rank}, out_i] "
                         f"with out_i summing to y's {y.shape[1]} columns")
