"""A tensor-parallel worker process (ranks 1..N-1; rank 0 is the driver, in the engine's process).

Each worker takes its device (on CUDA a GPU of its own, made the current one), joins the group, builds its
ModelRunner over its rank's shard (engine/distributed/: its heads, its
MLP columns, its vocabulary slice) and a KV cache of its own KV heads with as many blocks as the driver's, then
loops: it receives the step's `ForwardBatch` from the driver (step_channel.py), runs the same forward and computes
the same logits, whose collectives meet the driver's, and drops them; the driver samples. `StopWorkers` ends the
loop. An error in a worker ends its process at once (its traceback on stderr, its group not torn down), which
breaks the driver's collective now rather than at the group's deadline.
"""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.distributed.parallel import TensorParallel
from engine.distributed.process_group import join, leave
from engine.executor.step_channel import CopyAdapter, StepChannel, StopWorkers
from engine.model_runner import ModelRunner
from engine.platform import platform_of


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker process needs to build its shard (pickled into its process)."""
    rank: int
    world_size: int
    address: str  # the group's rendezvous, tcp://host:port
    config: EngineConfig
    model_path: str
    max_model_len: int
    device: str  # this rank's device as its own process sees it (WorkerLauncher.devices)


def build_runner(config: EngineConfig, path: Path, hf_config, max_model_len: int,
                 parallel: TensorParallel) -> ModelRunner:
    """This rank's runner; every rank allocates the fewest KV blocks any rank's budget allows."""
    return ModelRunner(config, path, hf_config, max_model_len, parallel,
                       agree_blocks=lambda count: fewest_blocks(parallel, count, config.backend.torch_device))


def on_rank_device(config: EngineConfig, device: str) -> EngineConfig:
    """The engine's config as one rank runs it: on its own device, made the current one (engine/platform.py)."""
    config = config.with_options(device=device)
    platform_of(config.backend.torch_device).make_current(config.backend.torch_device)
    return config


def fewest_blocks(parallel: TensorParallel, count: int, device: torch.device) -> int:
    """The fewest KV blocks any rank's budget allows (NCCL reduces device tensors only)."""
    blocks = torch.tensor([count], dtype=torch.long, device=device)
    dist.all_reduce(blocks, op=dist.ReduceOp.MIN, group=parallel.group)
    return int(blocks.item())


def worker_main(spec: WorkerSpec) -> None:
    """A worker process's life: join, build, serve steps until told to stop, leave."""
    from transformers import AutoConfig

    config = on_rank_device(spec.config, spec.device)
    platform_of(config.backend.torch_device).set_threads(config.backend.threads_per_worker)  # as the driver's
    parallel = join(spec.rank, spec.world_size, spec.address, config.backend.torch_device)
    try:
        channel = StepChannel(parallel)
        path = Path(spec.model_path)
        runner = build_runner(config, path, AutoConfig.from_pretrained(path), spec.max_model_len, parallel)
        serve_steps(runner, channel)
    except BaseException:  # noqa: BLE001 - whatever failed, the process ends now
        end_process_now()
    leave(parallel)


def end_process_now() -> None:
    """A failed worker leaves its process at once, its traceback on stderr. Tearing its group down instead could
    wait on a collective that the other ranks never finish, and a Ray actor's process outlives its failed call:
    either way its sockets would stay open and the driver would wait out the group's deadline, not fail now."""
    traceback.print_exc()
    sys.stderr.flush()
    os._exit(1)


def serve_steps(runner: ModelRunner, channel: StepChannel) -> None:
    while True:
        message = channel.receive()
        if isinstance(message, StopWorkers):
            return
        if isinstance(message, CopyAdapter):
            runner.copy_adapter(message.slot, channel.receive_shard())
            continue
        runner.run_forward(message)
