"""HTTP load benchmark: lora-serve through Ray Serve against the same engine offline.

    PYTHONPATH=. python -m benchmarks.run_serve_load            # full run (about 12 minutes)
    PYTHONPATH=. python -m benchmarks.run_serve_load --quick    # smoke test

SmolLM2 (bf16, one replica), requests mixing the base model and 8 rank-8 adapters. Closed loop at
several concurrency levels, and open loop with Poisson arrivals at several rates, all through
/generate_stream (SSE): time to first token (TTFT), time per output token (TPOT) and end-to-end
latency percentiles, and throughput. The offline engine runs the same requests in one generate call.
Writes benchmarks/results/serve_load.md, serve_load.json and serve_load.png.
"""

from __future__ import annotations

import asyncio
import random
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import transformers  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from benchmarks.common import benchmark_args, environment, fmt, markdown_table, save_results  # noqa: E402
from benchmarks.lora_adapters import write_random_adapter  # noqa: E402
from benchmarks.workloads import PROMPTS  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.config import default_cache_dir  # noqa: E402
from engine.model_files import resolve_model  # noqa: E402

MODEL = "smollm2-135m-instruct"
ADAPTERS = [f"adapter-{i}" for i in range(8)]
ENGINE = {"model": MODEL, "dtype": "bfloat16", "max_loras": 8, "max_lora_rank": 8,
          "log_stats": False}


@dataclass(frozen=True)
class Request:
    prompt: str
    adapter: str | None
    max_new_tokens: int


@dataclass
class Timing:
    start: float
    first: float | None = None
    end: float | None = None
    tokens: int = 0
    status: int = 0


def make_requests(n: int, max_new_tokens: int, seed: int = 0) -> list[Request]:
    """A third base-model requests, the rest spread over the adapters."""
    rng = random.Random(seed)
    return [Request(PROMPTS[i % len(PROMPTS)], None if rng.random() < 1 / 3 else rng.choice(ADAPTERS),
                    max_new_tokens) for i in range(n)]


async def stream_one(session: aiohttp.ClientSession, url: str, request: Request) -> Timing:
    timing = Timing(time.perf_counter())
    params = {"max_new_tokens": request.max_new_tokens, "ignore_eos_token": True, "adapter_id": request.adapter}
    async with session.post(f"{url}/generate_stream", json={"inputs": request.prompt, "parameters": params}) as r:
        timing.status = r.status
        async for line in r.content:
            if line.startswith(b"data:"):
                timing.tokens += 1
                timing.first = timing.first or time.perf_counter()
    timing.end = time.perf_counter()
    return timing


async def closed_loop(url: str, requests: list[Request], concurrency: int) -> tuple[list[Timing], float]:
    queue = list(reversed(requests))
    timings: list[Timing] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def worker():
            while queue:
                timings.append(await stream_one(session, url, queue.pop()))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return timings, time.perf_counter() - start


async def poisson(url: str, requests: list[Request], rate: float, seed: int = 0) -> tuple[list[Timing], float]:
    rng = random.Random(seed)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        tasks, start = [], time.perf_counter()
        for request in requests:
            tasks.append(asyncio.create_task(stream_one(session, url, request)))
            await asyncio.sleep(rng.expovariate(rate))
        timings = await asyncio.gather(*tasks)
    return list(timings), time.perf_counter() - start


def percentiles(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return {"p50": statistics.median(values), "p90": pick(0.9), "p99": pick(0.99)}


def summarise(name: str, timings: list[Timing], seconds: float) -> dict:
    ok = [t for t in timings if t.status == 200 and t.first is not None]
    tpot = [(t.end - t.first) / (t.tokens - 1) for t in ok if t.tokens > 1]
    return {"name": name, "requests": len(timings), "ok": len(ok), "seconds": seconds,
            "tok_s": sum(t.tokens for t in ok) / seconds,
            "ttft_ms": {k: v * 1000 for k, v in percentiles([t.first - t.start for t in ok]).items()},
            "tpot_ms": {k: v * 1000 for k, v in percentiles(tpot).items()},
            "e2e_s": percentiles([t.end - t.start for t in ok])}


def offline(requests: list[Request], adapters_root: Path) -> dict:
    llm = LLM(**{**ENGINE, "adapters_root": str(adapters_root)})
    params = SamplingParams(max_tokens=requests[0].max_new_tokens, temperature=0.0, ignore_eos=True)
    prompts, adapters = [r.prompt for r in requests], [r.adapter for r in requests]
    llm.generate(prompts[:8], params, use_tqdm=False, adapters=adapters[:8])  # warm-up, loads the adapters
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, adapters=adapters)
    seconds = time.perf_counter() - start
    return {"name": f"offline LLM.generate, all {len(requests)} at once", "requests": len(requests),
            "ok": len(outputs), "seconds": seconds, "tok_s": sum(len(o.token_ids) for o in outputs) / seconds,
            "ttft_ms": {k: v * 1000 for k, v in percentiles([o.ttft for o in outputs]).items()},
            "tpot_ms": None, "e2e_s": None}


def start_server(adapters_root: Path, tmp: Path) -> str:
    import ray
    from ray import serve

    from deployments.app import build_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=3, include_dashboard=False, _temp_dir=str(tmp / "ray"), log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"engine": {**ENGINE, "adapters_root": str(adapters_root)}}), name="bench",
              route_prefix="/")
    return f"http://127.0.0.1:{port}"


