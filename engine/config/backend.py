"""The device and its step backend (engine/backends/): which kernels run, how many threads they take, and over
how many tensor-parallel workers the model is split."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.config.options import check_choice, check_positive

if TYPE_CHECKING:
    import torch

CUDA_PREFILLS = ("sdpa", "triton", "flex")  # engine/layers/attention.py: cuda_prefill_kernel
CUDA_EXPERTS = ("per_expert", "grouped")  # engine/backends/cuda.py: _packing


@dataclass
class BackendConfig:
    # "auto" picks CUDA when present, else CPU; $LORA_SERVE_DEVICE overrides the default (the test suite runs on
    # CPU in CI and on CUDA on a GPU machine from the same files)
    device: str = dataclasses.field(default_factory=lambda: os.environ.get("LORA_SERVE_DEVICE", "auto"))
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode steps (they are captured per batch-size bucket)
    # CUDA prompt chunks' attention: "sdpa" (each chunk's blocks gathered, then SDPA), "triton" (one Triton call a
    # step reading the paged cache in place, engine/kernels/paged_prefill.py) or "flex" (its FlexAttention
    # variant). Only "sdpa" has run on a GPU yet (docs/gpu.md), so the others are opt-in
    cuda_prefill: str = "sdpa"
    # CUDA, a mixture of experts: "per_expert" (each expert's two linears, run expert by expert) or "grouped" (the
    # Triton grouped product over every expert at once, engine/kernels/grouped_gemm.py; not run on a GPU yet,
    # docs/gpu.md). The CPU always takes its C++ grouped operator where it builds
    cuda_experts: str = "per_expert"
    # CPU: the C++ operators (engine/kernels/cpu_ops.py, compiled once per machine): decode attention reading the
    # paged cache in place, RMSNorm and rotary; False keeps the pure-PyTorch paths (their references in tests)
    cpu_kernels: bool = True
    # CPU with the C++ operators: a step's decoder layers in one C++ call where the step allows it, the GIL released
    # throughout (engine/models/decoder_stack.py); False keeps the modules' path, its reference in tests
    decoder_stack: bool = True
    # CPU with the C++ operators (Linux): the weights and the KV cache on 2 MiB transparent huge pages
    # (engine/backends/huge_pages.py); False keeps them on the allocator's ordinary pages
    huge_pages: bool = True
    # CUDA: fused Triton element-wise operators (engine/kernels/cuda_ops.py: the residual addition with RMSNorm,
    # rotary, the K/V cache write, SiLU times up); False keeps the eager PyTorch ops (their references in tests)
    cuda_fused_ops: bool = True
    num_threads: int | None = None  # torch CPU threads per worker; None = the cores, shared evenly by the workers
    # N workers each holding 1/N of every layer (engine/distributed/), over gloo on CPU and NCCL on CUDA (a GPU
    # each, run eager): rank 0 in the engine's process, the others local processes offline and Ray actors in the
    # replica's placement group under Serve (one bundle each: args.tensor_parallel); 1 = the model whole in the
    # engine's process. N must divide the model's heads, KV heads and MLP columns, and not exceed the node's GPUs;
    # adapters are sharded with the model (LoRA B by output rows in q/k/v and gate/up, A by input in o and down);
    # quantization, mixtures of experts, async scheduling and kv_cache_memory_fraction are refused above 1
    tensor_parallel_size: int = 1

    def validate(self) -> None:
        check_choice("cuda_prefill", self.cuda_prefill, CUDA_PREFILLS)
        check_choice("cuda_experts", self.cuda_experts, CUDA_EXPERTS)
        check_positive(self, "tensor_parallel_size")

    @property
    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def threads_per_worker(self) -> int:
        """num_threads, else the machine's cores shared evenly by the tensor-parallel workers."""
        return self.num_threads or max(1, (os.cpu_count() or 1) // self.tensor_parallel_size)
