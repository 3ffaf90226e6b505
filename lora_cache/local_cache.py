"""In-process CPU tier: each adapter is read from its source once and kept in memory (LRU by bytes).

The offline engine uses it by default (`local_adapters`, an AdapterProviderFactory); in serving, the
cluster-wide Ray cache actor plays this role.
"""

from __future__ import annotations

import threading

from engine.errors import AdapterNotFoundError
from engine.lora.ids import validate_adapter_id
from engine.lora.merge_spec import MergeSpec, is_merge_key
from engine.lora.provider import LoRAAdapter, LoraShapes
from lora_cache.lru import LRUByBytes
from lora_cache.make_source import make_source
from lora_cache.provider import HeldAdapters
from lora_cache.reader import AdapterReader
from lora_cache.source_config import SourceConfig
from lora_cache.sources import AdapterSource


class LocalAdapterCache(HeldAdapters):
    """An AdapterProvider (lora_cache/provider.py); its load counts are reads from the source."""

    def __init__(self, source: AdapterSource, shapes: LoraShapes, max_adapter_bytes: int,
                 capacity_bytes: int = 4 << 30):
        self.source = source
        self.reader = AdapterReader(shapes, max_adapter_bytes)
        self._adapters: LRUByBytes[LoRAAdapter] = LRUByBytes(lambda a: a.nbytes, capacity_bytes)
        self.merges: dict[str, MergeSpec] = {}
        self._lock = threading.RLock()  # one load at a time: concurrent requests for one adapter load it once

    def get(self, adapter_id: str) -> LoRAAdapter:
        with self._lock:
            return self._adapters.get_or_load(adapter_id, lambda: self._read(adapter_id))

    def merge(self, spec: MergeSpec) -> str:
        """The key of the adapter that merges spec's adapters (merged on its first use)."""
        self.merges[spec.key()] = spec
        return spec.key()

    def _read(self, key: str) -> LoRAAdapter:
        if not is_merge_key(key):
            folder = self.source.locate(validate_adapter_id(key))
            return self.reader.read(key, folder)
        spec = self.merges.get(key)
        if spec is None:
            raise AdapterNotFoundError(key, "no such merge: send its merged_adapters spec")
        parts = [self.get(adapter_id) for adapter_id in spec.ids]  # the lock is re-entrant
        return self.reader.merge(key, parts, spec)

    def key(self, name: str) -> str:
        """Offline, an adapter is known by its name (serving keys reloaded ones apart: lora_cache/registry.py)."""
        return name


def local_adapters(sources: SourceConfig, shapes: LoraShapes) -> LocalAdapterCache:
    """The offline engine's adapter provider (an AdapterProviderFactory, and the default one: plugin.py's
    PLUGIN): the configured adapter source, read in this process."""
    return LocalAdapterCache(make_source(sources), shapes, sources.max_adapter_bytes)
