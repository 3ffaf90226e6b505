"""Multi-LoRA benchmark: the course's toy lesson, the engine with 0/1/8/32 adapters, cold loads and slot switches.

    PYTHONPATH=. python -m benchmarks.run_lora            # full run
    PYTHONPATH=. python -m benchmarks.run_lora --quick    # smoke test (under 2 minutes)

Writes benchmarks/results/lora.md, lora.json, lora_course.png and lora_engine.png.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from benchmarks import course_lora  # noqa: E402
from benchmarks.common import check_lengths, environment, fmt, markdown_table, timed  # noqa: E402
from benchmarks.lora_adapters import write_random_adapter  # noqa: E402
from benchmarks.workloads import PROMPTS, make_requests  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.config import default_cache_dir  # noqa: E402
from engine.model_files import resolve_model  # noqa: E402
from lora_cache.adapter import load_adapter  # noqa: E402

RESULTS = Path(__file__).parent / "results"
MODEL = "smollm2-135m-instruct"
RANK = 8
DTYPES = ("float32", "bfloat16")
OFF = "LoRA disabled (max_loras=0)"  # key of the base-only run on an engine without LoRA layers
# vLLM 0.32 CPU build, measured earlier on this machine: 64 requests x 32 new tokens, 8 distinct rank-8 q,k,v,o
# adapters; a [lo, hi] pair is a range over runs.
VLLM_LORA_REFERENCE = {"fp32": {"base_tok_s": [684, 829], "lora_tok_s": 295, "kept": [0.36, 0.43]},
                       "bf16": {"base_tok_s": 1332, "lora_tok_s": 354, "kept": 0.27},
                       "lora_enabled_no_adapter_cost": 0.40}
SHORT = {"float32": "fp32", "bfloat16": "bf16"}


@dataclass(frozen=True)
class LoraPlan:
    """Sizes of every part; `full()` is the benchmark, `quick()` a smoke test."""
    course_batches: tuple[int, ...]
    course_rounds: int
    course_iters: int
    requests: int  # engine throughput: requests x new_tokens
    new_tokens: int
    adapter_counts: tuple[int, ...]  # distinct adapters, round-robin over the requests (0 = base only)
    rounds: int
    ttft_repeats: int  # cold / resident / base TTFT samples
    switch_requests: int  # warm switches measured (each one needs a slot reload)

    @staticmethod
    def full() -> "LoraPlan":
        return LoraPlan(course_lora.BATCH_SIZES, 5, 100, 32, 32, (0, 1, 8, 32), 5, 9, 12)

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


def code_version() -> dict:
    """The git commit and the engine files with uncommitted changes, as they were when this run started."""
    def git(*args):
        out = subprocess.run(["git", *args], cwd=Path(__file__).parent.parent, capture_output=True, text=True)
        return out.stdout if out.returncode == 0 else ""
    dirty = [line[3:] for line in git("status", "--porcelain", "--", "engine", "lora_cache").splitlines()]
    return {"commit": git("rev-parse", "--short", "HEAD").strip() or "unknown", "uncommitted": dirty}


def make_llm(dtype: str, root: Path, max_loras: int) -> LLM:
    lora = {"max_loras": max_loras, "max_lora_rank": RANK, "adapters_root": str(root)} if max_loras else {}
    return LLM(MODEL, dtype=dtype, num_threads=2, log_stats=False, max_num_seqs=64, **lora)


def generate(llm: LLM, requests, adapters) -> tuple[list[list[int]], float]:
    params = SamplingParams(max_tokens=requests[0][1], temperature=0.0, ignore_eos=True)
    outputs, seconds = timed(llm.generate, [p for p, _ in requests], params, use_tqdm=False, adapters=adapters)
    return [o.token_ids for o in outputs], seconds


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


# ---- (3) cold load and warm switch ----

def first_token(llm: LLM, adapter: str | None) -> dict:
    """One request, one new token: wall time of the generate call (= call to first token) and the engine's ttft."""
    outputs, seconds = timed(llm.generate, [PROMPTS[0]], SamplingParams(max_tokens=1, temperature=0.0),
                             use_tqdm=False, adapters=[adapter])
    return {"call_ms": seconds * 1000, "ttft_ms": outputs[0].ttft * 1000}


