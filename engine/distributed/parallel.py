"""`TensorParallel`: where this worker stands in its tensor-parallel group, and the two collectives the sharded
layers need.

It is passed explicitly to every module that communicates (the row-parallel linears, the vocabulary-parallel
embedding and LM head): no layer reads a module-global group or torch.distributed's default group. At world size 1
(`TensorParallel.single()`) it holds no group, and nothing is sharded: `engine.models.load_model` then builds the
model exactly as without it, so a single worker pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int
    world_size: int
    group: dist.ProcessGroup | None  # None at world size 1

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a tensor-parallel group of {self.world_size}")
        if (self.group is None) != (self.world_size == 1):
            raise ValueError(f"a tensor-parallel group of {self.world_size} needs a process group exactly when it "
                             f"has more than one worker")

    @classmethod
    def single(cls) -> TensorParallel:
        """One worker holding the whole model: no group, no collective."""
        return cls(0, 1, None)

    @property
    def sharded(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the workers, in place (a row-parallel linear's partial outputs)."""
        if self.group is not None:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every worker's x side by side along the last dimension, in rank order (the LM head's vocabulary
        slices), on every worker."""
        if self.group is None:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)
