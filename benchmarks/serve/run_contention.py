"""What another process's CPU costs the engine: the in-process engine at 32 streams beside a busy loop; and what
threads that take the GIL cost it at one stream, in its own process or in another.

    PYTHONPATH=. python -m benchmarks contention            # full run
    PYTHONPATH=. python -m benchmarks contention --quick

Each cell (benchmarks/serve/contention_worker.py) runs SmolLM2 bf16 in an AsyncEngine, 96 closed-loop requests of 64
tokens at 32 concurrent, no Ray and no HTTP, with the engine replica's OpenMP runtime and malloc tunables, while a
busy loop in another process (benchmarks/serve/busy_loop.py) takes 0 to 30% of a core in short bursts, as a serving
stack's proxy, ingress and Ray processes do; and, with 2 engine threads, the same loop as a thread of the engine's
own process, where its spins also hold the GIL that the step thread needs between ops, as a replica's event loops
do (what running the engine in a process of its own, apart from the replica's event loops, could win).
On 2 cores with 2 engine threads, a burst preempts one of them in the middle of a parallel op. On OpenMP's loops
the other one waits for it at the op's end, so the engine loses several times the CPU the other process takes; on
the C++ operators' own loop (engine/kernels/cpu/work_pool.cpp) it takes the preempted thread's chunks, and the
engine loses more than the CPU taken only while its step thread, which starts every op, is the one preempted. With
1 engine thread the other core absorbs the bursts.

The second part runs one stream (8 requests of 64 tokens) with 3 threads that each wake every 3 ms (1,000 wake-ups
a second, about what a replica's Ray main thread and event loops make under one stream) and do nothing else: in
the engine's own process, where each wake-up takes the GIL that the engine's step thread needs between its ops,
or in another process, where they take only CPU. Rounds are interleaved. Writes contention.md and contention.png
to benchmarks/results/KIND/ and contention.json to benchmarks/runs/KIND/ (benchmarks/common.py: save_results).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from benchmarks.common import (benchmark_args, environment, fmt, markdown_table, report_header,  # noqa: E402
                               save_results)
from benchmarks.serve.http_servers import ROOT  # noqa: E402
from deployments.replica.openmp import replica_env_vars  # noqa: E402
from engine import host_heap  # noqa: E402

DUTIES = (0.0, 0.1, 0.2, 0.3)
THREADS = (2, 1)
IN_ENGINE_DUTIES = (0.1, 0.3)  # the busy loop as a thread of the engine's process, with 2 engine threads
# every (engine threads, busy loop's duty, where it runs) a round measures, in the table's order
BUSY_SETTINGS = tuple((t, d, "other") for t in THREADS for d in DUTIES) + tuple((2, d, "engine")
                                                                                 for d in IN_ENGINE_DUTIES)
WAKERS = 3
WAKER_PERIOD_MS = 3
WAKERS_IN = ("none", "engine", "other")


def cell(*options: str) -> dict:
    env = {**os.environ, **replica_env_vars(), **host_heap.process_env(os.environ.get("GLIBC_TUNABLES")),
           "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "benchmarks.serve.contention_worker", *options]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def busy_cell(threads: int, duty: float, requests: int, busy_in: str = "other") -> dict:
    where = ["--busy-in", busy_in] if duty > 0 else []
    return cell("--threads", str(threads), "--duty", str(duty), "--requests", str(requests), *where)


def waker_cell(wakers_in: str, requests: int) -> dict:
    wakers = ["--wakers", str(WAKERS), "--wakers-in", wakers_in, "--waker-period-ms", str(WAKER_PERIOD_MS)] \
        if wakers_in != "none" else []
    return cell("--concurrency", "1", "--requests", str(requests), *wakers)


def run(args) -> dict:
    requests, single = (32, 4) if args.quick else (96, 8)
    cells, wakes = [], []
    with tqdm(total=args.rounds * (len(BUSY_SETTINGS) + len(WAKERS_IN)), desc="contention", unit="cell") as bar:
        for rnd in range(args.rounds):
            for threads, duty, busy_in in (BUSY_SETTINGS if rnd % 2 == 0 else BUSY_SETTINGS[::-1]):
                cells.append({"round": rnd, **busy_cell(threads, duty, requests, busy_in)})
                bar.update()
                tqdm.write(f"round {rnd} threads={threads} duty={duty} in {busy_in}: {cells[-1]['tok_s']:.1f} tok/s")
            order = WAKERS_IN if rnd % 2 == 0 else WAKERS_IN[::-1]
            for wakers_in in order:
                wakes.append({"round": rnd, **waker_cell(wakers_in, single)})
                bar.update()
                tqdm.write(f"round {rnd} one stream, wakers in {wakers_in}: {wakes[-1]['tpot_ms_p50']:.1f} ms TPOT")
    return {"requests": requests, "single_requests": single, "rounds": args.rounds, "cells": cells, "wakes": wakes}


def _cells(raw: dict, threads: int, duty: float, busy_in: str = "other") -> list[dict]:
    """A setting's cells; the cells with no busy loop serve as the baseline of both places."""
    return [c for c in raw["cells"] if c["threads"] == threads and c["duty"] == duty
            and (duty == 0 or c.get("busy_in", "other") == busy_in)]


