"""AdapterReader: reads adapters from their folders and merges them, for one base model.

The CPU tiers (the offline engine's LocalAdapterCache, the cluster's cache actor) share it. It brings torch and
transformers with it, so the cache actor's module imports it in the actor's own process only: a replica imports
that module to create the actor, and creates it before its own torch import, so that the actor's start (5 s on a
2-core AVX2 EPYC) overlaps the replica's imports and model load.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

from lora_cache.adapter import LoRAAdapter, load_adapter, target_module_shapes
from lora_cache.merge import merge_adapters
from lora_cache.merge_spec import MergeSpec


class AdapterReader:
    def __init__(self, hf_config: PretrainedConfig, max_adapter_bytes: int, max_rank: int | None = None):
        """Every adapter read is refused unless it fits the base model, its weights file is at most
        max_adapter_bytes and its rank at most max_rank (the engines' max_lora_rank): a load through the lifecycle
        API is refused there, before anything is registered, not at its first request."""
        self.hf_config = hf_config
        self.max_adapter_bytes = max_adapter_bytes
        self.max_rank = max_rank

    @classmethod
    def for_base(cls, base_config: dict, max_adapter_bytes: int, max_rank: int | None = None) -> AdapterReader:
        """From the base model's config as a dict: the cache actor may live on a node without the model's files."""
        return cls(AutoConfig.for_model(**base_config), max_adapter_bytes, max_rank)

    def read(self, key: str, folder: Path) -> LoRAAdapter:
        return load_adapter(key, folder, self.hf_config, self.max_adapter_bytes, self.max_rank)

    def merge(self, key: str, parts: list[LoRAAdapter], spec: MergeSpec) -> LoRAAdapter:
        return merge_adapters(key, parts, spec, list(target_module_shapes(self.hf_config)))
