"""HTTP load benchmark: `serve run serve_config.yaml` against vLLM's OpenAI server, same load, same run.

    PYTHONPATH=. python -m benchmarks serve_load                 # full run
    PYTHONPATH=. python -m benchmarks serve_load --quick         # smoke test
    PYTHONPATH=. python -m benchmarks serve_load --vllm-python /work/vllm-venv/bin/python
    PYTHONPATH=. python -m benchmarks serve_load --variant one-thread=/tmp/one_thread.yaml   # an A/B

lora-serve runs twice a round when the config enables direct ingress: through its HTTP port (HAProxy, or Serve's
proxy), and on its replica's own port (`lora-serve direct`, deployments/routing/direct_ingress.py). SmolLM2 in bf16, or in
float32 with --dtype float32 for every server and the offline engine (on a CPU without bf16 matrix instructions
vLLM emulates bf16, far slower than its float32, and lora-serve computes bf16 in float32 on bf16 weights);
--vllm-dtype float32 runs vLLM alone in float32, its fastest there, against lora-serve's bf16. Streamed /v1/completions
of N new tokens each (ignore_eos, greedy, include_usage so a server that sends several tokens per chunk is counted
right), closed loop at 1, 8 and 32 concurrent streams, from one aiohttp client. Rounds are interleaved: each round
starts every server in turn, alone on the machine (who goes first alternates), runs every concurrency on it and
stops it, so drift on this shared machine hits all of them alike and no idle server takes CPU from the one measured
(an idle server's processes still take some, and on 2 cores the engine loses more throughput than the share of
the CPU taken from it). TTFT = request sent -> first chunk with text; TPOT = (last - first chunk) /
(tokens - 1); ITL = the gaps between a stream's chunks with text, p99 over every gap of the run (what a reader of
the stream waits between bursts of text). Each server's own engine runs offline on the same requests (benchmarks/serve/offline_engines.py):
lora-serve's LLM.generate (both cores, with the engine args of the config's application: the same LoRA slots and KV
cache as the server) all at once at the start of every round; and each server's engine, lora-serve's or vLLM's
LLM, at most 32 at a time (max_num_seqs = the top concurrency, so a finished request lets the next one in, as a
closed loop of 32 clients does) right before the server starts and right after it stops. Once more, 32 at a time,
while the server is up and warm but serves nothing, right before its 32 streams: what the server's processes
(Ray's, Serve's, the replica's; vLLM's API server and engine core) cost the engine by running beside it. And twice
with every process of the warm server stopped (SIGSTOP; Server.stopped), right before and right after its
32 streams: the engine alone on the machine, seconds from the HTTP run instead of a server start or stop away.
HTTP share = HTTP tok/s at 32 concurrent / offline tok/s: against all at once (that round's) it counts the larger
batch that HTTP at 32 streams cannot form; against 32 at a time (the mean of the two runs around that server, or
of the two with it stopped), what serving over HTTP loses, the stack's processes included; against 32 at a time
beside the idle server, what the requests' path itself loses. The runs bracket the server because this machine's
speed drifts: with one offline run per round, minutes away from some servers, the drift between the offline run
and a server's HTTP run swamps the difference between servers that served alike. Every run records the share of
the machine's CPU time that the hypervisor gave to other guests meanwhile (steal, /proc/stat). While each server
runs 32 streams, and while it idles beside the offline engine, every process of its tree is sampled for the CPU
breakdown (benchmarks/serve/http_servers.py).
vLLM runs when its virtual environment is given (--vllm-python, or $VLLM_PYTHON); its recipe is in docs/benchmarks.md ("The vLLM peer").
Writes serve_load.md and serve_load.png to benchmarks/results/KIND/ and serve_load.json to benchmarks/runs/KIND/
(benchmarks/common.py: save_results), with vLLM's offline log and, in serve_load-logs/, the logs of a server whose
requests failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import transformers  # noqa: E402
import yaml  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from benchmarks.common import (benchmark_args, environment, markdown_table, report_header,  # noqa: E402
                               save_results, value_range)
from benchmarks.serve.http_servers import (ROOT, Server, cores_by_role, enables_direct_ingress, sample,  # noqa: E402
                                           start_lora_serve, start_vllm, steal_seconds, with_dtype)
from benchmarks.serve.offline_engines import LORA_SERVE, VLLM, LoraServeOffline, VllmOffline  # noqa: E402
from benchmarks.workloads import PROMPTS, long_prompt  # noqa: E402
from engine import LLM  # noqa: E402
from engine.config import default_cache_dir  # noqa: E402
from engine.model_files import resolve_model  # noqa: E402
from lora_cache.local_cache import local_adapters  # noqa: E402

MODEL = "smollm2-135m-instruct"
IDLE_SERVER = ", beside the idle server"
STOPPED_SERVER = ", server stopped"


@dataclass
class Timing:
    start: float
    first: float | None = None
    end: float | None = None
    texts: list[float] = field(default_factory=list)  # when each chunk with text arrived: ITL is their gaps
    tokens: int = 0
    status: int = 0
    error: str | None = None  # the body of a refusal, or an error event in the stream (the first 300 characters)


@dataclass
class Scenario:
    """One server at one concurrency in one round."""
    system: str
    concurrency: int
    round: int
    requests: int
    ok: int
    seconds: float
    tok_s: float
    ttft_ms_p50: float | None
    tpot_ms_p50: float | None
    ttft_ms_p90: float | None = None
    tpot_ms_p90: float | None = None
    itl_ms_p50: float | None = None  # the gaps between a stream's chunks with text, over every stream of the run
    itl_ms_p99: float | None = None
    cores: dict | None = None
    beside: str | None = None  # an offline run: the server whose start (or stop) it came right before (after)
    steal: float | None = None  # share of the machine's CPU time the hypervisor gave to other guests meanwhile


async def stream_one(session: aiohttp.ClientSession, server: Server, prompt: str, max_tokens: int,
                     model: str | None = None, headers: dict | None = None) -> Timing:
    """One streamed completion of the server's model (or of `model`, an adapter), timed."""
    timing = Timing(time.perf_counter())
    body = {"model": model or server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    async with session.post(f"{server.url}/v1/completions", json=body, headers=headers) as response:
        timing.status = response.status
        if response.status != 200:
            timing.error = (await response.text())[:300]
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[len(b"data: "):])
            if "error" in chunk:
                timing.error = json.dumps(chunk["error"])[:300]
            elif chunk.get("usage"):
                timing.tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                timing.texts.append(time.perf_counter())
                timing.first = timing.first or timing.texts[0]
    timing.end = time.perf_counter()
    return timing


