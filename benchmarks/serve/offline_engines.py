"""The offline engines the HTTP load benchmark takes each server's HTTP share against, one per server kind.

A server's share is its HTTP tokens/s over its own engine's, offline, on the same requests: lora-serve's `LLM` for
`serve run`, vLLM's `LLM` for vLLM's OpenAI server. lora-serve's runs in the benchmark's own process (idle, its
threads asleep, while a server runs). vLLM's runs in a worker process of vLLM's own environment
(benchmarks/peers/vllm_worker.py), its whole process group stopped (SIGSTOP) between runs: an idle vLLM keeps its
processes polling and takes most of the CPU from the runs beside it. Both take every request at once and keep at
most max_num_seqs of them running (the top concurrency: a finished request lets the next one in, as a closed loop
of that many clients does), greedy, ignore_eos.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.peers.peer_timing import Batch, VLLMWorker
from engine import LLM, SamplingParams

LORA_SERVE = "lora-serve"
VLLM = "vLLM"


@dataclass(frozen=True)
class OfflineRun:
    requests: int  # answered
    seconds: float
    tokens: int
    ttft_ms_p50: float

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


class LoraServeOffline:
    """lora-serve's offline engine, with the engine args of the server's application."""
    name = LORA_SERVE  # its runs are named "lora-serve offline, ..."

    def __init__(self, llm: LLM):
        self.llm = llm

    def run(self, prompts: list[str], max_tokens: int, adapters: list[str | None] | None = None) -> OfflineRun:
        """adapters: one adapter (None: the base model) per prompt; none: the base model for all."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=False, adapters=adapters)
        seconds = time.perf_counter() - start
        return OfflineRun(len(outputs), seconds, sum(len(o.token_ids) for o in outputs),
                          statistics.median(o.ttft * 1000 for o in outputs))

    def close(self) -> None:
        pass


class VllmOffline:
    """vLLM's offline engine in a worker process, with its server's model, dtype and context; a smaller KV cache
    (1 GiB: these requests take a few MiB), so that it and the server fit in memory together."""
    name = VLLM

    def __init__(self, python: Path, model_dir: Path, dtype: str, max_num_seqs: int, log: Path):
        self.worker = VLLMWorker(python, model_dir, dtype, 1024, [], log, kv_cache_gib=1, max_num_seqs=max_num_seqs)

    def run(self, prompts: list[str], max_tokens: int) -> OfflineRun:
        # timed inside the worker, from its first request's arrival to its last token, as lora-serve's above
        timing = self.worker.run(Batch(prompts, [max_tokens] * len(prompts), [None] * len(prompts)))
        return OfflineRun(len(timing.first_token_s), timing.seconds, timing.tokens,
                          statistics.median(timing.first_token_s) * 1000)

    def close(self) -> None:
        self.worker.close()
