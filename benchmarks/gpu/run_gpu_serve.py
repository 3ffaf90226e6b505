"""lora-serve's HTTP server on a GPU: a Llama-3-8B-shape model with 16 rank-16 adapters served by `serve run`, its
OpenAI and LoRAX routes checked, then loaded over HTTP and set against the same engine offline.

    python -m benchmarks gpu_serve --tokenizer DIR [--out DIR] [--quick] [--no-ray]   # on the GPU
    python -m benchmarks gpu_serve --device cpu --tiny [--no-ray]                      # smoke run of the whole path

- Model: a typed-in shape with random weights (benchmarks/gpu/gpu_models.py, load_format "dummy", bf16) and SmolLM2's
  tokenizer; 16 rank-16 q, k, v, o adapters of random weights in its adapters root (benchmarks/lora_adapters.py).
- Serve config: serve_config.yaml's, with its engine replaced (max_loras 16, max_lora_rank 16, max_num_seqs 256, the
  KV cache 0.8 of the device memory free after the weights), one replica of one GPU, and free ports; written beside
  the results as gpu_serve_config.yaml. HAProxy serves the HTTP port as in serve_config.yaml where its launcher
  exists, else Serve's proxy does.
- Server: `serve run` on it (benchmarks/serve/http_servers.py). Where Ray cannot start (a sandbox without its object
  store, /dev/shm or ports) or Serve does not get healthy, the error is recorded with the end of the log and the same
  app is served in one process without Ray (deployments/replica/in_process.py over uvicorn, in a process of its own:
  benchmarks/gpu/in_process_server.py); --no-ray goes straight there. The results name the server that ran.
- Route checks: /v1/completions and /v1/chat/completions (OpenAI), /generate and /generate_stream (LoRAX), whole and
  streamed, for the base model and an adapter; each passes when it answers 200 with exactly the tokens asked for.
- Load: streamed /v1/completions, greedy, ignore_eos, 64 new tokens, closed loop from one aiohttp client at 1, 32 and
  256 concurrent streams, on the base model and on requests spread round-robin over the adapters. tok/s = tokens /
  wall; TTFT = request sent -> its first event; TPOT = (the stream's end - its first event) / (tokens - 1); ITL = the
  gaps between a stream's successive events, p50 and p99 over every gap of the scenario. An event is a chunk with a
  choice, text or not: the random model writes ids past the tokenizer's 49,152, whose text is empty. A replica paces
  its streams (deployments/replica/pacing.py): under load an event holds several tokens, so ITL is what a client
  waits between chunks, TPOT the rate of tokens.
- Offline: once the server has stopped and the device is free, the same engine args in this process (LLM) on the top
  concurrency's requests, all at once; HTTP share = HTTP tok/s at the top concurrency / offline tok/s, per workload
  (the bar: 90%).
- Every phase runs on its own: one that fails is recorded with its error and the rest still run; the summary and the
  raw figures are written after each, so a run cut short keeps what it measured. SIGTERM (a `timeout`) stops the
  server before the process ends.

Estimate on an H200 for the 8B shape: the folder and the adapters (16 x 54 MB) about 10 s; Ray and Serve up in 20-30 s
and the replica's engine (weights drawn on the device, KV cache, decode graphs up to 256) ready in 20-40 s; route
checks and warm-up 5 s; the load 30-40 s (2 workloads x 328 requests x 64 tokens; about 9,000 tok/s at 256 streams,
6 ms a token alone); the offline engine's start 20-30 s and its runs 5 s: 2-2.5 minutes, about 3 when Ray fails and
the in-process server starts after it.

Writes gpu_serve.md and gpu_serve.png to benchmarks/results/KIND/ and gpu_serve.json (with the serve config and, where
a server failed, its log) to benchmarks/runs/KIND/; --tiny all to benchmarks/runs/KIND/smoke/; --out DIR all to DIR.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import sysconfig
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import requests
import transformers
import yaml
from tqdm.auto import tqdm

from benchmarks.common import benchmark_args, environment, write_raw, write_summary
from benchmarks.gpu.gpu_models import build_model_dir
from benchmarks.gpu.gpu_serve_plan import NAME, WORKLOADS, Plan, error_text
from benchmarks.gpu.gpu_serve_report import markdown, save, shares
from benchmarks.gpu.gpu_timing import device_name
from benchmarks.gpu.in_process_server import start_in_process
from benchmarks.gpu.run_gpu import DEFAULT_TOKENIZERS, find_tokenizer
from benchmarks.gpu.serve_routes import check_routes
from benchmarks.gpu.stream_load import jobs, run_load, warm_up
from benchmarks.lora_adapters import write_random_adapter
from benchmarks.serve.http_servers import ROOT, Server, free_port, start_lora_serve
from benchmarks.workloads import PROMPTS
from deployments.routing.direct_ingress import ENABLE, ENABLE_HAPROXY, PREFIXES

HAPROXY_BINARY = "RAY_SERVE_HAPROXY_BINARY_PATH"


# ---------------------------------------------------------------------------------------------------- setup


def adapter_names(plan: Plan) -> list[str]:
    return [f"a{i:02d}" for i in range(plan.adapters)]


def write_adapters(plan: Plan, model_dir: Path, root: Path) -> Path:
    config = transformers.AutoConfig.from_pretrained(model_dir)
    for seed, name in enumerate(tqdm(adapter_names(plan), desc="adapters", leave=False)):
        write_random_adapter(root / name, config, rank=plan.rank, seed=seed)
    return root


def engine_args(plan: Plan, model_dir: Path, adapters_root: Path, device: str) -> dict:
    """The served engine, and the offline one: on CUDA the KV cache takes 0.8 of the memory left after the weights;
    on a CPU a fixed 64 MiB, not a share of the host's memory."""
    kv = {"kv_cache_memory_fraction": 0.8} if device.startswith("cuda") else {"kv_cache_bytes": 64 << 20}
    return {"model": str(model_dir), "dtype": "bfloat16", "device": device, "load_format": "dummy",
            "max_num_seqs": plan.top, "max_num_batched_tokens": 8192, "max_loras": plan.adapters,
            "max_lora_rank": plan.rank, "adapters_root": str(adapters_root), "adapter_source": "local",
            "log_stats": False, **kv}


