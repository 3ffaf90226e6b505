"""The spawned worker processes of a tensor-parallel engine: started with torch.multiprocessing's "spawn" (a fresh
interpreter each: no forked torch or OpenMP state; a script that builds a tensor-parallel engine at import must
guard it with `if __name__ == "__main__":`, as multiprocessing requires), watched, and stopped.

A worker that dies is reported by rank, process id and exit code (`WorkerDiedError`), before a step is sent to it
and when a step's collective fails, rather than leaving the driver to wait.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

import torch.multiprocessing as mp

from engine.distributed.worker import WorkerSpec, worker_main

STOP_TIMEOUT_S = 30.0  # a worker told to stop exits within this, or is killed
DEATH_GRACE_S = 5.0  # after a failed collective, how long the driver waits to see which worker died


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker is gone: the engine cannot step without its shard."""


@dataclass
class WorkerProcesses:
    processes: list[BaseProcess]  # ranks 1..N-1, in order

    @classmethod
    def spawn(cls, specs: list[WorkerSpec]) -> WorkerProcesses:
        ctx = mp.get_context("spawn")
        processes = [ctx.Process(target=worker_main, args=(spec,), name=f"tensor-parallel-rank-{spec.rank}",
                                 daemon=True) for spec in specs]
        for process in processes:
            process.start()
        return cls(processes)

    def check(self, grace_s: float = 0.0) -> None:
        """Raise WorkerDiedError for the first worker that has exited, waiting up to grace_s for one to."""
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
        """Wait for the workers to exit (they were told to, or their driver's group is gone); kill the rest."""
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join()
