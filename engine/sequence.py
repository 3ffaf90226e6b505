"""Per-request state: token ids, status, block table, timings."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.penalty_tokens import PenaltyTokens
from engine.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    prompt: str | None = None
    adapter_id: str | None = None
    lora_slot: int | None = None  # device slot of the adapter while the sequence runs
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_hashed_blocks: int = 0  # leading full blocks keyed for prefix caching (block_manager.py)
    num_released_blocks: int = 0  # leading blocks behind every layer's window, given back (block_manager.py)
    num_cached_tokens: int = 0  # prompt tokens its first admission took from cached blocks (usage's cached_tokens)
    finish_reason: str | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)  # per prompt token; the first has none
    prompt_top_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    prompt_ranks: list[int | None] = field(default_factory=list)  # each prompt token's rank; the first has none
    num_preemptions: int = 0  # times recomputed from its start: preempted, or restarted past a longrope switch
    long_rope: bool = False  # its K/V turned with a longrope model's long factors (engine/layers/rotary.py)
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    generator: torch.Generator | None = None  # per-request RNG, made by the sampler when a seed is given
    penalty_tokens: PenaltyTokens | None = None  # made by the sampler when a penalty first applies
    grammar: Any = None  # llguidance matcher of a structured-output request (engine/grammar.py)
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # params.bad_words as token sequences (LLMEngine tokenizes)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building the whole list."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.output_token_ids.append(token_id)

    def finish(self, reason: str) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.finish_time = time.perf_counter()
