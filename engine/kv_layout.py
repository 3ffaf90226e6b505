"""The paged KV cache's shape: per layer a key and a value cache of blocks of `block_size` tokens, each token its
KV heads' vectors. The number of blocks is `num_kv_blocks`, or what the configured budget holds: `kv_cache_bytes`,
or `kv_cache_memory_fraction` of the device memory free once the weights are loaded."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.config import EngineConfig


@dataclass
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    bytes_per_element: int

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_element

    @property
    def token_capacity(self) -> int:
        return self.num_blocks * self.block_size

    def cache_shape(self, extra_blocks: int) -> tuple[int, ...]:
        """(layers, key and value, KV heads, blocks, block size, head dim), with extra_blocks past num_blocks."""
        return (self.num_layers, 2, self.num_kv_heads, self.num_blocks + extra_blocks, self.block_size,
                self.head_dim)


def kv_layout(config: EngineConfig, kv_shape: tuple[int, int, int], dtype: torch.dtype,
              free_memory: Callable[[], int], agree_blocks: Callable[[int], int] | None = None) -> KVLayout:
    """kv_shape: the model's (layers, KV heads, head dim); free_memory: the device's free bytes now;
    agree_blocks: the blocks every tensor-parallel rank allocates, given this rank's count."""
    num_layers, kv_heads, head_dim = kv_shape
    element = torch.empty((), dtype=dtype).element_size()
    per_block = 2 * num_layers * kv_heads * head_dim * element * config.cache.block_size
    budget = config.cache.kv_cache_bytes
    if config.cache.kv_cache_memory_fraction is not None:
        budget = int(free_memory() * config.cache.kv_cache_memory_fraction)
    num_blocks = config.cache.num_kv_blocks or budget // per_block
    if num_blocks < 1:
        raise ValueError(f"the KV cache budget of {budget} bytes is smaller than one KV block ({per_block} bytes)")
    if agree_blocks is not None:
        num_blocks = agree_blocks(num_blocks)
    return KVLayout(num_layers, kv_heads, head_dim, config.cache.block_size, num_blocks, element)
