"""Tensor parallelism on this machine's cores: the step time at N = 1, 2 and 3 workers, and the collectives' share.

    PYTHONPATH=. python -m benchmarks tp            # full run
    PYTHONPATH=. python -m benchmarks tp --quick    # smoke test

Design: one offline engine per (model, N), LLM(..., tensor_parallel_size=N), driven one engine.step() at a time
(benchmarks/engine/tp_steps.py): a prefill case (4 prompts of 231 tokens) and decode cases at batch 1 and
16, each timed per step, with rank 0's seconds inside the all-reduces and the all-gather (and the step's
broadcast) taken by wrapping those methods in this process. SmolLM2-135M-Instruct (3 KV heads) runs at N = 1 and
3; a random-weight Llama of SmolLM2's size with 6 KV heads runs at N = 1, 2 and 3. N = 1 also runs on the modules'
path (decoder_stack=False), the path every N > 1 takes, so the collectives' cost is told apart from the C++ decoder
stack's gain. For reference, a bare gloo all-reduce among N processes that do nothing else is timed too
(tp_steps.bare_all_reduce). Every N shares the same cores: the figures are the collectives' and the per-worker
step's overhead, not a speed-up.

Writes tp.md and tp.png to benchmarks/results/KIND/ and tp.json to benchmarks/runs/KIND/ (benchmarks/common.py:
save_results). The script is guarded by `if __name__ == "__main__":`, as the worker processes require.
"""

from __future__ import annotations

import shutil
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from benchmarks.common import benchmark_args, environment, markdown_table, report_header, save_results
from benchmarks.engine.tp_steps import CaseResult, bare_all_reduce, collective_clock, divisible_model, run_steps
from benchmarks.workloads import PROMPTS
from engine import LLM
from engine.config import default_cache_dir
from engine.model_files import resolve_model

SMOLLM2 = "smollm2-135m-instruct"
LONG_PROMPT = " ".join(PROMPTS)


@dataclass(frozen=True)
class ModelSpec:
    label: str
    path: str
    load_format: str
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class Plan:
    """The cases of one run: (name, prompts, decode steps) each, and how many rounds of each."""
    cases: tuple[tuple[str, tuple[str, ...], int], ...]
    rounds: int
    modules_path_at_1: bool

    @staticmethod
    def of(quick: bool) -> Plan:
        if quick:
            return Plan((("prefill 2 x long", (LONG_PROMPT,) * 2, 0), ("decode b=1", PROMPTS[:1], 4),
                         ("decode b=4", tuple(PROMPTS[:4]), 4)), 1, False)
        batch16 = tuple(PROMPTS[i % len(PROMPTS)] for i in range(16))
        return Plan((("prefill 4 x long", (LONG_PROMPT,) * 4, 0), ("decode b=1", PROMPTS[:1], 32),
                     ("decode b=16", batch16, 32)), 3, True)


def models(quick: bool) -> list[ModelSpec]:
    smollm2 = resolve_model(SMOLLM2, default_cache_dir() / "models")
    divisible = ModelSpec("random Llama, 6 KV heads", str(divisible_model(Path(smollm2))), "dummy", (1, 2, 3))
    if quick:
        return [ModelSpec(divisible.label, divisible.path, "dummy", (1, 2))]
    return [ModelSpec("SmolLM2-135M-Instruct", str(smollm2), "safetensors", (1, 3)), divisible]


def engine(spec: ModelSpec, size: int, dtype: str, decoder_stack: bool) -> LLM:
    return LLM(spec.path, tensor_parallel_size=size, dtype=dtype, load_format=spec.load_format, log_stats=False,
               enable_prefix_caching=False, max_num_seqs=16, kv_cache_bytes=64 << 20, decoder_stack=decoder_stack)


def measure(spec: ModelSpec, size: int, plan: Plan, dtype: str, decoder_stack: bool) -> list[CaseResult]:
    """Every case of the plan, `rounds` times, on one engine (after a warm-up case); the engine closed after."""
    label = f"{spec.label} N={size}" + ("" if decoder_stack else " (modules)")
    print(f"starting {label}", flush=True)
    with engine(spec, size, dtype, decoder_stack) as llm, collective_clock() as clock:
        threads = llm.engine.config.backend.threads_per_worker
        for name, prompts, decode_steps in plan.cases:  # warm-up: every case once, untimed
            run_steps(llm, list(prompts), min(decode_steps, 2), clock, f"{label} warm-up {name}")
        results = {name: CaseResult(spec.label, size, decoder_stack and size == 1, name, len(prompts), threads, [])
                   for name, prompts, _ in plan.cases}
        for _ in range(plan.rounds):
            for name, prompts, decode_steps in plan.cases:
                results[name].steps += run_steps(llm, list(prompts), decode_steps, clock, f"{label} {name}")
    return list(results.values())


