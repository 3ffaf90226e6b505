"""Engine replica: one AsyncEngine per replica, behind the HTTP routes (deployments/routes/routes.py) in the same
process.

Serve's HTTP proxy hands each request to a replica with the deployment's router (deployments/routing/request_router.py),
which knows a request's adapter only from the `serve_multiplexed_model_id` header. The replica that parses the request
knows its adapter and prompt: it ranks itself and its peers by adapter residence, cached prefix and load
(deployments/routing/policy.py, deployments/routing/peer_view.py), serves the request itself when it is among the best,
and forwards it otherwise, through a handle to its own deployment whose router sends it to the chosen peer. A forwarded
request is served where it lands. A replica added by scale-up reaches every adapter through the cluster's cache actor at
once. Every second the replica builds its report (lora_cache/replica_report.py: adapters in device slots and in its CPU
copy, prefix-cache digests, load), sends it to the cache actor, which answers with its peers' reports, and hands it to
Serve's routers through record_routing_stats; it also publishes its engine gauges. From the same reports it preloads a
hot adapter that its holders cannot keep up with, and drops it once it cools (deployments/routing/replication.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import ray
from fastapi import FastAPI
from ray import serve
from ray.serve.config import BackpressureConfig

from deployments.api.events import TokenEvent
from deployments.control_node import ControlPlacement
from deployments.gate.gate import Gate, GateConfig
from deployments.gate.ray_ledger import RayLedger
from deployments.replica.engine_events import AdapterFetch, EngineEvents, EventRequest, RequestWatch
from deployments.replica.event_streams import Comebacks, ForwardedEvents, LocalEvents, ReturnedToSender
from deployments.replica.metrics import ServingMetrics
from deployments.replica.openmp import intel_openmp_loaded
from deployments.replica.pacing import STREAM_INTERVAL_MS, EventPacer
from deployments.replica.replica_stats import ReplicaStats, engine_info
from deployments.replica.tracing import RequestTracing, TraceCarrier, TracingConfig
from deployments.routes.engine_client import Served
from deployments.routes.routes import http_app
from deployments.routing.peer_view import PeerView
from deployments.routing.policy import RouteRequest, RoutingPolicy
from deployments.routing.replication import ReplicationSignals, Replicator
from deployments.routing.request_router import ROUTING_STATS_KEY, live_replicas, router_config
from engine.config import EngineConfig
from engine.errors import (
    OVERLOADED_RETRY_AFTER_S,
    Refusal,
    key_name,
)
from engine.lora.merge_spec import MergeSpec
from engine.outputs import EngineStats
from engine.sampling import SamplingParams
from lora_cache.actor import RayAdapterCache, get_or_create_cache_actor
from lora_cache.cache_stats import CacheStats
from lora_cache.registry import Registration
from lora_cache.replica_report import ClusterView, ReplicaReport

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine

REPORT_INTERVAL_S = 1.0
# A replica that Serve stops (a scale-down, a rolling update) gets no new requests and runs the ones it has to their
# end, for at most this long before Serve kills it and cuts the rest. Serve's default, 20 s, is shorter than one
# long generation on a CPU; the wait ends as soon as the last request does, so a long bound costs only when needed.
GRACEFUL_SHUTDOWN_TIMEOUT_S = 300


# The engine's own queue limit (max_waiting_requests, answered 429 in each API's error shape) is meant to act
# first: ongoing requests allow more than max_num_seqs + max_waiting_requests. Past Serve's own queue the proxy
# answers 503 with Retry-After in plain text.
@serve.deployment(max_ongoing_requests=1024, max_queued_requests=512, health_check_period_s=10,
                  graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_TIMEOUT_S,
                  backpressure_config=BackpressureConfig(status_code=503, retry_after_s=OVERLOADED_RETRY_AFTER_S),
                  request_router_config=router_config(RoutingPolicy()))
@serve.ingress()
class LLMServer:
    def __init__(self, engine: dict | None = None, top_adapters: int = 20,
                 gate: GateConfig = GateConfig(), routing: RoutingPolicy | None = RoutingPolicy(),
                 stream_interval_ms: float = STREAM_INTERVAL_MS, tracing: TracingConfig | None = None,
                 control: ControlPlacement = ControlPlacement()):
        """routing: how this replica places the requests it parses (deployments/routing/policy.py); None serves each
        where Serve's router put it (plain multiplexing, for comparison). stream_interval_ms: the longest a
        producing stream waits between events (deployments/replica/pacing.py). tracing: where its requests' spans
        go (deployments/replica/tracing.py; off without an endpoint). control: the nodes where the application's
        cluster-wide actors run, which this replica creates if it is the first (deployments/control_node.py)."""
        config = EngineConfig.from_overrides(**(engine or {}))
        self.node_id = ray.get_runtime_context().get_node_id()
        context = serve.get_replica_context()
        self.replica = f"{context.replica_tag}@node-{self.node_id[:8]}"
        self._deployment = (context.deployment, context.app_name)
        # API keys, per-key limits held for the whole application, body size: deployments/gate/gate.py
        self.gate = Gate(gate, RayLedger(context.app_name, control) if gate.limited else None, self.replica)
        # The cache actor first, before this process imports torch: if this replica creates it, its process start
        # overlaps the engine's imports, model load and operators' build
        self.adapter_cache = self._adapter_provider(config, control) if config.lora.max_loras else None
        self.engine = _start_engine(_engine_threads(config), self.adapter_cache)
        if self.adapter_cache is not None:
            self.adapter_cache.wait_ready()
        self.served = Served(self, config, self.engine.tokenizer)  # what the routes keep beside this replica
        self.metrics = ServingMetrics(top_adapters)
        self.tracing = RequestTracing.of(tracing or TracingConfig(), self.replica)  # owns its TracerProvider
        self.events = EngineEvents(self.engine, self.served.token_texts, self._content_id, self._fetch_adapter,
                                   EventPacer(max_interval_s=stream_interval_ms / 1000))
        self.metrics.memory(self.engine.memory())
        self._peer_handle = None  # a handle to this deployment, for requests a peer should serve
        self._peers = _peer_view(routing, context)
        self._replicator = self._replicator_of(routing)
        self._replication = ReplicationSignals(0, 0)  # as the last report interval found it
        self._forwarded = 0  # requests this replica sent to a peer
        self._comebacks = Comebacks()  # those of them in flight, to learn at once of one sent back here
        self._in_flight: Counter[str | None] = Counter()  # adapter key (None: base model) -> requests here
        self._report = ReplicaReport(self.replica)
        self._node_store: frozenset[str] = frozenset()  # adapters in this node's object store, per the cache actor
        self._stop = threading.Event()
        threading.Thread(target=self._report_loop, name="lora-serve-report", daemon=True).start()

    def _replicator_of(self, routing: RoutingPolicy | None) -> Replicator | None:
        """Preloads hot adapters here and drops them when cool (deployments/routing/replication.py); None without
        LoRA, peers or a hot threshold."""
        if self.adapter_cache is None or routing is None or routing.hot_adapter_requests is None:
            return None
        return Replicator(routing.hot_adapter_requests, self._preload_adapter, self._drop_adapter)

    def _preload_adapter(self, name: str) -> None:
        """Into the CPU copy here (a fetch, on the report thread), then into a device slot between two steps."""
        key = self._key(name)
        self.adapter_cache.get(key)
        self.engine.load_adapter(key)

    def _drop_adapter(self, name: str) -> None:
        key = self._key(name)
        self.adapter_cache.drop(key)
        self.engine.unload_adapter(key)

    def _adapter_provider(self, config: EngineConfig, control: ControlPlacement) -> RayAdapterCache:
        actor = get_or_create_cache_actor(config.sources, resources=control.resources())
        return RayAdapterCache(actor, self.replica, timeout_s=config.lora.adapter_cache_timeout_s)

    @serve.multiplexed(max_num_models_per_replica=64)
    async def _adapter(self, adapter_id: str) -> str:
        """Fetch the adapter into this replica's CPU copy; Serve then routes its requests here first."""
        await asyncio.to_thread(self.adapter_cache.get, adapter_id)
        return adapter_id

    def __serve_build_asgi_app__(self) -> FastAPI:
        """The HTTP routes over this replica (Serve's late-bound ingress builds them after __init__)."""
        return self.tracing.instrument(http_app(self.served, self.gate))

    def generate(self, prompt: str | list[int], params: SamplingParams, adapter: str | None,
                 stream: bool = True) -> LocalEvents | ForwardedEvents:
        """Served here, unless a peer ranks better for this request (deployments/routing/peer_view.py): then forwarded
        through Serve's router, and served here after all if that peer dies before its first event
        (deployments/replica/event_streams.py). The engine knows the adapter by its current key (lora_cache/registry.py:
        the name, or a new key once it was loaded at run time); a forwarded request names it as routing does, by name
        and content id, and its target resolves the key itself."""
        key = self._key(adapter)
        route = self._forward_route(prompt, params, key)
        if route is None:
            return self._serve_here(prompt, params, key, stream)
        if self._peer_handle is None:
            self._peer_handle = serve.get_deployment_handle(*self._deployment).options(stream=True)
        self._forwarded += 1
        forward_id, came_back = self._comebacks.open()
        events = self._peer_handle.forwarded.remote(route, prompt, params, stream, self.tracing.carrier(adapter),
                                                    forward_id)
        return ForwardedEvents(events, lambda: self._serve_here(prompt, params, key, stream),
                               lambda: self._forward_ended(route, forward_id), came_back)

    def _forward_ended(self, route: RouteRequest, forward_id: str) -> None:
        self._peers.finished(route)
        self._comebacks.close(forward_id)

    def _key(self, adapter: str | None) -> str | None:
        """The key the engine knows adapter `adapter` by now; None for the base model."""
        return self.adapter_cache.key(adapter) if adapter is not None and self.adapter_cache is not None else adapter

    def _serve_here(self, prompt: str | list[int], params: SamplingParams, adapter: str | None,
                    stream: bool) -> LocalEvents:
        request_id = uuid.uuid4().hex
        return LocalEvents(self._generate(request_id, prompt, params, adapter, stream),
                           lambda: self.engine.abort(request_id))

    def _forward_route(self, prompt: str | list[int], params: SamplingParams, key: str | None) -> RouteRequest | None:
        """The request with the peer to forward it to, or None to serve it here. The prompt is tokenized for its
        prefix digests only when there are peers to compare, and cut as the engine will cut it."""
        if self._peers is None or not self._peers.has_peers:
            return None
        token_ids = params.kept_prompt(self.served.tokenizer(prompt).input_ids if isinstance(prompt, str) else prompt)
        digests = self.engine.prompt_digests(token_ids, key)
        # Its own counts are live, not the last report's: a burst for one adapter spreads as it builds up.
        own = dataclasses.replace(self._report, running=sum(self._in_flight.values()), waiting=0,
                                  adapter_requests=self._adapter_requests())
        return self._peers.choose(self._route_request(key, digests), own)

    def _route_request(self, key: str | None, digests: list[int]) -> RouteRequest:
        """What routing knows of a request for this key: the adapter's name and, once this replica holds it, the
        content id of its weights."""
        if key is None:
            return RouteRequest(None, None, tuple(digests))
        return RouteRequest(key_name(key), self.adapter_cache.content_id(key), tuple(digests))

    async def forwarded(self, route: RouteRequest, prompt: str | list[int], params: SamplingParams,
                        stream: bool = True, trace: TraceCarrier | None = None,
                        forward_id: str | None = None) -> AsyncIterator[TokenEvent | Refusal]:
        """A request another replica forwarded here (Serve's router reads `route`:
        deployments/routing/request_router.py), in the trace it carries; refused at once when it came back to the
        replica that forwarded it, which also learns it in process (deployments/replica/event_streams.py)."""
        if route.sender == self.replica:
            self._comebacks.came_back(forward_id)
            raise ReturnedToSender(self.replica)
        async for event in self._generate(uuid.uuid4().hex, prompt, params, self._key(route.adapter), stream, trace):
            yield event

    async def register_adapter(self, name: str, lora_path: str) -> Registration:
        return await self._lora_cache().register(name, lora_path)

    async def unregister_adapter(self, name: str) -> None:
        await self._lora_cache().unregister(name)

    async def merge_adapters(self, spec: MergeSpec) -> str:
        return await self._lora_cache().merge(spec)

    def _lora_cache(self) -> RayAdapterCache:
        if self.adapter_cache is None:
            raise ValueError("this server runs without LoRA (engine.max_loras is 0): it cannot load adapters")
        return self.adapter_cache

    async def _generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                        adapter: str | None, stream: bool,
                        trace: TraceCarrier | None = None) -> AsyncIterator[TokenEvent | Refusal]:
        """Yield TokenEvents of one or more new tokens each (each event costs the HTTP proxy and, when forwarded,
        a Ray stream per item, not per token: the tokens ready when the consumer asks, held longer under load,
        see deployments/replica/pacing.py); the last one carries the Final. With stream=False, one event with every
        token. A request the engine refuses yields one Refusal instead."""
        name = key_name(adapter) if adapter is not None else None
        watch = self.tracing.watch(self.metrics.start(name), request_id, name, trace)
        self._in_flight[adapter] += 1
        try:
            async for event in self.events.events(EventRequest(request_id, prompt, params, adapter, stream), watch):
                yield event
        finally:
            self._in_flight[adapter] -= 1
            if not self._in_flight[adapter]:
                del self._in_flight[adapter]

    def _content_id(self, key: str) -> str | None:
        return self.adapter_cache.content_id(key)

    async def _fetch_adapter(self, adapter: str, watch: RequestWatch) -> None:
        if self.adapter_cache is None:
            raise ValueError(f"adapter {adapter!r} requested but this server runs without LoRA "
                             f"(engine.max_loras is 0)")
        hit = adapter in self.adapter_cache
        start = time.perf_counter()
        await self._adapter(adapter)
        watch.adapter_fetched(AdapterFetch(hit, start, time.perf_counter()))

    def stats(self) -> ReplicaStats:
        peers = self._peers.held_by_peers() if self._peers is not None else {}
        preloaded = sorted(self._replicator.preloaded) if self._replicator is not None else []
        return ReplicaStats.of(self.replica, self.node_id, self.engine.stats(), self.engine.adapter_stats(),
                               self._forwarded, peers, preloaded)

    def replica_info(self) -> dict:
        return engine_info(self.replica, self.engine)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Per-replica signals for deployments.replica.autoscaling.EngineLoadPolicy."""
        s = self.engine.stats()
        replication = self._replication
        return {"waiting": float(s.waiting), "running": float(s.running), "kv_utilisation": s.kv_utilisation,
                "unspreadable": float(replication.unspreadable), "preloaded": float(replication.preloaded)}

    def record_routing_stats(self) -> dict:
        """This replica's last report, for Serve's routers (deployments/routing/request_router.py)."""
        return {ROUTING_STATS_KEY: self._report}

    def _report_loop(self) -> None:
        while not self._stop.wait(REPORT_INTERVAL_S):
            stats = self.engine.stats()
            self.metrics.engine_state(stats)
            self._report = self._build_report(stats)
            self.metrics.adapters.update(self._report.held(), self._report.adapter_requests)
            if self.adapter_cache is not None:
                self._follow(self.adapter_cache.report(self._report))

    def _follow(self, view: ClusterView | None) -> None:
        """The cluster as the cache actor answered this report (None while it restarts)."""
        self._node_store = view.node_store(self.node_id) if view is not None else frozenset()
        if self._peers is not None:
            self._peers.update(view.peers if view is not None else None)
        if self._replicator is not None and view is not None:
            self._replication = self._replicator.follow(self._report, view.peers)

    def _build_report(self, s: EngineStats) -> ReplicaReport:
        """This replica's report: its adapters by name and content id, current versions only
        (lora_cache/replica_report.py)."""
        cache = self.adapter_cache
        device, cpu = (cache.versions(s.resident_adapters), cache.versions(cache.held())) if cache else ((), ())
        return ReplicaReport(self.replica, device, cpu, self._node_store, self.engine.cached_prefix_digests(),
                             s.running, s.waiting, s.kv_utilisation, self._adapter_requests())

    def _adapter_requests(self) -> dict[str, int]:
        """Each adapter's requests in flight here now, by name (the base model's are not counted)."""
        counts: Counter[str] = Counter()
        for key, n in dict(self._in_flight).items():
            if key is not None and n > 0:
                counts[key_name(key)] += n
        return dict(counts)

    def running(self) -> bool:
        return self.engine.is_healthy

    def max_model_len(self) -> int:
        return self.engine.max_model_len

    async def adapter_stats(self) -> CacheStats | None:
        """The cache actor's view of every adapter; None without LoRA."""
        return await self.adapter_cache.cache_stats() if self.adapter_cache is not None else None

    def check_health(self) -> None:
        if not self.running():
            raise RuntimeError("engine loop is not running")

    def __del__(self):
        self._stop.set()
        if getattr(self, "gate", None) is not None:
            self.gate.close()
        if getattr(self, "adapter_cache", None) is not None:
            self.adapter_cache.close()
        if getattr(self, "tracing", None) is not None:
            self.tracing.shutdown()