def wakes_table(raw: dict) -> str:
    """One stream: TPOT with no wakers, with wakers in the engine's process, and in another process."""
    by = {w: [c for c in raw.get("wakes", []) if c["wakers_in"] == w] for w in WAKERS_IN}
    if not all(by.values()):
        return ""
    alone = _median(by["none"], "tpot_ms_p50")
    where = {"none": "none", "engine": f"{WAKERS} threads of the engine's process (they take its GIL)",
             "other": f"{WAKERS} threads of another process"}
    rows = [[where[w], fmt(_median(by[w], "tpot_ms_p50"), 1),
             " / ".join(fmt(c["tpot_ms_p50"], 1) for c in by[w]), f"{_median(by[w], 'tpot_ms_p50') / alone:.2f}x",
             fmt(_median(by[w], "tok_s"), 1)] for w in WAKERS_IN]
    return markdown_table([f"threads waking every {WAKER_PERIOD_MS} ms", "TPOT p50 ms (median)", "per round", "of none",
                           "tok/s"], rows)


def _median(cells: list[dict], key: str) -> float:
    return statistics.median(c[key] for c in cells)


def table(raw: dict) -> str:
    """Per engine threads, busy-loop share and place: tok/s, TPOT, and engine throughput lost per core taken."""
    rows = [_row(raw, *setting) for setting in BUSY_SETTINGS if _cells(raw, *setting)]
    return markdown_table(["engine threads", "busy loop in", "busy loop (cores)", "tok/s", "of alone", "per round",
                           "TPOT p50 ms", "engine cores lost per core taken"], rows)


def _row(raw: dict, threads: int, duty: float, busy_in: str) -> list:
    cores, alone = raw["environment"]["cpu_count"], _median(_cells(raw, threads, 0.0), "tok_s")
    cells = _cells(raw, threads, duty, busy_in)
    taken, tok_s = _median(cells, "other_cores"), _median(cells, "tok_s")
    lost = (1 - tok_s / alone) * cores  # the engine's throughput lost, in cores of this machine
    place = "-" if duty == 0 else {"other": "another process", "engine": "the engine's process"}[busy_in]
    return [threads, place, fmt(taken, 2), fmt(tok_s, 1), f"{tok_s / alone:.0%}",
            " / ".join(fmt(c["tok_s"], 1) for c in cells), fmt(_median(cells, "tpot_ms_p50"), 1),
            fmt(lost / taken, 1) if taken else "-"]


def plot(raw: dict):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for threads in THREADS:
        xs = [_median(_cells(raw, threads, d), "other_cores") for d in DUTIES]
        ys = [_median(_cells(raw, threads, d), "tok_s") for d in DUTIES]
        ax.plot(xs, ys, marker="o", label=f"{threads} engine thread{'s' if threads > 1 else ''}, busy loop in "
                                          f"another process")
    if all(_cells(raw, 2, d, "engine") for d in IN_ENGINE_DUTIES):
        duties = (0.0,) + IN_ENGINE_DUTIES
        ax.plot([_median(_cells(raw, 2, d, "engine"), "other_cores") for d in duties],
                [_median(_cells(raw, 2, d, "engine"), "tok_s") for d in duties], marker="s", linestyle="--",
                label="2 engine threads, busy loop in the engine's process (GIL)")
    ax.set_xlabel("CPU taken by the busy loop (cores)")
    ax.set_ylabel("generated tokens / s (32 streams)")
    ax.set_title(f"Engine beside a busy loop: SmolLM2 bf16, 2 cores, median of {raw['rounds']} rounds",
                 fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower left", bbox_to_anchor=(0.0, 0.08), fontsize=8)
    return fig


def add_arguments(parser) -> None:
    parser.add_argument("--rounds", type=int, default=2)


def main(argv: list[str] | None = None) -> None:
    args = benchmark_args(__doc__, "32 requests per cell", argv, add_arguments)
    env = environment()
    raw = {"mode": "quick" if args.quick else "full", "environment": env, **run(args)}
    method = (f"Method: AsyncEngine in-process (no Ray, no HTTP), SmolLM2 bf16, Intel OpenMP, {raw['requests']} "
              f"closed-loop requests x 64 tokens at 32 concurrent; a busy loop spins for a share of every 10 ms, in "
              f"another process or as a thread of the engine's; {raw['rounds']} interleaved rounds (each in the "
              f"other's order), medians.")
    wakes = (f"One stream ({raw['single_requests']} requests x 64 tokens, 2 engine threads) beside {WAKERS} Python "
             f"threads that each wake every {WAKER_PERIOD_MS} ms and do nothing else, in the engine's process or in "
             f"another one:")
    title = f"Engine beside another process's CPU ({raw['mode']})"
    text = "\n".join(report_header(title, args.command, env)
                     + [method, "", table(raw), "", wakes, "", wakes_table(raw), "", "![contention](contention.png)",
                        ""])
    save_results(args.folders, "contention", raw, plot, text)


if __name__ == "__main__":
    main()
