"""One hot adapter on two replicas: per-adapter replication against residence alone, in one run, rounds interleaved.

    PYTHONPATH=. python -m benchmarks hot_adapter             # 2 rounds
    PYTHONPATH=. python -m benchmarks hot_adapter --quick     # a smoke run

Both servers are serve_config.yaml with LLMServer at 2 replicas (no autoscaling), one engine thread each (the
machine's 2 cores), SmolLM2 bf16, 4 device slots per replica and 16 random rank-8 adapters (benchmarks/serve/
run_routing.py writes them). They differ only in `routing.hot_adapter_requests`:
- replication: the shipped level, 16 (deployments/routing/replication.py: an adapter whose holders each run 16 of its
  requests spreads, is preloaded onto the other replica, and is dropped there once it cools);
- residence: null, so the adapter's holder keeps its requests until the load band (`imbalance`) sends them on.
Each pair runs at the shipped load band (`imbalance` 8) and at a wide one (64), as a config that keeps adapters and
prefixes where they are cached would set it: there the band alone hardly spreads an adapter.
HOT_SHARE of the requests ask for one adapter, the rest for the other 15 alike; each prompt is its adapter's system
prompt and a question. Before the timed load, 4 requests of the hot adapter one after another put it on one replica,
as an adapter is before its load rises; then CONCURRENCY clients in a closed loop stream /v1/completions of TOKENS
tokens. Figures per
server: the hot adapter's TTFT p50 and p99 and the other adapters' p99 at the client, tokens/s, and how many of the
hot adapter's requests each replica ran (each replica's /info: `adapter_requests`).
Writes hot_adapter.md and hot_adapter.png to benchmarks/results/KIND/ and hot_adapter.json to benchmarks/runs/KIND/.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from benchmarks.common import (benchmark_args, environment, markdown_table, report_header,  # noqa: E402
                               save_results, value_range)
from benchmarks.serve.http_servers import Server, start_lora_serve  # noqa: E402
from benchmarks.serve.run_routing import replica_infos, wait_ready, write_adapters, write_config  # noqa: E402
from benchmarks.serve.run_serve_load import Timing, quantile, stream_one  # noqa: E402
from benchmarks.workloads import PROMPTS  # noqa: E402

VARIANTS = {"replication": {"hot_adapter_requests": 16}, "residence": {"hot_adapter_requests": None}}
HOT_SHARE = 0.8
CONCURRENCY = 32
TOKENS = 16


@dataclass
class Run:
    variant: str
    imbalance: int
    round: int
    requests: int
    ok: int
    seconds: float
    tok_s: float
    hot_ttft_ms_p50: float
    hot_ttft_ms_p99: float
    other_ttft_ms_p99: float
    hot_per_replica: list[int]


def workload(names: list[str], num: int, seed: int) -> list[tuple[str, str]]:
    """(adapter, prompt) per request: names[0] takes HOT_SHARE of them, the others share the rest alike."""
    rng = random.Random(seed)
    drawn = [names[0] if rng.random() < HOT_SHARE else rng.choice(names[1:]) for _ in range(num)]
    return [(name, f"You are {name}. {PROMPTS[i % len(PROMPTS)]} Question {i}.") for i, name in enumerate(drawn)]


async def closed_loop(server: Server, load: list[tuple[str, str]],
                      concurrency: int = CONCURRENCY) -> tuple[list[tuple[str, Timing]], float]:
    queue = list(reversed(load))
    timings: list[tuple[str, Timing]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        async def worker():
            while queue:
                adapter, prompt = queue.pop()
                timings.append((adapter, await stream_one(session, server, prompt, TOKENS, model=adapter)))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return timings, time.perf_counter() - start


def adapter_requests(server: Server, adapter: str) -> dict[str, int]:
    """Each replica's requests of `adapter` so far, by replica, from its /info."""
    return {replica: info["adapter_requests"].get(adapter, 0) for replica, info in replica_infos(server).items()}


def run_variant(variant: str, imbalance: int, config: Path, tmp: Path, rnd: int, load: list[tuple[str, str]],
                hot: str) -> Run:
    server = start_lora_serve(f"{variant}-{imbalance}", config, tmp)
    try:
        server.wait_healthy(600)
        wait_ready(server)
        asyncio.run(closed_loop(server, [("smollm2-135m-instruct", p) for _, p in load[:CONCURRENCY]]))  # warm-up
        for _, prompt in load[:4]:  # the hot adapter on one replica, as an adapter is before its load rises
            asyncio.run(closed_loop(server, [(hot, prompt)], concurrency=1))
        time.sleep(2.5)  # the replicas' first reports
        before = adapter_requests(server, hot)
        timings, seconds = asyncio.run(closed_loop(server, load))
        after = adapter_requests(server, hot)
    finally:
        server.stop()
    hot_per_replica = sorted(after[r] - before.get(r, 0) for r in after)
    return summarise(variant, imbalance, rnd, timings, seconds, hot, hot_per_replica)


