"""The cluster-wide adapter cache: one named Ray actor that loads adapters just in time.

An adapter is read from its source once, validated, and kept in the Ray object store (the CPU
tier, LRU by bytes within a budget). Replicas get an object reference and fetch the tensors from
the object store, on any node, without touching the source again. Concurrent requests for one
adapter share one load (single flight). The actor is restarted by Ray if it dies and reloads on
demand; replicas keep serving the adapters they already hold.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import ray
from transformers import AutoConfig

from lora_cache.adapter import LoRAAdapter, load_adapter
from lora_cache.sources import SourceConfig, make_source, validate_adapter_id

ACTOR_NAME = "lora-serve-adapter-cache"
RESIDENCE_TTL_S = 30.0  # a replica that has not reported for this long is gone


@dataclass
class _Entry:
    ref: ray.ObjectRef
    nbytes: int


@ray.remote(max_restarts=-1, max_task_retries=-1, num_cpus=0)
class LoRACacheActor:
    def __init__(self, base_config: dict, sources: SourceConfig, capacity_bytes: int = 4 << 30):
        # The base model's config as a dict: the actor may live on a node without the model's files.
        self.hf_config = AutoConfig.for_model(**base_config)
        self.source = make_source(sources)  # remote sources download into the disk tier on the actor's node
        self.capacity_bytes = capacity_bytes
        self.max_adapter_bytes = sources.max_adapter_bytes
        self.entries: OrderedDict[str, _Entry] = OrderedDict()
        self.inflight: dict[str, asyncio.Future] = {}
        self.load_counts: dict[str, int] = {}
        self.load_seconds: dict[str, float] = {}
        self.hits = self.misses = 0
        self.residence: dict[str, tuple[float, list[str], list[str]]] = {}  # replica -> (time, device, cpu)

    async def get(self, adapter_id: str) -> list[ray.ObjectRef]:
        """A one-element list holding the adapter's object reference (a list, so Ray hands back the ref)."""
        entry = self.entries.get(adapter_id)
        if entry is not None:
            self.hits += 1
            self.entries.move_to_end(adapter_id)
            return [entry.ref]
        self.misses += 1
        if adapter_id not in self.inflight:  # single flight: later callers await the first caller's load
            self.inflight[adapter_id] = asyncio.ensure_future(self._load(adapter_id))
        try:
            return [await asyncio.shield(self.inflight[adapter_id])]
        finally:
            if self.inflight.get(adapter_id) is not None and self.inflight[adapter_id].done():
                self.inflight.pop(adapter_id, None)

    async def _load(self, adapter_id: str) -> ray.ObjectRef:
        start = time.perf_counter()
        adapter = await asyncio.to_thread(self._read, adapter_id)
        ref = ray.put(adapter)
        self.entries[adapter_id] = _Entry(ref, adapter.nbytes)
        self.load_counts[adapter_id] = self.load_counts.get(adapter_id, 0) + 1
        self.load_seconds[adapter_id] = self.load_seconds.get(adapter_id, 0.0) + time.perf_counter() - start
        self._evict_beyond_capacity()
        return ref

    def _read(self, adapter_id: str) -> LoRAAdapter:
        folder = self.source.locate(validate_adapter_id(adapter_id))
        return load_adapter(adapter_id, folder, self.hf_config, self.max_adapter_bytes)

    def _evict_beyond_capacity(self) -> None:
        while len(self.entries) > 1 and sum(e.nbytes for e in self.entries.values()) > self.capacity_bytes:
            self.entries.popitem(last=False)  # the object store frees it once no replica holds the ref

    def report_residence(self, replica: str, device: list[str], cpu: list[str]) -> list[str]:
        """A replica tells which adapters it holds in device slots and in its CPU copy; the answer is the adapters
        that the other live replicas hold (a replica forwards their requests there)."""
        self.residence[replica] = (time.monotonic(), device, cpu)
        others = [v for r, v in self._replicas().items() if r != replica]
        return sorted({a for v in others for a in v["device"] + v["cpu"]})

    def _replicas(self) -> dict[str, dict]:
        now = time.monotonic()
        self.residence = {r: v for r, v in self.residence.items() if now - v[0] < RESIDENCE_TTL_S}
        return {r: {"device": device, "cpu": cpu} for r, (_, device, cpu) in self.residence.items()}

    def stats(self) -> dict:
        return {"adapters": {a: {"nbytes": e.nbytes} for a, e in self.entries.items()}, "replicas": self._replicas(),
                "bytes": sum(e.nbytes for e in self.entries.values()), "capacity_bytes": self.capacity_bytes,
                "hits": self.hits, "misses": self.misses, "load_counts": dict(self.load_counts),
                "load_seconds": dict(self.load_seconds)}


