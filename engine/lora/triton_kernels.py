"""Multi-LoRA on CUDA (Triton): each adapter's tokens multiply its slot's weights in place, in tiles.

The step's tokens arrive grouped by adapter slot (SlotOrder: the rows of the flat batch sorted by slot, with each
slot's start and count, all device tensors), so a program takes a tile of up to BLOCK_M tokens of one slot and
multiplies them by that slot's A or B with one tile matrix product (SGMV, as in punica): a slot's weights are read
once per tile of its tokens, not once per token. Nothing is gathered or copied and every shape is static (the grid
covers every slot and the most tiles any slot can have; programs past their slot's count return at once), so the
launches are captured in the decode CUDA graphs unchanged, and loading another adapter into a slot changes what a
replay computes without a new capture. Eager steps (prefill, mixed) take the same kernels.

shrink: x [T, in] @ A[slot] [in, K] -> float32 [T, K], K = sub-modules x rank (q/k/v side by side).
  Grid (token tile x K block, split of `in`, slot). Small batches split `in` until the grid has about
  SHRINK_PROGRAMS working programs; the splits write partial sums that one torch sum adds up in a fixed order
  (deterministic, unlike atomics). Rows of base-model tokens are not written (no program reads them).
expand: y [T, N] += shrunk @ B[slot], one B [R, out_i] per sub-module at its column offset of y.
  Grid (token tile x column block over all sub-modules, slot): a program reads R x BLOCK_N of its sub-module's B
  and its tokens' R shrunk values, adds the product to y in float32 and rounds once to y's dtype. Blocks never
  straddle two sub-modules, so one launch covers a fused q/k/v or gate/up linear (up to three sub-modules a
  launch). Base-model rows of y are untouched.

Precision: bf16/fp16 products of the shrink are exact in float32 (tensor cores, float32 sums); a float32 model
multiplies in IEEE float32 (tf32 would break token equality with fp32 references). The expand's float32 shrunk
values go through tf32 for a bf16/fp16 y (an error of 2^-11 of each product, under y's own rounding) and IEEE
float32 for a float32 y.

Why tiles: the per-token form (each token reading its slot's A and B) re-read at rank 16 with 32 adapters and
256 decodes about 50 MB per linear from L2, and the adapters cost a sizeable share of the Llama-3.2-1B shape's
throughput on an H100; with 8 tokens a slot a tile reads each slot's weights once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton_dot import dot
from engine.lora.segments import SlotOrder

SHRINK_BLOCK_K = 64  # K columns a program: 3 blocks for a q/k/v rank-64 shrink, no masked lanes
SHRINK_PROGRAMS = 512  # split `in` until a shrink grid has about this many working programs (~4 per H100 SM)
SHRINK_BLOCK_IN = 64  # rows of A a program multiplies per step
EXPAND_TILE = 8192  # B elements an expand program reads (R x BLOCK_N)
EXPAND_MAX_BLOCK_N = 128
SMALL_BATCH = 256  # up to this many tokens (decode steps), tiles of 16 tokens; above (prefill), of 64
SUBS_PER_LAUNCH = 3  # q/k/v; a linear with more sub-modules takes several launches
NUM_WARPS = 4


def block_m(tokens: int) -> int:
    return 16 if tokens <= SMALL_BATCH else 64


@triton.jit
def _tile_rows(tokens_ptr, starts_ptr, count, slot, m_tile, BLOCK_M: tl.constexpr):
    """The flat-batch rows of this program's tile of its slot's `count` tokens, and which lanes hold one."""
    lanes = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = lanes < count
    rows = tl.load(tokens_ptr + tl.load(starts_ptr + slot) + lanes, mask=ok, other=0).to(tl.int64)
    return rows, ok


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, tokens_ptr, starts_ptr, counts_ptr, out_ptr, in_features, k_size, chunk, k_blocks,
                   stride_xt, stride_xi, stride_as, stride_ai, stride_ak, stride_op, stride_ot,
                   BLOCK_M: tl.constexpr, BLOCK_IN: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    m_tile = tl.program_id(0) // k_blocks
    k_block = tl.program_id(0) % k_blocks
    split = tl.program_id(1)
    slot = tl.program_id(2).to(tl.int64)
    count = tl.load(counts_ptr + slot)
    if m_tile * BLOCK_M >= count:
        return
    rows, row_ok = _tile_rows(tokens_ptr, starts_ptr, count, slot, m_tile, BLOCK_M)
    cols = k_block * BLOCK_K + tl.arange(0, BLOCK_K)
    col_ok = cols < k_size
    first = split * chunk
    acc = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
    for step in range(0, chunk, BLOCK_IN):
        ins = first + step + tl.arange(0, BLOCK_IN)
        in_ok = ins < in_features
        x = tl.load(x_ptr + rows[:, None] * stride_xt + ins[None, :] * stride_xi,
                    mask=row_ok[:, None] & in_ok[None, :], other=0.0)
        a = tl.load(a_ptr + slot * stride_as + ins[:, None] * stride_ai + cols[None, :] * stride_ak,
                    mask=in_ok[:, None] & col_ok[None, :], other=0.0)
        acc += dot(x.to(a.dtype), a, IEEE)
    tl.store(out_ptr + split * stride_op + rows[:, None] * stride_ot + cols[None, :], acc,
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _expand_block(y_ptr, shrunk_ptr, b_ptr, rows, row_ok, slot, block, out_size, y_offset, shrunk_offset, rank,
                  stride_yt, stride_yn, stride_st, stride_bs, stride_br, stride_bn,
                  BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """y[rows, y_offset + cols] += shrunk[rows, shrunk_offset:+rank] @ B[slot][:, cols] of one sub-module."""
    ranks = tl.arange(0, BLOCK_R)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    rank_ok = ranks < rank
    col_ok = cols < out_size
    s = tl.load(shrunk_ptr + rows[:, None] * stride_st + shrunk_offset + ranks[None, :],
                mask=row_ok[:, None] & rank_ok[None, :], other=0.0)
    b = tl.load(b_ptr + slot * stride_bs + ranks[:, None] * stride_br + cols[None, :] * stride_bn,
                mask=rank_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    y = y_ptr + rows[:, None] * stride_yt + (y_offset + cols)[None, :] * stride_yn
    mask = row_ok[:, None] & col_ok[None, :]
    total = tl.load(y, mask=mask, other=0.0).to(tl.float32) + dot(s, b, IEEE)
    tl.store(y, total.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _expand_kernel(y_ptr, shrunk_ptr, tokens_ptr, starts_ptr, counts_ptr, b0_ptr, b1_ptr, b2_ptr, rank,
                   out0, out1, out2, blocks0, blocks1, n_blocks, y_off0, y_off1, y_off2, s_off0, s_off1, s_off2,
                   stride_yt, stride_yn, stride_st, stride_bs0, stride_bs1, stride_bs2,
                   stride_br0, stride_br1, stride_br2, stride_bn0, stride_bn1, stride_bn2,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    m_tile = tl.program_id(0) // n_blocks
    block = tl.program_id(0) % n_blocks
    slot = tl.program_id(1).to(tl.int64)
    count = tl.load(counts_ptr + slot)
    if m_tile * BLOCK_M >= count:
        return
    rows, row_ok = _tile_rows(tokens_ptr, starts_ptr, count, slot, m_tile, BLOCK_M)
    if block < blocks0:
        _expand_block(y_ptr, shrunk_ptr, b0_ptr, rows, row_ok, slot, block, out0, y_off0, s_off0, rank,
                      stride_yt, stride_yn, stride_st, stride_bs0, stride_br0, stride_bn0, BLOCK_R, BLOCK_N, IEEE)
    elif block < blocks0 + blocks1:
        _expand_block(y_ptr, shrunk_ptr, b1_ptr, rows, row_ok, slot, block - blocks0, out1, y_off1, s_off1, rank,
                      stride_yt, stride_yn, stride_st, stride_bs1, stride_br1, stride_bn1, BLOCK_R, BLOCK_N, IEEE)
    else:
        _expand_block(y_ptr, shrunk_ptr, b2_ptr, rows, row_ok, slot, block - blocks0 - blocks1, out2, y_off2, s_off2,
                      rank, stride_yt, stride_yn, stride_st, stride_bs2, stride_br2, stride_bn2, BLOCK_R, BLOCK_N,
                      IEEE)


def lora_shrink(x: torch.Tensor, a_slots: torch.Tensor, order: SlotOrder) -> torch.Tensor:
    """x [T, in] (the dtype of a_slots), a_slots [S, in, K] (any strides), order over S slots -> float32 [T, K]:
    row t = x[t] @ a_slots[slot of t] for the rows in the order's slots; other rows are left unwritten."""
    tokens, in_features = _check_shrink(x, a_slots, order)
    k_size = a_slots.shape[2]
    if tokens == 0:
        return torch.zeros(0, k_size, dtype=torch.float32, device=x.device)
    bm = block_m(tokens)
    block_k = max(16, min(SHRINK_BLOCK_K, triton.next_power_of_2(k_size)))
    k_blocks = triton.cdiv(k_size, block_k)
    tiles = triton.cdiv(tokens, bm) * k_blocks
    splits = max(1, min(triton.cdiv(SHRINK_PROGRAMS, tiles), triton.cdiv(in_features, SHRINK_BLOCK_IN)))
    chunk = triton.cdiv(triton.cdiv(in_features, splits), SHRINK_BLOCK_IN) * SHRINK_BLOCK_IN
    splits = triton.cdiv(in_features, chunk)
    partials = torch.empty(splits, tokens, k_size, dtype=torch.float32, device=x.device)
    _shrink_kernel[(tiles, splits, a_slots.shape[0])](
        x, a_slots, order.tokens, order.starts, order.counts, partials, in_features, k_size, chunk, k_blocks,
        x.stride(0), x.stride(1), a_slots.stride(0), a_slots.stride(1), a_slots.stride(2),
        partials.stride(0), partials.stride(1), BLOCK_M=bm, BLOCK_IN=SHRINK_BLOCK_IN, BLOCK_K=block_k,
        IEEE=a_slots.dtype == torch.float32, num_warps=NUM_WARPS)
    return partials[0] if splits == 1 else partials.sum(0)


