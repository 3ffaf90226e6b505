"""What the GPU benchmark's sections share: the plan of sizes, the bench (device, model folders), and the engine
runs they time (lora-serve's LLM with random weights of a typed-in shape, greedy, ignore_eos).
"""

from __future__ import annotations

import random
import statistics
import traceback
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from benchmarks.gpu.gpu_models import kv_bytes_per_token, shape
from benchmarks.gpu.gpu_timing import free_device, timed


@dataclass(frozen=True)
class Plan:
    """Sizes of every section; `full()` is the benchmark, `quick()` fewer tokens, `tiny()` a CPU smoke run."""
    copy_bytes: int
    decode_prompt: int  # batch-1 decode: prompt tokens and new tokens
    decode_new: int
    decode_repeats: int
    batches: tuple[int, ...]  # throughput: concurrent sequences
    prompt: int
    new: int
    adapters: int
    adapter_rank: int
    ttft_prompt: int
    step_batches: tuple[int, ...]  # eager vs graphs: decode step time at these batch sizes
    step_new: int
    lora_rounds: int = 3  # base and adapter runs, interleaved, after a full-length warm-up of each
    bound_batch: int = 256  # decode against its bandwidth bound: sequences, each of bound_prompt prompt tokens
    bound_prompt: int = 512
    prefill_prompts: int = 16  # prefill against the matmul rate: prompts of prefill_len tokens
    prefill_len: int = 2048

    @staticmethod
    def full() -> Plan:
        return Plan(1 << 30, 128, 128, 3, (64, 256), 512, 256, 32, 16, 512, (1, 64), 64)

    @staticmethod
    def quick() -> Plan:
        return Plan(1 << 30, 128, 64, 3, (64, 256), 128, 64, 32, 16, 512, (1, 64), 32)

    @staticmethod
    def tiny() -> Plan:
        return Plan(1 << 24, 16, 8, 2, (4, 8), 16, 8, 4, 8, 16, (1, 4), 8, 1, 8, 16, 2, 32)


@dataclass
class Bench:
    """What every section needs: the device, the plan, the model folders and where adapters go."""
    device: str
    plan: Plan
    tiny: bool
    models: dict[str, Path]
    work: Path
    vocab_limit: dict[str, int]  # prompt ids stay below min(tokenizer length, model vocabulary)
    bandwidth: float | None = None  # copy bytes/s, once the bandwidth section ran
    matmul_flops: float | None = None  # bf16 matmul FLOP/s, measured with it

    def prompts(self, model: str, num: int, length: int, seed: int = 0) -> list[list[int]]:
        rng = random.Random(seed)
        return [[rng.randrange(3, self.vocab_limit[model]) for _ in range(length)] for _ in range(num)]


# ---------------------------------------------------------------------------------------------------- engine


def make_llm(bench: Bench, model: str, max_seqs: int, max_len: int, **overrides):
    from engine import LLM
    from lora_cache.local_cache import local_adapters

    kv = int(1.3 * max_seqs * (max_len + 16) * kv_bytes_per_token(shape(model, bench.tiny))) + (64 << 20)
    options = {"dtype": "bfloat16", "device": bench.device, "load_format": "dummy", "enforce_eager": False,
               "max_num_seqs": max_seqs, "max_num_batched_tokens": max(8192, max_len), "kv_cache_bytes": kv,
               "max_model_len": max_len, "log_stats": False, "enable_prefix_caching": False}
    adapters = local_adapters if overrides.get("max_loras") else None
    return LLM(str(bench.models[model]), adapters, **{**options, **overrides})


def run_llm(llm, prompts: list[list[int]], new: int, adapters: list[str | None] | None = None):
    from engine import SamplingParams

    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False, adapters=adapters)
    got = [len(o.token_ids) for o in outputs]
    if got != [new] * len(prompts):
        raise RuntimeError(f"lora-serve generated {got[:8]}... tokens, asked for {new}")
    return outputs


def decode_ms(outputs) -> float:
    """Median over requests of (latency - time to first token) / (new tokens - 1), in ms."""
    return statistics.median((o.latency - o.ttft) / (len(o.token_ids) - 1) * 1e3 for o in outputs)


def llm_throughput(bench: Bench, llm, model: str, prompts, new: int, adapters=None) -> dict:
    """Warm-up at the same batch size on other prompts (kernels compiled for these shapes, adapters loaded)."""
    run_llm(llm, bench.prompts(model, len(prompts), len(prompts[0]), seed=99), 4, adapters)
    outputs, seconds = timed(bench.device, run_llm, llm, prompts, new, adapters)
    return {"tok_s": len(prompts) * new / seconds, "seconds": seconds,
            "ttft_median_ms": statistics.median(o.ttft for o in outputs) * 1e3,
            "decode_ms_per_token": decode_ms(outputs)}


def guarded(label: str, device: str, fn, *args) -> dict:
    """fn(*args), or its error and traceback (printed): a part that fails leaves the rest of its section."""
    try:
        return fn(*args)
    except Exception as error:  # noqa: BLE001 - recorded in the results instead of ending the run
        tb = traceback.format_exc()
        tqdm.write(f"{label} failed:\n{tb}")
        free_device(device)
        return {"error": error_text(error), "traceback": tb}


def error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
