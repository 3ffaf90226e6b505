"""Block manager and scheduler: admission limits, token budget, preemption of the newest request, priority."""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus


def _seq(i, prompt_len, priority=0):
    return Sequence(f"r{i}", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=100, priority=priority))


def _run_step(scheduler):
    """Pretend the model ran: advance computed tokens, append a token to each sequence that sampled."""
    plan = scheduler.schedule()
    for s in plan.scheduled:
        sampled = s.completes_prompt
        s.seq.num_computed_tokens += s.num_new_tokens
        if sampled:
            s.seq.append_token(7)
    return plan


def test_block_manager_allocates_and_frees():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = _seq(0, 9)
    bm.allocate(seq, 9)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 1
    assert not bm.can_allocate(seq, 17)
    bm.free(seq)
    assert bm.num_free_blocks == 4 and seq.block_table == []


def test_max_num_seqs_and_token_budget_limit_admission():
    scheduler = Scheduler(BlockManager(100, 4), max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(4):
        scheduler.add(_seq(i, 10))
    plan = _run_step(scheduler)
    assert [s.seq.request_id for s in plan.scheduled] == ["r0", "r1"]
    assert len(scheduler.waiting) == 2

    budget = Scheduler(BlockManager(100, 4), max_num_seqs=8, max_num_batched_tokens=25)
    for i in range(3):
        budget.add(_seq(i, 10))
    plan = _run_step(budget)
    assert [s.num_new_tokens for s in plan.scheduled] == [10, 10, 5]  # the third prompt is chunked
    assert plan.num_batched_tokens == 25


def test_new_requests_join_running_batch_and_decodes_go_first():
    scheduler = Scheduler(BlockManager(100, 4), max_num_seqs=8, max_num_batched_tokens=64)
    scheduler.add(_seq(0, 5))
    _run_step(scheduler)
    scheduler.add(_seq(1, 5))
    plan = _run_step(scheduler)
    assert [(s.seq.request_id, s.num_new_tokens) for s in plan.scheduled] == [("r0", 1), ("r1", 5)]


def test_preemption_takes_newest_and_requeues_it_first():
    bm = BlockManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    old, new = _seq(0, 8), _seq(1, 8)
    scheduler.add(old)
    scheduler.add(new)
    _run_step(scheduler)  # both prompts fill 2 blocks each; each now holds 9 tokens
    plan = _run_step(scheduler)
    assert plan.num_preempted == 1
    assert [s.seq for s in plan.scheduled] == [old]
    assert new.status is SequenceStatus.WAITING and scheduler.waiting[0] is new
    assert new.block_table == [] and new.num_computed_tokens == 0 and new.output_token_ids == [7]
    scheduler.finish(old, "length")
    plan = _run_step(scheduler)
    assert plan.scheduled[0].seq is new and plan.scheduled[0].num_new_tokens == 9  # recompute prompt + output
    scheduler.finish(new, "length")
    assert bm.num_used_blocks == 0


def test_priority_orders_admission_ties_in_arrival_order():
    scheduler = Scheduler(BlockManager(100, 4), max_num_seqs=2, max_num_batched_tokens=64)
    for i, priority in enumerate([3, 0, 1, 0, -2]):
        scheduler.add(_seq(i, 5, priority))
    assert [s.seq.request_id for s in _run_step(scheduler).scheduled] == ["r4", "r1"]
    assert [s.request_id for s in scheduler.waiting] == ["r3", "r2", "r0"]
    scheduler.finish(scheduler.running[0], "length")
    assert [s.seq.request_id for s in _run_step(scheduler).scheduled] == ["r1", "r3"]  # running first, then r3


def test_preemption_takes_the_least_urgent_even_when_older():
    bm = BlockManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    background, urgent = _seq(0, 8, priority=5), _seq(1, 8, priority=0)
    scheduler.add(background)  # it arrives first
    scheduler.add(urgent)
    _run_step(scheduler)  # both prompts fill 2 blocks each
    plan = _run_step(scheduler)  # each needs a third block: one must go
    assert plan.num_preempted == 1 and [s.seq for s in plan.scheduled] == [urgent]
    assert background.status is SequenceStatus.WAITING and background.block_table == []
    queued = _seq(2, 4, priority=5)
    scheduler.add(queued)
    assert list(scheduler.waiting) == [background, queued]  # preempted: ahead of its priority's arrivals
