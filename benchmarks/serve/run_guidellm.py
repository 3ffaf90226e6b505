"""HTTP load from vLLM's own load tool, guidellm: `serve run serve_config.yaml` against vLLM's OpenAI server, the
same loads in the same run.

    PYTHONPATH=. python -m benchmarks guidellm --guidellm /work/guidellm-venv/bin/guidellm \\
        --vllm-python /work/vllm-venv/bin/python
    PYTHONPATH=. python -m benchmarks guidellm --quick                       # smoke test: lora-serve, one load
    PYTHONPATH=. python -m benchmarks guidellm --variant by-tokens=/tmp/by_tokens.yaml   # an A/B of serve configs

guidellm (`pip install guidellm==0.8.1` in a virtual environment of its own: it pins its own transformers) sends
streamed /v1/completions of synthetic prompts of a given token count, asking a given count of output tokens
(ignore_eos), at N concurrent streams (closed loop: `--profile kind=concurrent`) and at Poisson arrival rates, and
reports each request's time to first token and its mean gap between tokens (its "ITL"; the project's own client,
`python -m benchmarks serve_load`, keeps the gap between each pair of chunks). Every point runs one guidellm
process; the CPU seconds it and its workers take (reaped children's rusage) over the point's wall seconds are
reported, since it shares the machine's 2 cores with the server it measures.

Rounds are interleaved: each round starts every server in turn, alone on the machine (who goes first alternates),
runs every point on it and stops it. A warm-up request goes first. vLLM runs at its fastest dtype here unless told:
bf16 where the CPU has bf16 matrix math, else float32 (benchmarks/peers/vllm_env.py says how it is run).
Writes guidellm.md and guidellm.png to benchmarks/results/KIND/ and guidellm.json, with each point's guidellm
report, to benchmarks/runs/KIND/ (benchmarks/common.py: save_results).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import matplotlib
import requests

matplotlib.use("Agg")

from benchmarks.common import benchmark_args, environment, markdown_table, report_header, save_results, scaled
from benchmarks.serve.http_servers import ROOT, Server, start_lora_serve, start_vllm
from engine.config import default_cache_dir
from engine.model_files import resolve_model
from engine.platform import cpu_has_native_bf16

MODEL = "smollm2-135m-instruct"
LORA_SERVE, VLLM = "lora-serve", "vLLM"


@dataclass(frozen=True)
class Load:
    """One point: prompts of `prompt` tokens asking `output` tokens, at `streams` concurrent or `rate` a second."""
    prompt: int
    output: int
    streams: int | None = None
    rate: float | None = None

    @property
    def label(self) -> str:
        pace = f"{self.streams} streams" if self.streams is not None else f"Poisson {self.rate:g}/s"
        return f"{self.prompt}/{self.output}, {pace}"

    def profile(self) -> str:
        return f"kind=concurrent,streams={self.streams}" if self.streams is not None else \
            f"kind=poisson,rate={self.rate:g}"


@dataclass
class Point:
    """One load on one server: guidellm's figures and its own CPU."""
    server: str
    round: int
    load: Load
    tok_s: float | None = None
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    errors: int | None = None
    guidellm_cores: float | None = None
    failure: str | None = None


def loads(args) -> list[Load]:
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes]
    points = [Load(p, o, streams=n) for p, o in shapes for n in args.streams]
    return points + [Load(*shapes[0], rate=rate) for rate in args.rates]


