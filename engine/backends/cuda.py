"""The CUDA step backend: Triton kernels and CUDA graphs.

Decode attention reads the paged cache in place (engine/kernels/paged_attention.py); prompt chunks attend by gather
+ SDPA per chunk, or all at once in the in-place kernel that `cuda_prefill` names. The fused Triton operators
(engine/kernels/cuda_ops.py, unless `cuda_fused_ops` is off) write the KV cache and run the norms, rotary and
activations; adapters' tokens are grouped by slot for the Triton LoRA kernels (engine/lora/triton_kernels.py).
Decode steps replay CUDA graphs (cuda_graphs.py) unless `enforce_eager`, a quantized base or a tensor-parallel
shard rules them out. The cache holds one scratch block past the block manager's, which a graph's padding rows
write to.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.backends.cuda_graphs import DecodeGraphs
from engine.backends.torch_reference import TorchBackend
from engine.config import EngineConfig
from engine.layers.attention import KVCache, PrefillKernel, cuda_prefill_kernel
from engine.lora.backends import LoRAStepState, TritonLoRA


class CudaBackend(TorchBackend):
    name = "cuda"
    scratch_blocks = 1
    paged_decode = True

    def __init__(self, config: EngineConfig, sharded: bool):
        """sharded: a tensor-parallel rank, which runs eager (a capture would run the collectives on one rank)."""
        super().__init__(config)
        if config.cuda_fused_ops:  # imported here only: triton may be absent on CPU
            from engine.kernels import cuda_ops

            self.fused_ops = cuda_ops
        self.graphs_allowed = not (sharded or config.enforce_eager or config.quantization != "none")

    def _lora_backend(self) -> TritonLoRA:
        return TritonLoRA(self.device)

    def _prefill_kernel(self, config: EngineConfig) -> PrefillKernel | None:
        return cuda_prefill_kernel(config.cuda_prefill)

    def free_memory(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0]

    def decode_graphs(self, model: nn.Module, kv_caches: list[KVCache], lora_state: LoRAStepState,
                      config: EngineConfig, max_model_len: int, num_blocks: int) -> DecodeGraphs | None:
        """Captured now, where allowed and the model's forward captures (a mixture of experts does not)."""
        if not self.graphs_allowed or not model.decode_graphs:
            return None
        max_blocks = -(-max_model_len // self.block_size)
        graphs = DecodeGraphs(model, kv_caches, lora_state, config.max_num_seqs, max_blocks, num_blocks,
                              self.block_size, self.device, self.kv_write, config.max_loras)
        graphs.capture()
        return graphs