async def closed_loop(server: Server, prompts: list[str], max_tokens: int, concurrency: int):
    queue = list(reversed(prompts))
    timings: list[Timing] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        async def worker():
            while queue:
                timings.append(await stream_one(session, server, queue.pop(), max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return timings, time.perf_counter() - start


def summarise(system: str, concurrency: int, rnd: int, timings: list[Timing], seconds: float) -> Scenario:
    ok = [t for t in timings if t.status == 200 and t.first is not None and t.tokens]
    ttft = sorted((t.first - t.start) * 1000 for t in ok)
    tpot = sorted((t.end - t.first) / (t.tokens - 1) * 1000 for t in ok if t.tokens > 1)
    itl = sorted((b - a) * 1000 for t in ok for a, b in zip(t.texts, t.texts[1:]))
    median = lambda v: statistics.median(v) if v else None  # noqa: E731
    return Scenario(system, concurrency, rnd, len(timings), len(ok), seconds, sum(t.tokens for t in ok) / seconds,
                    median(ttft), median(tpot), quantile(ttft, 0.9), quantile(tpot, 0.9), median(itl),
                    quantile(itl, 0.99))


def quantile(ordered: list[float], q: float) -> float | None:
    """The q-quantile of sorted values (the nearest rank at or below it), None for none."""
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


def run_scenario(server: Server, prompts: list[str], max_tokens: int, concurrency: int, rnd: int,
                 profile: bool) -> Scenario:
    """One closed loop; with profile, the CPU of this server's processes and of the client."""
    import psutil

    client = psutil.Process()
    watched = server.tree() + [client]
    before, stolen = sample(watched), steal_seconds()
    timings, seconds = asyncio.run(closed_loop(server, prompts, max_tokens, concurrency))
    result = summarise(server.name, concurrency, rnd, timings, seconds)
    result.steal = _steal_share(stolen, seconds)
    if profile:
        after = sample(watched)
        after.roles[client.pid] = "benchmark client"
        result.cores = cores_by_role(before, after)
    return result


def _steal_share(steal_before: float, seconds: float) -> float:
    return (steal_seconds() - steal_before) / seconds / os.cpu_count()


def offline_name(concurrency: int, requests: int, server_state: str = "", engine: str = LORA_SERVE) -> str:
    """server_state: "" (no server up), IDLE_SERVER or STOPPED_SERVER; engine: LORA_SERVE or VLLM."""
    name = f"{engine} offline, " + ("all at once" if concurrency >= requests else f"{concurrency} at a time")
    return name + server_state


def engine_of(system: str) -> str:
    """The engine a server runs: every lora-serve server (its ports, its variants) lora-serve's, vLLM's vLLM's."""
    return LORA_SERVE if system.startswith(LORA_SERVE) else VLLM


def offline(engine: LoraServeOffline | VllmOffline, concurrency: int, prompts: list[str], max_tokens: int, rnd: int,
            beside: str | None = None, server: Server | None = None, server_state: str = "") -> Scenario:
    """The offline engine on the same requests, at most `concurrency` (its max_num_seqs) running at once; beside:
    the server it runs next to. With that server up, server_state IDLE_SERVER: while it serves nothing, recording
    its processes' cores; STOPPED_SERVER: with every process of it stopped, right before and right after its top
    concurrency, seconds from it, so that the share does not take the machine's drift for the serving path's."""
    idle_server = server if server_state == IDLE_SERVER else None
    before = sample(idle_server.tree()) if idle_server is not None else None
    with server.stopped() if server_state == STOPPED_SERVER else contextlib.nullcontext():
        stolen = steal_seconds()
        done = engine.run(prompts, max_tokens)
        steal = _steal_share(stolen, done.seconds)
    cores = cores_by_role(before, sample(idle_server.tree())) if idle_server is not None else None
    return Scenario(offline_name(concurrency, len(prompts), server_state, engine.name), concurrency, rnd,
                    len(prompts), done.requests, done.seconds, done.tok_s, done.ttft_ms_p50, None, cores=cores,
                    beside=beside, steal=steal)


@dataclass(frozen=True)
class ServerSpec:
    """How to start one server; each round starts it afresh, alone on the machine."""
    name: str
    config: Path | None = None  # lora-serve's serve config; None: vLLM
    direct: bool = False  # requests go to the replica's own port, not through Serve's proxy

    def start(self, args, tmp: Path) -> Server:
        if self.config is not None:
            return start_lora_serve(self.name, self.config, tmp, self.direct, dtype=args.dtype)
        return start_vllm(Path(args.vllm_python), resolve_model(MODEL, default_cache_dir() / "models"), MODEL, tmp,
                          dtype=args.vllm_dtype or args.dtype)


def server_specs(args) -> list[ServerSpec]:
    """lora-serve from args.config through Serve's proxy and, when the config enables direct ingress, through its
    replica's own port; each --variant NAME=CONFIG; and vLLM when its python is given."""
    specs = [ServerSpec(LORA_SERVE, args.config)]
    if enables_direct_ingress(args.config):
        specs.append(ServerSpec(f"{LORA_SERVE} direct", args.config, direct=True))
    for variant in args.variant:
        name, _, config = variant.partition("=")
        specs.append(ServerSpec(f"{LORA_SERVE} {name}", Path(config)))
    return specs + ([ServerSpec("vLLM")] if args.vllm_python else [])


def run_server(spec: ServerSpec, args, tmp: Path, rnd: int, loads: dict[int, list[str]], tokens: int,
               bar, offline_engine: LoraServeOffline | VllmOffline | None = None) -> list[Scenario]:
    """Start one server, warm it, run every concurrency on it, stop it; with offline_engine (the server's engine,
    offline), that runs the top concurrency's requests while the server idles, then with the server stopped right
    before and right after the server runs them."""
    tmp.mkdir(parents=True, exist_ok=True)
    server = spec.start(args, tmp)
    try:
        server.wait_healthy(600)
        warm = loads[max(loads)][:8]
        asyncio.run(closed_loop(server, warm, 8, 8))  # warm-up
        scenarios = []
        for c, prompts in loads.items():
            brackets = offline_engine is not None and c == max(loads)
            if brackets:
                scenarios.append(offline(offline_engine, c, prompts, tokens, rnd, server.name, server, IDLE_SERVER))
                scenarios.append(offline(offline_engine, c, prompts, tokens, rnd, server.name, server,
                                         STOPPED_SERVER))
            scenarios.append(run_scenario(server, prompts, tokens, c, rnd, profile=c == max(loads)))
            if brackets:
                scenarios.append(offline(offline_engine, c, prompts, tokens, rnd, server.name, server,
                                         STOPPED_SERVER))
            bar.update()
            tqdm.write(f"round {rnd} {server.name} c={c}: {scenarios[-1].tok_s:.1f} tok/s")
        if any(s.ok < s.requests for s in scenarios):  # keep the replicas' tracebacks
            server.keep_logs(args.folders.raw / "serve_load-logs" / f"{server.name.replace(' ', '-')}-round{rnd}")
        return scenarios
    finally:
        server.stop()


def make_prompts(n: int, prompt_tokens: int | None) -> list[str]:
    """The workload's short prompts cycled, or prompts of `prompt_tokens` SmolLM2 tokens, each opened by its number
    so that no two share a cached prefix."""
    if prompt_tokens is None:
        return [PROMPTS[i % len(PROMPTS)] for i in range(n)]
    tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model(MODEL, default_cache_dir() / "models"))
    return [tokenizer.decode(long_prompt(tokenizer, f"Request {i}.", prompt_tokens, i)) for i in range(n)]


def run(args) -> dict:
    n, tokens = (16, 16) if args.quick else (args.requests, args.tokens)
    concurrency = (1, 8) if args.quick else tuple(args.concurrency)
    prompts = make_prompts(n, None if args.quick else args.prompt_tokens)
    single = prompts[: max(4, n // 8)]  # one stream at a time: fewer requests, the same per-token figures
    loads = {c: single if c == 1 else prompts for c in concurrency}
    specs, top = server_specs(args), max(concurrency)
    engines = offline_engines(args, top)
    results: list[Scenario] = []
    try:  # vLLM's worker process ends whatever happens
        all_at_once = LoraServeOffline(_lora_serve_llm(args, n)) if n != top else None
        for engine in [*engines.values(), all_at_once]:
            if engine is not None:
                engine.run(prompts[:8], 4)  # warm-up
        with tempfile.TemporaryDirectory(prefix="sl-", dir="/tmp") as folder, \
                tqdm(total=args.rounds * len(specs) * len(concurrency), desc="HTTP load", unit="scenario") as bar:
            for rnd in range(args.rounds):
                if all_at_once is not None:
                    results.append(offline(all_at_once, n, prompts, tokens, rnd))
                order = specs[rnd % len(specs):] + specs[:rnd % len(specs)]  # who goes first alternates
                for spec in order:
                    results += _server_round(spec, engines.get(engine_of(spec.name)), args,
                                             Path(folder) / f"round-{rnd}", rnd, loads, tokens, bar)
    finally:
        for engine in engines.values():
            engine.close()
    names = [offline_name(n, n)] if all_at_once is not None else []
    for engine in engines:
        names += [offline_name(top, n, state, engine) for state in ("", STOPPED_SERVER, IDLE_SERVER)]
    return {"requests": n, "new_tokens": tokens, "dtype": args.dtype, "vllm_dtype": args.vllm_dtype or args.dtype,
            "offline": names, "concurrency": list(concurrency), "systems": [s.name for s in specs],
            "scenarios": [asdict(r) for r in results]}


def offline_engines(args, top: int) -> dict[str, LoraServeOffline | VllmOffline]:
    """Each server kind's engine offline, at most `top` requests at a time: lora-serve's, and vLLM's when its
    python is given."""
    engines: dict[str, LoraServeOffline | VllmOffline] = {LORA_SERVE: LoraServeOffline(_lora_serve_llm(args, top))}
    if args.vllm_python:
        args.folders.raw.mkdir(parents=True, exist_ok=True)
        engines[VLLM] = VllmOffline(Path(args.vllm_python), resolve_model(MODEL, default_cache_dir() / "models"),
                                    args.vllm_dtype or args.dtype, top, args.folders.raw / "vllm-offline.log")
    return engines


def _lora_serve_llm(args, max_num_seqs: int) -> LLM:
    """The config's engine offline, its adapters read in this process as the server's cache actor reads them."""
    engine = {**served_engine(args.config, args.dtype), "max_num_seqs": max_num_seqs, "log_stats": False}
    return LLM(adapters=local_adapters if engine.get("max_loras") else None, **engine)


def _server_round(spec: ServerSpec, engine: LoraServeOffline | VllmOffline | None, args, tmp: Path, rnd: int,
                  loads: dict[int, list[str]], tokens: int, bar) -> list[Scenario]:
    """One server's turn in a round. Its own engine runs offline right before the server starts and right after
    it stops (and beside it: run_server): the machine's speed drifts within minutes (see share_table)."""
    top = max(loads)
    bracket = [offline(engine, top, loads[top], tokens, rnd, spec.name)] if engine is not None else []
    served = run_server(spec, args, tmp, rnd, loads, tokens, bar, engine)
    after = [offline(engine, top, loads[top], tokens, rnd, spec.name)] if engine is not None else []
    return bracket + served + after


def served_engine(config: Path, dtype: str | None) -> dict:
    """The engine args of the config's application (its model, LoRA slots, KV cache), in `dtype` when given: the
    offline engine is the one the server runs."""
    [application] = with_dtype(yaml.safe_load(config.read_text()), dtype)["applications"]
    return dict(application["args"]["engine"])


def _of(raw: dict, system: str, concurrency: int | None = None) -> list[dict]:
    return [s for s in raw["scenarios"] if s["system"] == system
            and (concurrency is None or s["concurrency"] == concurrency)]


def table(raw: dict) -> str:
    """Per concurrency and server: tok/s, TTFT and TPOT p50, ITL p99 (ranges over rounds) and the ratio to vLLM."""
    peer = "vLLM" if "vLLM" in raw["systems"] else None
    header = ["concurrent", "server", "tok/s", "vs vLLM", "TTFT p50 ms", "TPOT p50 ms", "ITL p99 ms", "ok / requests"]
    rows = []
    for c in raw["concurrency"]:
        for system in raw["systems"]:
            runs = _of(raw, system, c)
            ratio = "-"
            if peer and system != peer:
                ratio = value_range([a["tok_s"] / b["tok_s"] for a, b in zip(runs, _of(raw, peer, c))], 2) + "x"
            rows.append([c, system, value_range([r["tok_s"] for r in runs]), ratio,
                         value_range([r["ttft_ms_p50"] for r in runs], 0),
                         value_range([r["tpot_ms_p50"] for r in runs]),
                         value_range([r.get("itl_ms_p99") for r in runs], 0),
                         f"{sum(r['ok'] for r in runs)} / {sum(r['requests'] for r in runs)}"])
    return markdown_table(header, rows)


def share_table(raw: dict) -> str:
    """HTTP at the highest concurrency as a share of each offline run in the same round: all at once (run at the
    round's start), and as many at a time: the mean of the runs right before the server started and right after
    it stopped, and of those with the warm server stopped right before and right after its HTTP run (the
    closest in time, so that the share does not take the machine's drift for the serving path's), and the run
    beside the idle server."""
    top = max(raw["concurrency"])
    rows = []
    for system in raw["systems"]:
        http = _of(raw, system, top)
        for name in _own_offline(raw, system):
            offline_tok_s = [_offline_tok_s(raw, name, system, h["round"]) for h in http]
            shares = [h["tok_s"] / o for h, o in zip(http, offline_tok_s)]
            rows.append([system, name, value_range(offline_tok_s), value_range([h["tok_s"] for h in http]),
                         _percents(shares), _percents([h.get("steal") for h in http], 1)])
    return markdown_table(["server", "offline run (same requests)", "offline tok/s", f"HTTP tok/s at {top}",
                           "HTTP share, round by round", "hypervisor steal during HTTP"], rows)


def _own_offline(raw: dict, system: str) -> list[str]:
    """The offline runs of the server's own engine (none for vLLM in results from before it ran offline)."""
    return [name for name in raw["offline"] if name.startswith(f"{engine_of(system)} offline")]


def _percents(shares: list[float | None], digits: int = 0) -> str:
    return ", ".join("-" if s is None else f"{s * 100:.{digits}f}%" for s in shares)


def _offline_tok_s(raw: dict, name: str, system: str, rnd: int) -> float:
    """The offline run `name` of round `rnd` beside `system` (the mean of those bracketing it), else the round's."""
    runs = [s for s in _of(raw, name) if s["round"] == rnd]
    beside = [s for s in runs if s.get("beside") == system] or runs
    return statistics.mean(s["tok_s"] for s in beside)


def cpu_table(raw: dict) -> str:
    """Cores per process role while each server ran the highest concurrency, and its busy cores while it served
    nothing beside the offline engine (first round)."""
    top = max(raw["concurrency"])
    rows = []
    for system in raw["systems"]:
        cores = _of(raw, system, top)[0]["cores"] or {}
        parts = ", ".join(f"{k} {v:.2f}" for k, v in cores.items() if v >= 0.005)
        rows.append([system, f"{_busy(cores):.2f}", parts, _idle_cores(raw, system)])
    return markdown_table(["server", f"busy cores at {top} concurrent (of 2)", "by process",
                           "busy cores while idle, beside the offline engine"], rows)


def _idle_cores(raw: dict, system: str) -> str:
    """The server's processes' cores (its own, not the offline engine's: that runs "outside" its tree) while it
    idled beside the offline engine in the first round; "-" where it did not."""
    name = offline_name(max(raw["concurrency"]), raw["requests"], IDLE_SERVER, engine_of(system))
    runs = [s for s in _of(raw, name) if s.get("beside") == system and s["round"] == 0 and s["cores"]]
    if not runs:
        return "-"
    return f"{_busy(runs[0]['cores']):.3f}"


def _busy(cores: dict[str, float]) -> float:
    """The cores of a server's own processes: every role but "outside" its tree."""
    return sum(v for k, v in cores.items() if k != "outside")


def plot(raw: dict):
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    for system in raw["systems"]:
        for ax, key in zip(axes, ("tok_s", "ttft_ms_p50", "tpot_ms_p50", "itl_ms_p99")):
            values = [statistics.median([r.get(key) or 0 for r in _of(raw, system, c)]) for c in raw["concurrency"]]
            ax.plot([str(c) for c in raw["concurrency"]], values, marker="o", label=system)
    styles = itertools.cycle(("--", ":", "-.", (0, (5, 1))))
    for name, style in zip(raw["offline"], styles):
        offline_tok_s = statistics.median(r["tok_s"] for r in _of(raw, name))
        color = "gray" if name.startswith(LORA_SERVE) else "tan"
        axes[0].axhline(offline_tok_s, color=color, linestyle=style, label=name)
    for ax, label in zip(axes, ("generated tokens / s", "TTFT p50 (ms)", "TPOT p50 (ms)", "ITL p99 (ms)")):
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"HTTP /v1/completions streaming: SmolLM2, {_dtypes(raw)}, {raw['requests']} requests x "
                 f"{raw['new_tokens']} tokens, median of {raw['rounds']} interleaved rounds", fontsize=10)
    return fig


def _dtypes(raw: dict) -> str:
    vllm = raw.get("vllm_dtype", raw["dtype"])
    return f"both in {raw['dtype']}" if vllm == raw["dtype"] else f"lora-serve in {raw['dtype']}, vLLM in {vllm}"


def add_arguments(parser) -> None:
    parser.add_argument("--config", type=Path, default=ROOT / "serve_config.yaml", help="lora-serve's serve config")
    parser.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"),
                        help="python of vLLM's virtual environment (default $VLLM_PYTHON); without it, no vLLM")
    parser.add_argument("--variant", action="append", default=[],
                        help="another lora-serve from another serve config, for an A/B: NAME=CONFIG.yaml")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="prompts of this many tokens (default: the short prompts of benchmarks/workloads.py)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="every server's and the offline engine's dtype, in place of the configs' (default "
                             "bfloat16; float32 on a CPU without bf16 matrix instructions, where vLLM emulates bf16)")
    parser.add_argument("--vllm-dtype", choices=("bfloat16", "float32"), default=None,
                        help="vLLM's dtype alone (default: --dtype's): float32 is vLLM's fastest on such a CPU")


