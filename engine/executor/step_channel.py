"""The per-step broadcast from the driver (rank 0) to the tensor-parallel workers: one message a step, a
`ForwardBatch` (engine/forward_batch.py) to run or `StopWorkers` to leave; between steps, `CopyAdapter` and then
each worker's own shard of the adapter, sent to it alone (engine/lora/shards.py).

A message is pickled once and broadcast with torch.distributed.broadcast_object_list (its size, then its bytes:
two gloo broadcasts a step) over a gloo group of its own, apart from the model's collectives: a step's tensors
are small (ids, positions, slots, block tables), so one pickled dataclass costs less than a broadcast per tensor
with a typed header and keeps the message typed end to end. The channel's group waits without a deadline (a worker
waits for the next step as long as the engine stays idle); a driver that dies closes its sockets, and the waiting
workers' receive then fails, so they exit. The model's group keeps its own deadline (process_group.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from engine.distributed.parallel import TensorParallel
from engine.forward_batch import ForwardBatch
from engine.lora.provider import LoRAAdapter

IDLE_TIMEOUT = timedelta(days=365)  # a worker waits for the next step as long as the engine is idle


@dataclass(frozen=True)
class StopWorkers:
    """The engine is closing: each worker leaves its loop, its group and its process."""


@dataclass(frozen=True)
class CopyAdapter:
    """Load device slot `slot` with the adapter shard that follows, sent to each worker on its own (send_to)."""
    slot: int


StepMessage = ForwardBatch | CopyAdapter | StopWorkers


class StepChannel:
    """Made by every rank at once, after joining the tensor-parallel group (it creates a group of all of them)."""

    def __init__(self, parallel: TensorParallel):
        self.rank = parallel.rank
        self.group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)

    def send(self, message: StepMessage) -> None:
        """Rank 0: the message to every worker."""
        dist.broadcast_object_list([message], src=0, group=self.group)

    def receive(self) -> StepMessage:
        """A worker: the driver's next message, waiting as long as it takes."""
        box: list[StepMessage | None] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def send_to(self, rank: int, shard: LoRAAdapter) -> None:
        """Rank 0: what one worker alone needs (its shard of an adapter), after the message that announced it."""
        dist.send_object_list([shard], dst=rank, group=self.group)

    def receive_shard(self) -> LoRAAdapter:
        """A worker: its own shard, sent after the CopyAdapter message."""
        box: list[LoRAAdapter | None] = [None]
        dist.recv_object_list(box, src=0, group=self.group)
        return box[0]
