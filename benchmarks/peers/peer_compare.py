"""lora-serve against vLLM's CPU build, measured in the same run: the same requests, rounds interleaved.

Each round runs every workload on both engines, lora-serve first in even rounds and vLLM first in odd ones,
with the workloads in a rotated order, so a drift of the machine's speed (a shared VM's speed changes from day
to day and within a run) falls on both sides alike. Every run gets prompts neither
engine has seen (a nonce opens each prompt), so neither serves a prompt from its prefix cache. The report gives
each side's median and spread (min-max) over the rounds and the ratio of the medians.

Workloads: (a) 64 x 32 new tokens; (s) the same sampled at temperature 1 with top-p 0.9, as chat requests often are
(the sampler's filters and draw in every step); (b) 64 requests, every 8th wants 100 new tokens, the rest 10; (d)
one stream of 128 tokens (ms per token after the first); (a) with 8 distinct rank-8 q,k,v,o adapters, one per
request in turn; (e) 16 prompts of 2,000 tokens x 128 new tokens, prefill and decode timed apart. (e) runs in the
dtype this CPU computes fastest (bf16 with bf16 matrix instructions, else fp32: vLLM emulates bf16 on an AVX2-only
CPU, far slower than its fp32).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from benchmarks.peers.peer_timing import Batch, Timing, VLLMWorker, run_lora_serve
from benchmarks.workloads import PROMPTS, long_prompt

DTYPES = ("float32", "bfloat16")
WORKLOADS = ("a", "s", "b", "d", "lora", "e")
LORA_ADAPTERS = 8
SAMPLED_TEMPERATURE, SAMPLED_TOP_P = 1.0, 0.9  # workload (s)


@dataclass(frozen=True)
class Sizes:
    requests: int = 64
    tokens: int = 32
    mixed: tuple[int, ...] = (100,) + (10,) * 7
    stream_tokens: int = 128
    long_requests: int = 16
    long_prompt: int = 2000
    long_tokens: int = 128

    @staticmethod
    def quick() -> "Sizes":
        return Sizes(8, 8, (20,) + (4,) * 3, 16, 4, 200, 8)


@dataclass(frozen=True)
class PeerJob:
    workload: str  # "a", "s", "b", "d", "lora", "e"
    dtype: str
    lora: bool = False


@dataclass
class PeerResult:
    job: PeerJob
    lora_serve: list[Timing] = field(default_factory=list)
    vllm: list[Timing] = field(default_factory=list)
    error: str | None = None


@dataclass(frozen=True)
class Selection:
    """Which workloads and dtypes a run compares (every one by default); (e) runs in its own dtype whatever
    `dtypes` says: `long_dtype`, else the machine's (bf16 where the CPU has bf16 matrix math). `vllm_dtype` runs
    vLLM in that dtype on every job (float32, its fastest on a CPU that only emulates bf16), None in the job's."""
    workloads: tuple[str, ...] = WORKLOADS
    dtypes: tuple[str, ...] = DTYPES
    long_dtype: str | None = None
    vllm_dtype: str | None = None

    def __post_init__(self):
        fixed = [d for d in (self.long_dtype, self.vllm_dtype) if d is not None]
        unknown = ([w for w in self.workloads if w not in WORKLOADS]
                   + [d for d in self.dtypes + tuple(fixed) if d not in DTYPES])
        if unknown or not self.workloads or not self.dtypes:
            raise ValueError(f"peer comparison: workloads must be among {', '.join(WORKLOADS)} and dtypes among "
                             f"{', '.join(DTYPES)}, neither empty; got {', '.join(unknown) or 'an empty list'}")

    def long_dtype_for(self, native_bf16: bool) -> str:
        """(e)'s dtype: long_dtype, else bf16 where the CPU has bf16 matrix math and float32 where it has not."""
        return self.long_dtype or ("bfloat16" if native_bf16 else "float32")


def jobs(long_dtype: str, selection: Selection = Selection()) -> list[PeerJob]:
    base = [PeerJob(w, d) for w in ("a", "s", "b", "d") for d in DTYPES]
    every = base + [PeerJob("lora", d, lora=True) for d in DTYPES] + [PeerJob("e", long_dtype)]
    return [job for job in every if job.workload in selection.workloads
            and (job.workload == "e" or job.dtype in selection.dtypes)]


def batch_for(job: PeerJob, sizes: Sizes, nonce: str, tokenizer) -> Batch:
    """The job's requests, every prompt opened by `nonce` (unseen by either engine's prefix cache)."""
    if job.workload == "e":
        prompts = [long_prompt(tokenizer, f"{nonce}, document {i}.", sizes.long_prompt, i)
                   for i in range(sizes.long_requests)]
        return Batch(prompts, [sizes.long_tokens] * len(prompts), [None] * len(prompts))
    count = 1 if job.workload == "d" else sizes.requests
    prompts = [f"{nonce}, request {i}. {PROMPTS[i % len(PROMPTS)]}" for i in range(count)]
    lengths = {"b": [sizes.mixed[i % len(sizes.mixed)] for i in range(count)],
               "d": [sizes.stream_tokens]}.get(job.workload, [sizes.tokens] * count)
    adapters = [f"adapter-{i % LORA_ADAPTERS}" if job.lora else None for i in range(count)]
    if job.workload == "s":  # (a) sampled as chat requests often are
        return Batch(prompts, lengths, adapters, SAMPLED_TEMPERATURE, SAMPLED_TOP_P)
    return Batch(prompts, lengths, adapters)



