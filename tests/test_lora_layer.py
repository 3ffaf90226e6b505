"""The batched LoRA linear against a per-token reference, over the batch shapes the engine produces."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from engine.kernels import cpu_ops
from engine.lora.backends import CppLoRA, LoRAStepState, TorchLoRA
from engine.lora.linear import LoRALinear, LoRASubModule
from engine.lora.segments import AdapterRun, build_lora_batch, token_slots

CPU = torch.device("cpu")
IN, OUTS, MAX_RANK, SLOTS = 24, (16, 8, 8), 8, 6
RANKS = {0: 2, 1: 8, 2: 4, 3: 8, 4: 1}  # slot 5 stays empty
# float32 against the per-token reference. A delta's terms reach about 100 (randn weights, scaling up to 5.5), so a
# different order of the float32 additions (AVX2's 8 lanes against AVX-512's 16) moves a result by up to about 2e-5.
FP32 = {"rtol": 1e-5, "atol": 1e-4}


def _adapter(slot: int, gen: torch.Generator, outs=OUTS) -> dict:
    r = RANKS[slot]
    def weights(out):
        return SimpleNamespace(lora_a=torch.randn(r, IN, generator=gen), lora_b=torch.randn(out, r, generator=gen),
                               scaling=0.5 + slot)
    if len(outs) == 1:
        return {"m0": weights(outs[0])}
    return {f"m{i}": weights(out) for i, out in enumerate(outs) if (slot + i) % 3}  # each skips one sub-module


def _runs(pairs: list[tuple[int, int]]) -> list[AdapterRun]:
    """The tables below as (slot, tokens) pairs, for reading."""
    return [AdapterRun(slot, tokens) for slot, tokens in pairs]


@pytest.fixture(params=["grouped", "C++"])
def path(request):
    """The two CPU paths of LoRALinear: grouped PyTorch batched matmuls, or the C++ operator (cpu/lora.cpp)."""
    if request.param == "C++" and cpu_ops.load() is None:
        pytest.skip("the C++ CPU operators do not build here")
    return request.param


def _layer(dtype=torch.float32, outs=OUTS, path="grouped"):
    gen = torch.Generator().manual_seed(0)
    base = nn.Linear(IN, sum(outs)).to(dtype)
    state = LoRAStepState()
    subs = [LoRASubModule(f"m{i}", out) for i, out in enumerate(outs)]
    backend = CppLoRA(CPU, cpu_ops.load()) if path == "C++" else TorchLoRA(CPU, float32_slots=True, a_k_major=True)
    layer = LoRALinear(base, IN, subs, state, SLOTS, MAX_RANK, dtype, backend)
    adapters = {slot: _adapter(slot, gen, outs) for slot in RANKS}
    for slot, weights in adapters.items():
        layer.load_slot(slot, weights)
    return layer, state, adapters


def _set_step(layer, runs, **kwargs) -> None:
    """The step's LoRA layout as the runner sets it: the grouped batch, or on the C++ path each token's slot."""
    if isinstance(layer.backend, CppLoRA):
        layer.state.step = layer.backend.step(_runs(runs), SLOTS, padding=0)
    else:
        layer.state.step = build_lora_batch(_runs(runs), CPU, **kwargs)


def _reference(layer, adapters, x, runs):
    """y = base(x) + scaling * x A^T B^T, one token at a time, with A and scaling * B rounded to the dtype the layer
    keeps them in (the model's, on the C++ path)."""
    y = layer.base(x).float()
    slots = [slot for slot, count in runs for _ in range(count)]
    offsets = [0]
    for out in (sub.out_size for sub in layer.subs):
        offsets.append(offsets[-1] + out)
    for row, slot in enumerate(slots):
        for i, (key, w) in enumerate(sorted(adapters.get(slot, {}).items())):
            col = int(key[1:])
            stored = layer.packed.dtype
            a, b = w.lora_a.to(stored).float(), (w.lora_b * w.scaling).to(stored).float()
            delta = x[row].float() @ a.t() @ b.t()
            y[row, offsets[col]:offsets[col + 1]] += delta
    return y


RUN_SHAPES = {
    "decode, contiguous slots in order": [(0, 1), (1, 1), (2, 1), (3, 1)],
    "decode with base-only rows": [(-1, 1), (3, 1), (-1, 1), (1, 1)],
    "prefill runs share a slot (padding)": [(2, 5), (-1, 3), (2, 2), (0, 7), (4, 1)],
    "non-contiguous slots": [(4, 2), (0, 1), (4, 1), (2, 3)],
    "a slot in many runs": [(1, 1), (2, 1), (1, 1), (2, 1), (1, 1), (2, 1), (1, 1), (2, 1), (1, 1), (2, 1)],
    "empty slot and base": [(5, 2), (-1, 2)],
}


@pytest.mark.parametrize("runs", RUN_SHAPES.values(), ids=RUN_SHAPES.keys())
def test_batched_lora_equals_per_token_reference(runs, path):
    layer, state, adapters = _layer(path=path)
    x = torch.randn(sum(c for _, c in runs), IN, generator=torch.Generator().manual_seed(1))
    _set_step(layer, runs)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), _reference(layer, adapters, x, runs), **FP32)


@pytest.mark.parametrize("runs", [[(1, 3), (0, 3), (1, 3)], [(1, 3), (1, 3), (0, 3)], [(1, 3), (-1, 1), (0, 2)]],
                         ids=["in order", "adjacent runs of a slot, cut back", "gathered"])
