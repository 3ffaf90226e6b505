"""Prometheus metrics of an engine replica, exported through Ray (ray.serve.metrics).

Ray adds the deployment, replica and application tags and serves them on each node's metrics agent
(scrape targets: prom_metrics_service_discovery.json in Ray's temp folder, or start Ray with
--metrics-export-port). Per-adapter series are bounded: the `top_adapters` most requested adapters
keep their own label, every other adapter is reported as "other", and base-model requests as "base"
(deployments/gate/tenant_metrics.py has the per-key series and the bounded labels).
"""

from __future__ import annotations

import time
from collections import Counter as Tally  # Ray's metrics.Counter is the other one
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ray.serve import metrics

from deployments.gate.tenant_metrics import TopLabels
from engine.outputs import EngineStats

if TYPE_CHECKING:
    from deployments.api.events import TokenEvent
    from deployments.replica.engine_events import AdapterFetch
    from engine.memory import MemoryReport
    from engine.outputs import RequestOutput

LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120]
TOKEN_GAP_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56]
BASE = "base"


@dataclass
class RequestTimer:
    """Timestamps of one request as its tokens arrive at the replica: a RequestWatch of its events
    (deployments/replica/engine_events.py), which reports the request's series when it finishes."""
    adapter_label: str
    metrics: ServingMetrics
    start: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_event: float | None = None  # when its stream last sent an event

    def token(self) -> None:
        if self.first_token is None:
            self.first_token = time.monotonic()

    def sent(self, event: TokenEvent) -> None:
        """An event left for the client: the gap since its last one is an inter-token latency as a reader sees it
        (an event holds every token since the last under load: deployments/replica/pacing.py)."""
        now = time.monotonic()
        if self.last_event is not None:
            self.metrics.itl.observe(now - self.last_event, {"adapter": self.adapter_label})
        self.last_event = now

    def adapter_fetched(self, fetch: AdapterFetch) -> None:
        self.metrics.adapter_fetch(self, fetch.hit, fetch.end - fetch.start)

    def finished(self, output: RequestOutput) -> None:
        self.metrics.finish(self, output.finish_reason, len(output.prompt_token_ids), len(output.token_ids))


class AdapterGauges:
    """Per adapter label, the adapters this replica holds (a device slot or its CPU copy) and their requests here,
    running or waiting: summed over replicas by adapter, how many replicas hold each adapter and its queue in the
    deployment."""

    def __init__(self, labels: TopLabels):
        self.labels = labels
        self.held = metrics.Gauge("lora_serve_adapter_held", "Adapters of this label that this replica holds (in a "
                                  "device slot or its CPU copy).", ("adapter",))
        self.requests = metrics.Gauge("lora_serve_adapter_requests", "Requests of adapters of this label in this "
                                      "replica, running or waiting.", ("adapter",))
        self._set: set[str] = set()  # the labels set last time: any not set now goes back to 0

    def update(self, held: list[str], requests: dict[str, int]) -> None:
        """The adapters this replica holds, by name, and each one's requests here now."""
        held_by: Tally[str] = Tally(self.labels.label(name, count=False) for name in held)
        requests_by: Tally[str] = Tally()
        for name, n in requests.items():
            requests_by[self.labels.label(name, count=False)] += n
        labels = set(held_by) | set(requests_by)
        for label in labels | self._set:
            self.held.set(held_by[label], tags={"adapter": label})
            self.requests.set(requests_by[label], tags={"adapter": label})
        self._set = labels


