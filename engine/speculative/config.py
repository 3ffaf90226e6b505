"""Speculative decoding's options (engine/speculative/): off unless a method is named."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.options import check_choice, check_positive

SPECULATIVE_METHODS = ("ngram",)  # vLLM's name for prompt lookup; suffix speculation is not implemented


@dataclass
class SpeculativeConfig:
    # "ngram": draft tokens found where the sequence's last tokens occurred before in its prompt or output (vLLM's
    # prompt lookup); None: every sequence decodes one token a step
    speculative_method: str | None = None
    num_speculative_tokens: int = 4  # the most draft tokens a sequence verifies in one step
    prompt_lookup_max: int = 4  # the longest tail of the sequence that the n-gram proposer matches
    prompt_lookup_min: int = 2  # the shortest: a shorter match proposes nothing

    def validate(self) -> None:
        if self.speculative_method is not None:
            check_choice("speculative_method", self.speculative_method, SPECULATIVE_METHODS)
        check_positive(self, "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed prompt_lookup_max "
                             f"({self.prompt_lookup_max})")

    @property
    def enabled(self) -> bool:
        return self.speculative_method is not None
