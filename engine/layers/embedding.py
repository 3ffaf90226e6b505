"""A token (or position) embedding whose lookup takes the fused operators' row gather where the model has them.

On CPU the C++ operators copy the rows on their own threads (cpu/gather.cpp): torch's embedding of 57 or more
rows of SmolLM2 runs on OpenMP's threads, whose spinning afterwards took a core from the rest of the step (the
step's linears ran slower after it than alone). On CUDA
the call is index_select (engine/kernels/cuda_ops.py). Without fused operators it is torch's embedding.
"""

from __future__ import annotations

import torch
from torch import nn


class Embedding(nn.Embedding):
    """nn.Embedding with the fused operators' hook (engine.models.use_fused_ops)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fused_ops = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.fused_ops is None or ids.dim() != 1:
            return super().forward(ids)
        return self.fused_ops.gather_rows(self.weight, ids)
