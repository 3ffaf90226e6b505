"""Which sequences speculate, with which draft, and which draft tokens the model agreed with.

A draft pays while the step is bound by reading the weights: its tokens ride along almost free. Once the batch is
large, each draft token costs about what a prompt token costs, and a sequence whose drafts are mostly rejected
slows every stream of the step. So each step, a sequence drafts only while its expected accepted tokens per draft
token, times the step's time, exceed what a draft token costs times the step's decodes (the step-cost model's
figures, engine/step_cost.py): then the step's tokens a second rise. Its acceptance is its own drafts' record,
started from the engine's so that a new sequence tries. Until the step-cost model has learned, every sequence
drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.sampler import plain_greedy
from engine.sequence import Sequence
from engine.speculative.config import SpeculativeConfig
from engine.speculative.ngram import NgramIndex
from engine.step_cost import StepCost, StepShape

PRIOR_TOKENS = 8  # draft tokens' worth of the engine's acceptance that a sequence's own record starts from


@dataclass
class SpeculationStats:
    drafts: int = 0  # drafts verified
    proposed: int = 0  # their tokens
    accepted: int = 0  # of those, the ones the model agreed with

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    @property
    def mean_accepted(self) -> float | None:
        """Draft tokens accepted per draft: a draft's step yields this many tokens more than a plain decode."""
        return self.accepted / self.drafts if self.drafts else None


@dataclass
class SequenceDrafts:
    """A sequence's speculation: the index its drafts come from, and how they fared."""
    index: NgramIndex
    proposed: int = 0
    accepted: int = 0


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, step_cost: StepCost | None = None):
        """step_cost: the engine's step-cost model, which says when a draft pays; None: every draft does."""
        self.config = config
        self.max_model_len = max_model_len
        self.step_cost = step_cost
        self.stats = SpeculationStats()

    def draft(self, seq: Sequence, budget: int, decodes: int) -> tuple[int, ...]:
        """The tokens the decoding `seq` verifies after its last one this step, within `budget` more tokens, in a
        step of `decodes` decoding sequences; none for a request that does not take its tokens as the raw logits'
        argmax, or whose drafts do not pay at this batch."""
        room = min(self.config.num_speculative_tokens, budget, seq.params.max_tokens - len(seq.output_token_ids) - 1,
                   self.max_model_len - seq.num_tokens - 1)
        if room <= 0 or not speculable(seq):
            return ()
        state = seq.speculation or seq.speculate(SequenceDrafts(NgramIndex(self.config.prompt_lookup_min,
                                                                           self.config.prompt_lookup_max)))
        if not self._pays(state, decodes):
            return ()
        state.index.extend(seq.token_slice(len(state.index.tokens), seq.num_tokens))
        return tuple(state.index.propose(room))

    def _pays(self, state: SequenceDrafts, decodes: int) -> bool:
        cost = self.step_cost
        if cost is None or not cost.learned:
            return True
        return self._acceptance(state) * cost.predict(StepShape(0, decodes)) > cost.coefficients[1] * decodes

    def _acceptance(self, state: SequenceDrafts) -> float:
        """The sequence's share of draft tokens accepted, its record started from the engine's."""
        prior = self.stats.acceptance if self.stats.acceptance is not None else 1.0
        return (state.accepted + PRIOR_TOKENS * prior) / (state.proposed + PRIOR_TOKENS)

    def accept(self, seq: Sequence, draft: tuple[int, ...], targets: list[int]) -> list[int]:
        """The draft's longest prefix that the model's argmax agrees with, then the model's own next token:
        targets[i] is the argmax after the last known token and the draft's first i tokens."""
        accepted = 0
        while accepted < len(draft) and draft[accepted] == targets[accepted]:
            accepted += 1
        for record in (self.stats, seq.speculation):
            record.proposed += len(draft)
            record.accepted += accepted
        self.stats.drafts += 1
        return [*draft[:accepted], targets[accepted]]


def speculable(seq: Sequence) -> bool:
    """Its next token is the argmax of the raw logits, and nothing else is read from them (logprobs), so a row
    of a draft chunk stands for a step of its own."""
    return plain_greedy(seq) and seq.grammar is None and seq.params.logprobs is None
