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
from engine.backends.torch_reference import InPlaceChunk, TorchBackend, padded
from engine.config import EngineConfig
from engine.layers.attention import (
    AttentionMetadata,
    KVCache,
    PagedAttention,
    PrefillKernel,
    PrefillSegment,
    cuda_prefill_kernel,
)
from engine.lora.backends import LoRAStepState, TritonLoRA
from engine.models.packing import AsLoaded, TritonGroupedExperts


class CudaBackend(TorchBackend):
    name = "cuda"
    scratch_blocks = 1

    def __init__(self, config: EngineConfig, sharded: bool):
        """sharded: a tensor-parallel rank, which runs eager (a capture would run the collectives on one rank)."""
        super().__init__(config)
        if config.backend.cuda_fused_ops:  # imported here only: triton may be absent on CPU
            from engine.kernels import cuda_ops

            self.fused_ops = cuda_ops
        self.graphs_allowed = not (sharded or config.backend.enforce_eager or config.model.quantization != "none")

    def _lora_backend(self) -> TritonLoRA:
        return TritonLoRA(self.device)

    def _packing(self, config: EngineConfig) -> AsLoaded:
        """The linears as loaded; a mixture's experts in the Triton grouped product where cuda_experts asks."""
        return TritonGroupedExperts() if config.backend.cuda_experts == "grouped" else AsLoaded()

    def _prefill_kernel(self, config: EngineConfig) -> PrefillKernel | None:
        return cuda_prefill_kernel(config.backend.cuda_prefill, config.cache.block_size)

    def attention_metadata(self, slots: torch.Tensor, decode_tables: list[list[int]], decode_lens: list[int],
                           prefills: list[PrefillSegment], in_place: list[InPlaceChunk]) -> AttentionMetadata:
        """The decodes read their blocks in place, by block tables and context lengths."""
        meta = PagedAttention(slots, len(decode_lens), prefills, self.kv_write, False, self.prefill_kernel,
                              self._prefill_batch(prefills, slots))
        if decode_tables:
            meta.decode_block_tables = self.tensor(padded(decode_tables))
            meta.decode_context_lens = self.tensor(decode_lens)
        return meta

    def free_memory(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0]

    def decode_graphs(self, model: nn.Module, kv_caches: list[KVCache], lora_state: LoRAStepState,
                      config: EngineConfig, max_model_len: int, num_blocks: int) -> DecodeGraphs | None:
        """Captured now, where allowed and the model's forward captures (a mixture of experts does not)."""
        if not self.graphs_allowed or not model.decode_graphs:
            return None
        max_blocks = -(-max_model_len // self.block_size)
        graphs = DecodeGraphs(model, kv_caches, lora_state, config.scheduler.max_num_seqs, max_blocks, num_blocks,
                              self.block_size, self.device, self.kv_write, config.lora.max_loras)
        graphs.capture()
        return graphs
