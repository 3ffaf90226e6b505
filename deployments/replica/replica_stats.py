"""One engine replica's state, as LLMServer.stats() answers it through a Serve handle, and the engine counters
/info publishes.

Operators and the serving tests ask a replica through its handle what it runs, holds and forwarded; the answer
crosses the Ray hop, so it is a dataclass (ReplicaStats) and not a dict: a renamed field fails where it is read.
It copies the engine's figures (engine/outputs.py: EngineStats, and AdapterStats per adapter) with the replica's
identity and routing state beside them. /info turns the prefix-cache and slot counters into JSON at
the HTTP edge (dataclasses.asdict).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.errors import key_name
from engine.outputs import AdapterStats, EngineStats

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine


@dataclass(frozen=True)
class PrefixCacheStats:
    queried_tokens: int  # prompt tokens looked up in the prefix cache
    hit_tokens: int  # of them, found
    hit_rate: float
    cached_blocks: int
    evictions: int

    @classmethod
    def of(cls, s: EngineStats) -> PrefixCacheStats:
        return cls(s.prefix_cache_queried_tokens, s.prefix_cache_hit_tokens, s.prefix_cache_hit_rate,
                   s.prefix_cache_blocks, s.prefix_cache_evictions)


@dataclass(frozen=True)
class AdapterSlotStats:
    acquisitions: int  # requests that took an adapter's device slot
    loads: int  # of them, copies into a slot
    hit_rate: float

    @classmethod
    def of(cls, s: EngineStats) -> AdapterSlotStats:
        return cls(s.adapter_slot_acquisitions, s.adapter_slot_loads, s.adapter_slot_hit_rate)


@dataclass(frozen=True)
class ReplicaStats:
    replica: str  # Serve's replica id
    node_id: str  # the Ray node it runs on
    waiting: int
    running: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_utilisation: float
    waiting_for_adapter: int  # waiting requests whose adapter is not in a device slot yet
    resident_adapters: list[str]  # in device slots
    adapters: dict[str, AdapterStats]  # per adapter: requests, tokens, residence, loads
    prefix_cache: PrefixCacheStats
    forwarded: int  # requests this replica sent to a peer that holds their adapter
    peer_adapters: dict[str, list[str]]  # per peer replica: the adapters it holds, as this one last heard
    preloaded: list[str]  # adapters it holds because they were hot elsewhere (deployments/routing/replication.py)

    def adapter_requests(self, adapter: str) -> int:
        """The requests this replica has run for the adapter of this name, in any of its versions (its keys)."""
        return requests_by_name(self.adapters).get(adapter, 0)

    def holds_on_device(self, adapter: str) -> bool:
        """Whether a version of the adapter of this name is in one of its device slots."""
        return any(key_name(key) == adapter for key in self.resident_adapters)

    @classmethod
    def of(cls, replica: str, node_id: str, s: EngineStats, adapters: dict[str, AdapterStats], forwarded: int,
           peer_adapters: dict[str, list[str]], preloaded: list[str]) -> ReplicaStats:
        return cls(replica, node_id, s.waiting, s.running, s.kv_blocks_used, s.kv_blocks_total, s.kv_utilisation,
                   s.waiting_for_adapter, list(s.resident_adapters), adapters, PrefixCacheStats.of(s), forwarded,
                   peer_adapters, preloaded)


def engine_info(name: str, engine: AsyncEngine) -> dict:
    """For /info: memory accounting (weight bytes by dtype, KV bytes per token, blocks and token capacity, adapter
    slot bytes), prefix-cache and device-slot counts, requests and KV blocks in use, and each adapter's requests so
    far, of the engine `name`."""
    s = engine.stats()
    return {"replica": name, "memory": engine.memory().to_dict(),
            "prefix_cache": dataclasses.asdict(PrefixCacheStats.of(s)),
            "adapter_slots": dataclasses.asdict(AdapterSlotStats.of(s)), "running": s.running,
            "waiting": s.waiting, "kv_blocks_used": s.kv_blocks_used,
            "adapter_requests": requests_by_name(engine.adapter_stats())}


def requests_by_name(adapters: dict[str, AdapterStats]) -> dict[str, int]:
    """Each adapter's requests in this engine by the name clients use, summed over its versions (keys)."""
    counts: dict[str, int] = {}
    for key, usage in adapters.items():
        counts[key_name(key)] = counts.get(key_name(key), 0) + usage.requests
    return counts