def serve_config(engine: dict, device: str) -> dict:
    """serve_config.yaml with this engine, one replica (of one GPU on CUDA), direct-ingress ports that are free, and
    Serve's proxy in place of HAProxy where the launcher it names is missing."""
    spec = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    env = spec["controller_options"]["runtime_env"]["env_vars"]
    low = free_port()  # Serve takes replica ports from [MIN, MAX) in order: the first is free, the rest likely
    env.update({"RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(low), "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(low + 8)})
    if not haproxy_launcher(env).is_file():
        for key in [k for k in env if k == ENABLE_HAPROXY or k.startswith(("RAY_SERVE_HAPROXY", "RAY_SERVE_INGRESS"))]:
            env.pop(key)
    [app] = spec["applications"]
    app["args"]["engine"] = engine
    [deployment] = app["deployments"]
    deployment.pop("autoscaling_config", None)
    deployment["num_replicas"] = 1
    if device.startswith("cuda"):  # these replace build_app's options: the direct-ingress variables go with them
        ingress = {k: v for k, v in env.items() if k in (ENABLE, ENABLE_HAPROXY) or k.startswith(PREFIXES)}
        deployment["ray_actor_options"] = {"num_cpus": 1, "num_gpus": 1, "runtime_env": {"env_vars": ingress}}
    return spec


def haproxy_launcher(env: dict) -> Path:
    return Path(os.path.expandvars(env.get(HAPROXY_BINARY, "")) or "/nonexistent")


def proxy_of(spec: dict) -> str:
    env = spec["controller_options"]["runtime_env"]["env_vars"]
    return "HAProxy" if env.get(ENABLE_HAPROXY) == "1" else "Serve's proxy"


# ---------------------------------------------------------------------------------------------------- server


def start_server(config: Path, tmp: Path, no_ray: bool, timeout_s: float, record: dict, logs: Path) -> Server:
    """`serve run` on the config, healthy within timeout_s; else (or with no_ray) the in-process server. record gets
    which one serves, how long it took to answer, and Ray's error with the end of its log where Ray failed."""
    if not no_ray:
        try:
            return _healthy(start_lora_serve("lora-serve", config, tmp, env=_serve_env()), timeout_s, record, logs)
        except Exception as error:  # noqa: BLE001 - recorded, then the same app is served without Ray
            record["ray_error"] = error_text(error)
            tqdm.write(f"Ray Serve did not come up, serving in one process instead:\n{record['ray_error']}")
    return _healthy(start_in_process(config, tmp), timeout_s, record, logs)


