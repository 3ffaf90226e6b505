"""Where a tensor-parallel engine's workers (ranks 1..N-1) run: the protocols the executor starts, watches and
stops them through, and their local implementation.

- `WorkerLauncher`: starts one worker per `WorkerSpec` (each runs worker.py's `worker_main`), says at which host
  the workers reach the driver's rendezvous, and which device each rank runs on as its own process sees it (a
  local process sees every GPU of the node: rank r takes the r-th; a Ray actor sees only its bundle's GPU). Serving implements it with Ray actors in the replica's placement group
  (deployments/replica/tensor_parallel_workers.py); the engine knows nothing of Ray.
- `WorkerGroup`: the started workers: `check` raises `WorkerDiedError` for one that is gone, naming its rank, before
  a step is sent to it and when a step's collective fails, rather than leaving the driver to wait.
- `LocalLauncher` and `WorkerProcesses`, the offline default: local processes forked by torch.multiprocessing's
  "forkserver", a single-threaded server that has imported torch and the worker but run nothing (no forked OpenMP
  or CUDA state, as with "spawn", without an interpreter's imports per worker). A script that builds a
  tensor-parallel engine at import must guard it with `if __name__ == "__main__":`, as multiprocessing requires.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Protocol

import torch
import torch.multiprocessing as mp

from engine.executor.worker import WorkerSpec, worker_main
from engine.platform import platform_of

STOP_TIMEOUT_S = 30.0  # a worker told to stop exits within this, or is killed
DEATH_GRACE_S = 5.0  # after a failed collective, how long the driver waits to see which worker died
# Imported once by the fork server, so that each worker it forks starts with torch and the engine loaded, rather
# than importing them afresh as an interpreter of its own would (about 3 s a worker on 2 cores).
FORKSERVER_PRELOAD = ("torch", "engine.executor.worker")


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker is gone: the engine cannot step without its shard."""


class WorkerGroup(Protocol):
    def check(self, grace_s: float = 0.0) -> None:
        """Raise WorkerDiedError for the first worker that has exited, waiting up to grace_s for one to."""

    def alive(self) -> bool:
        """Whether every worker still runs."""

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Wait up to timeout_s for the workers to exit (they were told to, or the driver's group is gone), then
        kill the rest."""


class WorkerLauncher(Protocol):
    def host(self) -> str:
        """The address at which every worker reaches the driver (the rendezvous host)."""

    def devices(self, size: int, device: torch.device) -> list[torch.device]:
        """Each rank's device, the driver's (rank 0) first, for a group of `size` on `device`'s type; ValueError
        where the workers cannot each have a GPU of their own, naming both numbers."""

    def start(self, specs: list[WorkerSpec]) -> WorkerGroup:
        """One worker per spec, each running worker_main(spec)."""


class LocalLauncher:
    """Workers as local processes of this machine."""

    def host(self) -> str:
        return "127.0.0.1"

    def devices(self, size: int, device: torch.device) -> list[torch.device]:
        return platform_of(device).rank_devices(size, device)

    def start(self, specs: list[WorkerSpec]) -> WorkerProcesses:
        return WorkerProcesses.spawn(specs)


@dataclass
class WorkerProcesses:
    processes: list[BaseProcess]  # ranks 1..N-1, in order

    @classmethod
    def spawn(cls, specs: list[WorkerSpec]) -> WorkerProcesses:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
        processes = [ctx.Process(target=worker_main, args=(spec,), name=f"tensor-parallel-rank-{spec.rank}",
                                 daemon=True) for spec in specs]
        for process in processes:
            process.start()
        return cls(processes)

    def check(self, grace_s: float = 0.0) -> None:
        deadline = time.monotonic() + grace_s
        while True:
            for rank, process in enumerate(self.processes, start=1):
                if process.exitcode is not None:
                    raise WorkerDiedError(f"tensor-parallel worker rank {rank} (pid {process.pid}) exited with code "
                                          f"{process.exitcode}: the engine cannot run its shard without it")
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def alive(self) -> bool:
        return all(process.exitcode is None for process in self.processes)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join()
