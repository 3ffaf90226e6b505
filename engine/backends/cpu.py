"""The CPU step backend on the engine's C++ operators (engine/kernels/cpu_ops.py).

Decodes, and prompt chunks shorter than IN_PLACE_CHUNK, read the paged cache in place in one call of the C++
attention kernel (every chunk, for a model whose attention only that kernel computes); longer chunks attend in the
C++ prompt kernel where it is faster than SDPA (cpu_attention.prompt_kernel_usable), else by SDPA over their
gathered context. Where the kernel cannot tile the cache (block size or head size), decodes take the gathered path
of the PyTorch reference. The fused operators write the KV cache and run the norms, rotary and activations;
adapters' tokens read their slot per token in the C++ LoRA call. Options it reads: huge_pages (weights and cache
on 2 MiB pages) and decoder_stack (a Llama-family model's layers in one C++ call).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from engine.backends.huge_pages import move_module, supported, zeros
from engine.backends.torch_reference import InPlaceChunk, TorchBackend, padded
from engine.config import EngineConfig
from engine.kernels import cpu_attention
from engine.layers.attention import (
    IN_PLACE_CHUNK,
    AttentionMetadata,
    InPlaceAttention,
    InPlaceQueries,
    KVCache,
    PrefillSegment,
)
from engine.lora.backends import CppLoRA, LoRAStepState
from engine.models.decoder_stack import build_decoder_stack
from engine.models.packing import AsLoaded, CppPacked, onednn_linear_supported
from engine.sampler_ops import CppSamplerOps
from engine.transfer import to_device


class CpuKernelsBackend(TorchBackend):
    name = "cpu"

    def __init__(self, config: EngineConfig, cpu_ops):
        self.cpu_ops = self.fused_ops = cpu_ops  # before the base's init, which asks for the LoRA backend
        super().__init__(config)
        self.huge_pages = config.backend.huge_pages and supported()
        self.head_dim = 0

    def _lora_backend(self) -> CppLoRA:
        return CppLoRA(self.device, self.cpu_ops)

    def _sampler_ops(self) -> CppSamplerOps:
        return CppSamplerOps(self.cpu_ops)

    def _packing(self, config: EngineConfig) -> AsLoaded:
        """oneDNN's prepacking, the operators' own kernels taking the linears and experts they serve faster."""
        return CppPacked(self.cpu_ops) if onednn_linear_supported(self.dtype) else AsLoaded()

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return zeros(shape, dtype) if self.huge_pages else super()._zeros(shape, dtype)

    def place_model(self, model: nn.Module, kv_caches: list[KVCache], lora_state: LoRAStepState,
                    config: EngineConfig) -> None:
        """The weights (the adapters' slots too) onto huge pages, then the decoder stack, which holds them."""
        if self.huge_pages:
            move_module(model)
        if config.backend.decoder_stack:
            model.decoder_stack = build_decoder_stack(model, kv_caches, self.cpu_ops, lora_state)

    def bind_model(self, model: nn.Module) -> None:
        """The kernels this model's heads and the cache's blocks allow: decodes in place where the attention
        kernel tiles them, and long chunks in the prompt kernel where it is faster than SDPA."""
        self.head_dim = model.kv_shape[2]
        self.prompt_kernel = cpu_attention.prompt_kernel_usable(self.dtype, self.head_dim, self.block_size)
        if not cpu_attention.usable(self.block_size, self.head_dim):
            super().bind_model(model)
            return
        self.in_place_limit = IN_PLACE_CHUNK if model.kernel_only_attention is None else sys.maxsize

    def _no_kernel(self) -> str:
        return (f"its blocks must hold a multiple of {self.cpu_ops.vector_width()} tokens and its heads a multiple "
                f"of 4 dimensions (block_size {self.block_size}, head_dim {self.head_dim})")

    def prefill_segment(self, block_table: list[int], row: int, start: int, end: int) -> PrefillSegment:
        if self.prompt_kernel:  # it reads the whole context from the cache: no block rows to gather
            return PrefillSegment(row, end - start, end, self.tensor(block_table))
        return super().prefill_segment(block_table, row, start, end)

    def attention_metadata(self, slots: torch.Tensor, decode_tables: list[list[int]], decode_lens: list[int],
                           prefills: list[PrefillSegment], in_place: list[InPlaceChunk]) -> AttentionMetadata:
        if not self.in_place_limit:
            return super().attention_metadata(slots, decode_tables, decode_lens, prefills, in_place)
        return InPlaceAttention(slots, len(decode_lens), prefills, self.kv_write, self.prompt_kernel,
                                in_place=self._queries(in_place))

    def _queries(self, chunks: list[InPlaceChunk]) -> InPlaceQueries | None:
        """One padded block table for the kernel's chunks; None when every chunk of the step is long."""
        if not chunks:
            return None
        tables = padded([c.block_table for c in chunks])
        return InPlaceQueries(self.tensor(tables), self.tensor([c.context_len for c in chunks]),
                              self.tensor([c.row for c in chunks]), self.tensor([c.length for c in chunks]))

    def gather_rows(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """By the C++ operators (cpu/gather.cpp): torch's indexing wakes OpenMP's threads."""
        return self.cpu_ops.gather_rows(hidden, to_device(rows, self.device))
