"""What the engine hands out: a request's output after a step, and the engine's and each adapter's figures.

Plain dataclasses with no torch, so that the serving side (the replica's metrics and its reports to the routers)
types its use of them without importing the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestTimes:
    """When a request passed each point of its life in the engine, in time.perf_counter() seconds (None: it did
    not get there): it arrived (before its prompt was tokenized and its adapter read), was prepared (from then on
    it waits for the scheduler), was first scheduled, had its first token, and finished."""
    arrival: float
    prepared: float | None
    first_scheduled: float | None
    first_token: float | None
    finished: float | None


@dataclass
class RequestOutput:
    """One request's state after a step. A step's output carries only what the step added (new_*, delta_text),
    so streaming costs O(new tokens) per step; the whole-output lists (token_ids, logprobs, top_logprobs) are
    filled once, in the finished output. Copying them at every step made a request O(length^2)."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str  # all output text so far (a reference, not a copy)
    delta_text: str  # text released by this step
    token_ids: list[int]  # all output tokens: filled when finished, empty before
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "length", "stop", "eos", "abort"
    logprobs: list[float] = field(default_factory=list)  # when finished: per output token, when asked
    top_logprobs: list[dict[int, float] | None] = field(default_factory=list)  # when finished
    new_logprobs: list[float] = field(default_factory=list)  # this step's, when asked
    new_top_logprobs: list[dict[int, float]] = field(default_factory=list)  # this step's, when asked
    prompt_logprobs: list[float | None] = field(default_factory=list)  # when asked: with the first token, and finished
    prompt_top_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    prompt_ranks: list[int | None] = field(default_factory=list)  # each prompt token's rank (1: the likeliest)
    ttft: float | None = None  # seconds from arrival to first token
    latency: float | None = None  # seconds from arrival to finish
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens its first admission read from the prefix cache instead of computing
    times: RequestTimes | None = None  # in the finished output only


@dataclass
class EngineStats:
    waiting: int
    running: int
    kv_blocks_used: int
    kv_blocks_total: int
    preemptions: int
    waiting_for_adapter: int = 0  # waiting requests whose adapter is not in a device slot yet
    resident_adapters: list[str] = field(default_factory=list)
    prefix_cache_queried_tokens: int = 0  # prompt tokens of admitted requests (cumulative)
    prefix_cache_hit_tokens: int = 0  # of those, read from cached blocks instead of computed
    prefix_cache_blocks: int = 0  # blocks holding a cached prefix now
    prefix_cache_evictions: int = 0  # cached blocks reused for other tokens (cumulative)
    adapter_slot_acquisitions: int = 0  # adapter requests given a device slot (cumulative)
    adapter_slot_loads: int = 0  # of those, the ones whose adapter had to be copied into the slot
    speculative_proposed_tokens: int = 0  # draft tokens verified (cumulative; engine/speculative/)
    speculative_accepted_tokens: int = 0  # of those, the ones the model agreed with

    @property
    def prefix_cache_hit_rate(self) -> float:
        queried = self.prefix_cache_queried_tokens
        return self.prefix_cache_hit_tokens / queried if queried else 0.0

    @property
    def adapter_slot_hit_rate(self) -> float:
        """Adapter requests whose adapter was already in a device slot, of all given one."""
        acquired = self.adapter_slot_acquisitions
        return (acquired - self.adapter_slot_loads) / acquired if acquired else 0.0

    @property
    def kv_utilisation(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total


@dataclass
class AdapterUsage:
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0


@dataclass
class AdapterStats:
    """One adapter's use in this engine and where it resides now: "device" (a slot), "cpu" (the CPU tier) or
    "source" (neither)."""
    requests: int
    prompt_tokens: int
    generated_tokens: int
    residence: str
    source_loads: int
    mean_load_s: float
    slot_loads: int  # copies into a device slot