def run(plan: Plan, dtype: str, quick: bool) -> list[CaseResult]:
    results = []
    for spec in models(quick):
        for size in spec.sizes:
            results += measure(spec, size, plan, dtype, decoder_stack=True)
        if plan.modules_path_at_1:
            results += measure(spec, 1, plan, dtype, decoder_stack=False)
        if spec.load_format == "dummy":
            shutil.rmtree(spec.path)  # the random model's config and tokenizer (tp_steps.divisible_model)
    return results


def phase(case: CaseResult) -> dict:
    """The case's figures: its decode steps (its prefill steps for a prefill case), medians in ms and shares."""
    steps = case.of("prefill" if case.case.startswith("prefill") else "decode")
    total = sum(s.seconds for s in steps)
    return {"model": case.model, "tp": case.tp, "path": "C++ decoder stack" if case.decoder_stack else "modules",
            "case": case.case, "threads_per_worker": case.threads_per_worker,
            "steps": len(steps), "tokens_per_step": statistics.median(s.tokens for s in steps),
            "step_ms": 1e3 * statistics.median(s.seconds for s in steps),
            "collective_ms": 1e3 * statistics.median(s.collective_s for s in steps),
            "collective_share": sum(s.collective_s for s in steps) / total,
            "collectives_per_step": statistics.median(s.collectives for s in steps),
            "all_reduce_share": sum(s.all_reduce_s for s in steps) / total,
            "broadcast_ms": 1e3 * statistics.median(s.broadcast_s for s in steps)}


def rows(figures: list[dict]) -> list[list[str]]:
    return [[f["model"], str(f["tp"]), f["path"], str(f["threads_per_worker"]), f["case"],
             f"{f['tokens_per_step']:.0f}",
             f"{f['step_ms']:.1f}", f"{f['collective_ms']:.1f}", f"{f['collectives_per_step']:.0f}",
             _per_call(f), f"{f['collective_share']:.0%}",
             f"{f['all_reduce_share']:.0%}", f"{f['broadcast_ms']:.2f}"] for f in figures]


def _per_call(figure: dict) -> str:
    """The median step's collective time over its collectives, in µs; a dash where none ran (N = 1)."""
    calls = figure["collectives_per_step"]
    return f"{1e3 * figure['collective_ms'] / calls:,.0f}" if calls else "-"


HEADLINE = ("Median step time, and in brackets the share of the steps' time rank 0 spent in the all-reduces and the "
            "all-gather:")
DTYPE_NOTE = ("bfloat16 also runs at N > 1 (`--dtype bfloat16`: gloo reduces bf16 tensors); this summary's run is "
              "the dtype named in the method, and N > 1's outputs were not compared with N = 1's here "
              "(tests/test_tensor_parallel*.py do that in float32).")
HEADER = ["model", "N", "path", "threads / worker", "case", "tokens / step", "step ms (median)",
          "all-reduce + all-gather ms (median)", "collectives / step", "µs per collective",
          "collectives' share of step time", "all-reduce's share",
          "broadcast ms"]


def method(plan: Plan, dtype: str) -> str:
    return (f"Method: one offline engine per model and N ({dtype}, the cores split among the N workers by the "
            "engine's default: `num_threads` = cores // N, at least 1; prefix caching off), driven one "
            "`engine.step()` at a time after a warm-up. Cases: "
            + "; ".join(f"{name} ({len(prompts)} requests, {steps} decode steps)"
                        for name, prompts, steps in plan.cases)
            + f"; {plan.rounds} rounds of each, one after the other. Step time is the wall time of `engine.step()` "
            "(schedule, forward on every rank, sample); decode rows are the median over the decode steps, "
            "prefill rows over the prefill steps. The collectives' time is rank 0's time inside "
            "`TensorParallel.all_reduce` and `all_gather` (2 all-reduces a layer, 1 for the embedding, 1 "
            "all-gather of the logits), taken by wrapping them in the driver's process; it is the transfer plus "
            "rank 0's wait for the slowest rank, so it includes the others' lag. The share is their summed time "
            "over the steps' summed time. Broadcast is the step's pickled `ForwardBatch` sent to the workers "
            "(`StepChannel.send`), apart from the collectives.")