def test_a_linear_with_one_sub_module(runs, path):
    layer, state, adapters = _layer(outs=(16,), path=path)
    x = torch.randn(sum(c for _, c in runs), IN, generator=torch.Generator().manual_seed(5))
    _set_step(layer, runs, allowance=1000)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), _reference(layer, adapters, x, runs), **FP32)


def test_bf16_base_gets_the_same_delta(path):
    layer, state, adapters = _layer(torch.bfloat16, path=path)
    runs = RUN_SHAPES["prefill runs share a slot (padding)"]
    x = torch.randn(sum(c for _, c in runs), IN, generator=torch.Generator().manual_seed(2)).bfloat16()
    _set_step(layer, runs)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x).float(), _reference(layer, adapters, x, runs), rtol=2e-2, atol=5e-2)


def test_batch_shape_fast_paths():
    assert build_lora_batch(_runs([(-1, 4)]), CPU) is None  # no adapter tokens: the LoRA path is skipped
    assert token_slots(_runs([(-1, 4)]), CPU) is None
    assert token_slots(_runs([(2, 2), (-1, 1)]), CPU).tolist() == [2, 2, -1]
    in_order = build_lora_batch(_runs([(0, 1), (1, 1), (2, 1)]), CPU)
    assert in_order.token_rows is None and in_order.valid_positions is None
    (group,) = in_order.groups
    assert group.gather_index is None and group.slots == slice(0, 3)
    padded = build_lora_batch(_runs([(3, 2), (-1, 1), (1, 1)]), CPU)
    (group,) = padded.groups
    assert (group.segments, group.longest) == (2, 2)
    assert group.gather_index.tolist() == [0, 1, 3, 0]  # slot 3's rows; then slot 1's row, padded
    assert padded.valid_positions.tolist() == [0, 1, 2] and padded.token_rows.tolist() == [0, 1, 3]
    assert group.slots.tolist() == [3, 1]  # not contiguous when sorted: batch order is kept


def test_runs_of_one_slot_are_segments_until_their_weight_copies_cost_more_than_a_gather():
    repeated = [(0, 4), (1, 8), (0, 4), (2, 8)]
    (group,) = build_lora_batch(_runs(repeated), CPU, allowance=1000).groups  # cheap weights: a segment per run
    assert group.gather_index is not None and group.slots.tolist() == [1, 2, 0, 0]  # longest first
    (group,) = build_lora_batch(_runs(repeated), CPU, allowance=4).groups  # dear weights: a segment per slot
    assert group.slots == slice(0, 3) and (group.segments, group.longest) == (3, 8)
    (group,) = build_lora_batch(_runs([(0, 8), (1, 8), (0, 8)]), CPU, allowance=1000).groups
    assert group.gather_index is None and group.slots.tolist() == [0, 1, 0]  # equal runs stay in batch order
    (group,) = build_lora_batch(_runs([(2, 1), (2, 1), (1, 2)]), CPU).groups  # adjacent runs of a slot merge
    assert group.segments == 2 and group.slots == slice(1, 3)  # sorted: the weights are a view


def test_unequal_runs_are_cut_to_one_length_when_a_weight_copy_costs_less_than_the_padding():
    # Two adjacent requests of adapter 0 merge into one 16-token run; cut back to 8s, the batch is one in-order
    # group (no gather, no scatter, no padding) at the price of one more weight copy.
    batch = build_lora_batch(_runs([(0, 8), (0, 8), (1, 8)]), CPU, allowance=1000)
    assert batch.in_order_group is not None and batch.valid_positions is None
    assert batch.in_order_group.slots.tolist() == [0, 0, 1] and batch.in_order_group.longest == 8
    (group,) = build_lora_batch(_runs([(0, 2), (0, 2), (1, 3)]), CPU, allowance=1000).groups  # 5 copies > 1 padded row
    assert (group.segments, group.longest) == (2, 4) and group.gather_index is not None
    # 1 copy = 8 rows > 2 padded
    (group,) = build_lora_batch(_runs([(0, 2), (1, 1), (2, 1)]), CPU, allowance=1000).groups
    assert (group.segments, group.longest) == (3, 2)


def test_a_long_prefill_gets_its_own_group_instead_of_padding_every_decode():
    runs = [(slot, 1) for slot in range(8)] + [(8, 500)]
    batch = build_lora_batch(_runs(runs), CPU)
    assert [(g.segments, g.longest) for g in batch.groups] == [(1, 500), (8, 1)]  # the default allowance: 32
    assert batch.valid_positions is None  # neither group needs padding
    assert build_lora_batch(_runs([(0, 3), (1, 2), (2, 3)]), CPU).groups[0].longest == 3  # similar lengths: one group


@pytest.mark.parametrize("runs", [[(0, 40), (1, 1), (2, 1), (0, 1), (3, 17), (-1, 5), (4, 2)],
                                  [(5, 300), (1, 1), (-1, 2), (3, 1)]])
def test_several_groups_equal_the_reference(runs, path):
    layer, state, adapters = _layer(path=path)
    x = torch.randn(sum(c for _, c in runs), IN, generator=torch.Generator().manual_seed(4))
    _set_step(layer, runs)
    assert len(build_lora_batch(_runs(runs), CPU).groups) > 1
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), _reference(layer, adapters, x, runs), **FP32)


def test_reloading_a_slot_clears_modules_the_new_adapter_does_not_target(path):
    layer, state, adapters = _layer(path=path)
    key = sorted(adapters[1])[0]
    kept = {key: adapters[1][key]}
    layer.load_slot(1, kept)
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(3))
    _set_step(layer, [(1, 3)])
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), _reference(layer, {1: kept}, x, [(1, 3)]), **FP32)
    layer.load_slot(1, {})
    assert 1 not in layer.slots_with_weights
