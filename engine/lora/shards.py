"""Multi-LoRA under tensor parallelism, sharded as S-LoRA and vLLM shard it, so that every rank's delta lands where
its base output does:

- a column-parallel linear (q/k/v, gate/up) keeps an adapter's A whole (it reads the whole input, as the base
  does) and holds its rank's rows of B: of each fused part of B on its own, as the base's rows are split
  (shards.output_rows), so that the rank's delta is its heads' or columns' delta;
- a row-parallel linear (o, down) holds its rank's input columns of A and keeps B whole: x_r A_r^T is the rank's
  part of the shrink, and its expand B (x_r A_r^T) is the rank's part of the delta. The delta is added to the
  rank's partial product before the base's all-reduce, which sums both: the same as all-reducing the shrink and
  expanding once, without a second collective a linear.

The engine loads a slot with the rank's shard (`adapter_shard`): the driver cuts each worker's shard of an
adapter and sends it only that one (engine/executor/multiprocess.py), and the LoRA linears' slots hold the
rank's shapes (engine/lora/linear.py wrap_lora_linears).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from engine.distributed.linears import RowParallelLinear
from engine.distributed.parallel import TensorParallel
from engine.distributed.shards import input_columns, output_rows
from engine.lora.provider import LoRAAdapter, LoRAWeights


@dataclass(frozen=True)
class ModuleShard:
    """How one PEFT module's weights split over the ranks."""
    row_parallel: bool  # A by input columns, B whole; else A whole, B by the rows of each of `parts`
    parts: tuple[int, ...] = ()  # column-parallel: the full output sizes of the fused parts B stacks


@dataclass(frozen=True)
class LoRALayout:
    """Every LoRA-capable module of the model, by PEFT module key (the same in every layer)."""
    modules: dict[str, ModuleShard]

    def shard(self, key: str, weights: LoRAWeights, parallel: TensorParallel) -> LoRAWeights:
        """The rank's part of one module's weights, as new contiguous tensors."""
        module = self.modules[key]
        if module.row_parallel:
            return dataclasses.replace(weights, lora_a=input_columns(weights.lora_a, parallel))
        return dataclasses.replace(weights, lora_b=output_rows(weights.lora_b, list(module.parts), parallel))


def sub_parts(out_sizes: list[int], parts: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The fused linear's output parts (in order) that each of its sub-modules' outputs stacks: q, k and v one
    each of q/k/v's three; a fused checkpoint's qkv_proj all three."""
    split, rest = [], list(parts)
    for size in out_sizes:
        taken: list[int] = []
        while sum(taken) < size:
            taken.append(rest.pop(0))
        if sum(taken) != size:
            raise ValueError(f"a LoRA module of {size} outputs does not cover whole parts of {parts}")
        split.append(tuple(taken))
    return split


def lora_layout(model) -> LoRALayout:
    """How each of a sharded model's LoRA modules splits: row-parallel where the model's linear is, else column-
    parallel over the parts the model's fused linear stacks (its `column_parts`)."""
    layer, targets = model.decoder_layers[0], model.lora_targets()[0]
    modules: dict[str, ModuleShard] = {}
    for path, target in targets.items():
        if isinstance(layer.get_submodule(path), RowParallelLinear):
            modules |= {sub.key: ModuleShard(True) for sub in target.subs}
            continue
        parts = sub_parts([sub.out_size for sub in target.subs], model.column_parts(path))
        modules |= {sub.key: ModuleShard(False, p) for sub, p in zip(target.subs, parts)}
    return LoRALayout(modules)


def adapter_shard(adapter: LoRAAdapter, layout: LoRALayout, parallel: TensorParallel) -> LoRAAdapter:
    """The adapter as rank `parallel.rank` holds it."""
    layers = {index: {key: layout.shard(key, w, parallel) for key, w in modules.items()}
              for index, modules in adapter.layers.items()}
    nbytes = sum(w.lora_a.nbytes + w.lora_b.nbytes for modules in layers.values() for w in modules.values())
    return dataclasses.replace(adapter, layers=layers, nbytes=nbytes)


def rank_view(parallel: TensorParallel, rank: int) -> TensorParallel:
    """Another rank of the same group, for cutting that rank's shard here (no collective is run through it)."""
    return dataclasses.replace(parallel, rank=rank)
