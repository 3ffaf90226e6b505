"""Host memory that a step frees, kept for the next step: glibc's malloc told once not to hand it back.

A prefill step on CPU allocates its activations afresh in every layer (a chunk of 4,096 tokens makes tensors of
several MB to tens of MB), and frees them before the next layer. glibc serves an allocation above its mmap
threshold with a fresh mapping and returns it to the kernel on free, and it trims the top of its heap once the free
space there passes its trim threshold; either way the next layer's tensors land on pages the kernel must fault in
and zero again, a large share of a prefill step on a small CPU (docs/benchmarks.md). So the engine, on CPU, raises
both thresholds: allocations up to `MMAP_THRESHOLD` come from the heap, and up to `TRIM_THRESHOLD` of freed heap
stays mapped, to be reused. The memory kept is what a step's peak already used.

mallopt governs the arena of the calling thread's process at once, but a thread that first allocates in an arena of
its own (an engine stepping on a server's thread) keeps that arena's own trimming. A server process therefore
starts with the same settings as glibc tunables (`GLIBC_TUNABLES`, read when the process starts), with one arena,
so every thread allocates from the main heap (`process_env`). Elsewhere than glibc both are no-ops.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

MMAP_THRESHOLD = 32 << 20  # the ceiling of glibc's own dynamic threshold on 64-bit
TRIM_THRESHOLD = 512 << 20
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)


def on_glibc() -> bool:
    return platform.libc_ver()[0] == "glibc"


def keep_freed_memory() -> bool:
    """Raise this process's malloc thresholds (idempotent); whether glibc took both."""
    if not on_glibc():
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def process_env(existing: str | None = None) -> dict[str, str]:
    """The environment that starts a process with these settings for all its threads, after any tunables the
    caller already sets (`existing`: its GLIBC_TUNABLES), which win."""
    if not on_glibc():
        return {}
    ours = (f"glibc.malloc.arena_max=1:glibc.malloc.mmap_threshold={MMAP_THRESHOLD}"
            f":glibc.malloc.trim_threshold={TRIM_THRESHOLD}")
    return {"GLIBC_TUNABLES": f"{ours}:{existing}" if existing else ours}
