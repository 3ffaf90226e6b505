"""The engine replica's OpenMP runtime: Intel's libiomp5, preloaded; chosen by measurement.

torch's CPU wheel ships GNU OpenMP (libgomp). In a Serve replica the engine steps on a thread of its own, not the
process's first thread; libgomp then counts more of its threads than there are cores and throttles its spin-wait
to a few hundred iterations, so every parallel op wakes its other thread through the kernel: an op on 2 torch
threads ran slower on another thread than on the main one, slower even than on 1 thread there. That is why two
torch threads served fewer tokens than one in a replica. Intel's runtime has no such penalty; vLLM's CPU build
preloads it too.

The engine's own C++ operators run on threads of their own (engine/kernels/cpu/work_pool.cpp), which spin
between a step's operators; OpenMP runs only torch's few parallel ops of a step (an embedding gather, an
index). Intel's threads would spin for KMP_BLOCKTIME (200 ms by default) after each of those, on the cores the
operators' threads need, and decode steps ran slower that way than with KMP_BLOCKTIME=0. So the replica sets it
to 0: OpenMP's threads sleep as soon as torch's op ends. The runtime comes from the `intel-openmp` package
(lib/libiomp5.so under the Python prefix); without it a replica keeps libgomp and leaves a core to the proxy
(deployments/replica/llm_server.py).
"""

from __future__ import annotations

import sys
from pathlib import Path


def intel_openmp_library() -> Path | None:
    library = Path(sys.prefix) / "lib" / "libiomp5.so"
    return library if library.exists() else None


def replica_env_vars() -> dict[str, str]:
    """Environment variables for an engine replica's process (set before it starts: LD_PRELOAD is read at exec)."""
    library = intel_openmp_library()
    if library is None:
        return {}
    return {"LD_PRELOAD": str(library), "KMP_BLOCKTIME": "0"}


def intel_openmp_loaded() -> bool:
    """Whether this process runs Intel's OpenMP runtime."""
    try:
        with open("/proc/self/maps") as maps:
            return "libiomp5" in maps.read()
    except OSError:
        return False
