"""The GPU serve benchmark's sizes and names, which its phases share (benchmarks/gpu/run_gpu_serve.py)."""

from __future__ import annotations

from dataclasses import dataclass

NAME = "gpu_serve"
HAPROXY_BINARY = "RAY_SERVE_HAPROXY_BINARY_PATH"
SHARE_BAR = 0.9
WORKLOADS = ("base", "adapters")


@dataclass(frozen=True)
class Plan:
    """Sizes of a run: `full()` the benchmark, `quick()` shorter on the device, `tiny()` the CPU smoke run."""
    shape: str
    new_tokens: int
    loads: tuple[tuple[int, int], ...]  # (concurrent streams, requests)
    adapters: int
    rank: int
    check_tokens: int  # new tokens of each route check

    @property
    def top(self) -> int:
        return max(c for c, _ in self.loads)

    @staticmethod
    def full() -> Plan:
        return Plan("llama-3-8b", 64, ((1, 8), (32, 64), (256, 256)), 16, 16, 8)

    @staticmethod
    def quick() -> Plan:
        return Plan("llama-3-8b", 32, ((1, 4), (32, 32), (256, 256)), 16, 16, 8)

    @staticmethod
    def tiny() -> Plan:
        return Plan("llama-3-8b", 8, ((1, 2), (4, 8)), 4, 8, 4)


def error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:4000]
