"""200 registered adapters with Zipf popularity, max_loras=8: throughput, latency by popularity, slot churn.

    PYTHONPATH=. python -m benchmarks lora_zipf            # full run
    PYTHONPATH=. python -m benchmarks lora_zipf --quick    # smoke test

Writes lora_zipf.md and lora_zipf.png to benchmarks/results/KIND/ and lora_zipf.json to benchmarks/runs/KIND/
(benchmarks/common.py: save_results).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from benchmarks.common import benchmark_args, save_results  # noqa: E402
from benchmarks.lora_adapters import write_random_adapter  # noqa: E402
from benchmarks.lora.lora_setup import source_reads  # noqa: E402
from benchmarks.workloads import PROMPTS  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.config import default_cache_dir  # noqa: E402
from engine.model_files import resolve_model  # noqa: E402
from lora_cache.local_cache import local_adapters

MODEL = "smollm2-135m-instruct"


def zipf_adapters(num_requests: int, num_adapters: int, exponent: float, seed: int) -> list[str]:
    """Adapter id per request; adapter k (0 = most popular) drawn with probability ~ 1 / (k + 1)^exponent."""
    weights = torch.tensor([1.0 / (k + 1) ** exponent for k in range(num_adapters)])
    draws = torch.multinomial(weights, num_requests, replacement=True, generator=torch.Generator().manual_seed(seed))
    return [f"adapter-{int(k):03d}" for k in draws]


def run(llm: LLM, prompts, params, adapters) -> tuple[float, list]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True, adapters=adapters)
    return time.perf_counter() - start, outs


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> None:
    args = benchmark_args(__doc__, "20 adapters and 32 requests: a smoke run", argv)
    num_adapters, num_requests, max_loras, tokens = (20, 32, 4, 8) if args.quick else (200, 256, 8, 32)

    torch.set_num_threads(2)
    config = AutoConfig.from_pretrained(resolve_model(MODEL, default_cache_dir() / "models"))
    root = Path(tempfile.mkdtemp(prefix="zipf-adapters-"))
    for k in tqdm(range(num_adapters), desc="writing adapters"):
        write_random_adapter(root / f"adapter-{k:03d}", config, rank=8, seed=k)
    adapters = zipf_adapters(num_requests, num_adapters, exponent=1.1, seed=0)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(num_requests)]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm = LLM(MODEL, dtype="float32", num_threads=2, max_num_seqs=32, adapters=local_adapters, max_loras=max_loras, max_lora_rank=8,
              adapters_root=str(root), log_stats=False)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up, base only
    base_seconds, _ = run(llm, prompts, params, None)
    zipf_seconds, outs = run(llm, prompts, params, adapters)
    result = summarise(llm, adapters, outs, base_seconds, zipf_seconds, num_adapters, num_requests, max_loras, tokens)
    save_results(args.folders, "lora_zipf", result, plot, markdown(result, args.quick))


def summarise(llm, adapters, outs, base_seconds, zipf_seconds, num_adapters, num_requests, max_loras, tokens):
    rank_of = {a: i for i, (a, _) in enumerate(sorted(((a, adapters.count(a)) for a in set(adapters)),
                                                      key=lambda x: -x[1]))}
    latency = [(rank_of[a], o.latency) for a, o in zip(adapters, outs)]
    top = [lat for r, lat in latency if r < max_loras]
    tail = [lat for r, lat in latency if r >= max_loras]
    slots = llm.engine.adapter_slots
    return {
        "num_adapters": num_adapters, "num_requests": num_requests, "max_loras": max_loras, "new_tokens": tokens,
        "distinct_adapters_requested": len(set(adapters)),
        "base_only_tok_s": num_requests * tokens / base_seconds, "zipf_tok_s": num_requests * tokens / zipf_seconds,
        "latency_s": {"top": {"p50": statistics.median(top), "p99": percentile(top, 0.99), "n": len(top)},
                      "tail": {"p50": statistics.median(tail), "p99": percentile(tail, 0.99), "n": len(tail)},
                      "max": max(lat for _, lat in latency)},
        "source_loads": source_reads(llm.engine.adapters), "slot_loads": slots.loads, "slot_evictions": slots.evictions,
        "latency_by_rank": latency,
    }


def markdown(r: dict, quick: bool) -> str:
    ratio = r["zipf_tok_s"] / r["base_only_tok_s"]
    lat = r["latency_s"]
    return "\n".join([
        "# Multi-LoRA under Zipf popularity: SmolLM2-135M-Instruct on CPU (fp32, 2 threads)", "",
        "> quick smoke run: not comparable" if quick else "", "",
        f"Method: {r['num_requests']} requests x {r['new_tokens']} new tokens (greedy, EOS ignored), submitted at "
        f"once; "
        f"each request's adapter drawn from {r['num_adapters']} registered rank-8 q,k,v,o adapters with Zipf "
        f"popularity (exponent 1.1); max_loras={r['max_loras']} device slots, max_num_seqs=32. The same requests "
        "without adapters give the base-only figure; the Zipf run's wall time includes reading every adapter once "
        "from disk (cold start). Latency = arrival to last token; 'top' = requests for the "
        f"{r['max_loras']} most requested adapters, 'tail' = all others.", "",
        "| metric | value |", "|---|---|",
        f"| distinct adapters requested | {r['distinct_adapters_requested']} |",
        f"| base-only throughput | {r['base_only_tok_s']:.1f} tok/s |",
        f"| Zipf multi-LoRA throughput | {r['zipf_tok_s']:.1f} tok/s ({ratio:.0%} of base-only) |",
        f"| latency p50 / p99, top adapters | {lat['top']['p50']:.1f} / {lat['top']['p99']:.1f} s "
        f"({lat['top']['n']} requests) |",
        f"| latency p50 / p99, tail adapters | {lat['tail']['p50']:.1f} / {lat['tail']['p99']:.1f} s "
        f"({lat['tail']['n']} requests) |",
        f"| worst latency | {lat['max']:.1f} s |",
        f"| source reads / slot loads / slot evictions | {r['source_loads']} / {r['slot_loads']} / "
        f"{r['slot_evictions']} |", "",
        "![zipf](lora_zipf.png)", ""])


def plot(r: dict):
    ranks, latencies = zip(*r["latency_by_rank"])
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.scatter(ranks, latencies, s=10, alpha=0.6)
    ax.axvline(r["max_loras"] - 0.5, color="grey", linestyle="--", label=f"max_loras = {r['max_loras']}")
    ax.set_xlabel("adapter popularity rank (0 = most requested)")
    ax.set_ylabel("request latency (s)")
    ax.set_title(f"{r['num_requests']} requests over {r['distinct_adapters_requested']} adapters (Zipf 1.1)")
    ax.legend()
    return fig


if __name__ == "__main__":
    main()
