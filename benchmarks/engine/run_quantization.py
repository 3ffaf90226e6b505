"""Quantization: fp32, bf16, int8 and NF4 base weights of SmolLM2 side by side.

    PYTHONPATH=. python -m benchmarks quantization            # full run
    PYTHONPATH=. python -m benchmarks quantization --quick    # smoke test

Per configuration: weight memory (the engine's own accounting), tokens/s at batch 1 (one stream of
64 tokens) and batch 32 (32 x 32 tokens, EOS ignored), and greedy agreement with fp32 over 20 prompts
x 32 tokens. Then the reconstruction error of every decoder linear of SmolLM2 under the course's
per-tensor zero-point uint8 scheme (benchmarks/engine/course_quantize.py) beside bitsandbytes' int8 and NF4.
Writes quantization.md and quantization.png to benchmarks/results/KIND/ and quantization.json to benchmarks/runs/KIND/
(benchmarks/common.py: save_results).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from benchmarks.engine import course_quantize  # noqa: E402
from benchmarks.common import benchmark_args, environment, fmt, markdown_table, save_results  # noqa: E402
from benchmarks.workloads import PROMPTS  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.config import default_cache_dir  # noqa: E402
from engine.model_files import resolve_model  # noqa: E402

CONFIGS = {"fp32": ("float32", "none"), "bf16": ("bfloat16", "none"), "int8 (bf16 compute)": ("bfloat16", "int8"),
           "nf4 (bf16 compute)": ("bfloat16", "nf4")}


def _tok_s(llm: LLM, prompts: list[str], tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)


def measure(path: Path, dtype: str, quantization: str, rounds: int, agreement_prompts: list[str]) -> dict:
    llm = LLM(str(path), dtype=dtype, quantization=quantization, log_stats=False)
    memory = llm.engine.memory()
    _tok_s(llm, PROMPTS[:2], 4)  # warm-up
    batch1 = [_tok_s(llm, PROMPTS[:1], 64) for _ in range(rounds)]
    batch32 = [_tok_s(llm, (PROMPTS * 4)[:32], 32) for _ in range(rounds)]
    greedy = llm.generate(agreement_prompts, SamplingParams(max_tokens=32, temperature=0), use_tqdm=False)
    return {"weight_bytes": memory.weight_bytes, "total_weight_bytes": memory.total_weight_bytes,
            "tok_s_batch1": statistics.median(batch1), "tok_s_batch32": statistics.median(batch32),
            "greedy": [o.token_ids for o in greedy]}


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> dict:
    """Prompts whose 32 greedy tokens all equal fp32's, and the mean share of tokens before the first divergence."""
    prefixes = []
    for got, want in zip(tokens, reference):
        same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        prefixes.append(same / max(len(want), 1))
    return {"identical": sum(p == 1.0 for p in prefixes), "prompts": len(prefixes),
            "mean_prefix": statistics.fmean(prefixes)}


def reconstruction(path: Path, layers: int | None) -> dict:
    """Mean over SmolLM2's decoder linears (read from its checkpoint) of each scheme's error, and their bytes."""
    from safetensors import safe_open

    weights = []
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                parts = name.split(".")
                if "layers" in parts and name.endswith(".weight") and len(f.get_slice(name).get_shape()) == 2:
                    if layers is None or int(parts[parts.index("layers") + 1]) < layers:
                        weights.append(f.get_tensor(name).float())
    schemes = {"course: per-tensor zero-point uint8": course_quantize.course_roundtrip,
               "bitsandbytes int8 (row-wise absmax)": lambda w: course_quantize.bnb_roundtrip(w, "int8"),
               "bitsandbytes nf4 (blocks of 64)": lambda w: course_quantize.bnb_roundtrip(w, "nf4")}
    results = {}
    for name, roundtrip in tqdm(schemes.items(), desc="reconstruction error", unit="scheme"):
        per_weight, stored = [], 0
        for weight in weights:
            rebuilt, nbytes = roundtrip(weight)
            per_weight.append(course_quantize.errors(weight, rebuilt))
            stored += nbytes
        results[name] = {key: statistics.fmean(e[key] for e in per_weight) for key in per_weight[0]}
        results[name]["bytes"] = stored
    results["fp32 (reference)"] = {"mean_abs": 0.0, "max_abs": 0.0, "relative_rms": 0.0,
                                   "bytes": sum(w.numel() * 4 for w in weights)}
    return results


