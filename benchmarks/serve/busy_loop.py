"""Another process's CPU, in short bursts: spin for `duty` of every PERIOD_S, sleep for the rest.

    python -m benchmarks.serve.busy_loop 0.25

Standard library only, so it starts in milliseconds; it prints "ready" once it loops. The HTTP proxy, the ingress
and Ray's own processes take the CPU this way: they wake for a little work many times a second.
"""

from __future__ import annotations

import sys
import time

PERIOD_S = 0.01


def busy_loop(duty: float) -> None:
    print("ready", flush=True)
    while True:
        start = time.perf_counter()
        while time.perf_counter() - start < duty * PERIOD_S:
            pass
        time.sleep((1 - duty) * PERIOD_S)


if __name__ == "__main__":
    busy_loop(float(sys.argv[1]))