def lora_expand_(y: torch.Tensor, shrunk: torch.Tensor, b_slots: list[torch.Tensor], order: SlotOrder,
                 rank: int) -> torch.Tensor:
    """y [T, N] in place: for sub-module i with b_slots[i] [S, R, out_i] at column offset sum(out_<i):
    y[t, off_i:off_i+out_i] += shrunk[t, i*rank:(i+1)*rank] @ b_slots[i][slot of t], summed in float32
    with y's value and rounded once to y.dtype, for the rows in the order's slots; other rows untouched. Returns y."""
    _check_expand(y, shrunk, b_slots, order, rank)
    if y.shape[0] == 0:
        return y
    offsets = [sum(b.shape[2] for b in b_slots[:i]) for i in range(len(b_slots))]
    for first in range(0, len(b_slots), SUBS_PER_LAUNCH):
        subs = range(first, min(first + SUBS_PER_LAUNCH, len(b_slots)))
        _expand_launch(y, shrunk, [b_slots[i] for i in subs], order, rank,
                       [offsets[i] for i in subs], [i * rank for i in subs])
    return y


def _expand_launch(y: torch.Tensor, shrunk: torch.Tensor, bs: list[torch.Tensor], order: SlotOrder, rank: int,
                   y_offsets: list[int], shrunk_offsets: list[int]) -> None:
    """One launch for up to SUBS_PER_LAUNCH sub-modules; absent ones are padded with empty stand-ins that no
    program reaches (their block count is 0)."""
    bm = block_m(y.shape[0])
    block_r = max(16, triton.next_power_of_2(rank))
    block_n = min(EXPAND_MAX_BLOCK_N, max(16, EXPAND_TILE // block_r))
    blocks = [triton.cdiv(b.shape[2], block_n) for b in bs]
    pad = SUBS_PER_LAUNCH - len(bs)
    bs, blocks = bs + [bs[0]] * pad, blocks + [0] * pad
    y_offsets, shrunk_offsets = y_offsets + [0] * pad, shrunk_offsets + [0] * pad
    n_blocks = sum(blocks)
    _expand_kernel[(triton.cdiv(y.shape[0], bm) * n_blocks, bs[0].shape[0])](
        y, shrunk, order.tokens, order.starts, order.counts, *bs, rank, *[b.shape[2] for b in bs], blocks[0],
        blocks[1], n_blocks, *y_offsets, *shrunk_offsets, y.stride(0), y.stride(1), shrunk.stride(0),
        *[b.stride(0) for b in bs], *[b.stride(1) for b in bs], *[b.stride(2) for b in bs],
        BLOCK_M=bm, BLOCK_R=block_r, BLOCK_N=block_n, IEEE=y.dtype == torch.float32, num_warps=NUM_WARPS)


def _check_order(order: SlotOrder, tokens: int, slots: int, name: str) -> None:
    if order.tokens.shape != (tokens,) or order.starts.shape != (slots,) or order.counts.shape != (slots,):
        raise ValueError(f"{name}: slot order of {tuple(order.tokens.shape)} tokens and {tuple(order.counts.shape)} "
                         f"slots does not match {tokens} tokens and {slots} slots")


def _check_shrink(x: torch.Tensor, a_slots: torch.Tensor, order: SlotOrder) -> tuple[int, int]:
    if x.dim() != 2 or a_slots.dim() != 3 or x.shape[1] != a_slots.shape[1]:
        raise ValueError(f"lora_shrink: x {tuple(x.shape)} and a_slots {tuple(a_slots.shape)} are not "
                         "[T, in] and [S, in, K]")
    _check_order(order, x.shape[0], a_slots.shape[0], "lora_shrink")
    return x.shape[0], x.shape[1]


def _check_expand(y: torch.Tensor, shrunk: torch.Tensor, b_slots: list[torch.Tensor], order: SlotOrder,
                  rank: int) -> None:
    if y.dim() != 2 or shrunk.shape != (y.shape[0], len(b_slots) * rank):
        raise ValueError(f"lora_expand_: y {tuple(y.shape)} and shrunk {tuple(shrunk.shape)} do not match "
                         f"{len(b_slots)} sub-modules of rank {rank}")
    _check_order(order, y.shape[0], b_slots[0].shape[0], "lora_expand_")
    if any(b.dim() != 3 or b.shape[1] != rank for b in b_slots) or sum(b.shape[2] for b in b_slots) != y.shape[1]:
        raise ValueError(f"lora_expand_: b_slots {[tuple(b.shape) for b in b_slots]} are not [S, {rank}, out_i] "
                         f"with out_i summing to y's {y.shape[1]} columns")
