"""Host memory that a step frees, kept for the next step: an engine process started with glibc malloc's tunables.

A prefill step on CPU allocates its activations afresh in every layer (a chunk of 4,096 tokens makes tensors of
several MB to tens of MB), and frees them before the next layer. On glibc's defaults the freed heap top is trimmed
and large blocks are unmapped, so the next layer's tensors land on pages the kernel must fault in and zero again, a
large share of a prefill step on a small CPU (docs/benchmarks.md). A process started with glibc's tunables
(`GLIBC_TUNABLES`, read when a process starts, so they hold for every thread) keeps that memory: allocations up to
`MMAP_THRESHOLD` come from the heap, up to `TRIM_THRESHOLD` of freed heap stays mapped, and every thread allocates
from the one main heap. The last matters: a thread's own arena grows in heaps of at most 64 MiB, which it unmaps as
soon as they are empty, so raised thresholds alone (mallopt, once a process runs) left an engine stepping on a
server's thread faulting as much as before. The memory kept is what a step's peak already used.

CPU engine replicas start with the variable `process_env()` gives (deployments/app.py: their runtime_env); an
offline script gets it on the command that starts it (docs/usage.md). Elsewhere than glibc there is nothing to set.
"""

from __future__ import annotations

import platform

MMAP_THRESHOLD = 32 << 20  # the ceiling of glibc's own dynamic threshold on 64-bit
TRIM_THRESHOLD = 512 << 20


def on_glibc() -> bool:
    return platform.libc_ver()[0] == "glibc"


def process_env(existing: str | None = None) -> dict[str, str]:
    """The environment that starts a process with these settings for all its threads, after any tunables the
    caller already sets (`existing`: its GLIBC_TUNABLES), which win."""
    if not on_glibc():
        return {}
    ours = (f"glibc.malloc.arena_max=1:glibc.malloc.mmap_threshold={MMAP_THRESHOLD}"
            f":glibc.malloc.trim_threshold={TRIM_THRESHOLD}")
    return {"GLIBC_TUNABLES": f"{ours}:{existing}" if existing else ours}
