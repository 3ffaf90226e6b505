"""Routing: two engine replicas behind `serve run`, a Zipf adapter mix; lora-serve's router against plain
multiplexing, in one run, rounds interleaved.

    PYTHONPATH=. python -m benchmarks routing             # 2 rounds
    PYTHONPATH=. python -m benchmarks routing --quick     # a smoke run

Both servers are serve_config.yaml with LLMServer at 2 replicas (no autoscaling), one engine thread each (the
machine's 2 cores), SmolLM2 bf16, MAX_LORAS device slots per replica, and ADAPTERS random rank-8 adapters on
the attention projections; each runs with a KV cache of 256 MiB per replica (each replica's prefix cache holds
every system prompt) and of 64 MiB (about half of them beside the running requests, as when KV memory is
scarce). They differ only in `routing.router`:
- lora_aware: deployments/routing/policy.py (adapter residence, cached prefix, load) in the proxy's router and in the
  replica that parses a request;
- multiplex: Ray Serve's own router (power of two choices, preferring replicas that loaded the adapter named in
  the serve_multiplexed_model_id header), each request served where it lands.
Every request names its adapter in the body and in the serve_multiplexed_model_id header (as a Ray Serve user of
multiplexing sends it). Adapters are drawn Zipf(ZIPF_EXPONENT); a prompt is its adapter's system prompt (about
230 tokens, shared by that adapter's requests) and a question. CONCURRENCY clients in a closed loop stream
/v1/completions of TOKENS tokens.

Figures per router: device-slot hit rate (adapter requests whose adapter was in a slot of the replica that ran
them), prefix-cache hit rate (prompt tokens read from cached blocks), both from each replica's /info counters
over the timed load; TTFT p50/p99 and tokens/s at the client. Writes routing.md and routing.png to
benchmarks/results/KIND/ and routing.json to benchmarks/runs/KIND/ (benchmarks/common.py: save_results), with the
logs of a server whose requests failed in routing-logs/ beside it.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import requests  # noqa: E402
import yaml  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from benchmarks.common import (benchmark_args, environment, markdown_table, report_header,  # noqa: E402
                               save_results, value_range)
from benchmarks.serve.http_servers import ROOT, Server, start_lora_serve  # noqa: E402
from benchmarks.serve.run_serve_load import Timing, stream_one  # noqa: E402
from benchmarks.workloads import PROMPTS  # noqa: E402

ROUTERS = ("lora_aware", "multiplex")
ADAPTERS = 16
MAX_LORAS = 4
ZIPF_EXPONENT = 1.1
CONCURRENCY = 8
TOKENS = 16


@dataclass(frozen=True)
class Counters:
    """A replica's /info counters (or several replicas' summed)."""
    slot_acquisitions: int = 0
    slot_loads: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0

    @classmethod
    def of(cls, info: dict) -> Counters:
        slots, prefix = info["adapter_slots"], info["prefix_cache"]
        return cls(slots["acquisitions"], slots["loads"], prefix["queried_tokens"], prefix["hit_tokens"])

    def __add__(self, other: Counters) -> Counters:
        return Counters(*(a + b for a, b in zip(asdict(self).values(), asdict(other).values())))

    def __sub__(self, other: Counters) -> Counters:
        return Counters(*(a - b for a, b in zip(asdict(self).values(), asdict(other).values())))


@dataclass
class Scenario:
    router: str
    kv_cache_mib: int
    round: int
    requests: int
    ok: int
    seconds: float
    tok_s: float
    slot_hit_rate: float
    prefix_hit_rate: float
    ttft_ms_p50: float
    ttft_ms_p99: float
    requests_per_replica: list[int]
    statuses: dict[str, int]  # HTTP status -> requests; "cut" for a 200 stream without a token


def write_config(router: str, kv_cache_mib: int, adapters_root: Path, folder: Path, policy: dict) -> Path:
    """serve_config.yaml at 2 fixed replicas with this router and KV cache; `policy` overrides the config's
    routing knobs."""
    spec = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    app = spec["applications"][0]
    app["args"]["engine"].update({"max_loras": MAX_LORAS, "max_lora_rank": 8, "adapters_root": str(adapters_root),
                                  "num_threads": 1, "kv_cache_bytes": kv_cache_mib << 20})
    app["args"]["routing"] = {**app["args"].get("routing", {}), **policy, "router": router}
    [deployment] = app["deployments"]
    deployment.pop("autoscaling_config", None)
    deployment["num_replicas"] = 2
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{router}-{kv_cache_mib}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def write_adapters(root: Path) -> list[str]:
    from transformers import AutoConfig

    from benchmarks.lora_adapters import write_random_adapter
    from engine.config import default_cache_dir
    from engine.model_files import resolve_model

    config = AutoConfig.from_pretrained(resolve_model("smollm2-135m-instruct", default_cache_dir() / "models"))
    names = [f"adapter-{k:02d}" for k in range(ADAPTERS)]
    for k, name in enumerate(names):
        write_random_adapter(root / name, config, rank=8, seed=k)
    return names


def workload(names: list[str], num: int, seed: int) -> list[tuple[str, str]]:
    """(adapter, prompt) per request: adapters Zipf-distributed, each with its own system prompt."""
    import random

    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** ZIPF_EXPONENT for k in range(len(names))]
    drawn = rng.choices(range(len(names)), weights, k=num)
    system = [f"You are assistant {k}. " + " ".join(PROMPTS[k % len(PROMPTS):] + PROMPTS[:k % len(PROMPTS)])
              for k in range(len(names))]
    return [(names[k], f"{system[k]}\nQuestion {i}: {PROMPTS[i % len(PROMPTS)]}") for i, k in enumerate(drawn)]


def replica_infos(server: Server) -> dict[str, dict]:
    """Each replica's /info, by replica (the proxy spreads /info over both)."""
    seen: dict[str, dict] = {}
    for _ in range(100):
        info = requests.get(f"{server.url}/info", timeout=30).json()
        seen[info["replica"]] = info
        if len(seen) == 2:
            return seen
    raise RuntimeError(f"/info reached {len(seen)} replica(s) only")