def markdown(raw: dict) -> str:
    env, configs = raw["environment"], raw["configs"]
    rows = [[name, fmt(r["total_weight_bytes"] / 2**20), ", ".join(f"{k} {v / 2**20:.1f}"
                                                                     for k, v in sorted(r["weight_bytes"].items())),
             fmt(r["tok_s_batch1"]), fmt(r["tok_s_batch32"]),
             f"{r['agreement']['identical']}/{r['agreement']['prompts']}", f"{r['agreement']['mean_prefix']:.0%}"]
            for name, r in configs.items()]
    err_rows = [[name, f"{r['mean_abs']:.2e}", f"{r['max_abs']:.2e}", f"{r['relative_rms']:.3f}",
                 fmt(r["bytes"] / 2**20)] for name, r in raw["reconstruction"].items()]
    return "\n".join([
        "# Quantization", "",
        f"{env['date']}, {env['cpu']}, {env['torch_threads']} torch threads, torch {env['torch']}; "
        f"mode: {raw['mode']}; median of {raw['rounds']} rounds.", "",
        "## SmolLM2-135M-Instruct", "",
        "Weight MiB: the engine's accounting (embeddings, norms and lm_head stay in the compute dtype; "
        "quantization applies to the decoder layers' linears). Greedy agreement: prompts whose 32 greedy tokens all "
        "equal fp32's, and the mean share of tokens before the first divergence.", "",
        markdown_table(["weights", "weight MiB", "by storage dtype (MiB)", "tok/s batch 1", "tok/s batch 32",
                        "identical to fp32", "agreement before divergence"], rows), "",
        f"## Reconstruction error of SmolLM2's decoder linears ({raw['reconstruction_layers']} layers)", "",
        "Mean over the linears of each weight's mean and max absolute error and relative RMS error.", "",
        markdown_table(["scheme", "mean abs error", "max abs error", "relative RMS", "MiB stored"], err_rows), "",
        "![quantization](quantization.png)", ""])


def plot(raw: dict):
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    names = list(raw["configs"])
    short = [n.split(" ")[0] for n in names]
    axes[0].bar(short, [raw["configs"][n]["total_weight_bytes"] / 2**20 for n in names], color="#59a")
    axes[0].set_ylabel("weight MiB")
    axes[1].bar(short, [raw["configs"][n]["tok_s_batch32"] for n in names], color="#27a", label="batch 32")
    axes[1].bar(short, [raw["configs"][n]["tok_s_batch1"] for n in names], color="#a73", label="batch 1")
    axes[1].set_ylabel("tokens/s")
    axes[1].legend(fontsize=8)
    schemes = list(raw["reconstruction"])[:-1]
    axes[2].bar([s.split(" (")[0].replace("bitsandbytes ", "bnb ").replace("course: ", "course ") for s in schemes],
                [raw["reconstruction"][s]["relative_rms"] for s in schemes], color="#a55")
    axes[2].set_ylabel("relative RMS error of the weights")
    fig.suptitle("SmolLM2-135M-Instruct: fp32, bf16, int8 and NF4 base weights", fontsize=10)
    return fig


def main(argv: list[str] | None = None) -> None:
    args = benchmark_args(__doc__, "one round, 4 agreement prompts, 2 layers", argv)
    torch.set_num_threads(2)
    path = resolve_model("smollm2-135m-instruct", default_cache_dir() / "models")
    rounds, prompts, layers = (1, PROMPTS[:4], 2) if args.quick else (3, (PROMPTS * 2)[:20], None)
    configs = {name: measure(path, dtype, q, rounds, prompts)
               for name, (dtype, q) in tqdm(CONFIGS.items(), desc="configurations", unit="config")}
    reference = configs["fp32"]["greedy"]
    for result in configs.values():
        result["agreement"] = agreement(result.pop("greedy"), reference)
    raw = {"mode": "quick" if args.quick else "full", "environment": environment(), "rounds": rounds,
           "configs": configs, "reconstruction_layers": layers or "all 30",
           "reconstruction": reconstruction(path, layers)}
    save_results(args.folders, "quantization", raw, plot, markdown(raw))


if __name__ == "__main__":
    main()
