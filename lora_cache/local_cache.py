"""In-process CPU tier: each adapter is read from its source once and kept in memory (LRU by bytes).

The offline engine uses it directly; in serving, the cluster-wide Ray cache actor plays this role.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

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
        self._lock = threading.Lock()  # one load at a time: concurrent requests for one adapter load it once

    def get(self, adapter_id: str) -> LoRAAdapter:
        with self._lock:
            adapter = self.adapters.get(adapter_id)
            if adapter is None:
                folder = self.source.locate(validate_adapter_id(adapter_id))
                adapter = load_adapter(adapter_id, folder, self.hf_config, self.max_adapter_bytes)
                self.adapters[adapter_id] = adapter
                self.loads += 1
                self._evict_beyond_capacity()
            self.adapters.move_to_end(adapter_id)
            return adapter

    def _evict_beyond_capacity(self) -> None:
        while len(self.adapters) > 1 and sum(a.nbytes for a in self.adapters.values()) > self.capacity_bytes:
            self.adapters.popitem(last=False)
