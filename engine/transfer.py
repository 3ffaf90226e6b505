"""Host values to device tensors without waiting for the device.

PyTorch finishes a blocking host-to-device copy from pageable memory by synchronizing the stream, so each
`torch.tensor(values, device="cuda")` waits for every kernel queued before it: with async scheduling, the whole step
in flight. A step's small host-built tensors (positions, block tables, sampling parameters, row indices) are
instead staged in pinned memory and copied asynchronously; the caching host allocator keeps the staging buffer
until its copy is done.
"""

from __future__ import annotations

import torch


def to_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype) on `device`; on CUDA without a stream synchronization."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)
