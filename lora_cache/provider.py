"""AdapterProvider: what the engine asks of wherever its adapters come from.

Two implementations: offline, the in-process CPU tier (lora_cache/local_cache.py); in serving, a replica's copy of
what the cluster-wide cache actor hands out (RayAdapterCache in lora_cache/actor.py). The engine holds one behind
this interface and knows nothing of Ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from lora_cache.lru import LoadStats, LRUByBytes

if TYPE_CHECKING:
    from lora_cache.adapter import LoRAAdapter


class AdapterProvider(Protocol):
    def get(self, key: str) -> LoRAAdapter:
        """The adapter of a key, read from the tier below on a miss; AdapterError (a ValueError) with the reason."""

    def key(self, name: str) -> str:
        """The key the adapter called `name` is known by now (a reloaded adapter gets a new one)."""

    def __contains__(self, key: str) -> bool:
        """Whether the adapter is held here, in the CPU tier."""

    def cached(self) -> list[str]:
        """The keys held here, least recently used first."""

    def load_stats(self) -> dict[str, LoadStats]:
        """Per key ever read from the tier below: how often, and how long it took in all."""


class HeldAdapters:
    """The AdapterProvider methods that read what a provider holds: its LRU of adapters, `_adapters`."""
    _adapters: LRUByBytes[LoRAAdapter]

    def __contains__(self, key: str) -> bool:
        return key in self._adapters

    def cached(self) -> list[str]:
        return self._adapters.keys()

    def load_stats(self) -> dict[str, LoadStats]:
        return self._adapters.load_stats()