def replica_counters(server: Server) -> dict[str, Counters]:
    """Each replica's /info counters, by replica."""
    return {replica: Counters.of(info) for replica, info in replica_infos(server).items()}


def wait_ready(server: Server, timeout_s: float = 300) -> None:
    """Until both replicas answer /info (the proxy may answer before every route is in place)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            replica_counters(server)
            return
        except (RuntimeError, KeyError, ValueError, requests.RequestException):
            if time.monotonic() > deadline:
                raise
            time.sleep(2)


async def closed_loop(server: Server, load: list[tuple[str, str]]) -> tuple[list[Timing], float]:
    queue = list(reversed(load))
    timings: list[Timing] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        async def worker():
            while queue:
                adapter, prompt = queue.pop()
                timings.append(await stream_one(session, server, prompt, TOKENS, model=adapter,
                                                headers={"serve_multiplexed_model_id": adapter}))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return timings, time.perf_counter() - start


def run_router(router: str, kv_cache_mib: int, config: Path, tmp: Path, rnd: int,
               load: list[tuple[str, str]], logs: Path) -> Scenario:
    """logs: where a server's logs are kept when any of its requests failed."""
    server = start_lora_serve(f"{router}-{kv_cache_mib}", config, tmp)
    try:
        server.wait_healthy(600)
        wait_ready(server)
        asyncio.run(closed_loop(server, [("smollm2-135m-instruct", p) for p in PROMPTS[:8]]))  # warm-up, no adapter
        time.sleep(2.5)  # the replicas' first reports
        before = replica_counters(server)
        timings, seconds = asyncio.run(closed_loop(server, load))
        after = replica_counters(server)
        failed = [t for t in timings if t.status != 200 or t.first is None]
        for t in failed[:3]:
            tqdm.write(f"{server.name}: HTTP {t.status}: {t.error}")
        if failed:
            server.keep_logs(logs / f"{server.name}-round{rnd}")
    finally:
        server.stop()
    per_replica = {r: after[r] - before.get(r, Counters()) for r in after}
    delta = sum(per_replica.values(), Counters())
    ok = [t for t in timings if t.status == 200 and t.first is not None]
    ttft = sorted((t.first - t.start) * 1000 for t in ok)
    return Scenario(router, kv_cache_mib, rnd, len(timings), len(ok), seconds, sum(t.tokens for t in ok) / seconds,
                    1 - delta.slot_loads / max(1, delta.slot_acquisitions),
                    delta.hit_tokens / max(1, delta.queried_tokens), statistics.median(ttft),
                    ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
                    sorted(c.slot_acquisitions for c in per_replica.values()),
                    dict(Counter("cut" if t.status == 200 else str(t.status) for t in timings if t not in ok)))


def run(args) -> dict:
    num = 48 if args.quick else args.requests
    results: list[Scenario] = []
    kv_sizes = args.kv_cache_mib
    with tempfile.TemporaryDirectory(prefix="rt-", dir="/tmp") as folder, \
            tqdm(total=args.rounds * len(ROUTERS) * len(kv_sizes), desc="routing", unit="server") as bar:
        names = write_adapters(Path(folder) / "adapters")
        policy = {k: v for k, v in (("imbalance", args.imbalance), ("hot_adapter_requests", args.hot)) if v is not None}
        for rnd in range(args.rounds):
            load = workload(names, num, seed=rnd)
            for kv in kv_sizes:
                for router in ROUTERS[rnd % 2:] + ROUTERS[:rnd % 2]:  # who goes first alternates
                    config = write_config(router, kv, Path(folder) / "adapters", Path(folder), policy)
                    results.append(run_router(router, kv, config, Path(folder) / f"r{rnd}", rnd, load,
                                              args.folders.raw / "routing-logs"))
                    bar.update()
                    tqdm.write(f"round {rnd} {router} {kv} MiB: {asdict(results[-1])}")
    return {"requests": num, "tokens": TOKENS, "concurrency": CONCURRENCY, "adapters": ADAPTERS,
            "max_loras": MAX_LORAS, "zipf_exponent": ZIPF_EXPONENT, "kv_cache_mib": kv_sizes,
            "scenarios": [asdict(r) for r in results]}


