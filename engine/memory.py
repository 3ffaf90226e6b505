"""Memory accounting: weight bytes by dtype, the KV cache's size and capacity, adapter slot bytes.

Bytes are those of the tensors that exist, each storage counted once (tied embeddings, views),
including bitsandbytes' quantization state (int8 row scales, NF4 block scales and code book),
which lives outside the module's parameters.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass
class MemoryReport:
    weight_bytes: dict[str, int]  # storage dtype -> bytes (packed NF4 weights count as uint8)
    kv_bytes_per_token: int  # 2 (K and V) x layers x kv_heads x head_dim x element bytes
    kv_blocks: int
    kv_block_size: int
    adapter_slot_bytes: int  # every LoRA linear's slot stacks, all slots

    @property
    def total_weight_bytes(self) -> int:
        return sum(self.weight_bytes.values())

    @property
    def kv_token_capacity(self) -> int:
        return self.kv_blocks * self.kv_block_size

    @property
    def kv_bytes(self) -> int:
        return self.kv_bytes_per_token * self.kv_token_capacity

    def to_dict(self) -> dict:
        return {**asdict(self), "total_weight_bytes": self.total_weight_bytes,
                "kv_token_capacity": self.kv_token_capacity, "kv_bytes": self.kv_bytes}

    def summary(self) -> str:
        weights = ", ".join(f"{dtype} {_mib(n)}" for dtype, n in sorted(self.weight_bytes.items()))
        return (f"weights {_mib(self.total_weight_bytes)} ({weights}); KV cache {self.kv_bytes_per_token / 1024:.1f} "
                f"KiB/token, {self.kv_blocks} blocks x {self.kv_block_size} = {self.kv_token_capacity} tokens "
                f"({_mib(self.kv_bytes)}); adapter slots {_mib(self.adapter_slot_bytes)}")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def weight_bytes(model: nn.Module, exclude: list[torch.Tensor] = ()) -> dict[str, int]:
    """Storage dtype -> bytes of the model's tensors, each storage once (the `exclude` ones left out)."""
    seen: set[int] = {_storage(t)[0] for t in exclude}
    totals: dict[str, int] = {}
    for tensor in _tensors(model):
        key, nbytes = _storage(tensor)
        if key in seen:
            continue
        seen.add(key)
        name = str(tensor.dtype).removeprefix("torch.")
        totals[name] = totals.get(name, 0) + nbytes
    return totals


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    """(identity, bytes) of a tensor's storage; oneDNN-prepacked weights are opaque: their own size."""
    if tensor.is_mkldnn:
        return id(tensor), tensor.numel() * tensor.element_size()
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def _tensors(module: nn.Module):
    yield from module.parameters(recurse=False)
    yield from (b for b in module.buffers(recurse=False) if b is not None)
    yield from _quantization_state(getattr(module, "weight", None), getattr(module, "state", None))
    for child in module.children():
        yield from _tensors(child)


def _quantization_state(weight, module_state) -> list[torch.Tensor]:
    """bitsandbytes keeps int8 row scales (SCB: on the weight, on the module's state after its first forward)
    and 4-bit block scales and code book beside the weight."""
    tensors = [scb for scb in (getattr(weight, "SCB", None), getattr(module_state, "SCB", None))
               if isinstance(scb, torch.Tensor)]
    state = getattr(weight, "quant_state", None)
    while state is not None:
        parts = (state.absmax, state.code, getattr(state, "offset", None))
        tensors += [t for t in parts if isinstance(t, torch.Tensor)]
        state = getattr(state, "state2", None)
    return tensors
