"""One cell of benchmarks/serve/run_contention: the engine serving a closed loop in-process while another process
takes a share of a core, or while threads that wake and take the GIL run beside it.

    python -m benchmarks.serve.contention_worker --threads 2 --duty 0.25     # prints one JSON line
    python -m benchmarks.serve.contention_worker --duty 0.1 --busy-in engine  # the busy loop takes the GIL too
    python -m benchmarks.serve.contention_worker --concurrency 1 --requests 8 --wakers 3 --wakers-in engine

The engine is an AsyncEngine (its step loop on its own thread, as in a replica), with no Ray and no HTTP, so what
it loses here comes only from the CPU that the other process takes. The other process is benchmarks/serve/busy_loop.py;
with --busy-in engine the same loop runs as a thread of the engine's process, where it also takes the GIL that the
engine's step thread needs between its ops, as a replica's event loops do.
Run it with the replica's OpenMP runtime (run_contention preloads it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass

import psutil

from benchmarks.serve.busy_loop import start_busy_thread, start_wakers
from benchmarks.workloads import PROMPTS
from engine import AsyncEngine, EngineConfig, SamplingParams


@dataclass
class Cell:
    threads: int
    duty: float
    other_cores: float  # what the busy loop (or the other process's wakers) actually got
    tok_s: float
    tpot_ms_p50: float
    concurrency: int = 32
    wakers: int = 0
    wakers_in: str = "none"  # "engine": threads of the engine's process; "other": of another process
    busy_in: str = "other"  # the busy loop in "other" (another process) or "engine" (a thread of its own); "none"


async def stream(engine: AsyncEngine, prompt: str, params: SamplingParams) -> float:
    """TPOT of one request: (last - first token) / (tokens - 1), as the HTTP benchmark counts it."""
    first = last = None
    async for out in engine.generate(uuid.uuid4().hex, prompt, params):
        last = time.perf_counter()
        first = first or last
    return (last - first) / max(1, len(out.token_ids) - 1)


async def closed_loop(engine: AsyncEngine, prompts: list[str], params: SamplingParams,
                      concurrency: int) -> tuple[float, list[float]]:
    queue, tpots = list(prompts), []

    async def worker():
        while queue:
            tpots.append(await stream(engine, queue.pop(), params))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - start, tpots


@dataclass
class OtherProcess:
    """The busy loop or the wakers in another process (benchmarks/serve/busy_loop.py), started once it loops."""
    process: subprocess.Popen

    @classmethod
    def start(cls, *args: str) -> OtherProcess:
        process = subprocess.Popen([sys.executable, "-m", "benchmarks.serve.busy_loop", *args],
                                   stdout=subprocess.PIPE, text=True)
        assert process.stdout.readline().strip() == "ready"
        return cls(process)

    def cpu_seconds(self) -> float:
        times = psutil.Process(self.process.pid).cpu_times()
        return times.user + times.system

    def stop(self) -> None:
        self.process.kill()


class BusyThread:
    """The busy loop as a thread of the engine's process, spinning until stopped."""

    def __init__(self, duty: float):
        self._stop = threading.Event()
        self._thread = start_busy_thread(duty, self._stop)

    def cpu_seconds(self) -> float:
        return next(t.user_time + t.system_time for t in psutil.Process().threads() if t.id == self._thread.native_id)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run(args) -> Cell:
    engine = AsyncEngine(EngineConfig.from_overrides(model=args.model, dtype="bfloat16", max_num_seqs=64,
                                                     num_threads=args.threads, log_stats=False))
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    nonce = uuid.uuid4().hex[:8]  # no prefix-cache hits from an earlier cell
    prompts = [f"{nonce}-{i}: {PROMPTS[i % len(PROMPTS)]}" for i in range(args.requests)]
    asyncio.run(closed_loop(engine, prompts[:8], SamplingParams(max_tokens=4), 8))  # warm-up
    other = _start_other(args)
    try:
        before = other.cpu_seconds() if other is not None else 0.0
        seconds, tpots = asyncio.run(closed_loop(engine, prompts, params, args.concurrency))
        other_cores = (other.cpu_seconds() - before) / seconds if other is not None else 0.0
    finally:  # a busy loop left running would skew every later measurement on the machine
        if other is not None:
            other.stop()
        engine.shutdown()
    return Cell(args.threads, args.duty, other_cores, args.requests * args.tokens / seconds,
                statistics.median(tpots) * 1000, args.concurrency, args.wakers,
                args.wakers_in if args.wakers else "none", args.busy_in if args.duty > 0 else "none")


def _start_other(args) -> OtherProcess | BusyThread | None:
    """The busy loop, or the wakers: in another process, or as threads of this one (None for the wakers, whose CPU
    is not taken)."""
    if args.duty > 0 and args.busy_in == "engine":
        return BusyThread(args.duty)
    if args.duty > 0:
        return OtherProcess.start(str(args.duty))
    if args.wakers and args.wakers_in == "other":
        return OtherProcess.start("--wakers", str(args.wakers), str(args.waker_period_ms / 1000))
    if args.wakers:
        start_wakers(args.wakers, args.waker_period_ms / 1000)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--duty", type=float, default=0.0)
    parser.add_argument("--busy-in", choices=("other", "engine"), default="other",
                        help="the busy loop in another process, or as a thread of the engine's (taking its GIL)")
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--wakers", type=int, default=0, help="threads that wake every --waker-period-ms")
    parser.add_argument("--waker-period-ms", type=float, default=3.0)
    parser.add_argument("--wakers-in", choices=("engine", "other"), default="engine",
                        help="the engine's process (they contend for its GIL) or another process")
    args = parser.parse_args()
    if args.duty > 0 and args.wakers:
        parser.error("--duty and --wakers measure different things: give one of them")
    if args.busy_in == "engine" and not args.duty > 0:
        parser.error("--busy-in engine places the busy loop: give its --duty too")
    print(json.dumps(asdict(run(args))), flush=True)


if __name__ == "__main__":
    main()
