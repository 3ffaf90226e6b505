"""Steps sized by time (engine/step_cost.py, engine/scheduler.py): the cost model learns a step's cost from the
engine's own steps, the scheduler cuts a burst's prompt tokens to the step-time target while every running stream
still decodes each step, waiting prompts go shortest first with aging and priorities still first, and the tokens
are the same as with steps sized by tokens alone."""

from __future__ import annotations

import time

import numpy as np
import pytest

from engine import LLM, SamplingParams
from engine.block_manager import BlockManager
from engine.scheduler import Scheduler
from engine.step_cost import StepCost, StepShape
from tests.helpers import PROMPTS
from tests.test_scheduler import _run_step, _seq

FIXED, PER_TOKEN, PER_DECODE = 0.02, 0.002, 0.001  # seconds: a made-up device, prompt tokens dearer than decodes


def _true_seconds(shape: StepShape) -> float:
    return FIXED + PER_TOKEN * shape.prefill_tokens + PER_DECODE * shape.decodes


def _learned(target_s: float) -> StepCost:
    cost = StepCost(target_s)
    rng = np.random.default_rng(0)
    for _ in range(40):
        shape = StepShape(int(rng.integers(0, 600)), int(rng.integers(0, 40)))
        cost.observe(shape, _true_seconds(shape))
    return cost


def test_the_model_learns_a_steps_cost_and_sizes_prefill_to_the_target():
    cost = StepCost(target_s=0.5)
    assert cost.prefill_budget(decodes=10) == cost.first_chunk, "a cold model takes a first chunk to measure"
    cost = _learned(target_s=0.5)
    assert cost.coefficients == pytest.approx([FIXED, PER_TOKEN, PER_DECODE], rel=1e-3)
    assert cost.prefill_budget(decodes=10) == pytest.approx((0.5 - FIXED - 10 * PER_DECODE) / PER_TOKEN, abs=1)
    assert cost.prefill_budget(decodes=1000) == cost.min_chunk, "decodes over the target leave a prompt a chunk"
    assert cost.prefill_rate() == pytest.approx(1 / PER_TOKEN, rel=1e-3)


def test_the_model_follows_a_device_that_slows_down():
    cost = _learned(target_s=0.5)
    for tokens, decodes in [(100, 8), (300, 16), (200, 4), (400, 12)] * 30:  # half speed: old steps forgotten
        cost.observe(StepShape(tokens, decodes), 2 * _true_seconds(StepShape(tokens, decodes)))
    assert cost.coefficients[1] == pytest.approx(2 * PER_TOKEN, rel=0.01)  # what sizes a step's prompt tokens
    for shape in (StepShape(0, 8), StepShape(250, 10), StepShape(400, 16)):
        assert cost.predict(shape) == pytest.approx(2 * _true_seconds(shape), rel=0.05)


def test_a_burst_is_prefilled_in_steps_of_the_target_while_streams_decode():
    """8 running streams, then 16 prompts of 128 tokens at once: 2,048 tokens that one step's token budget would
    take whole, cut to about 0.3 s of work a step; every stream decodes in every step, and every prompt gets its
    first token."""
    scheduler = Scheduler(BlockManager(1000, 16), max_num_seqs=32, max_num_batched_tokens=4096,
                          step_cost=_learned(target_s=0.3))
    for i in range(8):
        scheduler.add(_seq(i, 10))
    while scheduler.waiting:
        _run_step(scheduler)
    streams = {seq.request_id for seq in scheduler.running}
    burst = [_seq(i, 128) for i in range(8, 24)]
    for seq in burst:
        scheduler.add(seq)
    steps = 0
    while not all(seq.output_token_ids for seq in burst):
        plan = _run_step(scheduler)
        assert _true_seconds(plan.shape) <= 0.3 + PER_TOKEN * 128  # the target, within one chunk's rounding
        assert {s.seq.request_id for s in plan.scheduled if s.num_new_tokens == 1} >= streams
        steps += 1
    assert steps >= 2048 * PER_TOKEN / 0.3


def test_without_a_target_a_burst_goes_in_one_step():
    scheduler = Scheduler(BlockManager(1000, 16), max_num_seqs=32, max_num_batched_tokens=4096)
    for i in range(16):
        scheduler.add(_seq(i, 128))
    assert _run_step(scheduler).shape == StepShape(2048, 0)


def _admission_order(scheduler: Scheduler) -> list[str]:
    """The order requests start in, one at a time (max_num_seqs 1), each finished once it has a token."""
    order = []
    while scheduler.waiting or scheduler.running:
        order += [s.seq.request_id for s in _run_step(scheduler).scheduled if s.seq.request_id not in order]
        for seq in [seq for seq in scheduler.running if seq.output_token_ids]:
            scheduler.finish(seq, "length")
    return order


def test_waiting_prompts_go_shortest_first_with_priority_first():
    scheduler = Scheduler(BlockManager(1000, 16), max_num_seqs=1, max_num_batched_tokens=4096,
                          step_cost=_learned(target_s=10.0))
    for i, (length, priority) in enumerate([(500, 0), (20, 0), (300, 0), (400, -1)]):
        scheduler.add(_seq(i, length, priority))
    assert _admission_order(scheduler) == ["r3", "r1", "r2", "r0"]


def test_a_long_prompt_that_waited_passes_shorter_ones():
    """A wait counts as the prompt tokens the engine prefills in that time (500 tokens a second here): a prompt
    480 tokens longer passes once it has waited more than 0.96 s longer."""
    scheduler = Scheduler(BlockManager(1000, 16), max_num_seqs=1, max_num_batched_tokens=4096,
                          step_cost=_learned(target_s=10.0))
    old = _seq(0, 500)
    old.arrival_time = time.perf_counter() - 1.5
    scheduler.add(old)
    scheduler.add(_seq(1, 20))
    assert _admission_order(scheduler) == ["r0", "r1"]


def _prefill_per_step(llm: LLM, monkeypatch) -> list[int]:
    """The prompt tokens of each step the engine runs, observed around its scheduler."""
    scheduler, seen = llm.engine.scheduler, []
    schedule = scheduler.schedule
    monkeypatch.setattr(scheduler, "schedule", lambda: (plan := schedule(), seen.append(plan.shape.prefill_tokens))[0])
    return seen


@pytest.mark.parametrize("target", [None, 1e-4], ids=["by tokens", "by time"])
def test_time_sized_steps_give_the_same_tokens(tiny_llama_path, monkeypatch, target):
    """A burst of 8 prompts goes in one step by tokens, in several by time (the smallest steps the model allows):
    the same tokens and logprobs either way."""
    prompts = [p * 6 for p in PROMPTS]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)
    want = LLM(str(tiny_llama_path), step_time_target_s=None, log_stats=False).generate(
        prompts, params, use_tqdm=False)
    llm = LLM(str(tiny_llama_path), step_time_target_s=target, log_stats=False)
    steps = _prefill_per_step(llm, monkeypatch)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got, want):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in got)
    assert sum(steps) == prompt_tokens
    assert (max(steps) == prompt_tokens) == (target is None)


def test_a_step_time_target_must_be_positive(tiny_llama_path):
    with pytest.raises(ValueError, match="step_time_target_s must be positive or None, got 0"):
        LLM(str(tiny_llama_path), step_time_target_s=0, log_stats=False)
