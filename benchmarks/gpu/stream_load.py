"""The GPU serve benchmark's load: streamed /v1/completions in a closed loop from one aiohttp client, each stream's
events timed, summarised as tok/s, TTFT, TPOT and the gaps between a stream's events (ITL).
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from dataclasses import dataclass, field

import aiohttp
from tqdm.auto import tqdm

from benchmarks.gpu.gpu_serve_plan import WORKLOADS, Plan
from benchmarks.workloads import PROMPTS


@dataclass
class Stream:
    """One streamed request: when it was sent, when each event with a choice came and when the stream ended, the
    tokens its usage counts."""
    start: float
    events: list[float] = field(default_factory=list)
    end: float = 0.0
    tokens: int = 0
    status: int = 0
    error: str | None = None


async def stream_completion(session: aiohttp.ClientSession, url: str, model: str, prompt: str, tokens: int) -> Stream:
    stream = Stream(time.perf_counter())
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    async with session.post(f"{url}/v1/completions", json=body) as response:
        stream.status = response.status
        if response.status != 200:
            stream.error = (await response.text())[:300]
        async for line in response.content:
            if line.startswith(b"data: {"):
                _read_chunk(stream, json.loads(line[len(b"data: "):]))
    stream.end = time.perf_counter()
    return stream


def _read_chunk(stream: Stream, chunk: dict) -> None:
    if "error" in chunk:
        stream.error = json.dumps(chunk["error"])[:300]
    elif chunk.get("usage"):
        stream.tokens = chunk["usage"]["completion_tokens"]
    elif chunk.get("choices"):
        stream.events.append(time.perf_counter())


async def closed_loop(url: str, todo: list[tuple[str, str]], tokens: int, concurrency: int):
    """(streams, wall seconds) of `todo` (model, prompt), `concurrency` clients each sending its next when one ends.
    No connection limit: aiohttp's default of 100 would cap 256 streams at 100."""
    queue, done = list(reversed(todo)), []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=900)) as session:
        async def client():
            while queue:
                done.append(await stream_completion(session, url, *queue.pop(), tokens))

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
    return done, time.perf_counter() - start


def jobs(workload: str, count: int, base: str, adapters: list[str]) -> list[tuple[str, str]]:
    """(model, prompt) of each of `count` requests: the base model, or the adapters in turn."""
    return [(base if workload == "base" else adapters[i % len(adapters)], PROMPTS[i % len(PROMPTS)])
            for i in range(count)]


def percentile(values: list[float], q: float) -> float | None:
    """Nearest rank: the smallest value with at least q% of them at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)] if ordered else None


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarise(streams: list[Stream], seconds: float, tokens: int) -> dict:
    """A scenario's figures; a request counts as ok with status 200, no error and exactly `tokens` tokens."""
    ok = [s for s in streams if s.status == 200 and s.error is None and s.events and s.tokens == tokens]
    gaps = [(b - a) * 1e3 for s in ok for a, b in zip(s.events, s.events[1:])]
    return {"requests": len(streams), "ok": len(ok), "tokens": sum(s.tokens for s in ok), "seconds": seconds,
            "tok_s": sum(s.tokens for s in ok) / seconds,
            "ttft_ms_p50": _median([(s.events[0] - s.start) * 1e3 for s in ok]),
            "tpot_ms_p50": _median([(s.end - s.events[0]) / (s.tokens - 1) * 1e3 for s in ok if s.tokens > 1]),
            "itl_ms_p50": percentile(gaps, 50), "itl_ms_p99": percentile(gaps, 99),
            "events_per_request": statistics.mean(len(s.events) for s in ok) if ok else None,
            "errors": sorted({s.error or f"HTTP {s.status}, {s.tokens} tokens" for s in streams if s not in ok})[:3]}


def warm_up(url: str, plan: Plan, base: str, adapters: list[str]) -> float:
    """Every adapter into its slot, and the top concurrency's batch of each workload once, a few tokens each."""
    warm = [(m, PROMPTS[0]) for m in [base, *adapters]] + jobs("adapters", plan.top, base, adapters)
    started = time.perf_counter()
    asyncio.run(closed_loop(url, warm + jobs("base", plan.top, base, adapters), 4, plan.top))
    return time.perf_counter() - started


def run_load(url: str, plan: Plan, base: str, adapters: list[str], checkpoint) -> list[dict]:
    rows = []
    bar = tqdm(total=len(plan.loads) * len(WORKLOADS), desc="HTTP load", unit="scenario")
    for concurrency, count in plan.loads:
        for workload in WORKLOADS:
            streams, seconds = asyncio.run(closed_loop(url, jobs(workload, count, base, adapters), plan.new_tokens,
                                                       concurrency))
            rows.append({"workload": workload, "concurrency": concurrency,
                         **summarise(streams, seconds, plan.new_tokens)})
            bar.update()
            tqdm.write(f"{workload} at {concurrency}: {rows[-1]['tok_s']:.1f} tok/s, {rows[-1]['ok']}/{count} ok")
            checkpoint()
    bar.close()
    return rows
