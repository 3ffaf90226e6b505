"""Adapter cache: just-in-time LoRA loading, CPU tier in the Ray object store, device slots (issue 3)."""

from lora_cache.adapter import AdapterError, LoRAAdapter, LoRAWeights, load_adapter, target_module_shapes
from lora_cache.sources import make_source, validate_adapter_id

__all__ = [
    "AdapterError",
    "LoRAAdapter",
    "LoRAWeights",
    "load_adapter",
    "make_source",
    "target_module_shapes",
    "validate_adapter_id",
]
