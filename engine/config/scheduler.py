"""The scheduler: how many sequences run at once, how a step is sized, and how many requests may wait."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.options import check_positive


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences running at once; more wait in the queue
    max_num_batched_tokens: int = 4096  # per-step token budget (prefill + decode tokens)
    # steps sized by time too: a step's prompt tokens cut to what fits this many seconds beside its decodes, at the
    # costs the engine learns from its own steps (engine/step_cost.py), and waiting prompts ordered shortest first
    # with aging; None: steps sized by max_num_batched_tokens alone, first come first served
    step_time_target_s: float | None = 0.5
    max_tokens_limit: int | None = None  # a ceiling on any request's max_tokens, below what the context allows
    max_waiting_requests: int = 512  # a request beyond this many waiting ones is refused (EngineOverloadedError)
    # a step's host work (scheduling step N+1, filling its inputs, reading back step N's tokens) overlapping the
    # device's work on step N (engine/llm_engine.py). Opt-in: it has not run on a GPU yet (docs/gpu.md), and on CPU
    # the model runs on the host's own cores, so there is nothing to overlap; refused under tensor parallelism
    async_scheduling: bool = False

    def validate(self) -> None:
        check_positive(self, "max_num_seqs", "max_num_batched_tokens", "max_waiting_requests")
        if self.step_time_target_s is not None and self.step_time_target_s <= 0:
            raise ValueError(f"step_time_target_s must be positive or None, got {self.step_time_target_s}")
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise ValueError(f"max_tokens_limit must be >= 1, got {self.max_tokens_limit}")
