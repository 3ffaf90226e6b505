"""Adapter cache: just-in-time LoRA loading from local folders, the Hugging Face Hub and S3; tiers: device slots,
the CPU copy (in serving, the Ray object store), the disk tier of downloads, the source. Only actor.py imports Ray:
the engine uses the other modules (tests/test_layout.py checks it)."""

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
