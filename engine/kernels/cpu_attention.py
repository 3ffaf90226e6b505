"""Attention that reads the paged KV cache in place on CPU (C++: cpu/paged_attention.cpp), for decode tokens and
short prompt chunks of many sequences in one call.

Decodes keep the same contract as the Triton kernel for CUDA (paged_attention.py): q [B, heads, D], the head-major
cache, block tables and context lengths in, [B, heads, D] out. A prompt chunk is more queries of one sequence, the
last of its context, attending causally. This replaces, per layer and step, the gather of every block of every
sequence into a copy plus the masked grouped matmuls (whose cost grew with the widest block table), and the ~10
small ops per prompt and layer of short prompts' attention (most of a step that prefills many short prompts).
"""

from __future__ import annotations

import torch

from engine.kernels import cpu_ops


def usable(block_size: int, head_dim: int) -> bool:
    """Whether the kernel can serve this cache: the operators build here, and its vectors tile the blocks."""
    module = cpu_ops.load()
    return module is not None and block_size % module.vector_width() == 0 and head_dim % 4 == 0


def prompt_kernel_usable(dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
    """Whether long prompt chunks attend in the C++ prompt kernel (cpu/prompt_attention.cpp) rather than SDPA's
    flash kernel: bf16, on AMX tiles where the CPU has AMX (16-token blocks), else with AVX-512 BF16. Both beat
    SDPA on a long prompt, fresh or after cached tokens. On a Xeon the AVX-512 kernel is much slower than the AMX
    one, so where the blocks do not tile AMX's 16 rows SDPA keeps the work there."""
    module = cpu_ops.load()
    if module is None or dtype != torch.bfloat16 or head_dim not in (64, 128) or not module.bf16_prompt_attention():
        return False
    if cpu_ops.has_cpu_flag("amx_bf16"):
        return module.amx_prompt_attention() and block_size % 16 == 0
    return True


def prompt_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     context_len: int) -> torch.Tensor:
    """One sequence's prompt chunk, bf16: q [L, heads, D] (heads contiguous within a token) for the last L of its
    context_len positions, whose keys and values (this chunk's included) are in the caches under block_table
    [blocks] -> [L, heads, D]. Causal; a chunk after cached tokens needs nothing more."""
    return cpu_ops.load().prompt_attention(q, k_cache, v_cache, block_table, context_len)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, query_starts: torch.Tensor, query_lens: torch.Tensor,
                    out: torch.Tensor, softcap: float | None = None, window: int | None = None) -> None:
    """q [T, heads, D] (heads contiguous within a token: a view of the fused projection will do), out like q and
    contiguous; caches [kv_heads, blocks, block_size, D], contiguous, this step's keys and
    values already written. Sequence i's queries are rows query_starts[i] .. + query_lens[i] of q, the last
    positions of its context_lens[i]; its blocks are row i of block_tables [S, >= ceil(len / block_size)]. All
    int64. Writes those rows of out; leaves the others. softcap: Gemma 2's attention logit soft-capping, each
    scaled score turned into softcap * tanh(score / softcap) before the mask and softmax. window: a sliding window
    (Gemma 2's and 3's local layers), each query seeing the last `window` positions, its own included."""
    cpu_ops.load().paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_starts, query_lens, out,
                                   softcap or 0.0, window or 0)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """One query per sequence: q [B, heads, D] -> [B, heads, D] (the CUDA kernel's contract)."""
    q = q.contiguous()
    out = torch.empty_like(q)
    rows = torch.arange(q.shape[0], dtype=torch.long)
    paged_attention(q, k_cache, v_cache, block_tables, context_lens, rows, torch.ones_like(rows), out)
    return out

