"""Column- and row-parallel linears, made from a loaded model's full linears.

A column-parallel linear (q/k/v, gate/up) is a plain nn.Linear holding the rank's output rows: its output is the
rank's heads or MLP columns, which the next row-parallel linear reads as they are, so it needs no communication.
A row-parallel linear (o, down) holds the rank's input columns; each rank's product is a partial sum of the full
output, summed over the ranks in one all-reduce, and the bias, held whole by every rank, is added once after it.
The inner linears stay plain nn.Linear modules, so that the CPU prepacking (engine/layers/linear.py) replaces them
as it replaces any other.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.distributed.parallel import TensorParallel
from engine.distributed.shards import input_columns, output_rows


def linear_of(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An nn.Linear over these tensors (a Parameter given is kept as it is: a tied weight stays tied)."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)
    if bias is not None:
        layer.bias = nn.Parameter(bias)
    return layer


@torch.no_grad()
def column_parallel(linear: nn.Linear, sizes: list[int], parallel: TensorParallel) -> nn.Linear:
    """The rank's output rows of each of the linear's fused parts (`sizes`, its output split)."""
    bias = None if linear.bias is None else output_rows(linear.bias, sizes, parallel)
    return linear_of(output_rows(linear.weight, sizes, parallel), bias)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r W_r^T) + b: x_r and W_r the rank's input features, b the whole bias."""

    def __init__(self, linear: nn.Linear, parallel: TensorParallel):
        super().__init__()
        with torch.no_grad():
            self.linear = linear_of(input_columns(linear.weight, parallel), None)
        self.in_features, self.out_features = self.linear.in_features, linear.out_features  # the rank's inputs
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())
        self.parallel = parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.parallel.all_reduce(self.linear(x))
        return y if self.bias is None else y.add_(self.bias)
