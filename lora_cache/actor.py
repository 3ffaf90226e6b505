"""The cluster-wide adapter cache: one named Ray actor that loads adapters just in time.

An adapter is read from its source once, validated, and kept in the Ray object store (the CPU
tier, LRU by bytes within a budget). Replicas get an object reference and fetch the tensors from
the object store, on any node, without touching the source again. Concurrent requests for one
adapter share one load (single flight). The actor is restarted by Ray if it dies and reloads on
demand; replicas keep serving the adapters they already hold.

The actor reads adapters from the sources (adapters_root, adapter_source, ...) and for the LoRA shapes (the model's
linears, max_lora_rank) of the newest replica that asked: a rolling update to a new adapters_root reaches the actor
with the first request of a replica it started, and the adapters read for the former ones are dropped then (a name
may mean other weights there). The replicas still draining keep the copies they hold. Each request carries its
replica's sources, so an actor that Ray restarted with its first arguments follows the current ones again.

A replica's wait for the actor is bounded by the actor's silence, not by time: a load may rightly take minutes (a
download), but an actor that answers no ping for `timeout_s` (stopped, a restart that cannot be placed, its node
gone) fails the wait with AdapterCacheUnavailableError, a 503 with Retry-After at the edge. Unbounded, one such wait
would hold its request and, since Serve loads a replica's multiplexed models one at a time, every later request for
an adapter the replica does not yet hold.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import ray

from engine.errors import AdapterError, AdapterNotFoundError, key_name
from engine.lora.ids import validate_adapter_id
from engine.lora.merge_spec import MergeSpec, is_merge_key
from engine.lora.provider import LoraShapes
from lora_cache.adapter_folder import AdapterCacheUnavailableError
from lora_cache.cache_stats import CachedAdapter, CacheStats, ReplicaHolding
from lora_cache.lru import LRUByBytes
from lora_cache.make_source import make_source, remote_source
from lora_cache.provider import HeldAdapters
from lora_cache.registry import AdapterRegistry, Registration, RegistryView
from lora_cache.replica_report import AdapterVersion, ClusterView, ReplicaReport
from lora_cache.source_config import SourceConfig
from lora_cache.sources import AdapterLocation, AdapterSource

if TYPE_CHECKING:
    from engine.lora.provider import LoRAAdapter
    from lora_cache.reader import AdapterReader

ACTOR_NAME = "lora-serve-adapter-cache"
MAX_LOCAL_COPIES = 64  # adapters a replica keeps fetched from the actor
RESIDENCE_TTL_S = 10.0  # a replica that has not reported for this long is gone (replicas report every second)
ACTOR_TIMEOUT_S = 30.0  # the actor silent this long is unavailable: longer than its restart
PING_EVERY_S = 1.0  # while a call is awaited, how often the actor is asked whether it still answers


@dataclass
class _Entry:
    ref: ray.ObjectRef
    nbytes: int
    content_id: str


@ray.remote(max_restarts=-1, max_task_retries=-1, num_cpus=0)
class LoRACacheActor:
    def __init__(self, sources: SourceConfig, capacity_bytes: int = 4 << 30):
        # torch loads here, in the actor's process and before it answers: a replica imports this module to create
        # the actor before it imports torch itself (lora_cache/reader.py)
        import lora_cache.reader  # noqa: F401

        self.reader: AdapterReader | None = None  # made by the first read, for the shapes it brings (_reader)
        self.sources = sources
        self.sources_since = 0.0  # the start time of the replica whose sources these are (_follow)
        self.source = make_source(sources)  # remote sources download into the disk tier on the actor's node
        self.remote_sources: dict[str, AdapterSource] = {}  # for registered s3:// and hf:// locations
        name = ray.get_runtime_context().get_actor_name()
        saved = sources.disk_folder() / f"registry-{name}.json" if name else None
        self.registry = AdapterRegistry(saved)  # a named actor restarted by Ray keeps its registrations
        self._registering = asyncio.Lock()
        self.merges: dict[str, MergeSpec] = {}  # merge key -> its spec (lora_cache/merge.py)
        # the object store tier: the store frees an evicted entry's tensors once no replica holds the ref
        self.entries: LRUByBytes[_Entry] = LRUByBytes(lambda e: e.nbytes, capacity_bytes)
        self.inflight: dict[str, asyncio.Future] = {}
        self.hits = self.misses = 0
        self.residence: dict[str, ReplicaReport] = {}  # replica id -> its last report
        self.node_id = ray.get_runtime_context().get_node_id()  # where put() stores the adapters

    def ping(self) -> int:
        """This process's id: the actor answers (a replica's liveness probe while it awaits a call)."""
        return os.getpid()

    async def get(self, adapter_id: str, shapes: LoraShapes, sources: SourceConfig | None = None,
                  started_at: float = 0.0) -> list[ray.ObjectRef]:
        """A one-element list holding the adapter's object reference (a list, so Ray hands back the ref), read on
        a miss against the base model's LoRA `shapes` (each caller's engine knows them). sources, started_at: the
        caller's adapter sources and its start time (_follow)."""
        self._follow(sources, shapes, started_at)
        entry = self.entries.get(adapter_id)
        if entry is not None:
            self.hits += 1
            return [entry.ref]
        self.misses += 1
        if adapter_id not in self.inflight:  # single flight: later callers await the first caller's load
            self.inflight[adapter_id] = asyncio.ensure_future(self._load(adapter_id, shapes))
        try:
            return [await asyncio.shield(self.inflight[adapter_id])]
        finally:
            if self.inflight.get(adapter_id) is not None and self.inflight[adapter_id].done():
                self.inflight.pop(adapter_id, None)

    def _follow(self, sources: SourceConfig | None, shapes: LoraShapes, started_at: float) -> None:
        """Read from the sources, for the shapes, of a replica started after the one whose are in use, if they
        differ; forget what the former ones gave (an older replica asking, during a rolling update, changes nothing)."""
        if sources is None or started_at <= self.sources_since:
            return
        if sources != self.sources or (self.reader is not None and self.reader.shapes != shapes):
            self.source, self.sources, self.reader, self.remote_sources = make_source(sources), sources, None, {}
            self.entries.discard(list(self.entries.keys()))
            self.inflight.clear()  # a read under way finishes for its callers, unstored (_load)
        self.sources_since = started_at

    async def _load(self, key: str, shapes: LoraShapes, location: AdapterLocation | None = None) -> ray.ObjectRef:
        start, sources = time.perf_counter(), self.sources
        reader = self._reader(shapes)
        if is_merge_key(key):
            adapter = await self._merged(key, shapes)
        else:
            adapter = await asyncio.to_thread(self._read, reader, key, location or self._location(key))
        ref = ray.put(adapter)
        if sources is self.sources or location is not None:  # a registered location is not the sources'
            self.entries.put(key, _Entry(ref, adapter.nbytes, adapter.content_id), time.perf_counter() - start)
        return ref

    def merge(self, spec: MergeSpec) -> str:
        """The key of the adapter that merges spec's adapters (merged once, on its first use)."""
        self.merges[spec.key()] = spec
        return spec.key()

    def _reader(self, shapes: LoraShapes) -> AdapterReader:
        """The reader of this cluster's base model: one actor serves one base (the newest replica's, _follow), so
        other shapes are refused."""
        from lora_cache.reader import AdapterReader  # loaded at the actor's start

        if self.reader is None:
            self.reader = AdapterReader(shapes, self.sources.max_adapter_bytes)
        if self.reader.shapes != shapes:
            raise AdapterError("*", "this cluster's adapter cache serves another base model's LoRA shapes")
        return self.reader

    async def _merged(self, key: str, shapes: LoraShapes) -> LoRAAdapter:
        spec = self.merges.get(key)
        if spec is None:
            raise AdapterNotFoundError(key, "no such merge: send its merged_adapters spec")
        view = self.registry.view()
        parts = [await (await self.get(view.key(adapter_id), shapes))[0] for adapter_id in spec.ids]
        return await asyncio.to_thread(self._reader(shapes).merge, key, parts, spec)

    def _location(self, key: str) -> AdapterLocation | None:
        """Where the key's weights are: its registered location, or None for the configured source."""
        name = key_name(key)
        if not self.registry.view().is_current(key):
            raise AdapterError(name, "was loaded or unloaded again while this request was on its way; retry")
        return self.registry.location(name)

    def _read(self, reader: AdapterReader, key: str, location: AdapterLocation | None) -> LoRAAdapter:
        name = validate_adapter_id(key_name(key))
        if location is None:
            folder = self.source.locate(name)
        elif location.scheme == "local":
            folder = Path(location.path)
        elif location.scheme == "s3":
            bucket, _, prefix = location.path.partition("/")
            folder = self._remote_source("s3").fetch(name, bucket, prefix)
        else:
            folder = self._remote_source("hub").locate(location.path)
        return reader.read(key, folder)

    def _remote_source(self, kind: str) -> AdapterSource:
        if kind not in self.remote_sources:
            self.remote_sources[kind] = remote_source(kind, self.sources, root=None)
        return self.remote_sources[kind]

    async def register(self, name: str, lora_path: str, shapes: LoraShapes,
                       not_after: float = math.inf) -> Registration:
        """Serve `name` from `lora_path` (a local folder, s3://bucket/prefix or hf://org/name[@rev]) under a new
        key. The adapter is read and validated first: a bad one changes nothing. not_after: see _awaited."""
        _awaited(name, not_after)
        validate_adapter_id(name)
        if "@" in name:
            raise AdapterError(name, "a lora_name has no '@revision': put the revision in lora_path")
        try:
            location = AdapterLocation.parse(lora_path)
        except ValueError as exc:
            raise AdapterError(name, str(exc)) from None
        async with self._registering:  # one change of the registry at a time: each gets its own generation
            key = self.registry.next_key(name)
            await self._load(key, shapes, location)
            self.registry.register(name, location)
            self._forget_older(name, key)
            return Registration(name, key, self.entries.get(key).content_id, self.registry.version)

    async def unregister(self, name: str, not_after: float = math.inf) -> int:
        """Stop serving `name` from its registered location; the registry version that says so."""
        _awaited(name, not_after)
        async with self._registering:
            self.registry.unregister(name)
            self._forget_older(name, None)
            return self.registry.version

    async def watch(self, replica: str, applied_version: int) -> RegistryView:
        """Long poll: the registry view once it differs from the version `replica` has applied (or after 10 s)."""
        return await self.registry.changed_since(replica, applied_version, 10.0)

    async def wait_applied(self, version: int, timeout_s: float = 5.0) -> list[str]:
        """Wait until every live replica has applied `version`; the replicas that did not in time."""
        return await self.registry.wait_applied(version, list(self._live_residence()), timeout_s)

    def _forget_older(self, name: str, keep: str | None) -> None:
        self.entries.discard([k for k in self.entries.keys() if key_name(k) == name and k != keep])

    def report(self, report: ReplicaReport) -> ClusterView:
        """A replica tells where its adapters reside, what its prefix cache holds and its load; the answer is the
        other live replicas' reports and what the object store holds (a replica routes requests by them:
        deployments/routing/policy.py)."""
        self.residence[report.replica] = dataclasses.replace(report, reported_at=time.monotonic())
        peers = [v for r, v in self._live_residence().items() if r != report.replica]
        return ClusterView(peers, self._stored(), self.node_id)

    def _stored(self) -> frozenset[AdapterVersion]:
        """The adapters in the object store tier, as routing knows them (only current keys are kept there)."""
        entries = self.entries.snapshot()
        return frozenset(AdapterVersion(key_name(key), entry.content_id) for key, entry in entries.items())

    def _live_residence(self) -> dict[str, ReplicaReport]:
        """The reports of the replicas that reported within RESIDENCE_TTL_S (the others are dropped)."""
        now = time.monotonic()
        self.residence = {r: v for r, v in self.residence.items() if now - v.reported_at < RESIDENCE_TTL_S}
        return self.residence

    def _replicas(self) -> dict[str, ReplicaHolding]:
        return {r: ReplicaHolding(tuple(a.name for a in v.device), tuple(a.name for a in v.cpu))
                for r, v in self._live_residence().items()}

    def stats(self) -> CacheStats:
        entries, loads = self.entries.snapshot(), self.entries.load_stats()
        return CacheStats(
            adapters={a: CachedAdapter(e.nbytes, e.content_id) for a, e in entries.items()},
            registered={n: str(loc) for n, loc in self.registry.locations.items()},
            generations=dict(self.registry.generations), replicas=self._replicas(),
            nbytes=self.entries.nbytes(), capacity_bytes=self.entries.capacity_bytes, hits=self.hits,
            misses=self.misses, load_counts={a: load.loads for a, load in loads.items()},
            load_seconds={a: load.seconds for a, load in loads.items()})


