"""AdapterReader: reads adapters from their folders and merges them, for one base model's LoRA shapes.

The CPU tiers (the offline engine's LocalAdapterCache, the cluster's cache actor) share it. It brings torch with
it, so the cache actor's module imports it in the actor's own process only: a replica imports that module to
create the actor, and creates it before its own torch import, so that the actor's start overlaps the replica's
imports and model load.
"""

from __future__ import annotations

from pathlib import Path

from engine.lora.merge_spec import MergeSpec
from engine.lora.provider import LoRAAdapter, LoraShapes
from lora_cache.adapter import read_adapter
from lora_cache.merge import merge_adapters


class AdapterReader:
    def __init__(self, shapes: LoraShapes, max_adapter_bytes: int):
        """Every adapter read is refused unless it fits the base model's `shapes` (its rank at most their
        max_rank, the engines' max_lora_rank) and its weights file is at most max_adapter_bytes: a load through the
        lifecycle API is refused there, before anything is registered, not at its first request."""
        self.shapes = shapes
        self.max_adapter_bytes = max_adapter_bytes

    def read(self, key: str, folder: Path) -> LoRAAdapter:
        return read_adapter(key, folder, self.shapes, self.max_adapter_bytes, self.shapes.max_rank)

    def merge(self, key: str, parts: list[LoRAAdapter], spec: MergeSpec) -> LoRAAdapter:
        return merge_adapters(key, parts, spec, list(self.shapes.modules))