def cold_load(root: Path, ids: dict[str, list[str]], plan: LoraPlan, bar) -> dict:
    """Never-loaded adapter (fresh id each time) vs a resident adapter vs base; fp32. The order of the three
    rotates every round, so none of them always runs right after a cold load."""
    max_loras = len(ids["cold"]) + 2
    llm = make_llm("float32", root, max_loras)
    resident, (warm_cold, *cold) = ids["lora"][0], ids["cold"]
    for adapter in (None, resident, warm_cold):
        first_token(llm, adapter)
    samples = {"cold": [], "resident": [], "base": []}
    cache = llm.engine.adapters
    for i, cold_id in enumerate(cold):
        cases = [("cold", cold_id), ("resident", resident), ("base", None)]
        for case, adapter in cases[i % 3:] + cases[:i % 3]:
            before = cache.loads
            samples[case].append(first_token(llm, adapter))
            if case == "cold" and cache.loads != before + 1:
                raise RuntimeError(f"cold adapter {adapter!r} was not read from its source")
        bar.update(1)
    return {"samples": samples, "median": _medians(samples), "max_loras": max_loras, "source_reads": cache.loads,
            "slot_loads": llm.engine.adapter_slots.loads, "components": components(llm, root, resident, 10)}


def warm_switch(root: Path, ids: dict[str, list[str]], plan: LoraPlan, bar) -> dict:
    """max_loras=2, 4 adapters already in the CPU tier: cycling over them needs a slot reload every request.
    Each switch is followed by a second request for the same (now resident) adapter."""
    llm = make_llm("float32", root, 2)
    four = ids["lora"][:4]
    for adapter in four:  # into the CPU tier once (and through the slots)
        first_token(llm, adapter)
    cache, slots = llm.engine.adapters, llm.engine.adapter_slots
    reads, loads = cache.loads, slots.loads
    samples = {"switch": [], "resident": []}
    for i in range(plan.switch_requests):
        adapter = four[i % 4]
        samples["switch"].append(first_token(llm, adapter))
        samples["resident"].append(first_token(llm, adapter))
        bar.update(1)
    return {"samples": samples, "median": _medians(samples), "source_reads_during": cache.loads - reads,
            "slot_loads_during": slots.loads - loads, "evictions": slots.evictions}


def components(llm: LLM, root: Path, adapter_id: str, repeats: int) -> dict:
    """Direct timings of the two steps a cold request adds: read + validate from disk, copy into a device slot
    (re-copying a resident adapter into its own slot, so the engine's bookkeeping stays true)."""
    cache, slot = llm.engine.adapters, llm.engine.adapter_slots.slot_of[adapter_id]
    read = [timed(load_adapter, adapter_id, root / adapter_id, cache.hf_config, cache.max_adapter_bytes)[1]
            for _ in range(repeats)]
    adapter = cache.get(adapter_id)
    copy = [timed(llm.engine.runner.load_adapter, slot, adapter)[1] for _ in range(repeats)]
    return {"read_validate_ms": statistics.median(read) * 1000, "slot_copy_ms": statistics.median(copy) * 1000,
            "adapter_mib": adapter.nbytes / 2 ** 20, "repeats": repeats}


def _medians(samples: dict[str, list[dict]]) -> dict:
    return {k: {f: statistics.median(s[f] for s in v) for f in ("call_ms", "ttft_ms")} for k, v in samples.items()}


def latency(root: Path, ids: dict[str, list[str]], plan: LoraPlan) -> dict:
    with tqdm(total=plan.ttft_repeats + plan.switch_requests, desc="cold load / warm switch", unit="item") as bar:
        return {"cold": cold_load(root, ids, plan, bar), "switch": warm_switch(root, ids, plan, bar)}


# ---- plots ----