def run_guidellm(args, server: Server, load: Load, round_: int, out: Path) -> Point:
    """One guidellm run of `load` against `server`, its JSON report kept at `out`."""
    count = max(8, args.requests // 8) if load.streams == 1 else args.requests
    command = [args.guidellm, "run", "--disable-console-interactive",
               "--backend", f"kind=openai_http,target={server.url},request_format=/v1/completions,model={server.model}",
               "--profile", load.profile(), "--constraint", f"kind=max_requests,count={count}",
               "--data", f"kind=synthetic_text,prompt_tokens={load.prompt},output_tokens={load.output}",
               "--tokenizer", f"kind=hf_auto,model={args.tokenizer}", "--output", f"kind=json,path={out}"]
    before, start = _children_cpu(), time.perf_counter()
    done = subprocess.run(command, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                          check=False, timeout=args.point_timeout)
    cores = (_children_cpu() - before) / (time.perf_counter() - start)
    if done.returncode != 0 or not out.exists():
        return Point(server.name, round_, load, guidellm_cores=cores,
                     failure=done.stderr[-2000:] or done.stdout[-2000:])
    return Point(server.name, round_, load, guidellm_cores=cores, **figures(json.loads(out.read_text())))


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def figures(report: dict) -> dict:
    """tok/s, TTFT and ITL percentiles and errors of a guidellm JSON report's benchmark."""
    benchmark = report["benchmarks"][0]
    metrics = benchmark["metrics"]
    ttft = metrics["time_to_first_token_ms"]["successful"]["percentiles"]
    itl = metrics["inter_token_latency_ms"]["successful"]["percentiles"]
    tokens = metrics["output_token_count"]["successful"]["total_sum"]
    return {"tok_s": tokens / benchmark["duration"], "ttft_p50_ms": ttft["p50"], "ttft_p99_ms": ttft["p99"],
            "itl_p50_ms": itl["p50"], "itl_p99_ms": itl["p99"], "errors": metrics["request_totals"]["errored"]}


def start(name: str, args, tmp: Path) -> Server:
    if name == VLLM:
        model_dir = resolve_model(MODEL, default_cache_dir() / "models")
        return start_vllm(Path(args.vllm_python), model_dir, MODEL, tmp, dtype=args.vllm_dtype)
    config = args.config if name == LORA_SERVE else dict(args.variants)[name]
    return start_lora_serve(name, config, tmp)


WARM_UP_PROMPT = "Warm up on a prompt of a few hundred tokens, as the load's are. " * 20


def warm_up(server: Server) -> None:
    """A few prompts of the load's length before the first point, on either server alike: the first prefills
    of a fresh process fault in its memory, and lora-serve's step-cost model learns from its first steps."""
    body = {"model": server.model, "prompt": WARM_UP_PROMPT, "max_tokens": 8}
    for _ in range(6):
        requests.post(f"{server.url}/v1/completions", json=body, timeout=120).raise_for_status()


def run_server(name: str, args, round_: int, folder: Path) -> list[Point]:
    """Every load on one freshly started server, stopped after."""
    with tempfile.TemporaryDirectory() as tmp:
        server = start(name, args, Path(tmp))
        try:
            server.wait_healthy(args.start_timeout, "/v1/models")
            warm_up(server)
            points = []
            for i, load in enumerate(loads(args)):
                print(f"round {round_ + 1}, {name}: {load.label}", flush=True)
                points.append(run_guidellm(args, server, load, round_, folder / f"{name}-r{round_}-{i}.json"))
            return points
        finally:
            server.stop()


def run(args) -> dict:
    servers = [LORA_SERVE, *(name for name, _ in args.variants)] + ([VLLM] if args.vllm_python else [])
    folder = args.folders.raw / "guidellm-reports"
    folder.mkdir(parents=True, exist_ok=True)
    points = []
    for round_ in range(args.rounds):
        order = servers if round_ % 2 == 0 else servers[::-1]
        for name in order:
            points += run_server(name, args, round_, folder)
    return {"servers": servers, "points": [asdict(point) for point in points], "vllm_dtype": args.vllm_dtype,
            "requests": args.requests}


def _median(points: list[dict], key: str) -> float | None:
    values = [p[key] for p in points if p.get(key) is not None]
    return statistics.median(values) if values else None


def by_point(raw: dict) -> dict[tuple[str, str], dict]:
    """(server, load label) -> the median over rounds of each figure, in the order of the loads, then servers."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for point in sorted(raw["points"], key=lambda p: (_order(Load(**p["load"])), p["server"])):
        groups.setdefault((point["server"], Load(**point["load"]).label), []).append(point)
    keys = ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "guidellm_cores")
    return {group: {key: _median(points, key) for key in keys} | _counts(points) for group, points in groups.items()}


def _counts(points: list[dict]) -> dict:
    """Errored requests and failed runs, summed over rounds (a median would hide one round's errors)."""
    errors = [p["errors"] for p in points if p.get("errors") is not None]
    return {"errors": sum(errors) if errors else None, "failures": sum(bool(p["failure"]) for p in points)}


def _order(load: Load) -> tuple:
    """Shapes in turn, each's stream counts rising, then the rates."""
    return load.streams is None, load.prompt, load.output, load.streams or 0, load.rate or 0.0


def table(raw: dict) -> str:
    medians = by_point(raw)
    rows = []
    for (server, label), m in medians.items():
        peer = medians.get((VLLM, label), {})
        rows.append([label, server, scaled(m["tok_s"], 1), _vs(m["tok_s"], peer.get("tok_s")),
                     scaled(m["ttft_p50_ms"], 0), scaled(m["ttft_p99_ms"], 0), scaled(m["itl_p50_ms"], 1),
                     scaled(m["itl_p99_ms"], 1), m["errors"] if m["errors"] is not None else "-",
                     m["failures"], scaled(m["guidellm_cores"], 2)])
    return markdown_table(["load (prompt/output tokens)", "server", "tok/s", "vs vLLM", "TTFT p50 ms", "TTFT p99 ms",
                           "ITL p50 ms", "ITL p99 ms", "errors", "failed runs", "guidellm cores"], rows)


def _vs(value: float | None, peer: float | None) -> str:
    return f"{value / peer:.2f}x" if value is not None and peer else "-"


def plot(raw: dict):
    import matplotlib.pyplot as plt

    medians = by_point(raw)
    shapes = sorted({(p["load"]["prompt"], p["load"]["output"]) for p in raw["points"]})
    fig, axes = plt.subplots(len(shapes), 3, figsize=(15, 4 * len(shapes)), squeeze=False)
    for row, (prompt, output) in enumerate(shapes):
        for server in raw["servers"]:
            streams = sorted({p["load"]["streams"] for p in raw["points"] if p["load"]["streams"] is not None
                              and (p["load"]["prompt"], p["load"]["output"]) == (prompt, output)})
            figures_ = [medians.get((server, Load(prompt, output, streams=n).label), {}) for n in streams]
            for ax, key in zip(axes[row], ("tok_s", "ttft_p50_ms", "itl_p99_ms")):
                ax.plot(streams, [f.get(key) or float("nan") for f in figures_], marker="o", label=server)
        for ax, label in zip(axes[row], ("output tokens / s", "TTFT p50 (ms)", "ITL p99 (ms)")):
            ax.set(xlabel="concurrent streams", ylabel=label, title=f"{prompt}-token prompts, {output} out")
            ax.set_xscale("log", base=2)
            ax.set_xticks(streams, [str(n) for n in streams])
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"guidellm against lora-serve and vLLM (vLLM in {raw['vllm_dtype']}), medians over rounds",
                 fontsize=10)
    return fig


def add_arguments(parser) -> None:
    parser.add_argument("--guidellm", default=os.environ.get("GUIDELLM", "/work/guidellm-venv/bin/guidellm"),
                        help="the guidellm command (default $GUIDELLM, else /work/guidellm-venv/bin/guidellm)")
    parser.add_argument("--config", type=Path, default=ROOT / "serve_config.yaml", help="lora-serve's serve config")
    parser.add_argument("--variant", dest="variant_specs", action="append", default=[],
                        help="another lora-serve from another serve config, for an A/B: NAME=CONFIG.yaml")
    parser.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"),
                        help="python of vLLM's virtual environment (default $VLLM_PYTHON); without it, no vLLM")
    parser.add_argument("--vllm-dtype", choices=("bfloat16", "float32"), default=None,
                        help="vLLM's dtype (default: its fastest here, bf16 with bf16 matrix math, else float32)")
    parser.add_argument("--tokenizer", type=Path, default=default_cache_dir() / "models" / MODEL,
                        help="the model folder whose tokenizer guidellm counts tokens with")
    parser.add_argument("--shapes", nargs="+", default=["128x64", "512x128"], help="PROMPTxOUTPUT tokens")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--rates", type=float, nargs="*", default=[1.0, 2.0, 4.0],
                        help="Poisson arrival rates (requests/s) of the first shape")
    parser.add_argument("--requests", type=int, default=64, help="requests a point (an eighth at 1 stream, >= 8)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--start-timeout", type=float, default=300)
    parser.add_argument("--point-timeout", type=float, default=600)