def _serve_env() -> dict[str, str]:
    """`serve` from this interpreter's scripts folder (a pip install may put it off PATH); no usage report (the
    device has no network)."""
    return {"PATH": f"{sysconfig.get_path('scripts')}:{os.environ.get('PATH', '')}", "RAY_USAGE_STATS_ENABLED": "0"}


def _healthy(server: Server, timeout_s: float, record: dict, logs: Path) -> Server:
    """The server once it answers; else its log kept in `logs`, the server stopped and the error raised, with the
    end of the log where the error does not hold it (a timeout)."""
    started = time.perf_counter()
    try:
        server.wait_healthy(timeout_s)
    except BaseException as error:
        logs.mkdir(parents=True, exist_ok=True)
        shutil.copy(server.log, logs / f"{NAME}-{server.name.replace(' ', '-')}.log")
        server.stop()
        if isinstance(error, TimeoutError):
            raise TimeoutError(f"{error}; the end of its log:\n{_tail(server.log)}") from None
        raise
    record.update(server=server.name, ready_s=time.perf_counter() - started)
    tqdm.write(f"{server.name} healthy at {server.url} after {record['ready_s']:.1f} s")
    return server


def _tail(log: Path, lines: int = 40) -> str:
    return "".join(log.read_text(errors="replace").splitlines(keepends=True)[-lines:])


def base_model(url: str) -> str:
    return requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


# ---------------------------------------------------------------------------------------------------- route checks
# ---------------------------------------------------------------------------------------------------- load
# ---------------------------------------------------------------------------------------------------- offline


def wait_for_device(device: str, timeout_s: float = 60.0) -> None:
    """Until the stopped server's memory is back (its processes may outlive their parent for a moment)."""
    if not device.startswith("cuda"):
        return
    import torch

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        free, total = torch.cuda.mem_get_info()
        if free > 0.9 * total:
            return
        time.sleep(1)


def run_offline(engine: dict, plan: Plan, base: str, adapters: list[str]) -> list[dict]:
    """The served engine args in this process, warmed as the server was; each workload's top-concurrency requests
    all at once (max_num_seqs is the top concurrency)."""
    from benchmarks.serve.offline_engines import LoraServeOffline
    from engine import LLM
    from lora_cache.local_cache import local_adapters

    started = time.perf_counter()
    offline = LoraServeOffline(LLM(adapters=local_adapters, **engine))
    ready_s = time.perf_counter() - started
    count = dict(plan.loads)[plan.top]
    work = {w: jobs(w, count, base, adapters) for w in WORKLOADS}
    for todo in ([(base, PROMPTS[0])] + [(a, PROMPTS[0]) for a in adapters], *work.values()):
        offline.run(*_offline_args(todo, 4, base))
    rows = []
    for workload, todo in work.items():
        done = offline.run(*_offline_args(todo, plan.new_tokens, base))
        rows.append({"workload": workload, "requests": done.requests, "tokens": done.tokens,
                     "ok": done.tokens == count * plan.new_tokens, "seconds": done.seconds, "tok_s": done.tok_s,
                     "ttft_ms_p50": done.ttft_ms_p50, "ready_s": ready_s})
        tqdm.write(f"offline {workload}: {done.tok_s:.1f} tok/s")
    return rows


def _offline_args(todo: list[tuple[str, str]], tokens: int, base: str):
    return [p for _, p in todo], tokens, [None if m == base else m for m, _ in todo]


# ---------------------------------------------------------------------------------------------------- report
# ---------------------------------------------------------------------------------------------------- main


class Phases:
    """Runs each phase on its own, recording its seconds and error, and checkpoints the results after it."""

    def __init__(self, raw: dict, folders):
        self.raw, self.folders = raw, folders

    def run(self, name: str, fn, *args):
        started, value = time.perf_counter(), None
        tqdm.write(f"== {name}")
        try:
            value, error = fn(*args), None
        except Exception:  # noqa: BLE001 - recorded; the phases after it run with what there is
            error = traceback.format_exc()
            tqdm.write(f"{name} failed:\n{error}")
        self.raw["phases"][name] = {"ok": error is None, "error": error, "seconds": time.perf_counter() - started}
        self.checkpoint()
        return value

    def checkpoint(self) -> None:
        write_raw(self.folders, NAME, self.raw)
        write_summary(self.folders, NAME, markdown(self.raw))


