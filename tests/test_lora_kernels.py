"""The Triton multi-LoRA kernels (tokens grouped by slot, tiles of one slot's tokens) against a float64 reference
over gathered slot weights.

The weights are the strided views of one packed buffer that LoRALinear itself builds (A of every
sub-module side by side, one B per sub-module), so the kernels are checked on the layout they serve.
On CPU (CI) the kernels run in Triton's interpreter, so their indexing, masks, splits and sub-module
boundaries are checked everywhere; on a CUDA machine the same tests run the compiled kernels, in
fp16/bf16 as well.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():  # set before triton is first imported: its own library (tl.zeros) is @triton.jit too
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from engine.lora.backends import LoRAStepState, TorchLoRA, TritonLoRA
from engine.lora.linear import LoRALinear, LoRASubModule
from engine.lora.segments import AdapterRun, build_lora_batch, slot_order
from engine.lora.triton_kernels import lora_expand_, lora_shrink

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if DEVICE.type == "cuda" else [])
# Relative to the largest reference value. Shrink outputs float32 from exact inputs: only summation order differs.
# Expand rounds y once to its dtype.
SHRINK_TOLERANCE = 1e-4
EXPAND_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}
MAX_LORAS = 4
SLOTS = [2, -1, 0, 2, 3, -1, 2]  # repeated slots, base-model tokens, and a slot (1) nobody uses

# (in_features, rank, sub-module out sizes): in not a multiple of the block, a rank not a power of 2 (masked
# rank lanes), K = 1 x R and 3 x R, unequal outs, a shrink split over `in` with a partial last chunk (K = 64:
# 128-row blocks, in = 300), and five sub-modules (two expand launches).
SHAPES = [(64, 6, [24, 8, 8]), (100, 16, [40]), (300, 32, [96, 33]), (72, 64, [64, 16, 16]),
          (50, 4, [8, 8, 8, 8, 5])]


@dataclass
class _AdapterWeights:
    lora_a: torch.Tensor  # [r, in]
    lora_b: torch.Tensor  # [out, r]
    scaling: float


def _lora_linear(in_features: int, rank: int, outs: list[int], dtype: torch.dtype, seed: int) -> LoRALinear:
    """A LoRALinear whose packed slot buffer (A, every B, the rank padding too) holds random values."""
    subs = [LoRASubModule(f"sub{i}", out) for i, out in enumerate(outs)]
    base = torch.nn.Linear(in_features, sum(outs), bias=False, device=DEVICE, dtype=dtype)
    layer = LoRALinear(base, in_features, subs, LoRAStepState(), MAX_LORAS, rank, dtype, TritonLoRA(DEVICE))
    gen = torch.Generator().manual_seed(seed)
    layer.packed.copy_(torch.randn(layer.packed.shape, generator=gen))
    return layer


def _slots(tokens: int) -> torch.Tensor:
    return torch.tensor((SLOTS * tokens)[:tokens], device=DEVICE)


def _order(slots: torch.Tensor):
    return slot_order(slots.tolist(), MAX_LORAS, DEVICE)


def _reference_shrink(x: torch.Tensor, a_slots: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    a = a_slots[slots.clamp(min=0)].double()
    return torch.einsum("ti,tik->tk", x.double(), a) * (slots >= 0)[:, None]


def _reference_expand(y: torch.Tensor, shrunk: torch.Tensor, b_slots: list[torch.Tensor], slots: torch.Tensor,
                      rank: int) -> torch.Tensor:
    deltas = [torch.einsum("tr,tro->to", shrunk[:, i * rank:(i + 1) * rank].double(), b[slots.clamp(min=0)].double())
              for i, b in enumerate(b_slots)]
    return y.double() + torch.cat(deltas, dim=1) * (slots >= 0)[:, None]


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_features, rank, outs", SHAPES)
def test_shrink_matches_reference(dtype, in_features, rank, outs):
    layer = _lora_linear(in_features, rank, outs, dtype, seed=in_features + rank)
    slots = _slots(7)
    wide = torch.randn(7, 2 * in_features + 3, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    x = wide[:, 3::2]  # a strided view: the kernel must use x's strides
    shrunk = lora_shrink(x, layer.a_slots, _order(slots))
    assert shrunk.dtype == torch.float32 and shrunk.shape == (7, rank * len(outs))
    adapter_rows = slots >= 0  # base-model rows are left unwritten: nothing reads them
    want = _reference_shrink(x, layer.a_slots, slots)[adapter_rows]
    assert _relative_error(shrunk[adapter_rows], want) < SHRINK_TOLERANCE


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_features, rank, outs", SHAPES)
def test_expand_matches_reference_in_place(dtype, in_features, rank, outs):
    layer = _lora_linear(in_features, rank, outs, dtype, seed=in_features * rank)
    slots = _slots(7)
    gen = torch.Generator().manual_seed(2)
    shrunk = torch.randn(7, rank * len(outs), generator=gen).to(DEVICE)
    buffer = torch.full((7, sum(outs) + 5), float("nan"), dtype=dtype, device=DEVICE)
    y = buffer[:, 2:2 + sum(outs)]  # the columns beside y are poison: an out-of-bounds write shows up as a change
    y.copy_(torch.randn(y.shape, generator=gen))
    before = y.clone()
    assert lora_expand_(y, shrunk, layer.b_slots, _order(slots), rank) is y
    ref = _reference_expand(before, shrunk, layer.b_slots, slots, rank)
    assert _relative_error(y, ref) < EXPAND_TOLERANCE[dtype]
    assert torch.equal(y[slots < 0], before[slots < 0])  # base-model rows untouched, bit for bit
    assert buffer[:, :2].isnan().all() and buffer[:, 2 + sum(outs):].isnan().all()


@pytest.mark.parametrize("tokens", [1, 3])
def test_single_tokens_split_in(tokens):
    """Few tokens split `in` across many programs (partial sums)."""
    layer = _lora_linear(1000, 64, [32], torch.float32, seed=tokens)
    slots = torch.tensor([2, 0, 2][:tokens], device=DEVICE)
    x = torch.randn(tokens, 1000, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    shrunk = lora_shrink(x, layer.a_slots, _order(slots))
    assert _relative_error(shrunk, _reference_shrink(x, layer.a_slots, slots)) < SHRINK_TOLERANCE
    y = torch.zeros(tokens, 32, device=DEVICE)
    lora_expand_(y, shrunk, layer.b_slots, _order(slots), 64)
    ref = _reference_expand(torch.zeros_like(y), shrunk, layer.b_slots, slots, 64)
    assert _relative_error(y, ref) < EXPAND_TOLERANCE[torch.float32]


def test_one_slot_over_several_tiles():
    """A prefill-sized batch: tiles of 64 tokens, one slot's tokens spread over several of them and interleaved
    with another slot's and base-model rows."""
    tokens = 300
    layer = _lora_linear(80, 8, [24, 8, 8], torch.float32, seed=9)
    slots = torch.tensor([(0, 3, -1, 0, 0)[i % 5] for i in range(tokens)], device=DEVICE)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(tokens, 80, generator=gen).to(DEVICE)
    order = _order(slots)
    shrunk = lora_shrink(x, layer.a_slots, order)
    adapter_rows = slots >= 0
    want = _reference_shrink(x, layer.a_slots, slots)
    assert _relative_error(shrunk[adapter_rows], want[adapter_rows]) < SHRINK_TOLERANCE
    y = torch.randn(tokens, 40, generator=gen).to(DEVICE)
    before = y.clone()
    lora_expand_(y, shrunk, layer.b_slots, order, 8)
    ref = _reference_expand(before, shrunk.nan_to_num(), layer.b_slots, slots, 8)
    assert _relative_error(y, ref) < EXPAND_TOLERANCE[torch.float32]
    assert torch.equal(y[~adapter_rows], before[~adapter_rows])


