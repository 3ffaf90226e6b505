"""Continuous-batching scheduler: which sequences run this step, and how many tokens each feeds.

Every step, running sequences are served first (oldest first: a decode token each, or the next
chunk of a long prompt), then waiting sequences are admitted while the token budget, the
`max_num_seqs` cap and the free KV blocks allow; an admitted sequence first takes the cached blocks
of its longest already computed prefix (block_manager.py) and is fed only the rest of its prompt,
in chunks when it exceeds the token budget. When a running sequence needs a block and none
is free, the newest running sequence is preempted: its blocks are freed and it is recomputed later
from its prompt plus the tokens it has already produced. A request for a LoRA adapter is admitted
only with a device slot for its adapter (so at most `max_loras` adapters run in one step); one
that cannot get a slot yet keeps its place while the requests behind it are admitted. That alone
could starve it (a popular adapter's requests keep re-pinning its slot), so once such a request
has waited `max_adapter_wait_s`, only base-model requests and requests of its own adapter may pass
it: running requests finish, a slot drains, and it is admitted. Its wait is bounded.

Steps are sized by time as well as by tokens (engine/step_cost.py): given what a prompt token and a decode cost on
this engine, learned from its own steps, a step's prompt tokens are cut to what fits the step-time target beside
its decodes. Running streams keep their pace under a burst of prompts, the burst's first tokens come out one chunk
after another instead of all at the end of one long step, and a waiting prompt still gets a chunk every step. The
waiting queue is then ordered shortest remaining prompt first within each priority, with aging: a request's wait
counts as the prompt tokens the engine could have prefilled meanwhile, so a long prompt passes shorter ones once it
has waited as long as theirs take.

Requests carry vLLM's `priority` (SamplingParams; lower first, 0 by default). Both queues stay ordered by it, ties
in their order of arrival: the waiting queue admits the most urgent first, and the running list is served from
its front and preempted from its back, so a block shortage recomputes the least urgent, newest request. With every
priority equal and steps sized by tokens alone this is first come, first served; a request finds its place by
binary search.

A longrope model (engine/layers/rotary.py) turns a sequence with its long factors once the sequence is longer than
`long_rope_switch`: one admitted longer runs on them from its start, and a running one that grows past the switch
is recomputed on them from its start (restarted as a preemption is, though not counted as one), as transformers'
Phi-3 drops its cache there. Its blocks are keyed apart in the prefix cache (block_manager.py).

With speculative decoding (engine/speculative/) a decoding sequence may feed a draft behind its last token: the
draft fits the step's tokens left and the free blocks, or it is dropped, so it never preempts another sequence.

With async scheduling (engine/llm_engine.py) a step is scheduled before the tokens of the step before are read
back: a sequence counts its token in flight (Sequence.reserve_token), and one whose token in flight is its last by
length is not scheduled again. One that the token in flight ends otherwise (EOS, a stop string) runs one step whose
result is dropped.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.block_manager import BlockManager
from engine.layers.rotary import runs_long
from engine.lora.slots import AdapterSlots
from engine.sequence import Sequence
from engine.step_cost import StepCost, StepShape

if TYPE_CHECKING:
    from engine.speculative.speculator import Speculator


@dataclass
class ScheduledSeq:
    seq: Sequence
    # rows the step feeds: seq.token_ids[num_computed_tokens : num_computed_tokens + num_known_tokens], then draft
    num_new_tokens: int
    draft: tuple[int, ...] = ()  # tokens proposed after the sequence's last one, verified by this step

    @property
    def num_known_tokens(self) -> int:
        return self.num_new_tokens - len(self.draft)

    @property
    def completes_prompt(self) -> bool:
        """True when this chunk reaches the sequence's last token, so the step samples a new one (from each row
        from there on, with a draft)."""
        return self.seq.num_computed_tokens + self.num_known_tokens == self.seq.num_tokens


@dataclass
class AdapterCopy:
    """An adapter the runner copies into a device slot before the step runs."""
    slot: int
    adapter_id: str


@dataclass
class StepBudget:
    """What a step has left to hand out: tokens of any kind, and of those, prompt tokens."""
    tokens: int
    prefill: int

    def grant(self, wanted: int, prefill: bool) -> int:
        return min(wanted, self.tokens, self.prefill) if prefill else min(wanted, self.tokens)

    def take(self, n: int, prefill: bool) -> None:
        self.tokens -= n
        self.prefill -= n if prefill else 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    num_preempted: int
    adapter_copies: list[AdapterCopy] = field(default_factory=list)  # copied in before the step
    shape: StepShape = field(default_factory=lambda: StepShape(0, 0))  # its work, as the step-cost model counts it

    def add(self, seq: Sequence, n: int, prefilling: bool, draft: tuple[int, ...] = ()) -> None:
        """n: rows, draft included; a draft's rows cost what prompt tokens with a context do."""
        self.scheduled.append(ScheduledSeq(seq, n, draft))
        prompt_rows = n if prefilling else len(draft)
        self.shape = StepShape(self.shape.prefill_tokens + prompt_rows, self.shape.decodes + (not prefilling))

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 adapter_slots: AdapterSlots | None = None, max_adapter_wait_s: float = 1.0,
                 long_rope_switch: int | None = None, step_cost: StepCost | None = None,
                 speculator: Speculator | None = None):
        """step_cost: steps sized by time too, and the waiting queue ordered shortest prompt first with aging; None:
        by tokens alone, first come first served within a priority. speculator: decoding sequences verify drafts
        (engine/speculative/)."""
        self.block_manager = block_manager
        self.step_cost = step_cost
        self.speculator = speculator
        self.long_rope_switch = long_rope_switch
        self.adapter_slots = adapter_slots
        self.max_adapter_wait_s = max_adapter_wait_s
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.total_preemptions = 0

    def add(self, seq: Sequence) -> None:
        _insert_by_priority(self.waiting, seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        decodes = sum(1 for seq in self.running if not _prefilling(seq))
        budget = StepBudget(self.max_num_batched_tokens, self._prefill_budget(decodes))
        plan = SchedulerOutput([], 0)
        self._schedule_running(budget, plan, decodes)
        if plan.num_preempted == 0:
            self._order_waiting()
            self._admit_waiting(budget, plan)
        return plan

    def _prefill_budget(self, decodes: int) -> int:
        """The step's prompt tokens: what fits the step-time target beside its decodes, or the token budget."""
        if self.step_cost is None:
            return self.max_num_batched_tokens
        return self.step_cost.prefill_budget(decodes)

    def _order_waiting(self) -> None:
        """Shortest remaining prompt first within each priority, a request's wait counted as the prompt tokens the
        engine prefills in that time (aging); first come first served until the engine knows that rate."""
        rate = self.step_cost.prefill_rate() if self.step_cost is not None else None
        if rate is None or len(self.waiting) < 2:
            return
        now = time.perf_counter()
        self.waiting = deque(sorted(self.waiting, key=lambda seq: (
            seq.params.priority, seq.num_uncomputed_tokens - rate * (now - seq.arrival_time))))

    def _schedule_running(self, budget: StepBudget, plan: SchedulerOutput, decodes: int) -> None:
        """Schedule the running sequences into plan (preempting the newest when blocks run out), out of budget;
        `decodes` of them decode."""
        i = 0
        while i < len(self.running) and budget.tokens > 0:
            seq = self.running[i]
            if seq.final_by_length:  # finishes once its token in flight is read back: nothing left to compute
                i += 1
                continue
            if self._past_long_rope_switch(seq):  # its K/V turned with the short factors: recomputed with the long
                self._restart(self.running.pop(i))
                continue
            prefilling = _prefilling(seq)
            n = budget.grant(seq.num_uncomputed_tokens, prefilling)
            if n == 0:  # a prompt chunk, and the step's prompt tokens are spent: decodes still go
                i += 1
                continue
            draft = () if prefilling else self._draft(seq, budget.tokens - n, decodes)
            n += len(draft)
            while not self.block_manager.can_allocate(seq, seq.num_computed_tokens + n):
                self._preempt(self.running.pop())
                plan.num_preempted += 1
                if i >= len(self.running):  # seq itself was the newest and got preempted
                    return
            self.block_manager.allocate(seq, seq.num_computed_tokens + n)
            plan.add(seq, n, prefilling, draft)
            budget.take(n, prefilling)
            i += 1

    def _draft(self, seq: Sequence, budget: int, decodes: int) -> tuple[int, ...]:
        """The decoding sequence's draft, within the step's tokens left and the free blocks: a draft never costs
        another sequence its blocks."""
        if self.speculator is None:
            return ()
        draft = self.speculator.draft(seq, budget, decodes)
        fits = self.block_manager.can_allocate(seq, seq.num_computed_tokens + 1 + len(draft))
        return draft if fits else ()

    def _admit_waiting(self, budget: StepBudget, plan: SchedulerOutput) -> None:
        """Admit waiting sequences into plan while the budget, max_num_seqs and the free blocks allow."""
        no_slot: list[Sequence] = []  # their adapter has no slot free now: they keep their place in line
        starving = self._starving_adapter()
        while self.waiting and min(budget.tokens, budget.prefill) > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.pending_index is not None:  # restarted with a token in flight: admitted once it is read back
                break
            seq.admit(self._past_long_rope_switch(seq))  # before its prefix is looked up
            prefix = self.block_manager.cached_prefix(seq)
            computed = len(prefix) * self.block_manager.block_size
            n = budget.grant(seq.num_tokens - computed, prefill=True)
            if not self.block_manager.can_allocate(seq, computed + n, prefix):
                break
            may_pass = starving is None or seq.adapter_id in (None, starving)
            if seq.adapter_id is not None and (not may_pass or not self._grant_slot(seq, plan.adapter_copies)):
                no_slot.append(self.waiting.popleft())
                continue
            self.waiting.popleft()
            self.block_manager.take_prefix(seq, prefix)
            self.block_manager.allocate(seq, seq.num_computed_tokens + n)
            seq.start_running()
            _insert_by_priority(self.running, seq)
            plan.add(seq, n, prefilling=True)
            budget.take(n, prefill=True)
        self.waiting.extendleft(reversed(no_slot))

    def _starving_adapter(self) -> str | None:
        """The adapter of the oldest waiting request that has no slot and has waited too long, if any."""
        if self.adapter_slots is None:
            return None
        now = time.perf_counter()
        for seq in self.waiting:
            if seq.adapter_id is not None and seq.adapter_id not in self.adapter_slots.slot_of:
                return seq.adapter_id if now - seq.arrival_time >= self.max_adapter_wait_s else None
        return None

    def num_waiting_for_adapter(self) -> int:
        """Waiting requests whose adapter is not in a device slot yet ("loading adapter")."""
        if self.adapter_slots is None:
            return 0
        return sum(1 for seq in self.waiting
                   if seq.adapter_id is not None and seq.adapter_id not in self.adapter_slots.slot_of)

    def _grant_slot(self, seq: Sequence, adapter_copies: list[AdapterCopy]) -> bool:
        grant = self.adapter_slots.acquire(seq.adapter_id)
        if grant is None:
            return False
        seq.assign_slot(grant.slot)
        if grant.needs_load:
            adapter_copies.append(AdapterCopy(grant.slot, seq.adapter_id))
        return True

    def _release_slot(self, seq: Sequence) -> None:
        if seq.lora_slot is not None:
            self.adapter_slots.release(seq.adapter_id)
            seq.assign_slot(None)

    def _preempt(self, seq: Sequence) -> None:
        self._restart(seq)
        self.total_preemptions += 1

    def _restart(self, seq: Sequence) -> None:
        """Free its blocks and slot; it waits at the front of its priority, to be recomputed from its start."""
        self.block_manager.free(seq)
        self._release_slot(seq)
        seq.preempt()
        _insert_by_priority(self.waiting, seq, ahead=True)

    def _past_long_rope_switch(self, seq: Sequence) -> bool:
        """Longer than a longrope model's switch, with K/V (if any) turned with the short factors."""
        return not seq.long_rope and runs_long(self.long_rope_switch, seq.num_tokens)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a finished or aborted sequence and return its blocks at once."""
        seq.finish(reason)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        self._release_slot(seq)


def _prefilling(seq: Sequence) -> bool:
    """Whether its next tokens are prompt tokens (a first prefill, or a recompute after a preemption), not one
    generated token's decode."""
    return seq.num_uncomputed_tokens > 1 or seq.num_computed_tokens < len(seq.prompt_token_ids)


def _insert_by_priority(queue: deque[Sequence] | list[Sequence], seq: Sequence, ahead: bool = False) -> None:
    """Into a queue kept in priority order: behind the sequences of its priority (a new arrival), or `ahead` of
    them (a preempted one, which arrived before those waiting)."""
    find = bisect.bisect_left if ahead else bisect.bisect_right
    queue.insert(find(queue, seq.params.priority, key=_priority), seq)


def _priority(seq: Sequence) -> int:
    return seq.params.priority
