"""Which part of a full tensor each rank keeps (Megatron-LM's layout), and the sizes that must split evenly.

- Output rows (column-parallel linears): a fused linear's output is several parts stacked (q, k, v; gate, up), and
  each part is split on its own, so that rank r holds the r-th N-th of every part: of q/k/v its query heads and
  the KV heads they read (query heads are grouped by KV head in order, so rank r's query heads read rank r's KV
  heads), of gate/up the same columns of both.
- Input columns (row-parallel linears: o, down): the r-th N-th of the input features, matching the column-parallel
  output that feeds it.
- Vocabulary rows (embedding, LM head): ceil(vocab / N) rows each, the last rank's shard padded with zero rows;
  a vocabulary that N does not divide is padded, not refused, and the padded logits are cut off after the gather.

Heads, KV heads and the MLP's intermediate size are never padded: a size N does not divide is refused when the
model is built (`check_divides`), naming both numbers.
"""

from __future__ import annotations

import torch

from engine.distributed.parallel import TensorParallel


def check_divides(world_size: int, sizes: dict[str, int]) -> None:
    """Refuse a tensor_parallel_size that does not split each of these sizes (config names) evenly."""
    for name, size in sizes.items():
        if size % world_size:
            raise ValueError(f"tensor_parallel_size {world_size} does not divide {name} {size}: each worker must "
                             f"hold an equal share of them")


def even_slice(size: int, parallel: TensorParallel) -> slice:
    """The rank's range of a size the world size divides."""
    share = size // parallel.world_size
    return slice(parallel.rank * share, (parallel.rank + 1) * share)


def output_rows(tensor: torch.Tensor, sizes: list[int], parallel: TensorParallel) -> torch.Tensor:
    """The rank's rows of each stacked part of a fused output (a weight's rows or a bias), as a new tensor."""
    parts = tensor.split(sizes, dim=0)
    return torch.cat([part[even_slice(part.shape[0], parallel)] for part in parts])


def input_columns(weight: torch.Tensor, parallel: TensorParallel) -> torch.Tensor:
    """The rank's input features of a weight [out, in], as a new contiguous tensor."""
    return weight[:, even_slice(weight.shape[1], parallel)].clone(memory_format=torch.contiguous_format)


def vocab_share(vocab: int, parallel: TensorParallel) -> tuple[int, int]:
    """(first id, rows) of the rank's vocabulary shard: ceil(vocab / N) rows each, past the vocabulary padding."""
    rows = -(-vocab // parallel.world_size)
    return parallel.rank * rows, rows


def vocab_rows(weight: torch.Tensor, parallel: TensorParallel) -> torch.Tensor:
    """The rank's rows of a [vocab, dim] weight, zero-padded to its full share."""
    start, rows = vocab_share(weight.shape[0], parallel)
    shard = weight.new_zeros(rows, weight.shape[1])
    held = weight[start:start + rows]
    shard[:held.shape[0]] = held
    return shard