class ServingMetrics:
    def __init__(self, top_adapters: int = 20):
        self.labels = TopLabels(top_adapters, BASE)
        tags = ("adapter",)
        self.ttft = metrics.Histogram("lora_serve_time_to_first_token_seconds", "Time to first token.",
                                      LATENCY_BUCKETS, tags)
        self.tpot = metrics.Histogram("lora_serve_time_per_output_token_seconds",
                                      "Mean time between output tokens of a request.", TOKEN_GAP_BUCKETS, tags)
        self.e2e = metrics.Histogram("lora_serve_request_latency_seconds", "End-to-end request latency.",
                                     LATENCY_BUCKETS, tags)
        self.itl = metrics.Histogram("lora_serve_inter_token_latency_seconds",
                                     "Gap between successive events of a streamed response (each holds one or more "
                                     "tokens).", TOKEN_GAP_BUCKETS, tags)
        self.requests = metrics.Counter("lora_serve_requests", "Finished requests.", ("adapter", "finish_reason"))
        self.prompt_tokens = metrics.Counter("lora_serve_prompt_tokens", "Prompt tokens of finished requests.", tags)
        self.generation_tokens = metrics.Counter("lora_serve_generation_tokens", "Generated tokens.", tags)
        self.adapter_hits = metrics.Counter("lora_serve_adapter_cache_hits",
                                            "Adapter requests served from this replica's copy.", tags)
        self.adapter_misses = metrics.Counter("lora_serve_adapter_cache_misses",
                                              "Adapter requests that fetched the adapter from the cache actor.", tags)
        self.adapter_load = metrics.Histogram("lora_serve_adapter_load_seconds",
                                              "Fetching an adapter into the replica.", LATENCY_BUCKETS, tags)
        self.gauges = {name: metrics.Gauge(f"lora_serve_{name}", description) for name, description in (
            ("running_requests", "Requests in the running batch."),
            ("waiting_requests", "Requests waiting for admission."),
            ("waiting_for_adapter", "Waiting requests whose adapter has no device slot yet."),
            ("kv_cache_utilisation", "Fraction of KV cache blocks in use."),
            ("resident_adapters", "Adapters in device slots."),
            ("prefix_cache_blocks", "KV blocks holding a cached prefix."),
            # a running total, as a gauge so that it is exported from the start (a Ray counter appears only once
            # incremented): increase() over it counts preemptions
            ("preemptions", "Running requests preempted for KV blocks since the replica started."))}
        self.total_counters = {name: metrics.Counter(f"lora_serve_{name}", description) for name, description in (
            ("prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache."),
            ("prefix_cache_hit_tokens", "Prompt tokens read from the prefix cache instead of computed."),
            ("prefix_cache_evictions", "Cached prefix blocks reused for other tokens."),
            ("speculative_proposed_tokens", "Speculative draft tokens verified."),
            ("speculative_accepted_tokens", "Speculative draft tokens the model agreed with."))}
        self._totals = dict.fromkeys(self.total_counters, 0)
        self.adapters = AdapterGauges(self.labels)

    def start(self, adapter: str | None) -> RequestTimer:
        return RequestTimer(self.labels.label(adapter), self)

    def adapter_fetch(self, timer: RequestTimer, hit: bool, seconds: float) -> None:
        tags = {"adapter": timer.adapter_label}
        if hit:
            self.adapter_hits.inc(1, tags)
            return
        self.adapter_misses.inc(1, tags)
        self.adapter_load.observe(seconds, tags)

    def finish(self, timer: RequestTimer, finish_reason: str, prompt_tokens: int, generated_tokens: int) -> None:
        now, tags = time.monotonic(), {"adapter": timer.adapter_label}
        first = timer.first_token or now
        self.ttft.observe(first - timer.start, tags)
        if generated_tokens > 1:
            self.tpot.observe((now - first) / (generated_tokens - 1), tags)
        self.e2e.observe(now - timer.start, tags)
        self.requests.inc(1, {**tags, "finish_reason": finish_reason})
        for counter, count in ((self.prompt_tokens, prompt_tokens), (self.generation_tokens, generated_tokens)):
            if count:  # Ray counters refuse 0
                counter.inc(count, tags)

    def memory(self, report: MemoryReport) -> None:
        """Set once at start-up: the replica's memory accounting."""
        weights = metrics.Gauge("lora_serve_weight_bytes", "Model weight bytes by storage dtype.", ("dtype",))
        for dtype, n in report.weight_bytes.items():
            weights.set(n, {"dtype": dtype})
        for name, description, value in (
                ("kv_cache_bytes", "Bytes of the paged KV cache.", report.kv_bytes),
                ("kv_cache_capacity_tokens", "Tokens the KV cache holds.", report.kv_token_capacity),
                ("kv_cache_bytes_per_token", "KV bytes per token.", report.kv_bytes_per_token),
                ("adapter_slot_bytes", "Bytes of the device slots for LoRA adapters.", report.adapter_slot_bytes)):
            metrics.Gauge(f"lora_serve_{name}", description).set(value)

    def engine_state(self, stats: EngineStats) -> None:
        values = {"running_requests": stats.running, "waiting_requests": stats.waiting,
                  "waiting_for_adapter": stats.waiting_for_adapter, "kv_cache_utilisation": stats.kv_utilisation,
                  "resident_adapters": len(stats.resident_adapters), "prefix_cache_blocks": stats.prefix_cache_blocks,
                  "preemptions": stats.preemptions}
        for name, value in values.items():
            self.gauges[name].set(value)
        for name, counter in self.total_counters.items():  # the engine keeps totals; counters take increments
            total = getattr(stats, name)
            if total > self._totals[name]:
                counter.inc(total - self._totals[name])
                self._totals[name] = total
