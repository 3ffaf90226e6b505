"""Multi-LoRA benchmark: the course's toy lesson, the engine with 0/1/8/32 adapters, cold loads and slot switches.

    PYTHONPATH=. python -m benchmarks lora            # full run
    PYTHONPATH=. python -m benchmarks lora --quick    # smoke test

Writes lora.md and lora.png (the engine with adapters) to benchmarks/results/KIND/, lora.json and
lora_course.png (the course's lesson) to benchmarks/runs/KIND/ (benchmarks/common.py: save_results).
"""

from __future__ import annotations

import gc
import statistics
import subprocess
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from benchmarks.lora import course_lora  # noqa: E402
from benchmarks.common import (benchmark_args, check_lengths, environment, fmt, markdown_table,  # noqa: E402
                               save_results)
from benchmarks.lora.lora_latency import latency, latency_section  # noqa: E402
from benchmarks.lora.lora_setup import RANK, LoraPlan, generate, make_llm, write_adapters  # noqa: E402
from benchmarks.workloads import make_requests  # noqa: E402

DTYPES = ("float32", "bfloat16")
OFF = "LoRA disabled (max_loras=0)"  # key of the base-only run on an engine without LoRA layers
SHORT = {"float32": "fp32", "bfloat16": "bf16"}


def code_version() -> dict:
    """The git commit and the engine files with uncommitted changes, as they were when this run started."""
    def git(*args):
        out = subprocess.run(["git", *args], cwd=Path(__file__).parents[2], capture_output=True, text=True)
        return out.stdout if out.returncode == 0 else ""
    dirty = [line[3:] for line in git("status", "--porcelain", "--", "engine", "lora_cache").splitlines()]
    return {"commit": git("rev-parse", "--short", "HEAD").strip() or "unknown", "uncommitted": dirty}


def round_robin(ids: list[str], count: int, num_requests: int) -> list[str | None]:
    return [ids[i % count] if count else None for i in range(num_requests)]


# ---- (2) throughput with 0 / 1 / 8 / 32 adapters ----

def throughput(dtype: str, root: Path, ids: list[str], plan: LoraPlan) -> dict:
    """Interleaved rounds of every configuration on one LoRA engine plus an engine without LoRA layers."""
    requests = make_requests(plan.requests, plan.new_tokens)
    engines = {"lora": make_llm(dtype, root, max(plan.adapter_counts)), "off": make_llm(dtype, root, 0)}
    configs = [(OFF, "off", 0)] + [(n, "lora", n) for n in plan.adapter_counts]
    generate(engines["off"], requests, None)  # warm-up; the LoRA one loads every adapter into a slot
    generate(engines["lora"], requests, round_robin(ids, max(plan.adapter_counts), plan.requests))
    samples, outputs = {key: [] for key, _, _ in configs}, {}
    items = [(r, c) for r in range(plan.rounds) for c in configs]
    for _, (key, engine, count) in tqdm(items, desc=f"engine {dtype}", unit="item"):
        tokens, seconds = generate(engines[engine], requests, round_robin(ids, count, plan.requests))
        samples[key].append(check_lengths(tokens, requests) / seconds)
        outputs[key] = tokens
    base = outputs[0]
    changed = {n: sum(a != b for a, b in zip(outputs[n], base)) for n in (OFF, *plan.adapter_counts) if n}
    slots = engines["lora"].engine.adapter_slots
    result = {"tok_s_samples": samples, "tok_s": {k: statistics.median(v) for k, v in samples.items()},
              "requests_changed_by_adapter": changed, "slot_loads": slots.loads, "slot_evictions": slots.evictions}
    del engines
    gc.collect()
    return result


# ---- plots ----