def _awaited(name: str, not_after: float) -> None:
    """A change of the registry reaching the actor after `not_after` (time.time(), sent by the caller: clocks of a
    cluster's nodes agree to far less than the second of margin it leaves) finds its caller gone, refused with a 503:
    it must not land once a silent actor runs again. A call that starts earlier answers the caller's next ping in
    time, so that the caller waits for it (RayAdapterCache._answer)."""
    if time.time() > not_after:
        raise AdapterCacheUnavailableError(name, "the change reached it after the replica had stopped waiting")


def get_or_create_cache_actor(sources: SourceConfig, name: str = ACTOR_NAME,
                              resources: Mapping[str, float] | None = None) -> ray.actor.ActorHandle:
    """The one named, detached cache actor of this Ray cluster (created by the first replica that asks), on a node
    with these custom resources (the caller's choice of node: deployments/control_node.py). Outside any placement
    group: Serve's replicas capture their children in theirs, and a tensor-parallel replica has one, which goes with
    the replica, and an actor restarting into a removed group waits forever."""
    return LoRACacheActor.options(name=name, lifetime="detached", get_if_exists=True, scheduling_strategy="DEFAULT",
                                  resources=dict(resources or {})).remote(sources)


class RayAdapterCache(HeldAdapters):
    """The engine's adapter provider in serving: asks the cache actor, keeps a process-local copy.

    An AdapterProvider (lora_cache/provider.py), as LocalAdapterCache is, so the engine does not know which one it
    has; its load counts are fetches from the actor. A call is retried once if the actor died in between (Ray
    restarts it).
    """

    def __init__(self, actor: ray.actor.ActorHandle, replica: str = "driver", follow_registry: bool = True,
                 timeout_s: float = ACTOR_TIMEOUT_S):
        """follow_registry: keep this copy's view of adapters loaded at run time current, from a thread that
        long-polls the actor (a replica does; a driver that only fetches adapters need not). timeout_s: how long
        the actor may answer nothing before a call awaiting it fails (AdapterCacheUnavailableError)."""
        self._actor = actor
        self._shapes: LoraShapes | None = None  # the engine's, once it binds this provider (bound)
        self._sources: SourceConfig | None = None  # the engine's too, sent with each read (LoRACacheActor._follow)
        self._started_at = time.time()
        self.replica = replica
        self.timeout_s = timeout_s
        self._ping_every_s = min(PING_EVERY_S, timeout_s / 2)
        # process-local copies by key (their tensors live in the object store's shared memory: a count bounds them)
        self._adapters: LRUByBytes[LoRAAdapter] = LRUByBytes(lambda a: a.nbytes, max_entries=MAX_LOCAL_COPIES)
        # The registry's current view, asked for now and waited for where it is first needed (a preload, a key):
        # a replica's first start creates the actor, and its process start then overlaps the engine's model load
        # and operator build instead of coming before them
        self._first_view = actor.watch.remote(replica, -1)
        self._latest: RegistryView | None = None
        self._view_lock = threading.Lock()
        self._stop = threading.Event()
        if follow_registry:
            threading.Thread(target=self._watch, name="lora-serve-registry", daemon=True).start()

    def bound(self, sources: SourceConfig, shapes: LoraShapes) -> RayAdapterCache:
        """This provider, for the engine whose LoRA shapes these are: an AdapterProviderFactory. The replica
        makes the provider before its engine, so that the actor's start and first answer overlap the model's
        load, and the engine binds it once it has read its model's config."""
        self._shapes, self._sources = shapes, sources
        return self

    def _bound_shapes(self) -> LoraShapes:
        if self._shapes is None:
            raise RuntimeError("this adapter provider reads adapters once an engine has bound it (bound)")
        return self._shapes

    def wait_ready(self) -> None:
        """Wait for the actor's first answer: an actor that cannot start fails the caller's start here, with its
        error, rather than its first adapter request."""
        self._view()

    def key(self, name: str) -> str:
        """The key the engine knows `name` by now (lora_cache/registry.py)."""
        return self._view().key(name)

    def _view(self) -> RegistryView:
        """The latest registry view: the first one waits for the actor's answer."""
        with self._view_lock:
            if self._latest is None:
                try:
                    self._latest = ray.get(self._first_view)
                except ray.exceptions.RayActorError:  # it died before answering: ask its restart next time
                    self._first_view = self._actor.watch.remote(self.replica, -1)
                    raise
            return self._latest

    def content_id(self, key: str) -> str | None:
        """The content id of the key's weights, if this replica holds them (its LRU order unchanged)."""
        adapter = self._adapters.peek(key)
        return adapter.content_id if adapter is not None else None

    def versions(self, keys: list[str] | tuple[str, ...]) -> tuple[AdapterVersion, ...]:
        """The current ones of these keys as routing knows them, by name and content id: a key a reload replaced
        is left out (lora_cache/replica_report.py)."""
        view = self._view()
        return tuple(AdapterVersion(key_name(k), self.content_id(k) or "") for k in keys if view.is_current(k))

    async def register(self, name: str, lora_path: str) -> Registration:
        """Load `name` from `lora_path` in the cache actor; returns once every live replica serves the new key."""
        registration = await self._call(self._actor.register.remote(name, lora_path, self._bound_shapes(),
                                                                    self._not_after()), name)
        await self._call(self._actor.wait_applied.remote(registration.version), name)
        return registration

    async def unregister(self, name: str) -> None:
        version = await self._call(self._actor.unregister.remote(name, self._not_after()), name)
        await self._call(self._actor.wait_applied.remote(version), name)

    async def merge(self, spec: MergeSpec) -> str:
        return await self._call(self._actor.merge.remote(spec), None)

    def _not_after(self) -> float:
        """The latest time at which a change sent now may start in the actor: before this call's wait can end
        (timeout_s without an answer), less one ping's period."""
        return time.time() + self.timeout_s - self._ping_every_s

    async def _call(self, ref: ray.ObjectRef, adapter_id: str | None):
        """The answer of an actor call, awaited off the event loop (_answer blocks)."""
        return await asyncio.to_thread(self._answer, ref, adapter_id)

    def _answer(self, ref: ray.ObjectRef, adapter_id: str | None):
        """The answer of an actor call; AdapterCacheUnavailableError once the actor has answered no ping for
        timeout_s (one ping outstanding at a time: the calls of a restarting actor queue until it is back). A call
        given up may still run once the actor answers: a load then warms the cache, and a change of the registry
        refuses itself (_awaited)."""
        heard = time.monotonic()
        ping = self._actor.ping.remote()
        while not ray.wait([ref], timeout=self._ping_every_s)[0]:
            if ray.wait([ping], timeout=0)[0]:
                heard, ping = time.monotonic(), self._actor.ping.remote()
            elif time.monotonic() - heard > self.timeout_s:
                raise AdapterCacheUnavailableError(adapter_id, f"its actor ({ACTOR_NAME}) has answered nothing for "
                                                   f"{self.timeout_s:g} s")
        return ray.get(ref)

    def _watch(self) -> None:
        """Long-poll the actor for registry changes; drop the copies of keys that are no longer current."""
        while not self._stop.is_set():
            try:
                view = self._next_view()
            except ray.exceptions.RayError:  # the actor is restarting
                self._stop.wait(1.0)
                continue
            except SystemExit:  # Ray is shutting down in this process
                return
            if view is None:
                return
            self._adapters.discard([k for k in self._adapters.keys() if not view.is_current(k)])
            with self._view_lock:
                self._latest = view

    def _next_view(self) -> RegistryView | None:
        """The actor's next view, waited for in short slices so that close() stops the thread within one."""
        ref = self._actor.watch.remote(self.replica, self._view().version)
        while not ray.wait([ref], timeout=2.0)[0]:
            if self._stop.is_set():
                return None
        return ray.get(ref)

    def close(self) -> None:
        self._stop.set()

    def get(self, adapter_id: str) -> LoRAAdapter:
        """The adapter of a key (a name, for one never registered at run time)."""
        return self._adapters.get_or_load(adapter_id, lambda: self._fetch(adapter_id))

    def _fetch(self, adapter_id: str) -> LoRAAdapter:
        """The adapter from the actor: its object reference, then its tensors from the object store (a read, so
        bounded by timeout_s itself). A call is asked again once if the actor died in between, or the copy it
        handed out was lost with a node (the actor, restarted or not, loads it again)."""
        for attempt in range(2):
            try:
                call = self._actor.get.remote(adapter_id, self._bound_shapes(), self._sources, self._started_at)
                [ref] = self._answer(call, adapter_id)
                return ray.get(ref, timeout=self.timeout_s)
            except ray.exceptions.RayTaskError as exc:  # the load itself failed: the adapter is bad
                raise exc.as_instanceof_cause() from None
            except ray.exceptions.GetTimeoutError:
                raise AdapterCacheUnavailableError(adapter_id, f"its copy in Ray's object store did not arrive in "
                                                   f"{self.timeout_s:g} s") from None
            except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as exc:
                if attempt:
                    raise AdapterCacheUnavailableError(adapter_id, f"{type(exc).__name__} twice") from None
        raise AssertionError("unreachable")

    async def cache_stats(self) -> CacheStats:
        """The cache actor's stats: its tier's adapters and each adapter's residence across the replicas;
        AdapterCacheUnavailableError while the actor restarts or answers nothing."""
        try:
            return await self._call(self._actor.stats.remote(), None)
        except ray.exceptions.RayActorError as exc:
            raise AdapterCacheUnavailableError(None, type(exc).__name__) from None

    def held(self) -> tuple[str, ...]:
        """The adapter keys in this replica's CPU copy."""
        return tuple(self._adapters.keys())

    def drop(self, key: str) -> None:
        """Drop this replica's CPU copy of the adapter of `key` (a later request fetches it again)."""
        self._adapters.discard([key])

    def report(self, report: ReplicaReport) -> ClusterView | None:
        """Send this replica's report to the cache actor; its view of the cluster, or None while the actor
        restarts. Blocks for one actor call: the replica's report thread calls it."""
        try:
            return ray.get(self._actor.report.remote(report), timeout=self.timeout_s)
        except ray.exceptions.RayError:  # GetTimeoutError too
            return None
