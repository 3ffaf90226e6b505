"""Token tallies behind the repetition, presence and frequency penalties, kept up to date in O(new tokens).

Rebuilding the set of a sequence's tokens every step costs O(length) per step, O(length^2) per request:
at a 2,000-token prompt that is 2,000 set insertions per step for a request that asked for a repetition
penalty. The sampler instead keeps one `PenaltyTokens` per such sequence and, each step, folds in only the
output tokens it has not seen yet (a sequence's outputs only ever grow; a preempted sequence keeps them).
The ids stay on the device as a tensor that grows only when a token appears for the first time.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from engine.transfer import to_device


@dataclass
class PenaltyTokens:
    """Distinct tokens of prompt + output (repetition penalty) and counts over the output only (OpenAI's)."""

    seen: set[int]
    seen_ids: torch.Tensor  # the ids of `seen`, for indexing a logits row
    output_counts: Counter = field(default_factory=Counter)
    absorbed: int = 0  # output tokens folded in so far

    @classmethod
    def of_prompt(cls, prompt_token_ids: list[int], device: torch.device) -> PenaltyTokens:
        seen = set(prompt_token_ids)
        return cls(seen, to_device(sorted(seen), device, torch.long))

    def absorb(self, output_token_ids: list[int]) -> None:
        """Fold in the outputs appended since the last call."""
        new = output_token_ids[self.absorbed:]
        if not new:
            return
        self.absorbed = len(output_token_ids)
        self.output_counts.update(new)
        unseen = sorted(set(new) - self.seen)
        if unseen:
            self.seen.update(unseen)
            self.seen_ids = torch.cat([self.seen_ids, to_device(unseen, self.seen_ids.device, torch.long)])

    def penalise_repetition(self, row: torch.Tensor, penalty: float) -> None:
        """transformers' rule over prompt and output: positive logits divided by the penalty, negative multiplied."""
        scores = row[self.seen_ids]
        row[self.seen_ids] = torch.where(scores < 0, scores * penalty, scores / penalty)

    def penalise_output(self, row: torch.Tensor, presence: float, frequency: float) -> None:
        """logit -= frequency * (times the output holds the token) + presence * (it holds it)."""
        ids = to_device(list(self.output_counts), row.device, torch.long)
        counts = to_device(list(self.output_counts.values()), row.device, row.dtype)
        row[ids] -= frequency * counts + presence