def main(argv: list[str] | None = None) -> None:
    args = benchmark_args(__doc__, "small workloads: a smoke test", argv, add_arguments)
    transformers.logging.set_verbosity_error()
    env = environment()
    raw = {"mode": "quick" if args.quick else "full", "environment": env, "rounds": args.rounds, **run(args)}
    prompts = f"prompts of {args.prompt_tokens} tokens" if args.prompt_tokens and not args.quick else "short prompts"
    note = (f"Method: {raw['requests']} streamed /v1/completions ({prompts}) x {raw['new_tokens']} new tokens (ignore_eos, "
            f"greedy) per scenario ({max(4, raw['requests'] // 8)} at 1 concurrent), closed loop, one aiohttp "
            f"client on the same 2 cores; {raw['rounds']} interleaved rounds, each server started alone in each "
            f"round; ranges over rounds. lora-serve: "
            f"`serve run serve_config.yaml`; vLLM: its OpenAI server (CPU build, both cores bound, Intel OpenMP); "
            f"{_dtypes(raw)}. TTFT = request sent -> first text chunk; TPOT = (last - first chunk) / "
            f"(tokens - 1).")
    text = "\n".join(report_header(f"HTTP load: lora-serve against vLLM ({raw['mode']})", args.command, env)
                     + [note, "", table(raw), "", share_table(raw), "", cpu_table(raw), "",
                        "![serve load](serve_load.png)", ""])
    save_results(args.folders, "serve_load", raw, plot, text)


if __name__ == "__main__":
    main()
