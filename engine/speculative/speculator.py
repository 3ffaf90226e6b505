"""Which sequences speculate, with which draft, and which draft tokens the model agreed with."""

from __future__ import annotations

from dataclasses import dataclass

from engine.sampler import plain_greedy
from engine.sequence import Sequence
from engine.speculative.config import SpeculativeConfig
from engine.speculative.ngram import NgramIndex


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


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.stats = SpeculationStats()

    def draft(self, seq: Sequence, budget: int) -> tuple[int, ...]:
        """The tokens the decoding `seq` verifies after its last one this step, within `budget` more tokens; none
        for a request that does not take its tokens as the raw logits' argmax."""
        room = min(self.config.num_speculative_tokens, budget, seq.params.max_tokens - len(seq.output_token_ids) - 1,
                   self.max_model_len - seq.num_tokens - 1)
        if room <= 0 or not speculable(seq):
            return ()
        index = seq.ngrams or seq.index_ngrams(NgramIndex(self.config.prompt_lookup_min,
                                                          self.config.prompt_lookup_max))
        index.extend(seq.token_slice(len(index.tokens), seq.num_tokens))
        return tuple(index.propose(room))

    def accept(self, draft: tuple[int, ...], targets: list[int]) -> list[int]:
        """The draft's longest prefix that the model's argmax agrees with, then the model's own next token:
        targets[i] is the argmax after the last known token and the draft's first i tokens."""
        accepted = 0
        while accepted < len(draft) and draft[accepted] == targets[accepted]:
            accepted += 1
        self.stats.drafts += 1
        self.stats.proposed += len(draft)
        self.stats.accepted += accepted
        return [*draft[:accepted], targets[accepted]]


def speculable(seq: Sequence) -> bool:
    """Its next token is the argmax of the raw logits, and nothing else is read from them (logprobs), so a row
    of a draft chunk stands for a step of its own."""
    return plain_greedy(seq) and seq.grammar is None and seq.params.logprobs is None
