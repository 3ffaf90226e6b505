"""The n-gram proposer (vLLM's prompt lookup): where did the sequence's last n tokens occur before, and what
followed them there?

Each sequence keeps an index of its n-grams (n from prompt_lookup_min to prompt_lookup_max) to the position just
past their latest occurrence that has a token after it. The index grows by the tokens appended since the last
proposal, so a proposal costs a few dictionary lookups, whatever the sequence's length. The longest matching tail
wins, and its latest occurrence: an output that repeats itself repeats its most recent shape.
"""

from __future__ import annotations


class NgramIndex:
    def __init__(self, shortest: int, longest: int):
        self.shortest, self.longest = shortest, longest
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> the index just past its latest followed occurrence

    def extend(self, tokens: list[int]) -> None:
        """The sequence's tokens appended since the index last grew."""
        for token in tokens:
            end = len(self.tokens)
            for n in range(self.shortest, min(self.longest, end) + 1):
                self._ends[tuple(self.tokens[end - n:end])] = end
            self.tokens.append(token)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the longest tail of the sequence seen before; none without a match."""
        tokens = self.tokens
        for n in range(min(self.longest, len(tokens)), self.shortest - 1, -1):
            end = self._ends.get(tuple(tokens[-n:]))
            if end is not None:
                return tokens[end:end + k]
        return []