def caveats(env: dict) -> str:
    return (f"**All N share the same {env['cpu_count']} cores.** At N = 2 each worker has 1 thread; at N = 3 three "
            "single-threaded workers compete for 2 cores. The figures are the overhead of the collectives and of "
            "each worker's step, not a speed-up: tensor parallelism pays only where each worker has cores (or a "
            "device) of its own. N > 1 runs the model layer by layer in PyTorch modules (no C++ decoder stack); "
            "the N = 1 rows whose path is `modules` run that same path (`decoder_stack=False`). SmolLM2-135M has 3 "
            "KV heads, which N = 2 "
            "does not divide, so N = 2 is measured on a random-weight Llama of SmolLM2's size (hidden 576, MLP "
            "1536, 30 layers, vocabulary 49,152, tied embeddings) with 12 query heads of 48 and 6 KV heads, "
            "loaded with `load_format=\"dummy\"`.")


def headline(figures: list[dict]) -> str:
    """One row per engine: each case's median step ms with the collectives' share beside it."""
    engines = list(dict.fromkeys((f["model"], f["tp"], f["path"]) for f in figures))
    cases = list(dict.fromkeys(f["case"] for f in figures))
    cell = {(f["model"], f["tp"], f["path"], f["case"]): f for f in figures}
    rows = [[model, str(tp), path] + [f"{cell[model, tp, path, c]['step_ms']:.1f} ms "
                                      f"({cell[model, tp, path, c]['collective_share']:.0%})" for c in cases]
            for model, tp, path in engines]
    return markdown_table(["model", "N", "path"] + cases, rows)


def bare_line(bare: dict[int, float]) -> str:
    return ("The collective alone, for reference: one gloo all-reduce of a decode step's hidden state (1 x 576 "
            "float32) among processes doing nothing else takes (median of 400) "
            + ", ".join(f"{us:,.0f} µs at N = {size}" for size, us in bare.items())
            + "; what a step's collectives take beyond that is rank 0's wait for the other workers to reach them (and "
            "the scheduling of N processes on the shared cores).")


def markdown(figures: list[dict], bare: dict[int, float], plan: Plan, dtype: str, command: str, env: dict,
             quick: bool) -> str:
    lines = report_header("Tensor parallelism on CPU: step time at N = 1, 2, 3 workers over gloo", command, env)
    lines += ["> quick smoke run: not comparable" if quick else "", "", method(plan, dtype), "", caveats(env), "",
              HEADLINE, "", headline(figures), "", "Every figure:", "", markdown_table(HEADER, rows(figures)),
              "", bare_line(bare), "", DTYPE_NOTE, "", f"torch {env['torch']}, {env['openmp']}.", "",
              "![tp](tp.png)", ""]
    return "\n".join(lines)


def plot(raw: dict):
    figures = raw["figures"]
    cases = list(dict.fromkeys(f["case"] for f in figures))
    fig, axes = plt.subplots(1, len(cases), figsize=(5 * len(cases), 4.5), squeeze=False)
    for ax, case in zip(axes[0], cases):
        these = [f for f in figures if f["case"] == case]
        labels = [_label(f) for f in these]
        ax.bar(labels, [f["step_ms"] for f in these], color="tab:blue", label="step (median)")
        ax.bar(labels, [f["collective_ms"] for f in these], color="tab:orange", label="in collectives (rank 0)")
        ax.set_title(case)
        ax.set_ylabel("ms per step")
        ax.tick_params(axis="x", labelsize=7)
        ax.legend(fontsize=8)
    fig.suptitle(f"Step time by tensor-parallel size, {raw['environment']['cpu_count']} shared cores")
    return fig


def _label(figure: dict) -> str:
    """A bar's name: the model's first word, N, and whether N = 1 ran on the modules' path."""
    name = "SmolLM2" if figure["model"].startswith("SmolLM2") else "random"
    modules = figure["tp"] == 1 and figure["path"] == "modules"
    return f"{name}\nN={figure['tp']}" + ("\nmodules" if modules else "")


def main(argv: list[str] | None = None) -> None:
    args = benchmark_args(__doc__, "the random model at N = 1 and 2, a few steps: a smoke run", argv,
                          lambda p: p.add_argument("--dtype", default="float32", help="float32 or bfloat16"))
    plan = Plan.of(args.quick)
    env = environment()
    cases = run(plan, args.dtype, args.quick)
    bare = {size: 1e6 * bare_all_reduce(size) for size in ((2,) if args.quick else (2, 3))}
    figures = [phase(case) for case in cases]
    raw = {"environment": env, "dtype": args.dtype, "plan": asdict(plan), "figures": figures,
           "bare_all_reduce_us": bare, "cases": [asdict(case) for case in cases]}
    text = markdown(figures, bare, plan, args.dtype, args.command, env, args.quick)
    save_results(args.folders, "tp", raw, plot, text)


if __name__ == "__main__":
    main()
