"""The paged KV cache: its blocks, its budget in bytes or in blocks, its dtype, and prefix caching."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.options import DTYPES, check_positive


@dataclass
class CacheConfig:
    block_size: int = 16  # tokens per paged KV cache block (and per prefix-cache digest)
    kv_cache_bytes: int = 512 * 1024 * 1024  # memory budget for the paged KV cache (per tensor-parallel worker)
    # the KV cache's dtype: "auto" is the model's dtype (vLLM's meaning). Where a bf16 model computes in float32 (a
    # CPU without bf16 matrix math), "float32" keeps its keys and values unrounded at twice the bytes
    kv_cache_dtype: str = "auto"
    kv_cache_memory_fraction: float | None = None  # overrides kv_cache_bytes: this share of free device memory
    num_kv_blocks: int | None = None  # overrides kv_cache_bytes when set (tests use it to force preemption)
    enable_prefix_caching: bool = True  # reuse the K/V of full blocks of an already computed prefix

    def validate(self, dtype: str) -> None:
        """dtype: the model's, which the cache's must fit."""
        check_positive(self, "block_size")
        if self.kv_cache_memory_fraction is not None and not 0 < self.kv_cache_memory_fraction < 1:
            raise ValueError(f"kv_cache_memory_fraction must be between 0 and 1, got {self.kv_cache_memory_fraction}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        self._validate_dtype(dtype)

    def _validate_dtype(self, dtype: str) -> None:
        """'auto', the model's dtype, or float32 for a bf16 model (which takes it only where it computes in float32:
        the attention kernels read float32 queries over a bf16 cache, not the reverse)."""
        if self.kv_cache_dtype == "auto":
            return
        if self.kv_cache_dtype not in DTYPES:
            raise ValueError(f"kv_cache_dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.kv_cache_dtype!r}"
                             " (fp8 KV caches are not implemented)")
        wanted, model = DTYPES[self.kv_cache_dtype], DTYPES.get(dtype)
        if wanted != model and (wanted, model) != ("float32", "bfloat16"):
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} does not fit dtype {dtype!r}: use 'auto'"
                             " (the model's dtype), or float32 for a bfloat16 model on a CPU without bf16 matrix math")