class Engines:
    """Both sides' engines, one per (dtype, LoRA) and made on first use; vLLM workers are closed at the end."""

    def __init__(self, vllm_python: Path, model_dir: Path, threads: int, adapter_dirs: list[Path], log_dir: Path,
                 long_dtype: str, vllm_dtype: str | None = None):
        self.vllm_python, self.model_dir, self.threads, self.long_dtype = vllm_python, model_dir, threads, long_dtype
        self.vllm_dtype = vllm_dtype  # every vLLM engine in this dtype; None: the job's
        self.adapter_dirs, self.log_dir = adapter_dirs, log_dir
        self.lora_serve: dict[PeerJob, object] = {}
        self.vllm: dict[PeerJob, VLLMWorker] = {}

    def _long(self, key: PeerJob) -> bool:
        """The engine that runs (e) gets the KV room for 16 x 2,128 tokens; the others need little."""
        return key.dtype == self.long_dtype and not key.lora

    @staticmethod
    def key(job: PeerJob) -> PeerJob:
        return PeerJob("", job.dtype, job.lora)

    def run_lora_serve(self, job: PeerJob, batch: Batch) -> Timing:
        key = self.key(job)
        if key not in self.lora_serve:
            self.lora_serve[key] = self._make_lora_serve(key)
        return run_lora_serve(self.lora_serve[key], batch)

    def run_vllm(self, job: PeerJob, batch: Batch) -> Timing:
        key = self.key(job)
        if key not in self.vllm:
            log = self.log_dir / f"vllm-{key.dtype}{'-lora' if key.lora else ''}.log"
            adapters = self.adapter_dirs if key.lora else []
            worker = VLLMWorker(self.vllm_python, self.model_dir, self.vllm_dtype or key.dtype, 4096, adapters, log,
                                kv_cache_gib=2 if self._long(key) else 1)
            self.vllm[key] = worker  # kept before its warm-up, so close() ends it whatever happens
            worker.run(_warmup(key))
        return self.vllm[key].run(batch)

    def _make_lora_serve(self, key: PeerJob):
        from engine import LLM
        from lora_cache.local_cache import local_adapters

        lora = dict(adapters=local_adapters, max_loras=LORA_ADAPTERS, max_lora_rank=8, adapters_root=str(self.adapter_dirs[0].parent)) \
            if key.lora else {}
        llm = LLM(str(self.model_dir), dtype=key.dtype, max_num_seqs=64, max_model_len=4096,
                  kv_cache_bytes=(2 << 30) if self._long(key) else (512 << 20), num_threads=self.threads,
                  log_stats=False, **lora)
        run_lora_serve(llm, _warmup(key))
        return llm

    def close(self) -> None:
        for worker in self.vllm.values():
            worker.close()


def _warmup(key: PeerJob) -> Batch:
    adapters = [f"adapter-{i}" if key.lora else None for i in range(4)]
    return Batch([f"Warm-up {i}. {PROMPTS[i]}" for i in range(4)], [4] * 4, adapters)


def run(engines: Engines, tokenizer, sizes: Sizes, rounds: int, long_dtype: str,
        selection: Selection = Selection()) -> list[PeerResult]:
    results = {job: PeerResult(job) for job in jobs(long_dtype, selection)}
    order = list(results)
    steps = tqdm(total=rounds * len(order) * 2, desc="lora-serve vs vLLM", unit="run")
    for r in range(rounds):
        rotated = order[r % len(order):] + order[:r % len(order)]
        for job in rotated:
            batch = batch_for(job, sizes, f"Round {r}, {job.workload} {job.dtype}", tokenizer)
            sides = [("lora-serve", engines.run_lora_serve), ("vLLM", engines.run_vllm)]
            for name, runner in sides if r % 2 == 0 else sides[::-1]:
                steps.set_postfix_str(f"round {r + 1}: {job.workload} {job.dtype} {name}")
                _measure(results[job], name, runner, job, batch)
                steps.update(1)
                time.sleep(1.0)  # let the other side's threads go idle
    steps.close()
    return list(results.values())


def _measure(result: PeerResult, name: str, runner, job: PeerJob, batch: Batch) -> None:
    if result.error:
        return
    try:
        timing = runner(job, batch)
    except Exception as error:  # one side failing is a row in the report, not the end of the run
        result.error = f"{name}: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
        return
    if timing.tokens != batch.new_tokens:
        result.error = f"{name} produced {timing.tokens} tokens, {batch.new_tokens} requested"
    (result.lora_serve if name == "lora-serve" else result.vllm).append(timing)


def adapters_folder(hf_config, root: Path | None = None) -> list[Path]:
    """LORA_ADAPTERS random rank-8 q,k,v,o adapters in PEFT's format, named adapter-<i>."""
    from benchmarks.lora_adapters import write_random_adapter

    root = root or Path(tempfile.mkdtemp(prefix="peer-adapters-"))
    return [write_random_adapter(root / f"adapter-{i}", hf_config, rank=8, seed=i) for i in range(LORA_ADAPTERS)]


def median_spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)