def run(quick: bool) -> dict:
    n, tokens = (16, 16) if quick else (64, 64)
    concurrency, rates = ((1, 8), (2.0,)) if quick else ((1, 8, 32), (1.0, 2.0, 4.0))
    requests = make_requests(n, tokens)
    with tempfile.TemporaryDirectory(prefix="serve-load-") as folder:
        tmp = Path(folder)
        hf_config = transformers.AutoConfig.from_pretrained(resolve_model(MODEL, default_cache_dir() / "models"))
        for seed, name in enumerate(ADAPTERS):
            write_random_adapter(tmp / "adapters" / name, hf_config, rank=8, seed=seed)
        results = [offline(requests, tmp / "adapters")]
        url = start_server(tmp / "adapters", tmp)
        try:
            asyncio.run(closed_loop(url, requests[:8], 8))  # warm-up: every adapter reaches the replica
            plan = [("closed", c) for c in concurrency] + [("poisson", r) for r in rates]
            for kind, value in tqdm(plan, desc="HTTP load", unit="scenario"):
                if kind == "closed":
                    timings, seconds = asyncio.run(closed_loop(url, requests, value))
                    results.append(summarise(f"HTTP, {value} concurrent", timings, seconds))
                else:
                    timings, seconds = asyncio.run(poisson(url, requests, value))
                    results.append(summarise(f"HTTP, Poisson {value:g} req/s", timings, seconds))
        finally:
            from ray import serve
            import ray

            serve.shutdown()
            ray.shutdown()
    return {"requests": n, "new_tokens": tokens, "scenarios": results}


def table(raw: dict) -> str:
    header = ["scenario", "ok / requests", "tok/s", "TTFT p50 / p90 / p99 ms", "TPOT p50 / p90 / p99 ms",
              "end-to-end p50 / p99 s"]
    rows = []
    for r in raw["scenarios"]:
        triple = lambda d: " / ".join(fmt(d[k]) for k in ("p50", "p90", "p99")) if d else "-"  # noqa: E731
        e2e = f"{fmt(r['e2e_s']['p50'], 2)} / {fmt(r['e2e_s']['p99'], 2)}" if r["e2e_s"] else "-"
        rows.append([r["name"], f"{r['ok']} / {r['requests']}", fmt(r["tok_s"]), triple(r["ttft_ms"]),
                     triple(r["tpot_ms"]), e2e])
    return markdown_table(header, rows)


def plot(raw: dict):
    http = [r for r in raw["scenarios"] if r["name"].startswith("HTTP")]
    names = [r["name"].replace("HTTP, ", "") for r in http]
    fig, (ax_tok, ax_ttft) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax_tok.bar(names, [r["tok_s"] for r in http], color="tab:blue", label="through Ray Serve (HTTP, SSE)")
    ax_tok.axhline(raw["scenarios"][0]["tok_s"], color="gray", linestyle="--", label="offline engine, all at once")
    ax_tok.set_ylabel("generated tokens / s")
    for q, color in (("p50", "tab:green"), ("p99", "tab:red")):
        ax_ttft.plot(names, [r["ttft_ms"][q] for r in http], marker="o", color=color, label=f"TTFT {q}")
        ax_ttft.plot(names, [r["tpot_ms"][q] for r in http], marker="x", linestyle=":", color=color,
                     label=f"TPOT {q}")
    ax_ttft.set_yscale("log")
    ax_ttft.set_ylabel("ms")
    for ax in (ax_tok, ax_ttft):
        ax.tick_params(axis="x", rotation=30)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"lora-serve HTTP load: SmolLM2 bf16, 1 replica, {raw['requests']} requests x "
                 f"{raw['new_tokens']} tokens, base + {len(ADAPTERS)} adapters", fontsize=10)
    return fig


def main(argv: list[str] | None = None) -> None:
    args = benchmark_args(__doc__, "small workloads: a smoke test", argv)
    transformers.logging.set_verbosity_error()
    env = environment()
    raw = {"mode": "quick" if args.quick else "full", "environment": env, **run(args.quick)}
    note = (f"Method: {raw['requests']} requests x {raw['new_tokens']} new tokens (EOS ignored), a third for the "
            f"base model and the rest spread over {len(ADAPTERS)} rank-8 q,k,v,o adapters; SmolLM2 bf16, one "
            f"engine replica (1 torch thread: a replica leaves one core to the proxy and ingress; the offline row "
            f"uses both) behind the Ray Serve HTTP proxy and ingress, all on this 2-core "
            f"machine, so the client, proxy and ingress compete with the engine for the same cores. Streams over "
            f"SSE (/generate_stream): TTFT = request sent -> first token event; TPOT = mean gap between later "
            f"events. The offline row runs the same requests in one `LLM.generate` call (its TTFT counts from "
            f"the call).")
    text = "\n".join([f"# lora-serve HTTP load benchmark ({raw['mode']})", "",
                      f"Command: `PYTHONPATH=. python -m benchmarks.run_serve_load"
                      f"{' --quick' if args.quick else ''}`  ", f"Date: {env['date']}  ",
                      f"CPU: {env['cpu']} ({env['cpu_count']} cores)", "", note, "", table(raw), "",
                      "![serve load](serve_load.png)", ""])
    save_results(args.out, "serve_load", raw, plot, text)


if __name__ == "__main__":
    main()
