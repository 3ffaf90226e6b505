"""Continuous-batching scheduler: which sequences run this step, and how many tokens each feeds.

Every step, running sequences are served first (oldest first: a decode token each, or the next
chunk of a long prompt), then waiting sequences are admitted while the token budget, the
`max_num_seqs` cap and the free KV blocks allow. When a running sequence needs a block and none
is free, the newest running sequence is preempted: its blocks are freed and it is recomputed later
from its prompt plus the tokens it has already produced.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # feeds seq.token_ids[num_computed_tokens : num_computed_tokens + num_new_tokens]

    @property
    def completes_prompt(self) -> bool:
        """True when this chunk reaches the sequence's last token, so the step samples a new one."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    num_preempted: int

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.total_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled, budget, num_preempted = self._schedule_running(budget)
        if num_preempted == 0:
            scheduled += self._admit_waiting(budget)
        return SchedulerOutput(scheduled, num_preempted)

    def _schedule_running(self, budget: int) -> tuple[list[ScheduledSeq], int, int]:
        scheduled: list[ScheduledSeq] = []
        num_preempted = 0
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.can_allocate(seq, seq.num_computed_tokens + n):
                self._preempt(self.running.pop())
                num_preempted += 1
                if i >= len(self.running):  # seq itself was the newest and got preempted
                    return scheduled, budget, num_preempted
            self.block_manager.allocate(seq, seq.num_computed_tokens + n)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        return scheduled, budget, num_preempted

    def _admit_waiting(self, budget: int) -> list[ScheduledSeq]:
        scheduled: list[ScheduledSeq] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_uncomputed_tokens, budget)
            if not self.block_manager.can_allocate(seq, seq.num_computed_tokens + n):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return scheduled

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.total_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a finished or aborted sequence and return its blocks at once."""
        seq.finish(reason)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
