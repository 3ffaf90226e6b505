"""Decode attention that reads the paged KV cache in place on CPU (C++, cpu_paged_attention.cpp).

The same contract as the Triton kernel for CUDA (paged_attention.py): q [B, heads, D], the head-major cache,
block tables and context lengths in, [B, heads, D] out. It replaces, per layer and step, the gather of every
block of every sequence into a copy plus the masked grouped matmuls: that path's cost grew with the widest
block table and its small ops dominated a batch-1 step.

The extension is compiled once per machine with torch's cpp_extension (ninja and a C++ compiler) and kept in
torch's extensions directory ($TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions): a later process, or a
replica on the same node, loads it in well under a second. The build name carries a hash of the source and
of the CPU's instruction-set flags, because it is compiled with -march=native. Where it cannot be built,
`load()` says why once and the engine keeps the gather path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_paged_attention.cpp")
log = logging.getLogger(__name__)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor()


def build_name() -> str:
    """Extension name: changes with the source, the CPU's flags and the torch version."""
    digest = hashlib.sha256(SOURCE.read_bytes() + _cpu_flags().encode() + torch.__version__.encode())
    return f"lora_serve_cpu_attention_{digest.hexdigest()[:12]}"


def vector_flags() -> list[str]:
    """ATen's vector types (at::vec) are plain arrays unless told the CPU's capability, as torch's own kernels
    are: AVX-512 where the CPU has it, else AVX2."""
    flags = set(_cpu_flags().split())
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    if {"avx2", "fma"} <= flags:
        return ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return []


@functools.cache
def load():
    """The compiled extension module, or None (with one warning saying why) where it cannot be built."""
    from torch.utils.cpp_extension import load as load_extension

    try:
        flags = ["-O3", "-march=native", "-fopenmp", *vector_flags()]
        return load_extension(build_name(), [str(SOURCE)], extra_cflags=flags, verbose=False)
    except Exception as error:  # no compiler or ninja: the gather path still works, only slower
        log.warning("CPU paged attention kernel unavailable (%s: %s); decode gathers KV blocks instead",
                    type(error).__name__, error)
        return None


def usable(block_size: int, head_dim: int) -> bool:
    """Whether the kernel can serve this cache: it builds here, and its vectors tile the blocks."""
    module = load()
    return module is not None and block_size % module.vector_width() == 0 and head_dim % 4 == 0


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """q [B, heads, D]; caches [kv_heads, blocks, block_size, D], contiguous; block_tables [B, >= ceil(len /
    block_size)] int64; context_lens [B] int64 (the new token included, already written). Returns [B, heads, D]."""
    return load().paged_decode_attention(q.contiguous(), k_cache, v_cache, block_tables, context_lens)
