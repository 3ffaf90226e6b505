"""Decode attention that reads the paged KV cache in place on CPU (C++: cpu/paged_attention.cpp).

The same contract as the Triton kernel for CUDA (paged_attention.py): q [B, heads, D], the head-major cache,
block tables and context lengths in, [B, heads, D] out. It replaces, per layer and step, the gather of every
block of every sequence into a copy plus the masked grouped matmuls: that path's cost grew with the widest
block table, and its small ops dominated a batch-1 step.
"""

from __future__ import annotations

import torch

from engine.kernels import cpu_ops


def usable(block_size: int, head_dim: int) -> bool:
    """Whether the kernel can serve this cache: the operators build here, and its vectors tile the blocks."""
    module = cpu_ops.load()
    return module is not None and block_size % module.vector_width() == 0 and head_dim % 4 == 0


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """q [B, heads, D]; caches [kv_heads, blocks, block_size, D], contiguous; block_tables [B, >= ceil(len /
    block_size)] int64; context_lens [B] int64 (the new token included, already written). Returns [B, heads, D]."""
    return cpu_ops.load().paged_decode_attention(q.contiguous(), k_cache, v_cache, block_tables, context_lens)