def test_slot_order_groups_rows_by_slot():
    order = slot_order([2, -1, 0, 2, 3, -1], MAX_LORAS, torch.device("cpu"))
    assert order.tokens.tolist()[:4] == [2, 0, 3, 4]  # slot 0's row, slot 2's two rows in batch order, slot 3's
    assert order.starts.tolist() == [0, 1, 1, 3] and order.counts.tolist() == [1, 0, 2, 1]
    with pytest.raises(ValueError, match="not below 4"):
        slot_order([4], MAX_LORAS, torch.device("cpu"))


def test_kernel_path_matches_grouped_path():
    """LoRALinear's CUDA path (the kernels over the tokens grouped by slot) gives its grouped batched-matmul
    path's output."""
    rank, outs = 8, [24, 8, 8]
    layer = _lora_linear(64, rank, outs, torch.float32, seed=5)
    gen = torch.Generator().manual_seed(6)
    for slot in range(MAX_LORAS):
        layer.load_slot(slot, {f"sub{i}": _AdapterWeights(torch.randn(rank - slot, 64, generator=gen),
                                                          torch.randn(out, rank - slot, generator=gen), 0.5)
                               for i, out in enumerate(outs) if i != slot})  # some slots lack a sub-module
    slots = SLOTS
    x = torch.randn(len(slots), 64, generator=gen).to(DEVICE)
    layer.backend = TorchLoRA(DEVICE, float32_slots=False, a_k_major=False)
    layer.state.step = build_lora_batch([AdapterRun(slot, 1) for slot in slots], DEVICE)
    grouped = layer(x)
    layer.backend = TritonLoRA(DEVICE)
    layer.state.step = slot_order(slots, MAX_LORAS, DEVICE)
    tiled = layer(x)
    assert _relative_error(tiled, grouped.double()) < 1e-4


def test_mismatched_shapes_are_refused():
    layer = _lora_linear(64, 8, [24, 8], torch.float32, seed=7)
    order = _order(_slots(3))
    with pytest.raises(ValueError, match="lora_shrink"):
        lora_shrink(torch.zeros(3, 63, device=DEVICE), layer.a_slots, order)
    with pytest.raises(ValueError, match="slot order"):
        lora_shrink(torch.zeros(2, 64, device=DEVICE), layer.a_slots, order)
    with pytest.raises(ValueError, match="b_slots"):
        lora_expand_(torch.zeros(3, 33, device=DEVICE), torch.zeros(3, 16, device=DEVICE), layer.b_slots, order, 8)
