"""Shared setup of the multi-LoRA benchmarks: the plan, random adapters for SmolLM2, engines, timed generate."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import transformers
from tqdm.auto import tqdm

from benchmarks.common import timed
from benchmarks.lora import course_lora
from benchmarks.lora_adapters import write_random_adapter
from engine import LLM, SamplingParams
from engine.config import default_cache_dir
from engine.model_files import resolve_model
from lora_cache.local_cache import local_adapters

MODEL = "smollm2-135m-instruct"
RANK = 8


@dataclass(frozen=True)
class LoraPlan:
    """Sizes of every part; `full()` is the benchmark, `quick()` a smoke test."""
    course_batches: tuple[int, ...]
    course_rounds: int
    course_samples: int
    requests: int  # engine throughput: requests x new_tokens
    new_tokens: int
    adapter_counts: tuple[int, ...]  # distinct adapters, round-robin over the requests (0 = base only)
    rounds: int
    ttft_repeats: int  # cold / resident / base TTFT samples
    switch_requests: int  # warm switches measured (each one needs a slot reload)

    @staticmethod
    def full() -> "LoraPlan":
        return LoraPlan(course_lora.BATCH_SIZES, 5, 200, 32, 32, (0, 1, 8, 32), 5, 9, 12)

    @staticmethod
    def quick() -> "LoraPlan":
        return LoraPlan((1, 8, 32), 1, 10, 8, 8, (0, 1, 8), 1, 2, 4)

    @property
    def num_adapters(self) -> int:
        return max(max(self.adapter_counts), 4)


def write_adapters(root: Path, plan: LoraPlan) -> dict[str, list[str]]:
    """Random rank-8 q,k,v,o adapters: `lora-i` for throughput and switching, `cold-i` loaded once each."""
    hf_config = transformers.AutoConfig.from_pretrained(resolve_model(MODEL, default_cache_dir() / "models"))
    ids = {"lora": [f"lora-{i:02d}" for i in range(plan.num_adapters)],
           "cold": [f"cold-{i:02d}" for i in range(plan.ttft_repeats + 1)]}  # +1: a cold warm-up
    names = ids["lora"] + ids["cold"]
    for seed, name in enumerate(tqdm(names, desc="writing adapters", unit="adapter")):
        write_random_adapter(root / name, hf_config, rank=RANK, seed=seed)
    return ids


def make_llm(dtype: str, root: Path, max_loras: int) -> LLM:
    lora = {"adapters": local_adapters, "max_loras": max_loras, "max_lora_rank": RANK, "adapters_root": str(root)} if max_loras else {}
    return LLM(MODEL, dtype=dtype, num_threads=2, log_stats=False, max_num_seqs=64, **lora)


def generate(llm: LLM, requests, adapters) -> tuple[list[list[int]], float]:
    params = SamplingParams(max_tokens=requests[0][1], temperature=0.0, ignore_eos=True)
    outputs, seconds = timed(llm.generate, [p for p, _ in requests], params, use_tqdm=False, adapters=adapters)
    return [o.token_ids for o in outputs], seconds


def source_reads(adapters) -> int:
    """Adapters read from their source so far by an engine's CPU tier (an AdapterProvider's load counts)."""
    return sum(stats.loads for stats in adapters.load_stats().values())
