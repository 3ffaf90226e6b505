"""Host values to device tensors without waiting for the device.

PyTorch finishes a blocking host-to-device copy from pageable memory by synchronizing the stream, so each
`torch.tensor(values, device="cuda")` waits for every kernel queued before it: with async scheduling, the whole step
in flight. A step's small host-built tensors (positions, block tables, sampling parameters, row indices) are
instead staged in pinned memory and copied asynchronously; the caching host allocator keeps the staging buffer
until its copy is done.

`moved` carries a typed step's tensors (a dataclass of tensors, lists and nested dataclasses, like ForwardBatch)
to another device whole, for a tensor-parallel step that crosses processes through the host.
"""

from __future__ import annotations

import dataclasses

import torch


def to_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype) on `device`; on CUDA without a stream synchronization."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


def moved(value, device: torch.device):
    """`value` with every tensor in it on `device`, the rest as it is: a tensor, a list or tuple, or a dataclass
    (rebuilt by dataclasses.replace, frozen or not), nested; nothing is copied where a tensor is there already."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list | tuple):
        return type(value)(moved(item, device) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: moved(getattr(value, f.name), device)
                                             for f in dataclasses.fields(value) if f.init})
    return value
