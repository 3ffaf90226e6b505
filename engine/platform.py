"""The platform: what a device is, apart from the kernels that run on it.

A step backend (engine/backends/) chooses the kernels a step runs. A platform answers the questions about the
device itself that the engine's lower parts would otherwise ask by testing `device.type`: the collective backend
that joins tensor-parallel ranks, the devices those ranks take, how host-built values reach the device without
waiting for it, the dtype a model computes in, and whether torch's thread count is the engine's to set.
`platform_of(device)` is where a device's type is read, outside the step backends.
"""

from __future__ import annotations

import torch


def cpu_has_native_bf16() -> bool:
    """Whether oneDNN runs bf16 matrix math natively on this CPU (its own check: AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT, used by its bf16 kernels)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class HostPlatform:
    """The CPU: a tensor built on the host is where it is needed, and the engine's threads are the compute."""
    collective_backend = "gloo"
    threads_compute = True  # the thread count sets the step's speed, so a server chooses it (set_threads)

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """bf16 runs in float32 on a CPU without bf16 matrix instructions (no AVX-512 BF16, AMX or AVX-NE-CONVERT,
        e.g. an AVX2-only EPYC): torch emulates bf16 matrix math there, many times slower than float32."""
        return torch.float32 if dtype == torch.bfloat16 and not cpu_has_native_bf16() else dtype

    def set_threads(self, count: int) -> None:
        torch.set_num_threads(count)

    def make_current(self, device: torch.device) -> None:
        """A CPU has no current device."""

    def rank_devices(self, size: int, device: torch.device) -> list[torch.device]:
        """Each tensor-parallel rank's device on this machine: the same CPU for all."""
        return [device] * size

    def tensor(self, values, device: torch.device, dtype: torch.dtype | None) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)


class CudaPlatform:
    """A GPU: host values are staged in pinned memory on their way, and the host's threads only launch work."""
    collective_backend = "nccl"
    threads_compute = False

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype

    def set_threads(self, count: int) -> None:
        """torch's own thread count stays: the host's threads launch kernels and do not compute the step."""

    def make_current(self, device: torch.device) -> None:
        """The device a bare "cuda" allocates on and Triton launches on: a worker's own GPU."""
        torch.cuda.set_device(device)

    def rank_devices(self, size: int, device: torch.device) -> list[torch.device]:
        """GPUs first, first + 1, ... of this node, from the configured one (cuda: the first); ValueError where the
        node has too few, naming both numbers."""
        first, count = device.index or 0, torch.cuda.device_count()
        if first + size > count:
            raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs from cuda:{first}; this node has "
                             f"{count}")
        return [torch.device("cuda", first + rank) for rank in range(size)]

    def tensor(self, values, device: torch.device, dtype: torch.dtype | None) -> torch.Tensor:
        """A blocking copy from pageable memory synchronizes the stream, so it would wait for the whole step in
        flight; a pinned staging buffer copies asynchronously, and the caching host allocator keeps it until the
        copy is done."""
        return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


Platform = HostPlatform | CudaPlatform
PLATFORMS: dict[str, Platform] = {"cpu": HostPlatform(), "cuda": CudaPlatform()}


def platform_of(device: torch.device) -> Platform:
    """The platform of `device`'s type; ValueError for a type the engine does not run on."""
    if device.type not in PLATFORMS:
        raise ValueError(f"device {device} is not supported: the engine runs on {', '.join(PLATFORMS)}")
    return PLATFORMS[device.type]
