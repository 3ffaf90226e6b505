"""What the cluster's adapter cache holds, as it crosses the Ray hop: CacheStats, and per adapter name the view
that /v1/models and /info publish (AdapterResidence).

The cache actor (lora_cache/actor.py) answers stats() with a CacheStats: its object-store entries by key, the
registered names and their generations, and what each live replica last reported holding. residence() folds this
into one AdapterResidence per adapter name, for the key current in the registry (lora_cache/registry.py): a
replica's ingress publishes that, and tests and operators read the same fields. Dataclasses, not dicts, so that a
renamed field fails where it is read, not as a missing key in an HTTP body.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import key_name
from lora_cache.registry import RegistryView


@dataclass(frozen=True)
class CachedAdapter:
    """An adapter in the object store tier."""
    nbytes: int
    content_id: str  # a digest of its weights (lora_cache/adapter.py content_id)


@dataclass(frozen=True)
class ReplicaHolding:
    """The adapters (by name, their current versions) a live replica reported holding."""
    device: tuple[str, ...]  # in its device slots
    cpu: tuple[str, ...]  # in its process-local copy


@dataclass(frozen=True)
class AdapterResidence:
    """Where one adapter name's current version resides in the cluster."""
    content_id: str | None  # None until it is loaded
    lora_path: str | None  # the location it was registered from at run time, if it was
    object_store: bool
    device_replicas: tuple[str, ...]
    cpu_replicas: tuple[str, ...]
    source_loads: int  # how often it was read from its source


@dataclass(frozen=True)
class CacheStats:
    adapters: dict[str, CachedAdapter]  # the object store tier, by adapter key
    registered: dict[str, str]  # name -> the location registered for it
    generations: dict[str, int]  # name -> its registry generation (a key is name#generation)
    replicas: dict[str, ReplicaHolding]  # the live replicas' last reports
    nbytes: int  # the object store tier's bytes
    capacity_bytes: int | None
    hits: int
    misses: int
    load_counts: dict[str, int]  # key -> reads from its source
    load_seconds: dict[str, float]  # key -> seconds those reads took

    def residence(self) -> dict[str, AdapterResidence]:
        """Per adapter name the cache knows, for its current key, sorted by key."""
        view = RegistryView(generations=self.generations)
        known = {k for k in set(self.adapters) | set(self.load_counts) if view.is_current(k)}
        known |= {view.key(n) for n in set(self.registered) | self._held_names() if self._served(n)}
        return {key_name(k): self._residence(k) for k in sorted(known)}

    def _held_names(self) -> set[str]:
        return {n for holding in self.replicas.values() for n in holding.device + holding.cpu}

    def _served(self, name: str) -> bool:
        """Whether a name is served now: registered, or never registered (its source's). A report that still names
        an adapter unloaded since does not bring it back."""
        return name in self.registered or not self.generations.get(name, 0)

    def _residence(self, key: str) -> AdapterResidence:
        cached, name = self.adapters.get(key), key_name(key)
        return AdapterResidence(
            content_id=cached.content_id if cached is not None else None,
            lora_path=self.registered.get(name), object_store=cached is not None,
            device_replicas=tuple(sorted(r for r, h in self.replicas.items() if name in h.device)),
            cpu_replicas=tuple(sorted(r for r, h in self.replicas.items() if name in h.cpu)),
            source_loads=self.load_counts.get(key, 0))
