"""The executor: what runs a step's forward for the engine. The engine schedules, manages blocks, samples and
detokenizes in its own process; it hands each step's scheduled sequences to its executor and gets back what the
sampler needs (`StepResult`: the logits of the rows that sample, and the prompt scores), however many workers
computed them.

- `InProcessExecutor`: one worker, the engine's own ModelRunner (tensor_parallel_size 1): the runner's call as it
  is, no copy, no process.
- `multiprocess.MultiprocessExecutor`: tensor_parallel_size N > 1: rank 0's runner in this process (the driver),
  ranks 1..N-1 in worker processes (`worker.py` is their loop), each step's `ForwardBatch` broadcast to them once
  (`step_channel.py`). Where the workers run is the caller's `WorkerLauncher` (`workers.py`, with the offline one:
  local processes from a fork server); Serve's starts Ray actors in the replica's placement group.

Either exposes its rank-0 `runner`, whose KV layout, operators and memory report the engine reads (under tensor
parallelism they are one worker's: its KV heads and its share of the weights).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from engine.config import EngineConfig
from engine.model_runner import ModelRunner, StepResult
from engine.scheduler import ScheduledSeq

if TYPE_CHECKING:
    from engine.executor.workers import WorkerLauncher


class Executor(Protocol):
    runner: ModelRunner  # rank 0's

    def execute(self, scheduled: list[ScheduledSeq], pending_tokens: torch.Tensor | None = None) -> StepResult:
        """One step's forward over every worker: the logits to sample and the step's prompt scores."""

    def copy_adapter(self, slot: int, adapter) -> None:
        """A LoRAAdapter's weights into device slot `slot` (of every worker)."""

    def alive(self) -> bool:
        """Whether every worker still runs (always, with none)."""

    def close(self) -> None:
        """Stop the workers, if any (idempotent)."""


class InProcessExecutor:
    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def execute(self, scheduled: list[ScheduledSeq], pending_tokens: torch.Tensor | None = None) -> StepResult:
        return self.runner.execute(scheduled, pending_tokens)

    def copy_adapter(self, slot: int, adapter) -> None:
        self.runner.copy_adapter(slot, adapter)

    def alive(self) -> bool:
        return True

    def close(self) -> None:
        pass


def start_executor(config: EngineConfig, path: Path, hf_config, max_model_len: int,
                   workers: WorkerLauncher | None = None) -> Executor:
    """The executor config.backend.tensor_parallel_size asks for; above 1, what it cannot run is refused by name first.
    workers: a WorkerLauncher for ranks 1..N-1 (None: local processes)."""
    if config.backend.tensor_parallel_size == 1:
        return InProcessExecutor(ModelRunner(config, path, hf_config, max_model_len))
    from engine.executor.multiprocess import MultiprocessExecutor, refuse_unsupported

    refuse_unsupported(config, hf_config)
    return MultiprocessExecutor(config, path, hf_config, max_model_len, workers)