def plot_engine(engine: dict):
    """Left: tok/s vs distinct adapters per dtype, base-only (same engine, no adapter) dashed. Right: the fraction
    of base-only kept, with the 75% target. (vLLM with adapters is measured in the same run by run_engine.)"""
    fig, (ax_tps, ax_kept) = plt.subplots(1, 2, figsize=(12, 4.5))
    for (dtype, result), color in zip(engine.items(), ("tab:blue", "tab:orange")):
        tok = result["tok_s"]
        counts = sorted(k for k in tok if isinstance(k, int) and k > 0)
        ax_tps.plot(counts, [tok[k] for k in counts], marker="o", color=color, label=SHORT[dtype])
        ax_tps.axhline(tok[0], color=color, linestyle="--", label=f"{SHORT[dtype]} base only")
        ax_kept.plot(counts, [tok[k] / tok[0] for k in counts], marker="o", color=color, label=SHORT[dtype])
    ax_kept.axhline(0.75, color="green", linestyle=":", label="target 75%")
    ticks = sorted({k for r in engine.values() for k in r["tok_s"] if isinstance(k, int) and k > 0})
    for ax, ylabel in ((ax_tps, "generated tokens / s (median)"), (ax_kept, "fraction of base-only throughput")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("distinct adapters (round-robin over the requests)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="lower left")
    ax_kept.set_ylim(0, 1.1)
    ax_tps.set_title("lora-serve, SmolLM2-135M, rank-8 q,k,v,o adapters", fontsize=10)
    ax_kept.set_title("throughput kept with adapters", fontsize=10)
    return fig


# ---- markdown ----

def _span(samples: list[float]) -> str:
    return f"{min(samples):,.0f}-{max(samples):,.0f}"


def engine_section(engine: dict, plan: dict) -> str:
    header = ["dtype", "configuration", "tok/s (median)", "min-max", "vs base-only", "outputs differing from base-only"]
    rows = []
    for dtype, r in engine.items():
        base = r["tok_s"][0]
        for key, tok_s in r["tok_s"].items():
            label = key if key == OFF else ("LoRA enabled, no adapter (base-only)" if key == 0 else
                                            f"{key} distinct adapter{'s' if key > 1 else ''}")
            changed = r["requests_changed_by_adapter"].get(key)
            rows.append([SHORT[dtype], label, fmt(tok_s), _span(r["tok_s_samples"][key]), fmt(tok_s / base, 2),
                         "" if changed is None else f"{changed}/{plan['requests']}"])
    note = (f"Method: {plan['requests']} requests x {plan['new_tokens']} new tokens (greedy, EOS ignored, prompts "
            f"cycled from `benchmarks/workloads.py`), rank-{RANK} q,k,v,o adapters assigned round-robin; one engine "
            f"with max_loras={max(plan['adapter_counts'])} (all adapters stay in slots after a warm-up that loads "
            f"them) and one with max_loras=0, {plan['rounds']} interleaved round(s) of every configuration, median "
            f"tok/s. \"vs base-only\" divides by the same engine's base-only run; the last column counts requests "
            f"whose tokens differ from base-only (adapters really applied; none for the engine without LoRA).")
    lines = [note, "", markdown_table(header, rows), ""]
    for dtype, r in engine.items():
        tok = r["tok_s"]
        top = max(k for k in tok if isinstance(k, int))
        lines.append(f"- {SHORT[dtype]}: {top} distinct adapters keep **{tok[top] / tok[0]:.0%}** of base-only "
                     f"(target >= 75%); LoRA enabled with no adapter requested costs "
                     f"**{1 - tok[0] / tok[OFF]:+.1%}** vs the engine without LoRA.")
    loads = ", ".join(f"{SHORT[d]} {r['slot_loads']} slot loads / {r['slot_evictions']} evictions"
                      for d, r in engine.items())
    lines.append(f"- Slot counters over the whole run (warm-up included): {loads}.")
    lines.append("- vLLM with adapters: `python -m benchmarks engine --vllm-python ...` measures it in the same run "
                 "as lora-serve (its \"(a) with 8 rank-8 adapters\" rows and the share of base kept).")
    return "\n".join(lines)


def markdown(raw: dict) -> str:
    env, quick = raw["environment"], raw["mode"] == "quick"
    command = raw["command"]
    header = [
        "# lora-serve multi-LoRA benchmark: SmolLM2-135M-Instruct on CPU",
        "",
        f"Command: `{command}`" + ("  (quick smoke run: tiny workloads, not representative)" if quick else "") + "  ",
        f"Date: {env['date']}  ",
        f"Code: commit {raw['code']['commit']}" + (", with uncommitted changes in " + ", ".join(
            f"`{f}`" for f in raw["code"]["uncommitted"]) if raw["code"]["uncommitted"] else "") + "  ",
        f"CPU: {env['cpu']} ({env['cpu_count']} cores visible); torch {env['torch']} with {env['torch_threads']} "
        f"threads; OpenMP: {env['openmp']}; transformers {env['transformers']}; Python {env['python']}",
        "",
    ]
    sections = [
        ("1. Course lesson: toy model, loop vs gathered vs lora-serve's LoRA layer",
         course_lora.section(raw["course"])),
        ("2. Engine throughput with many adapters", engine_section(raw["engine"], raw["plan"])),
        ("3. Cold adapter load and warm slot switch: time to first token", latency_section(raw["latency"])),
    ]
    body = [f"## {title}\n\n{text}\n" for title, text in sections]
    plot = ["## Plot: engine throughput with adapters", "", "![lora](lora.png)", "",
            "The course lesson's plot (lora_course.png) is written beside lora.json."]
    return "\n".join(header + body + plot) + "\n"


def main(argv: list[str] | None = None) -> None:
    args = benchmark_args(__doc__, "tiny workloads: a smoke test of the whole pipeline", argv)

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(2)
    plan = LoraPlan.quick() if args.quick else LoraPlan.full()
    env, code = environment(), code_version()
    course = course_lora.run(plan.course_batches, plan.course_rounds, plan.course_samples)
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        root = Path(tmp)
        ids = write_adapters(root, plan)
        engine = {dtype: throughput(dtype, root, ids["lora"], plan) for dtype in DTYPES}
        lat = latency(root, ids, plan)

    raw = {"mode": "quick" if args.quick else "full", "command": args.command, "environment": env, "code": code,
           "plan": plan.__dict__, "course": course, "engine": engine, "latency": lat}
    save_results(args.folders, "lora", raw, lambda _: plot_engine(engine), markdown(raw),
                 {"course": lambda _: course_lora.plot(course, plt)})


if __name__ == "__main__":
    main()