def summarise(variant: str, imbalance: int, rnd: int, timings: list[tuple[str, Timing]], seconds: float, hot: str,
              hot_per_replica: list[int]) -> Run:
    ok = [(a, t) for a, t in timings if t.status == 200 and t.first is not None]
    ttft = lambda want: sorted((t.first - t.start) * 1000 for a, t in ok if (a == hot) == want)  # noqa: E731
    hot_ttft, other_ttft = ttft(True), ttft(False)
    return Run(variant, imbalance, rnd, len(timings), len(ok), seconds, sum(t.tokens for _, t in ok) / seconds,
               quantile(hot_ttft, 0.5), quantile(hot_ttft, 0.99), quantile(other_ttft, 0.99), hot_per_replica)


def run(args) -> dict:
    num = 96 if args.quick else args.requests
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="ha-", dir="/tmp") as folder, \
            tqdm(total=args.rounds * len(VARIANTS) * len(args.imbalance), desc="hot adapter", unit="server") as bar:
        names = write_adapters(Path(folder) / "adapters")
        for rnd in range(args.rounds):
            load = workload(names, num, seed=rnd)
            order = list(VARIANTS) if rnd % 2 == 0 else list(VARIANTS)[::-1]  # who goes first alternates
            for imbalance, variant in ((i, v) for i in args.imbalance for v in order):
                config = write_config("lora_aware", args.kv_cache_mib, Path(folder) / "adapters",
                                      Path(folder) / f"{variant}-{imbalance}", {**VARIANTS[variant],
                                                                                "imbalance": imbalance})
                runs.append(run_variant(variant, imbalance, config, Path(folder) / f"r{rnd}", rnd, load, names[0]))
                bar.update()
                tqdm.write(f"round {rnd} {variant} imbalance {imbalance}: {asdict(runs[-1])}")
    return {"requests": num, "tokens": TOKENS, "concurrency": CONCURRENCY, "hot_share": HOT_SHARE,
            "kv_cache_mib": args.kv_cache_mib, "imbalance": args.imbalance, "runs": [asdict(r) for r in runs]}


def table(raw: dict) -> str:
    rows = []
    for imbalance, variant in ((i, v) for i in raw["imbalance"] for v in VARIANTS):
        runs = [r for r in raw["runs"] if r["variant"] == variant and r["imbalance"] == imbalance]
        col = lambda key: [r[key] for r in runs]  # noqa: E731
        rows.append([imbalance, variant, value_range(col("hot_ttft_ms_p50"), 0), value_range(col("hot_ttft_ms_p99"), 0),
                     value_range(col("other_ttft_ms_p99"), 0), value_range(col("tok_s")),
                     "; ".join("/".join(str(n) for n in r["hot_per_replica"]) for r in runs),
                     f"{sum(r['ok'] for r in runs)}/{sum(r['requests'] for r in runs)}"])
    return markdown_table(["imbalance", "routing", "hot adapter TTFT p50 ms", "hot adapter TTFT p99 ms",
                           "other adapters TTFT p99 ms", "tok/s", "hot adapter requests per replica", "ok"], rows)


def plot(raw: dict):
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    width = 0.38
    for ax, (key, label) in zip(axes, (("hot_ttft_ms_p99", "hot adapter TTFT p99 (ms)"), ("tok_s", "tok/s"))):
        for i, (variant, color) in enumerate(zip(VARIANTS, ("tab:green", "tab:gray"))):
            values = [statistics.median(r[key] for r in raw["runs"] if r["variant"] == variant
                                        and r["imbalance"] == imbalance) for imbalance in raw["imbalance"]]
            ax.bar([x + (i - 0.5) * width for x in range(len(values))], values, width, color=color, label=variant)
        ax.set_xticks(range(len(raw["imbalance"])), [f"imbalance {i}" for i in raw["imbalance"]])
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"2 replicas, one adapter {raw['hot_share']:.0%} of requests, {raw['concurrency']} concurrent; "
                 f"median over rounds", fontsize=9)
    return fig


def add_arguments(parser) -> None:
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=384)
    parser.add_argument("--kv-cache-mib", type=int, default=256, help="KV cache per replica")
    parser.add_argument("--imbalance", type=int, nargs="+", default=[8, 64],
                        help="routing.imbalance, one setting after another (8: as shipped)")


def main(argv: list[str] | None = None) -> None:
    args = benchmark_args(__doc__, "96 requests a round: a smoke test", argv, add_arguments)
    env = environment()
    raw = {"mode": "quick" if args.quick else "full", "environment": env, "rounds": args.rounds, **run(args)}
    note = (f"Method: `serve run` of serve_config.yaml at 2 replicas (1 engine thread each), SmolLM2 bf16, 16 random "
            f"rank-8 adapters, 4 device slots per replica, KV cache {raw['kv_cache_mib']} MiB per replica; one "
            f"adapter, first put on one replica by 4 requests in a row, takes {raw['hot_share']:.0%} of "
            f"{raw['requests']} streamed /v1/completions x {raw['tokens']} "
            f"tokens, {raw['concurrency']} concurrent, closed loop; {raw['rounds']} interleaved rounds, each server "
            f"started alone; ranges over rounds. replication: hot_adapter_requests 16 (shipped); residence: null; "
            f"each at routing.imbalance {' and '.join(str(i) for i in raw['imbalance'])}.")
    title = f"A hot adapter: per-adapter replication against residence alone ({raw['mode']})"
    text = "\n".join(report_header(title, args.command, env)
                     + [note, "", table(raw), "", "![hot adapter](hot_adapter.png)", ""])
    save_results(args.folders, "hot_adapter", raw, plot, text)


if __name__ == "__main__":
    main()
