"""CPU in short bursts: spin for `duty` of every PERIOD_S, sleep for the rest, in another process or as a thread of
the engine's (where the spin holds the GIL); or Python threads that wake and take the GIL many times a second,
almost for free.

    python -m benchmarks.serve.busy_loop 0.25
    python -m benchmarks.serve.busy_loop --wakers 3 0.003     # 3 threads, each waking every 3 ms

Standard library only, so it starts in milliseconds; it prints "ready" once it loops. The HTTP proxy, the ingress
and Ray's own processes take the CPU this way: they wake for a little work many times a second. A Ray worker's
main thread wakes every 10 ms to check for signals, under the GIL, and a replica's event loops wake for each event.
"""

from __future__ import annotations

import sys
import threading
import time

PERIOD_S = 0.01


def busy_loop(duty: float) -> None:
    print("ready", flush=True)
    _spin(duty, threading.Event())


def start_busy_thread(duty: float, stop: threading.Event) -> threading.Thread:
    """The busy loop as a daemon thread of this process, until `stop` is set: its spins hold the GIL, as a replica's
    event loops do."""
    thread = threading.Thread(target=_spin, args=(duty, stop), daemon=True, name="busy-loop")
    thread.start()
    return thread


def _spin(duty: float, stop: threading.Event) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        while time.perf_counter() - start < duty * PERIOD_S:
            pass
        time.sleep((1 - duty) * PERIOD_S)


def start_wakers(count: int, period_s: float) -> None:
    """`count` daemon threads, each taking the GIL every `period_s` (a sleep's return) and doing nothing else."""
    for _ in range(count):
        threading.Thread(target=_wake_forever, args=(period_s,), daemon=True).start()


def _wake_forever(period_s: float) -> None:
    while True:
        time.sleep(period_s)


if __name__ == "__main__":
    if sys.argv[1] == "--wakers":
        start_wakers(int(sys.argv[2]), float(sys.argv[3]))
        print("ready", flush=True)
        threading.Event().wait()
    else:
        busy_loop(float(sys.argv[1]))
