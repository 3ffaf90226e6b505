"""In-process CPU tier: each adapter is read from its source once and kept in memory (LRU by bytes).

The offline engine uses it directly; in serving, the cluster-wide Ray cache actor plays this role.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, defaultdict

from lora_cache.adapter import LoRAAdapter, load_adapter
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
        self._lock = threading.Lock()  # one load at a time: concurrent requests for one adapter load it once

    def get(self, adapter_id: str) -> LoRAAdapter:
        with self._lock:
            adapter = self.adapters.get(adapter_id)
            if adapter is None:
                start = time.perf_counter()
                folder = self.source.locate(validate_adapter_id(adapter_id))
                adapter = load_adapter(adapter_id, folder, self.hf_config, self.max_adapter_bytes)
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
