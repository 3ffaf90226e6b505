"""Joining a tensor-parallel group: one process per worker, rendezvous over TCP (`tcp://host:port`), NCCL between
CUDA devices, gloo between CPU processes.

The group is torch.distributed's world of these processes, handed to the layers inside a `TensorParallel`, which
they pass to every collective explicitly; a group of one worker creates nothing. `leave` tears it down again, so
that a worker process exits without torch.distributed's warning about an undestroyed group.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from engine.distributed.parallel import TensorParallel
from engine.free_ports import free_port
from engine.platform import platform_of

RENDEZVOUS_TIMEOUT = timedelta(seconds=120)  # every worker joins within this, or each raises


def free_address(host: str = "127.0.0.1") -> str:
    """A rendezvous address on a port free now (engine/free_ports.py), for the workers of this group."""
    return f"tcp://{host}:{free_port(host)}"


def join(rank: int, world_size: int, address: str, device: torch.device) -> TensorParallel:
    """This process as worker `rank` of `world_size`, meeting the others at `address` (`tcp://host:port`, the same
    for all)."""
    if world_size == 1:
        return TensorParallel.single()
    dist.init_process_group(platform_of(device).collective_backend, init_method=address, rank=rank,
                            world_size=world_size, timeout=RENDEZVOUS_TIMEOUT)
    return TensorParallel(rank, world_size, dist.group.WORLD)


def leave(parallel: TensorParallel) -> None:
    if parallel.group is not None:
        dist.destroy_process_group()