def main(argv: list[str] | None = None) -> None:
    args = benchmark_args(__doc__, "lora-serve alone, 128/64 at 8 streams, 16 requests: a smoke test", argv,
                          add_arguments)
    args.variants = [(name, Path(path)) for name, path in (spec.split("=", 1) for spec in args.variant_specs)]
    args.vllm_dtype = args.vllm_dtype or ("bfloat16" if cpu_has_native_bf16() else "float32")
    if args.quick:
        args.shapes, args.streams, args.rates, args.requests, args.vllm_python = ["128x64"], [8], [], 16, None
    raw = {"mode": "quick" if args.quick else "full", "environment": environment(), "rounds": args.rounds,
           "command": args.command, **run(args)}
    save_results(args.folders, "guidellm", raw, plot, summary(raw))


def summary(raw: dict) -> str:
    """guidellm.md: the method, then the table."""
    requests = raw["requests"]
    note = (f"Method: guidellm 0.8.1, streamed /v1/completions of synthetic prompts (ignore_eos), {requests} "
            f"requests a point ({max(8, requests // 8)} at 1 stream); {raw['rounds']} interleaved round(s), each "
            f"server started alone; medians over rounds, errors and failed runs summed. ITL is guidellm's: a "
            f"request's mean gap between tokens. guidellm cores: the CPU guidellm took over the point's wall time, "
            f"its start-up (tokenizer, synthetic prompts) included, on the same 2 cores. vLLM: its "
            f"OpenAI server (CPU build, both cores bound, Intel OpenMP) in {raw['vllm_dtype']}.")
    header = report_header(f"guidellm load: lora-serve against vLLM ({raw['mode']})", raw["command"],
                           raw["environment"])
    return "\n".join(header + [note, "", table(raw), "", "![guidellm](guidellm.png)", ""])


if __name__ == "__main__":
    main()
