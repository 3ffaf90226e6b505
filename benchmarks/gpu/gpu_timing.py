"""Timing on an accelerator: wall time between two device synchronisations, medians over repeats, and the device's
copy bandwidth (the yardstick of every memory-bound figure in the GPU benchmark).

Wall time with a synchronize on both sides rather than CUDA events: the engine's steps mix host work (scheduling,
sampling) with kernels, and what a user waits for is the sum of both.
"""

from __future__ import annotations

import statistics
import time

import torch


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(device: str, fn, *args, **kwargs):
    """(return value, seconds) of fn(*args, **kwargs), the device idle before and after."""
    sync(device)
    start = time.perf_counter()
    value = fn(*args, **kwargs)
    sync(device)
    return value, time.perf_counter() - start


def median_seconds(device: str, fn, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(timed(device, fn)[1] for _ in range(repeats))


def copy_bandwidth(device: str, nbytes: int, copies: int = 10) -> float:
    """Bytes per second of a large device-to-device copy, counting bytes read and bytes written. Each timing
    covers `copies` back-to-back copies, so the synchronisation's own cost stays out of the figure."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def copy():
        for _ in range(copies):
            dst.copy_(src)

    return 2 * nbytes / (median_seconds(device, copy, repeats=10, warmup=2) / copies)


def free_device(device: str) -> None:
    """Hand cached blocks back after a section's models are dropped, so the next section starts with the memory."""
    import gc

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name()
    from benchmarks.common import cpu_model

    return cpu_model()


def matmul_rate(device: str, n: int = 8192, dtype=torch.bfloat16, repeats: int = 10) -> float:
    """FLOP/s of an n x n by n x n matrix product in `dtype`, the yardstick of a compute-bound figure (prefill). The
    largest square that fits a prefill's shapes: 8,192 is the width of the 8B shape's wider projections' order."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n ** 3 / median_seconds(device, lambda: torch.matmul(a, b), repeats=repeats, warmup=2)
