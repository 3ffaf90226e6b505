"""lora_cache as the engine's default adapter provider: `PLUGIN`, registered under the engine's entry point group
(pyproject.toml: lora_serve.adapter_providers, "default").

Its options are the adapter sources (source_config.py), which become engine options; its factory makes the
in-process CPU tier (local_cache.py), imported only when an engine makes its provider, since it brings torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.lora.provider import ProviderPlugin
from lora_cache.source_config import SourceConfig

if TYPE_CHECKING:
    from engine.lora.provider import LoraShapes
    from lora_cache.local_cache import LocalAdapterCache


def _local_adapters(sources: SourceConfig, shapes: LoraShapes) -> LocalAdapterCache:
    from lora_cache.local_cache import local_adapters

    return local_adapters(sources, shapes)


PLUGIN = ProviderPlugin(options=SourceConfig, factory=_local_adapters)
