"""Host values to device tensors without waiting for the device.

A step's small host-built tensors (positions, block tables, sampling parameters, row indices) reach the device
the platform's way (engine/platform.py): on CUDA through pinned memory, so that the copy does not wait for the
step in flight.

`moved` carries a typed step's tensors (a dataclass of tensors, lists and nested dataclasses, like ForwardBatch)
to another device whole, for a tensor-parallel step that crosses processes through the host.
"""

from __future__ import annotations

import dataclasses

import torch

from engine.platform import platform_of


def to_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype) on `device`; on CUDA without a stream synchronization."""
    return platform_of(device).tensor(values, device, dtype)


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
