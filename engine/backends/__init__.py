"""Step backends: one per device, chosen once when the runner is built.

A backend is what a step does differently by device: where the KV cache lives, how a step's attention and LoRA
metadata are built (one typed `AttentionMetadata`, one `LoRAStepState`), which fused operators the model's modules
call, how sampled rows are gathered, and whether decode steps replay graphs. The runner, the scheduler and the
models never ask which device they are on; they call the backend.

- `TorchBackend` (torch_reference.py): plain PyTorch, the reference the kernels are tested against, and the path
  where neither kernel set applies (`cpu_kernels=False`, or a CPU where the C++ operators did not build).
- `CpuKernelsBackend` (cpu.py): the C++ operators; reads `huge_pages` and `decoder_stack`.
- `CudaBackend` (cuda.py): Triton kernels and CUDA graphs; reads `cuda_fused_ops`, `cuda_prefill` and
  `enforce_eager`.
"""

from __future__ import annotations

from engine.backends.cpu import CpuKernelsBackend
from engine.backends.cuda import CudaBackend
from engine.backends.torch_reference import TorchBackend
from engine.config import EngineConfig
from engine.kernels import cpu_ops

__all__ = ["CpuKernelsBackend", "CudaBackend", "TorchBackend", "step_backend"]


def step_backend(config: EngineConfig, sharded: bool = False) -> TorchBackend:
    """The backend of config's device and kernel options (sharded: a tensor-parallel rank). Its `bind_model`
    completes the choice once the model is loaded."""
    device = config.backend.torch_device.type
    if device == "cuda":
        return CudaBackend(config, sharded)
    ops = cpu_ops.load() if device == "cpu" and config.backend.cpu_kernels else None
    return CpuKernelsBackend(config, ops) if ops is not None else TorchBackend(config)