def table(raw: dict) -> str:
    rows = []
    for kv, router in ((kv, r) for kv in raw["kv_cache_mib"] for r in ROUTERS):
        runs = [s for s in raw["scenarios"] if s["router"] == router and s["kv_cache_mib"] == kv]
        col = lambda key: [s[key] for s in runs]  # noqa: E731
        rows.append([f"{kv} MiB", router, value_range([100 * v for v in col("slot_hit_rate")], 0) + "%",
                     value_range([100 * v for v in col("prefix_hit_rate")], 0) + "%",
                     value_range(col("ttft_ms_p50"), 0), value_range(col("ttft_ms_p99"), 0), value_range(col("tok_s")),
                     "; ".join("/".join(str(n) for n in s["requests_per_replica"]) for s in runs),
                     f"{sum(s['ok'] for s in runs)}/{sum(s['requests'] for s in runs)}"])
    return markdown_table(["KV cache per replica", "router", "device-slot hit rate", "prefix-cache hit rate",
                           "TTFT p50 ms", "TTFT p99 ms",
                           "tok/s", "adapter requests per replica", "ok"], rows)


def plot(raw: dict):
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    keys = (("slot_hit_rate", "device-slot hit rate"), ("prefix_hit_rate", "prefix-cache hit rate"),
            ("ttft_ms_p50", "TTFT p50 (ms)"))
    width = 0.38
    for ax, (key, label) in zip(axes, keys):
        for i, (router, color) in enumerate(zip(ROUTERS, ("tab:green", "tab:gray"))):
            values = [statistics.median(s[key] for s in raw["scenarios"] if s["router"] == router
                                        and s["kv_cache_mib"] == kv) for kv in raw["kv_cache_mib"]]
            ax.bar([x + (i - 0.5) * width for x in range(len(values))], values, width, color=color, label=router)
        ax.set_xticks(range(len(raw["kv_cache_mib"])), [f"KV {kv} MiB" for kv in raw["kv_cache_mib"]])
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"2 replicas, {raw['adapters']} adapters Zipf({raw['zipf_exponent']}), {raw['max_loras']} slots "
                 f"each, {raw['requests']} requests x {raw['tokens']} tokens at {raw['concurrency']} concurrent; "
                 f"median over rounds", fontsize=10)
    return fig


def add_arguments(parser) -> None:
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=192)
    parser.add_argument("--kv-cache-mib", type=int, nargs="+", default=[256, 64],
                        help="KV cache per replica, one setting after another (256: each replica's prefix cache "
                             "holds every system prompt; 64: about half of them, beside the running requests)")
    parser.add_argument("--imbalance", type=int, help="routing.imbalance (default: serve_config.yaml's)")
    parser.add_argument("--hot", type=int, help="routing.hot_adapter_requests (default: serve_config.yaml's)")


def main(argv: list[str] | None = None) -> None:
    args = benchmark_args(__doc__, "48 requests a round: a smoke test", argv, add_arguments)
    env = environment()
    raw = {"mode": "quick" if args.quick else "full", "environment": env, "rounds": args.rounds, **run(args)}
    note = (f"Method: `serve run` of serve_config.yaml at 2 replicas (1 engine thread each), SmolLM2 bf16, "
            f"{raw['adapters']} random rank-8 adapters drawn Zipf({raw['zipf_exponent']}), {raw['max_loras']} "
            f"device slots per replica, KV cache {' or '.join(str(k) for k in raw['kv_cache_mib'])} MiB per replica; "
            f"each prompt is its adapter's system prompt (~230 tokens) and a question; "
            f"{raw['requests']} streamed /v1/completions x {raw['tokens']} tokens, {raw['concurrency']} concurrent, "
            f"closed loop, adapter in the body and the serve_multiplexed_model_id header; {raw['rounds']} "
            f"interleaved rounds, each server started alone; ranges over rounds. Hit rates from the replicas' /info "
            f"counters over the timed load.")
    title = f"Routing: lora-serve's router against plain multiplexing ({raw['mode']})"
    text = "\n".join(report_header(title, args.command, env)
                     + [note, "", table(raw), "", "![routing](routing.png)", ""])
    save_results(args.folders, "routing", raw, plot, text)


if __name__ == "__main__":
    main()
