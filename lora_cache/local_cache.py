"""In-process CPU tier: each adapter is read from its source once and kept in memory (LRU by bytes).

The offline engine uses it directly; in serving, the cluster-wide Ray cache actor plays this role.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, defaultdict

from lora_cache.adapter import AdapterNotFoundError, LoRAAdapter, load_adapter, target_module_shapes
from lora_cache.merge import MergeSpec, is_merge_key, merge_adapters
from lora_cache.sources import AdapterSource, validate_adapter_id


class LocalAdapterCache:
    def __init__(self, source: AdapterSource, hf_config, max_adapter_bytes: int, capacity_bytes: int = 4 << 30):
        self.source = source
        self.hf_config = hf_config
        self.max_adapter_bytes = max_adapter_bytes
        self.capacity_bytes = capacity_bytes
        self.adapters: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self.loads = 0
        self.load_counts: defaultdict[str, int] = defaultdict(int)  # per adapter: reads from the source
        self.load_seconds: defaultdict[str, float] = defaultdict(float)
        self.merges: dict[str, MergeSpec] = {}
        self._lock = threading.Lock()  # one load at a time: concurrent requests for one adapter load it once

    def get(self, adapter_id: str) -> LoRAAdapter:
        with self._lock:
            return self._get(adapter_id)

    def merge(self, spec: MergeSpec) -> str:
        """The key of the adapter that merges spec's adapters (merged on its first use)."""
        self.merges[spec.key()] = spec
        return spec.key()

    def _read(self, key: str) -> LoRAAdapter:
        if not is_merge_key(key):
            folder = self.source.locate(validate_adapter_id(key))
            return load_adapter(key, folder, self.hf_config, self.max_adapter_bytes)
        spec = self.merges.get(key)
        if spec is None:
            raise AdapterNotFoundError(key, "no such merge: send its merged_adapters spec")
        parts = [self._get(adapter_id) for adapter_id in spec.ids]
        return merge_adapters(key, parts, spec, list(target_module_shapes(self.hf_config)))

    def _get(self, adapter_id: str) -> LoRAAdapter:
        """get, with the lock held (a merge gets its parts through it)."""
        adapter = self.adapters.get(adapter_id)
        if adapter is None:
            start = time.perf_counter()
            adapter = self._read(adapter_id)
            self.adapters[adapter_id] = adapter
            self.loads += 1
            self.load_counts[adapter_id] += 1
            self.load_seconds[adapter_id] += time.perf_counter() - start
            self._evict_beyond_capacity()
        self.adapters.move_to_end(adapter_id)
        return adapter

    def key(self, name: str) -> str:
        """Offline, an adapter is known by its name (serving keys reloaded ones apart: lora_cache/registry.py)."""
        return name

    def __contains__(self, adapter_id: str) -> bool:
        return adapter_id in self.adapters

    def _evict_beyond_capacity(self) -> None:
        while len(self.adapters) > 1 and sum(a.nbytes for a in self.adapters.values()) > self.capacity_bytes:
            self.adapters.popitem(last=False)