def prepare(args, plan: Plan, work: Path, raw: dict) -> tuple[dict, Path]:
    """The model folder, its adapters and the serve config (written to work/ and beside the results)."""
    model_dir = build_model_dir(work / "models", plan.shape, find_tokenizer(args.tokenizer), tiny=args.tiny)
    root = write_adapters(plan, model_dir, work / "adapters")
    engine = engine_args(plan, model_dir, root, args.device)
    spec = serve_config(engine, args.device)
    raw["server"]["proxy"] = proxy_of(spec)
    config = work / "gpu_serve_config.yaml"
    config.write_text(yaml.safe_dump(spec, sort_keys=False))
    args.folders.raw.mkdir(parents=True, exist_ok=True)
    shutil.copy(config, args.folders.raw / config.name)
    return engine, config


def serve_and_load(args, plan: Plan, config: Path, work: Path, phases: Phases) -> tuple[str, list[str]]:
    """Start a server, check its routes, load it, stop it; (the base model's name, the adapters' names)."""
    raw, adapters = phases.raw, adapter_names(plan)
    server = phases.run("server start", start_server, config, work / "servers", args.no_ray, args.start_timeout,
                        raw["server"], args.folders.raw)
    if server is None:
        return str(Path(raw["engine"]["model"])), adapters
    try:
        base = base_model(server.url)
        raw["routes"] = phases.run("route checks", check_routes, server.url, base, adapters[0],
                                   plan.check_tokens) or []
        raw["server"]["warm_up_s"] = phases.run("warm-up", warm_up, server.url, plan, base, adapters)
        raw["load"] = phases.run("HTTP load", run_load, server.url, plan, base, adapters, phases.checkpoint) or []
    finally:
        server.stop()
    return base, adapters


def _add_arguments(parser) -> None:
    parser.add_argument("--tiny", action="store_true", help="a tiny model of the same architecture, few requests at "
                        "1 and 4 streams: the smoke run (CPU)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="folder with SmolLM2's tokenizer files (default: the first of "
                             + ", ".join(str(p) for p in DEFAULT_TOKENIZERS) + " that exists)")
    parser.add_argument("--no-ray", action="store_true",
                        help="serve in one process without Ray (deployments/replica/in_process.py), not `serve run`")
    parser.add_argument("--start-timeout", type=float, default=180.0,
                        help="seconds a server may take to answer /health (default 180)")
    parser.add_argument("--work", type=Path, default=None, help="folder for the model, adapters and configs (temp)")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _stop_on_sigterm() -> None:
    """SIGTERM (`timeout`) as SystemExit, so that the finally blocks stop the server, whose processes are a session
    of their own and would outlive this one holding the device."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def main(argv: list[str] | None = None) -> None:
    args = benchmark_args(__doc__, "fewer requests and tokens (a shorter GPU run)", argv, _add_arguments,
                          device="cuda", quick_is_smoke=False)
    _stop_on_sigterm()
    if args.device.startswith("cuda") and not _cuda_available():
        raise SystemExit("--device cuda but CUDA is not available (use --device cpu --tiny for a smoke run)")
    transformers.logging.set_verbosity_error()
    plan = Plan.tiny() if args.tiny else Plan.quick() if args.quick else Plan.full()
    work = args.work or Path(tempfile.mkdtemp(prefix="lora-serve-gpu-serve-"))
    raw = {"mode": "tiny" if args.tiny else "quick" if args.quick else "full", "device": args.device,
           "device_name": device_name(args.device), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "command": args.command, "environment": environment(), "plan": {**asdict(plan), "top": plan.top},
           "server": {"ray": not args.no_ray}, "phases": {}}
    print(f"{NAME}: {plan.shape} shape on {raw['device_name']}, work folder {work}")
    phases = Phases(raw, args.folders)
    try:
        prepared = phases.run("model, adapters, config", prepare, args, plan, work, raw)
        if prepared is not None:
            raw["engine"], config = prepared
            base, adapters = serve_and_load(args, plan, config, work, phases)
            phases.run("wait for the device", wait_for_device, args.device)
            raw["offline"] = phases.run("offline engine", run_offline, raw["engine"], plan, base, adapters) or []
    finally:
        raw["shares"] = shares(raw)
        save(args.folders, raw)
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {args.folders.results / (NAME + '.md')} and {args.folders.raw / (NAME + '.json')}")


if __name__ == "__main__":
    main()
