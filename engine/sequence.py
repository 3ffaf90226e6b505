"""Per-request state: token ids, status, block table, timings.

The scheduler, the block manager, the sampler and the engine each move a sequence through its life, and each does
it through one of its methods (admit, add_block, computed, preempt, ...): a field read anywhere is written in
one place, which names what happened to the request.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.penalty_tokens import PenaltyTokens
from engine.sampling import SamplingParams

PENDING_TOKEN = -1  # the placeholder of a sampled token not yet read back from the device (reserve_token)


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
    prepared_time: float | None = None  # tokenized, its adapter read: from then on it waits for the scheduler
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    generator: torch.Generator | None = None  # per-request RNG, made by the sampler when a seed is given
    penalty_tokens: PenaltyTokens | None = None  # made by the sampler when a penalty first applies
    grammar: Any = None  # llguidance matcher of a structured-output request (engine/grammar.py)
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # params.bad_words as token sequences (LLMEngine tokenizes)
    speculation: Any = None  # its n-gram index and drafts' record, made when it first speculates (engine/speculative/)
    # set while its last output token is a placeholder: the token a step sampled that is still on the device, row
    # `pending_index` of that step's tokens (reserve_token); the next step reads its input from there
    pending_index: int | None = None

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

    @property
    def final_by_length(self) -> bool:
        """Its reserved token is its last: the output is at max_tokens with it (which is within the context)."""
        return self.pending_index is not None and len(self.output_token_ids) >= self.params.max_tokens

    def reserve_token(self, index: int) -> None:
        """A step sampled its next token, row `index` of the step's tokens, not yet read back: a placeholder
        holds its place, so it counts in num_tokens and the next step can be scheduled before it is known."""
        self.output_token_ids.append(PENDING_TOKEN)
        self.pending_index = index

    def append_token(self, token_id: int, logprobs: list[float] = (),
                     top_logprobs: list[dict[int, float]] = ()) -> None:
        """A sampled token (into the place reserved for it, if one was), with its logprob and top alternatives
        when the request asked for them; a structured output's matcher takes it too."""
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self._drop_reservation()
        self.output_token_ids.append(token_id)
        self.logprobs.extend(logprobs)
        self.top_logprobs.extend(top_logprobs)
        if self.grammar is not None:
            self.grammar.consume_token(token_id)

    def _drop_reservation(self) -> None:
        if self.pending_index is not None:
            self.output_token_ids.pop()
            self.pending_index = None

    def finish(self, reason: str) -> None:
        """Its output ends here: a token still on its way (aborted meanwhile) is not part of it."""
        self._drop_reservation()
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.finish_time = time.perf_counter()

    def admit(self, long_rope: bool) -> None:
        """The scheduler runs it; once its K/V turned with longrope's long factors, it stays on them."""
        self.long_rope = self.long_rope or long_rope

    def prepared(self) -> None:
        """Tokenized and its adapter read: it waits for the scheduler from now on."""
        self.prepared_time = time.perf_counter()

    def start_running(self) -> None:
        if self.first_scheduled_time is None:
            self.first_scheduled_time = time.perf_counter()
        self.status = SequenceStatus.RUNNING

    def preempt(self) -> None:
        """Back to waiting, to be recomputed from its start (its blocks are freed by the block manager)."""
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1  # its re-admission keeps what its first one billed (cached tokens)

    def assign_slot(self, slot: int | None) -> None:
        """The device slot of its adapter while it runs; None once it gives the slot back."""
        self.lora_slot = slot

    def add_block(self, block: int) -> None:
        self.block_table.append(block)

    def took_prefix(self, num_blocks: int, block_size: int) -> None:
        """Its first `num_blocks` blocks came from the prefix cache: their tokens count as computed, and a first
        admission bills them as cached (a preempted one's re-admission does not change what it was billed)."""
        self.num_hashed_blocks = num_blocks
        self.num_computed_tokens = num_blocks * block_size
        if not self.num_preemptions:
            self.num_cached_tokens = self.num_computed_tokens

    def hashed(self, full_blocks: int) -> None:
        """Its leading `full_blocks` blocks are keyed for prefix caching."""
        self.num_hashed_blocks = max(self.num_hashed_blocks, full_blocks)

    def released(self, behind: int) -> None:
        """Its blocks before `behind` lie behind every layer's window and were given back."""
        self.num_released_blocks = max(self.num_released_blocks, behind)

    def freed(self) -> None:
        """Its blocks were given back: nothing of it is in the cache any more."""
        self.block_table.clear()
        self.num_computed_tokens = 0
        self.num_hashed_blocks = 0
        self.num_released_blocks = 0

    def computed(self, num_new_tokens: int) -> None:
        """A step wrote the K/V of its next `num_new_tokens` tokens."""
        self.num_computed_tokens += num_new_tokens

    def constrain(self, grammar: Any, bad_words_ids: tuple[tuple[int, ...], ...]) -> None:
        """What its sampling must keep to: a structured-output matcher, and bad words as token sequences."""
        self.grammar = grammar
        self.bad_words_ids = bad_words_ids

    def speculate(self, state: Any) -> Any:
        """Its speculative decoding state, kept for its life (the n-gram index grows with the sequence)."""
        self.speculation = state
        return state

    def add_prompt_scores(self, first_index: int, logprobs: list, top_logprobs: list, ranks: list) -> None:
        """The scores of a chunk of its prompt tokens from position `first_index` (prompt_logprobs); the first
        prompt token has none. A preempted sequence recomputes its prompt: the positions it has are skipped."""
        if not self.prompt_logprobs:
            self.prompt_logprobs.append(None)
            self.prompt_top_logprobs.append(None)
            self.prompt_ranks.append(None)
        skip = len(self.prompt_logprobs) - first_index
        self.prompt_logprobs += logprobs[skip:]
        self.prompt_top_logprobs += top_logprobs[skip:]
        self.prompt_ranks += ranks[skip:]

    def seeded_generator(self, device: torch.device) -> torch.Generator:
        """Its own RNG, seeded with params.seed once, on the device its draws are made on."""
        if self.generator is None:
            self.generator = torch.Generator(device=device).manual_seed(self.params.seed)
        return self.generator

    def penalties(self, device: torch.device) -> PenaltyTokens:
        """The tokens its penalties count, made from its prompt when a penalty first applies."""
        if self.penalty_tokens is None:
            self.penalty_tokens = PenaltyTokens.of_prompt(self.prompt_token_ids, device)
        return self.penalty_tokens