def plot_course(course: dict, path: Path) -> Path:
    """Latency vs batch size, one panel per toy hidden size; the base linear alone dashed."""
    fig, axes = plt.subplots(1, len(course), figsize=(6 * len(course), 4.5), squeeze=False)
    for ax, sweep in zip(axes[0], course.values()):
        for method, per_batch in sweep["median_ms"].items():
            batches = sorted(per_batch)
            style = {course_lora.BASE: {"linestyle": "--", "color": "gray"},
                     course_lora.PREBUILT: {"linestyle": ":", "marker": "."}}.get(method, {"marker": "o"})
            ax.plot(batches, [per_batch[b] for b in batches], label=method, **style)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sweep["batch_sizes"], [str(b) for b in sweep["batch_sizes"]])
        ax.set_xlabel("batch size (requests, one token each)")
        ax.set_ylabel("mean latency per forward (ms)")
        ax.set_title(f"Toy LoRA linear, hidden {sweep['hidden']}, {sweep['num_adapters']} adapters of rank "
                     f"{sweep['ranks']}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_engine(engine: dict, path: Path) -> Path:
    """Left: tok/s vs distinct adapters per dtype, base-only (same engine, no adapter) dashed. Right: the fraction
    of base-only kept, with the 75% target and vLLM's reference (different workload: 64 x 32, 8 adapters)."""
    fig, (ax_tps, ax_kept) = plt.subplots(1, 2, figsize=(12, 4.5))
    for (dtype, result), color in zip(engine.items(), ("tab:blue", "tab:orange")):
        tok = result["tok_s"]
        counts = sorted(k for k in tok if isinstance(k, int) and k > 0)
        ax_tps.plot(counts, [tok[k] for k in counts], marker="o", color=color, label=SHORT[dtype])
        ax_tps.axhline(tok[0], color=color, linestyle="--", label=f"{SHORT[dtype]} base only")
        ax_kept.plot(counts, [tok[k] / tok[0] for k in counts], marker="o", color=color, label=SHORT[dtype])
    ax_kept.axhline(0.75, color="green", linestyle=":", label="target 75%")
    ref = VLLM_LORA_REFERENCE
    ax_kept.errorbar([8], [sum(ref["fp32"]["kept"]) / 2], yerr=[(ref["fp32"]["kept"][1] - ref["fp32"]["kept"][0]) / 2],
                     marker="x", color="gray", capsize=4, linestyle="none", label="vLLM CPU fp32 (reference)")
    ax_kept.plot([8], [ref["bf16"]["kept"]], marker="+", markersize=10, color="gray", linestyle="none",
                 label="vLLM CPU bf16 (reference)")
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
    ax_kept.set_title("throughput kept with adapters (vLLM: 64 x 32 tokens, 8 adapters)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plots(course: dict, engine: dict, folder: Path) -> list[Path]:
    return [plot_course(course, folder / "lora_course.png"), plot_engine(engine, folder / "lora_engine.png")]


# ---- markdown ----

def course_table(sweep: dict) -> str:
    med = sweep["median_ms"]
    base = med[course_lora.BASE]
    loop, gathered, ls = (med[m] for m in course_lora.METHODS)
    pre = med[course_lora.PREBUILT]
    rows = [[str(b), fmt(base[b], 3), fmt(loop[b], 3), fmt(gathered[b], 3), fmt(ls[b], 3), fmt(pre[b], 3),
             fmt(loop[b] / ls[b], 2), fmt(gathered[b] / ls[b], 2),
             " / ".join(fmt(m[b] - base[b], 3) for m in (loop, gathered, ls, pre)),
             str(sweep["distinct_adapters"][b])] for b in sweep["batch_sizes"]]
    header = ["batch", "base only ms", "loop ms", "gathered ms", "lora-serve ms", "lora-serve prebuilt ms",
              "lora-serve speed-up vs loop", "vs gathered", "LoRA part ms: loop / gathered / lora-serve / prebuilt",
              "distinct adapters"]
    return markdown_table(header, rows)


def course_section(course: dict) -> str:
    first = next(iter(course.values()))
    note = (f"Method: one linear layer (fp32, 2 threads) with {first['num_adapters']} adapters of rank "
            f"{first['ranks']}; each batch row is one request with one token and a uniformly drawn adapter. Mean "
            f"latency per forward over {first['iters']} calls, median of {first['rounds']} round(s) with the "
            f"methods interleaved; lora-serve's time includes `build_lora_batch` (\"prebuilt\": built outside the "
            f"timed call, as the engine builds it once per step for all 120 LoRA linears of SmolLM2). \"LoRA "
            f"part\" = method - base linear alone (medians, so it can be slightly negative). Outputs of the three "
            f"agree to {max(s['max_abs_difference'] for s in course.values()):.1e}.")
    parts = [note]
    for hidden, sweep in course.items():
        label = "the course's own size" if hidden == course_lora.COURSE_HIDDEN else "the briefed toy size"
        parts += ["", f"**Hidden {hidden} -> {hidden}** ({label})", "", course_table(sweep)]
        med = sweep["median_ms"]
        loop, gathered, ls = (med[m][32] for m in course_lora.METHODS) if 32 in med[course_lora.BASE] else (0,) * 3
        if ls:
            verdict = "met" if loop / ls >= 5 else "missed"
            parts += ["", f"At batch 32: lora-serve is **{loop / ls:.2f}x** the loop's speed (target at least 5x: "
                          f"{verdict}) and **{gathered / ls:.2f}x** the gathered version's."]
    return "\n".join(parts)


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
    ref = VLLM_LORA_REFERENCE
    rows.append(["fp32", "vLLM CPU 0.32, 8 adapters (reference, 64 x 32)", fmt(ref["fp32"]["lora_tok_s"]),
                 "", fmt(tuple(ref["fp32"]["kept"]), 2), ""])
    rows.append(["bf16", "vLLM CPU 0.32, 8 adapters (reference, 64 x 32)", fmt(ref["bf16"]["lora_tok_s"]),
                 "", fmt(ref["bf16"]["kept"], 2), ""])
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
    lines.append(f"- vLLM's CPU build on this machine (reference): kept 36-43% of base in fp32 (295 tok/s) and 27% "
                 f"in bf16 (354 of 1,332 tok/s) with 8 adapters on 64 x 32 tokens; enabling LoRA with no adapter "
                 f"requested cost it {ref['lora_enabled_no_adapter_cost']:.0%}.")
    return "\n".join(lines)


def latency_section(lat: dict) -> str:
    cold, switch = lat["cold"], lat["switch"]
    entries = [  # label, phase, case, reference case (same engine)
        ("base model (no adapter)", cold, "base", "resident"),
        ("resident adapter (already in a slot)", cold, "resident", "resident"),
        ("cold adapter (never loaded: read + validate + slot copy)", cold, "cold", "resident"),
        ("max_loras=2: resident adapter (same adapter again)", switch, "resident", "resident"),
        ("max_loras=2: warm switch (in CPU tier, slot reload)", switch, "switch", "resident")]
    rows = []
    for label, phase, case, ref in entries:
        m, r = phase["median"][case], phase["median"][ref]
        rows.append([label, fmt(m["call_ms"]), fmt(m["ttft_ms"]), fmt(m["call_ms"] - r["call_ms"]),
                     str(len(phase["samples"][case]))])
    header = ["request", "call -> first token ms", "engine ttft ms", "extra vs resident (same engine) ms",
              "samples"]
    note = ("Method: fp32, one request (the first workload prompt, 7 tokens) with max_tokens=1, medians. "
            "\"call -> first token\" is the wall time of `generate` (the request ends at its first token); "
            "\"engine ttft\" is `out.ttft`, which starts when the request enters the engine, i.e. after "
            "`prepare_request` has already read a cold adapter from disk, so it includes the slot copy but not "
            f"the read. Cold (engine with max_loras={lat['cold']['max_loras']}): a fresh adapter id each time (the "
            "files were just written, so they come from the OS page cache), interleaved with a resident-adapter and "
            "a base request in rotating order. Warm switch (engine with max_loras=2): 4 adapters already in the CPU "
            "tier, cycled one request at a time, each switch followed by a second request for the same, now "
            "resident, adapter.")
    c, sw = cold["components"], switch
    lines = [note, "", markdown_table(header, rows), "",
             f"Components, timed directly (median of {c['repeats']}): reading + validating one adapter "
             f"({c['adapter_mib']:.1f} MiB of fp32 A/B) {c['read_validate_ms']:.1f} ms; copying it into a device "
             f"slot {c['slot_copy_ms']:.2f} ms. The single-request prefill itself varies by several ms between "
             f"calls on this machine, so the TTFT differences above are only meaningful at that scale.",
             "",
             f"Counters: {cold['source_reads']} source reads in the cold engine (warm-ups plus one per cold "
             f"request); during the switch phase {sw['source_reads_during']} source reads and "
             f"{sw['slot_loads_during']} slot loads for {len(sw['samples']['switch'])} switches."]
    return "\n".join(lines)


def markdown(raw: dict, images: list[Path]) -> str:
    env, quick = raw["environment"], raw["mode"] == "quick"
    command = "PYTHONPATH=. python -m benchmarks.run_lora" + (" --quick" if quick else "")
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
        ("1. Course lesson: toy model, loop vs gathered vs lora-serve's LoRA layer", course_section(raw["course"])),
        ("2. Engine throughput with many adapters", engine_section(raw["engine"], raw["plan"])),
        ("3. Cold adapter load and warm slot switch: time to first token", latency_section(raw["latency"])),
    ]
    body = [f"## {title}\n\n{text}\n" for title, text in sections]
    pictures = [f"![{p.stem}]({p.name})" for p in images]
    return "\n".join(header + body + ["## Plots", ""] + pictures) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny workloads: a smoke test of the whole pipeline")
    parser.add_argument("--out", type=Path, default=RESULTS, help="output folder")
    args = parser.parse_args(argv)

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(2)
    plan = LoraPlan.quick() if args.quick else LoraPlan.full()
    env, code = environment(), code_version()
    course = course_lora.run(plan.course_batches, plan.course_rounds, plan.course_iters)
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        root = Path(tmp)
        ids = write_adapters(root, plan)
        engine = {dtype: throughput(dtype, root, ids["lora"], plan) for dtype in DTYPES}
        lat = latency(root, ids, plan)

    args.out.mkdir(parents=True, exist_ok=True)
    raw = {"mode": "quick" if args.quick else "full", "environment": env, "code": code, "plan": plan.__dict__,
           "vllm_reference": VLLM_LORA_REFERENCE, "course": course, "engine": engine, "latency": lat}
    (args.out / "lora.json").write_text(json.dumps(raw, indent=2, default=str) + "\n")
    images = plots(course, engine, args.out)
    (args.out / "lora.md").write_text(markdown(raw, images))
    print(f"wrote {args.out / 'lora.md'}, {args.out / 'lora.json'}, " + ", ".join(str(i) for i in images))


if __name__ == "__main__":
    main()