def _peer_view(routing: RoutingPolicy | None, context) -> PeerView | None:
    """This replica's view of its peers, for the requests it parses; None when Serve's router alone places them."""
    live = lambda: live_replicas(context.app_name, context.deployment)
    return PeerView(routing, live) if routing is not None else None


def _start_engine(config: EngineConfig, adapters: RayAdapterCache | None) -> AsyncEngine:
    """The engine, imported here: this module is imported without torch (Serve's build step imports the app before
    any replica starts, and a replica creates the cache actor before the engine's imports). Its tensor-parallel
    workers, if any, are Ray actors in this replica's placement group (deployments/replica/tensor_parallel_workers.py)."""
    from deployments.replica.tensor_parallel_workers import RayWorkerLauncher
    from engine.async_engine import AsyncEngine

    workers = RayWorkerLauncher() if config.backend.tensor_parallel_size > 1 else None
    return AsyncEngine(config, adapters.bound if adapters is not None else None, workers)


def _engine_threads(config: EngineConfig) -> EngineConfig:
    """On CPU, unless num_threads is set: every core when this replica runs Intel's OpenMP runtime
    (deployments/replica/openmp.py preloads it wherever the intel-openmp dependency is installed), else all cores but
    one. On GNU OpenMP the engine steps on a thread that is not the process's first, and libgomp then throttles its
    spin-waits, so every parallel op wakes its threads through the kernel; the core left over goes to the proxy.
    Tensor-parallel workers share the cores (BackendConfig.threads_per_worker)."""
    from engine.platform import platform_of  # with torch: Serve's build step imports this module, a replica runs it

    backend = config.backend
    if backend.num_threads is not None or not platform_of(backend.torch_device).threads_compute \
            or backend.tensor_parallel_size > 1:
        return config
    cores = os.cpu_count() or 2
    return config.with_options(num_threads=cores if intel_openmp_loaded() else max(1, cores - 1))
