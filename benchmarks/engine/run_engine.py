"""Benchmark lora-serve against vLLM's CPU build, the course's baseline loops and Hugging Face transformers on
SmolLM2-135M (CPU).

    PYTHONPATH=. python -m benchmarks engine --vllm-python /work/vllm-venv/bin/python   # full run
    PYTHONPATH=. python -m benchmarks engine --quick    # smoke test
    PYTHONPATH=. python -m benchmarks engine --vllm-python ... --vllm-only --workloads a,b,d,e --dtypes float32

vLLM runs when its virtual environment is given (--vllm-python or $VLLM_PYTHON; benchmarks/peers/install_vllm.sh
makes one), on the same requests with rounds interleaved (benchmarks/peers/peer_compare.py); without it the report
says it was not measured. Writes engine.md and engine.png (the comparison with vLLM where it ran, else the
throughput bars) to benchmarks/results/KIND/, and engine.json with the other plots (engine_throughput.png,
engine_batch_sweep.png) and vLLM's logs to benchmarks/runs/KIND/ (benchmarks/common.py: save_results).
With --vllm-only it runs the comparison with vLLM alone, on the workloads and dtypes named, and writes
engine_vs_vllm.md, .png and .json the same way.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from tqdm.auto import tqdm

from benchmarks.common import Result, benchmark_args, check_lengths, environment, report_header, save_results, timed
from benchmarks.engine import plots, report, systems
from benchmarks.peers import peer_compare, peer_report
from benchmarks.peers.vllm_env import NOT_INSTALLED, describe_openmp, vllm_env, vllm_python
from benchmarks.workloads import Plan, make_requests

WARMUP = make_requests(2, 4)


@dataclass
class Job:
    workload: str  # "a", "b", "c:<batch>", "d"
    system: str  # key of the runner / decoder
    requests: list
    batch: int
    label: str = ""  # shown name when it differs from the system
    note: str = ""
    decode: bool = False  # workload (d): single-stream decode ms per token


def jobs_for(plan: Plan) -> list[Job]:
    jobs = []
    for name, requests in (("a", plan.uniform()), ("b", plan.mixed())):
        for system in systems.ALL:
            reqs, note = requests, ""
            if system in systems.SLOW and plan.slow_subset < len(requests):
                reqs, note = requests[:plan.slow_subset], f"measured on {plan.slow_subset} of {len(requests)} requests"
            jobs.append(Job(name, system, reqs, len(requests), note=note))
    small = plan.static_small_batch
    jobs.append(Job("b", systems.HF_STATIC, plan.mixed(), small, label=f"{systems.HF_STATIC}, batch {small}"))
    for batch in plan.batch_sizes:
        for system in (systems.HF_STATIC, systems.LS_FP32, systems.LS_BF16):
            jobs.append(Job(f"c:{batch}", system, make_requests(batch, plan.sweep_tokens), batch))
    for system, label in ((systems.HF_STATIC, "HF generate"), (systems.LS_FP32, None), (systems.LS_BF16, None)):
        jobs.append(Job("d", system, make_requests(1, plan.stream_tokens), 1, label=label or system, decode=True))
    return jobs


def run_job(job: Job, runners, decoders, warmed: set) -> Result:
    result = Result(job.workload, job.label or job.system, note=job.note, extra={"batch": job.batch})
    prompt, new_tokens = job.requests[0]
    try:
        if job.decode:
            if ("d", job.system) not in warmed:
                decoders[job.system](prompt, 4)
                warmed.add(("d", job.system))
            ms = decoders[job.system](prompt, new_tokens)
            result.tokens, result.seconds, result.extra["ms_per_token"] = new_tokens, 0.0, ms
            return result
        if job.system not in warmed:
            runners[job.system](WARMUP, len(WARMUP))
            warmed.add(job.system)
        outputs, seconds = timed(runners[job.system], job.requests, job.batch)
        result.tokens, result.seconds = check_lengths(outputs, job.requests), seconds
        # Per-token latency as each request of the batch sees it: wall time / decode steps of the longest request.
        result.extra.update(requests=len(job.requests), ms_per_token=seconds / max(n for _, n in job.requests) * 1000)
    except Exception as error:  # record it in the tables instead of aborting the whole run
        result.error = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    return result


def _arguments(parser) -> None:
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--vllm-python", default=None,
                        help="python of vLLM's virtual environment (default $VLLM_PYTHON); without it, no vLLM")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds against vLLM (3; 1 if --quick)")
    parser.add_argument("--vllm-only", action="store_true", help="only the comparison with vLLM (no baselines)")
    parser.add_argument("--workloads", type=_names, default=peer_compare.WORKLOADS,
                        help=f"workloads to compare, comma-separated (default {','.join(peer_compare.WORKLOADS)})")
    parser.add_argument("--dtypes", type=_names, default=peer_compare.DTYPES,
                        help=f"the comparison's dtypes, comma-separated (default {','.join(peer_compare.DTYPES)})")
    parser.add_argument("--long-dtype", default=None,
                        help="(e)'s dtype (default bfloat16 where the CPU has bf16 matrix math, else float32)")
    parser.add_argument("--vllm-dtype", default=None,
                        help="run vLLM in this dtype on every workload (default: the workload's)")


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _selection(args) -> peer_compare.Selection:
    try:
        return peer_compare.Selection(args.workloads, args.dtypes, args.long_dtype, args.vllm_dtype)
    except ValueError as error:
        raise SystemExit(f"benchmarks engine: {error}") from None


def main(argv: list[str] | None = None) -> None:
    args = benchmark_args(__doc__, "tiny workloads: a smoke test of the whole pipeline", argv, _arguments)
    peer_python = vllm_python(args.vllm_python)
    selection = _selection(args)
    if args.vllm_only:
        if peer_python is None:
            raise SystemExit(f"benchmarks engine: --vllm-only needs vLLM. {NOT_INSTALLED}")
        return vllm_only(peer_python, args, selection)

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    plan = Plan.quick() if args.quick else Plan.full()
    runners, decoders = systems.build(args.threads, plan.max_batch)
    env = environment()
    results, warmed = [], set()
    bar = tqdm(jobs_for(plan), desc="benchmark", unit="item")
    for job in bar:
        bar.set_postfix_str(f"{job.workload} | {job.label or job.system}")
        results.append(run_job(job, runners, decoders, warmed))
    bar.close()

    del runners, decoders  # the baseline engines' memory goes back before the peer comparison's
    gc.collect()
    peer = PeerSection([], f"## lora-serve against vLLM's CPU build\n\n{NOT_INSTALLED}")
    if peer_python is not None:
        peer = vllm_section(peer_python, args, env, selection)
    else:
        print(NOT_INSTALLED)
    raw = {"mode": "quick" if args.quick else "full", "environment": env, "plan": plan.__dict__,
           "results": [r.to_dict() for r in results], "vs_vllm": [_row_dict(r) for r in peer.rows]}
    throughput, sweep = (lambda _: plots.throughput_bars(results)), (lambda _: plots.batch_sweep(results))
    if peer.measured:  # the comparison with vLLM is the engine's summary plot where it ran
        plot, more, plotted = peer.plot, {"throughput": throughput, "batch_sweep": sweep}, "against vLLM"
    else:
        plot, more, plotted = throughput, {"batch_sweep": sweep}, "throughput of (a) and (b)"
    others = [f"engine_{key}.png" for key in more]
    text = report.markdown(results, plan, env, args.quick, plotted, others, peer.text, args.command)
    save_results(args.folders, "engine", raw, plot, text, more)


@dataclass
class PeerSection:
    """The comparison with vLLM as the report shows it."""
    rows: list[peer_report.Row]
    text: str  # markdown

    @property
    def measured(self) -> bool:
        return any(row.ratio is not None for row in self.rows)

    def plot(self, _raw: dict):
        return peer_report.plot(self.rows)


def vllm_section(python: Path, args, env: dict, selection: peer_compare.Selection) -> PeerSection:
    """Run the comparison with vLLM (args.rounds, 3 or 1 with --quick)."""
    rounds = args.rounds or (1 if args.quick else 3)
    rows = peer_report.rows(compare_with_vllm(python, args, rounds, env, selection))
    return PeerSection(rows, peer_report.markdown(rows, rounds, env))


def vllm_only(python: Path, args, selection: peer_compare.Selection) -> None:
    """The comparison with vLLM alone: engine_vs_vllm.md and .png, and its .json (save_results)."""
    env = environment()
    peer = vllm_section(python, args, env, selection)
    mode = "quick" if args.quick else "full"
    raw = {"mode": mode, "environment": env, "vs_vllm": [_row_dict(r) for r in peer.rows]}
    header = report_header(f"Engine against vLLM's CPU build ({mode})", args.command, env)
    save_results(args.folders, "engine_vs_vllm", raw, peer.plot, "\n".join(header) + "\n" + peer.text + "\n")


def compare_with_vllm(python: Path, args, rounds: int, env: dict,
                      selection: peer_compare.Selection) -> list[peer_compare.PeerResult]:
    from transformers import AutoConfig, AutoTokenizer

    from engine.config import default_cache_dir
    from engine.model_files import resolve_model
    from engine.platform import cpu_has_native_bf16

    model_dir = resolve_model(systems.MODEL, default_cache_dir() / "models")
    native_bf16 = cpu_has_native_bf16()
    long_dtype = selection.long_dtype_for(native_bf16)
    env["vllm"] = f"vLLM CPU build from {python}; " + describe_openmp(vllm_env(python, 2))
    emulated = "" if selection.vllm_dtype else " and vLLM emulates bf16"
    bf16 = "" if native_bf16 else ("; this CPU has no bf16 matrix instructions, so lora-serve computes the bfloat16 "
                                   f"rows in float32 on bf16 weights, with a bf16 KV cache{emulated}")
    env["lora_serve"] = f"torch threads {args.threads}, {env['openmp']}; (e) in {long_dtype}{bf16}"
    if selection.vllm_dtype:
        env["vllm"] += f"; vLLM runs every workload in {selection.vllm_dtype}, whatever its dtype asked"
    sizes = peer_compare.Sizes.quick() if args.quick else peer_compare.Sizes()
    adapters = peer_compare.adapters_folder(AutoConfig.from_pretrained(model_dir))
    args.folders.raw.mkdir(parents=True, exist_ok=True)  # vLLM's logs
    engines = peer_compare.Engines(python, model_dir, args.threads, adapters, args.folders.raw, long_dtype,
                                   selection.vllm_dtype)
    try:
        return peer_compare.run(engines, AutoTokenizer.from_pretrained(model_dir), sizes, rounds, long_dtype,
                                selection)
    finally:
        engines.close()


def _row_dict(row: peer_report.Row) -> dict:
    return {"workload": row.workload, "dtype": row.dtype, "metric": row.metric.label, "lora_serve": row.lora_serve,
            "vllm": row.vllm, "ratio": row.ratio, "error": row.error}


if __name__ == "__main__":
    main()