def adapter_residence(stats: dict) -> dict[str, dict]:
    """Per adapter the cache knows: in the object store or not, the replicas holding it in device slots and in
    their CPU copy, and how often it was read from its source."""
    known = set(stats["adapters"]) | set(stats["load_counts"])
    for replica in stats["replicas"].values():
        known |= set(replica["device"]) | set(replica["cpu"])
    return {a: {"object_store": a in stats["adapters"],
                "device_replicas": sorted(r for r, v in stats["replicas"].items() if a in v["device"]),
                "cpu_replicas": sorted(r for r, v in stats["replicas"].items() if a in v["cpu"]),
                "source_loads": stats["load_counts"].get(a, 0)} for a in sorted(known)}


def get_or_create_cache_actor(base_config: dict, sources: SourceConfig,
                              name: str = ACTOR_NAME) -> ray.actor.ActorHandle:
    """The one named, detached cache actor of this Ray cluster (created by the first replica that asks)."""
    return LoRACacheActor.options(name=name, lifetime="detached", get_if_exists=True).remote(base_config, sources)


class RayAdapterCache:
    """The engine's adapter provider in serving: asks the cache actor, keeps a process-local copy.

    Same interface as LocalAdapterCache (`get`, `in`, per-adapter load counts), so the engine does not
    know which one it has. A call is retried once if the actor died in between (Ray restarts it).
    """

    def __init__(self, actor: ray.actor.ActorHandle):
        self.actor = actor
        self.adapters: OrderedDict[str, LoRAAdapter] = OrderedDict()  # process-local copies, newest last
        self.load_counts: dict[str, int] = {}
        self.load_seconds: dict[str, float] = {}
        self.max_local = 64
        self._lock = threading.Lock()  # the engine's step thread fetches, the replica's report thread lists

    def get(self, adapter_id: str) -> LoRAAdapter:
        adapter = self.adapters.get(adapter_id)
        if adapter is None:
            start = time.perf_counter()
            adapter = self._fetch(adapter_id)
            with self._lock:
                self.adapters[adapter_id] = adapter
                self.load_counts[adapter_id] = self.load_counts.get(adapter_id, 0) + 1
                self.load_seconds[adapter_id] = self.load_seconds.get(adapter_id, 0.0) + time.perf_counter() - start
                while len(self.adapters) > self.max_local:
                    self.adapters.popitem(last=False)
        with self._lock:
            self.adapters.move_to_end(adapter_id)
        return adapter

    def _fetch(self, adapter_id: str) -> LoRAAdapter:
        for attempt in range(2):
            try:
                [ref] = ray.get(self.actor.get.remote(adapter_id))
                return ray.get(ref)
            except ray.exceptions.RayTaskError as exc:  # the load itself failed: the adapter is bad
                raise exc.as_instanceof_cause() from None
            except ray.exceptions.RayActorError:
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def report_residence(self, replica: str, device: list[str]) -> frozenset[str]:
        """Tell the cache actor which adapters this replica holds (device slots, and its CPU copy); return the ones
        other replicas hold. Blocks for one actor call: the replica's report thread calls it."""
        with self._lock:
            cpu = list(self.adapters)
        try:
            return frozenset(ray.get(self.actor.report_residence.remote(replica, device, cpu)))
        except ray.exceptions.RayError:  # the actor is restarting: serve every adapter here until it answers
            return frozenset()

    def __contains__(self, adapter_id: str) -> bool:
        return adapter_id in self.adapters
