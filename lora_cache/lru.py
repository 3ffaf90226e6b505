"""The one eviction policy of the adapter tiers: least recently used first, within a byte budget (and optionally a
count), with per-key load counters.

Used by the in-process CPU tier (lora_cache/local_cache.py), a replica's copy of what the cache actor hands out
(RayAdapterCache) and the cache actor's object-store entries. Thread-safe: in a replica the engine's step thread,
request threads and the report thread all touch the same copy. The newest entry is never evicted, so one adapter
larger than the budget is still served.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

from engine.lora.provider import LoadStats

V = TypeVar("V")


class LRUByBytes(Generic[V]):
    def __init__(self, nbytes: Callable[[V], int], capacity_bytes: int | None = None, max_entries: int | None = None):
        """capacity_bytes / max_entries: None is no limit."""
        self._nbytes = nbytes
        self.capacity_bytes = capacity_bytes
        self.max_entries = max_entries
        self._entries: OrderedDict[str, V] = OrderedDict()
        self._loads: dict[str, LoadStats] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> V | None:
        """The entry, now the most recently used; None when absent."""
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def peek(self, key: str) -> V | None:
        """The entry, its place in the LRU order left as it is; None when absent."""
        with self._lock:
            return self._entries.get(key)

    def get_or_load(self, key: str, load: Callable[[], V]) -> V:
        """The entry; on a miss, load() it (timed, without holding the lock: a load may read other entries)."""
        value = self.get(key)
        if value is None:
            start = time.perf_counter()
            value = load()
            self.put(key, value, time.perf_counter() - start)
        return value

    def put(self, key: str, value: V, load_seconds: float) -> None:
        """Keep a freshly loaded entry (counted as one load), evicting the least recently used beyond the limits."""
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            old = self._loads.get(key, LoadStats(0, 0.0))
            self._loads[key] = LoadStats(old.loads + 1, old.seconds + load_seconds)
            while len(self._entries) > 1 and self._over_limits():
                self._entries.popitem(last=False)

    def _over_limits(self) -> bool:
        if self.max_entries is not None and len(self._entries) > self.max_entries:
            return True
        return self.capacity_bytes is not None and self.nbytes() > self.capacity_bytes

    def nbytes(self) -> int:
        return sum(self._nbytes(v) for v in list(self._entries.values()))

    def discard(self, keys: list[str]) -> None:
        with self._lock:
            for key in keys:
                self._entries.pop(key, None)

    def keys(self) -> list[str]:
        """The keys held, least recently used first (a snapshot)."""
        with self._lock:
            return list(self._entries)

    def snapshot(self) -> dict[str, V]:
        """The entries held, least recently used first."""
        with self._lock:
            return dict(self._entries)

    def load_stats(self) -> dict[str, LoadStats]:
        """Per key ever loaded (held or since evicted): its loads (a snapshot)."""
        with self._lock:
            return dict(self._loads)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)
