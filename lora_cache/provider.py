"""What the two implementations of the engine's AdapterProvider protocol (engine/lora/provider.py) share.

Offline, the in-process CPU tier (lora_cache/local_cache.py); in serving, a replica's copy of what the cluster-wide
cache actor hands out (RayAdapterCache in lora_cache/actor.py). The engine holds one behind the protocol and knows
nothing of Ray or of where adapters come from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.lora.provider import LoadStats
from lora_cache.lru import LRUByBytes

if TYPE_CHECKING:
    from engine.lora.provider import LoRAAdapter


class HeldAdapters:
    """The AdapterProvider methods that read what a provider holds: its LRU of adapters, `_adapters`."""
    _adapters: LRUByBytes[LoRAAdapter]

    def __contains__(self, key: str) -> bool:
        return key in self._adapters

    def cached(self) -> list[str]:
        return self._adapters.keys()

    def load_stats(self) -> dict[str, LoadStats]:
        return self._adapters.load_stats()
