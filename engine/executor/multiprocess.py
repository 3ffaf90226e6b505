"""The multiprocess tensor-parallel executor: rank 0 is the driver, in the engine's process, and ranks 1..N-1
are worker processes (worker.py) that a `WorkerLauncher` starts (workers.py: local processes offline, Ray actors in
the replica's placement group under Serve), over one group: gloo on CPU, NCCL on CUDA, where each rank has a GPU
of its own (the launcher says which) and runs eager (no CUDA graphs: engine/backends/cuda.py). A step's batch
travels through the host (ForwardBatch.portable), and each worker carries it to its own GPU.

The scheduler, block manager, sampler and detokenizer stay in the engine, which sees this executor as it sees the
in-process one (engine/executor/__init__.py). Per step the driver prepares the step's `ForwardBatch` once, broadcasts it
(step_channel.py), runs its own shard's forward and samples from the logits, which every rank holds whole after
the LM head's all-gather. Nothing else a step does touches the workers' caches: the block manager's prefix caching
shares blocks by table (no copies), preemption recomputes (no swaps), so the batch is all they need.

Faults: a worker that has exited is reported (WorkerDiedError) before a step is sent, and when a step's
collective fails (its sockets closed), by rank and exit code; a worker that hangs without exiting is caught by the
model group's deadline (process_group.RENDEZVOUS_TIMEOUT) in the driver's next collective. Restarting workers is
not done: the engine is then closed. `close` (and, failing that, interpreter exit or the executor's collection)
tells the workers to stop, waits for them, kills any left, and leaves the group.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.distributed.parallel import TensorParallel
from engine.distributed.process_group import free_address, join, leave
from engine.executor.step_channel import CopyAdapter, StepChannel, StopWorkers
from engine.executor.worker import WorkerSpec, build_runner, on_rank_device
from engine.executor.workers import DEATH_GRACE_S, STOP_TIMEOUT_S, LocalLauncher, WorkerGroup, WorkerLauncher
from engine.lora.provider import LoRAAdapter
from engine.lora.shards import adapter_shard, lora_layout, rank_view
from engine.model_runner import StepResult
from engine.models import check_tensor_parallel
from engine.scheduler import ScheduledSeq


def refuse_unsupported(config: EngineConfig, hf_config) -> None:
    """What tensor parallelism does not run yet, refused by name before any worker starts, and sizes the model
    does not split, naming both numbers."""
    size = config.backend.tensor_parallel_size
    check_tensor_parallel(hf_config, size)
    if config.model.quantization != "none":
        raise ValueError(f"quantization {config.model.quantization!r} under tensor parallelism is not supported yet")
    if config.scheduler.async_scheduling:
        raise ValueError("async_scheduling under tensor parallelism is not supported yet")


class MultiprocessExecutor:
    def __init__(self, config: EngineConfig, path: Path, hf_config, max_model_len: int,
                 launcher: WorkerLauncher | None = None):
        """launcher: where ranks 1..N-1 run; None: local processes (LocalLauncher)."""
        launcher = launcher or LocalLauncher()
        size, address = config.backend.tensor_parallel_size, free_address(launcher.host())
        devices = [str(device) for device in launcher.devices(size, config.backend.torch_device)]
        specs = [WorkerSpec(rank, size, address, config, str(path), max_model_len, devices[rank])
                 for rank in range(1, size)]
        config = on_rank_device(config, devices[0])
        self.workers = launcher.start(specs)
        self.parallel: TensorParallel | None = None
        try:
            self.parallel = join(0, size, address, config.backend.torch_device)
            self.channel = StepChannel(self.parallel)
            self.runner = build_runner(config, path, hf_config, max_model_len, self.parallel)
            self.layout = lora_layout(self.runner.model) if config.lora.max_loras else None
        except BaseException:
            _shut_down(self.workers, None, self.parallel, stop_timeout_s=0.0)  # they may wait on this rank: kill
            raise
        self._finalizer = weakref.finalize(self, _shut_down, self.workers, self.channel, self.parallel)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq], pending_tokens: torch.Tensor | None = None) -> StepResult:
        self.workers.check()
        step = self.runner.prepare(self.runner.decodes_first(scheduled), pending_tokens)
        try:
            self.channel.send(step.forward.portable())
            return self.runner.run(step)
        except RuntimeError:
            self.workers.check(DEATH_GRACE_S)  # a worker's death explains the failure: say so
            raise

    def copy_adapter(self, slot: int, adapter: LoRAAdapter) -> None:
        """Each rank's shard of the adapter into its slot `slot`: every worker is sent its own shard only."""
        self.workers.check()
        parallel = self.parallel
        shards = [adapter_shard(adapter, self.layout, rank_view(parallel, r)) for r in range(parallel.world_size)]
        self.channel.send(CopyAdapter(slot))
        for rank in range(1, parallel.world_size):
            self.channel.send_to(rank, shards[rank])
        self.runner.copy_adapter(slot, shards[0])

    def alive(self) -> bool:
        return self.workers.alive()

    def close(self) -> None:
        self._finalizer()


def _shut_down(workers: WorkerGroup, channel: StepChannel | None, parallel: TensorParallel | None,
               stop_timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Tell the workers to stop (if they can still hear), wait for them, kill any left, leave the group."""
    if channel is not None and workers.alive():
        try:
            channel.send(StopWorkers())
        except RuntimeError:
            pass  # a worker is gone already: the others' receive fails as the group closes
    workers.stop(stop_timeout_s)
    if parallel is not None:
        leave(parallel)
