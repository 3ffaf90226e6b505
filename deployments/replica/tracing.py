"""Per-request OpenTelemetry traces of an engine replica, exported over OTLP.

A replica owns one `RequestTracing`: its own TracerProvider (never the process-global one), built from the app's
`tracing` args (`TracingConfig`), with a batching processor over an OTLP exporter (gRPC or HTTP/protobuf, imported
only when an endpoint is configured). Without an endpoint there is no provider and nothing is instrumented: the
app is served as it is and each request's watch is the metrics' own, so tracing costs nothing.

One HTTP request is one trace (or continues the client's, from its W3C `traceparent` header):

    POST /v1/completions  (route: the replica's root span, kind SERVER; its tenant, adapter and HTTP status)
    ├── gate              (body size, API key and limits: GateMiddleware until it admits or refuses)
    ├── adapter_load      (the adapter fetched into the replica's copy: LLMServer._fetch_adapter)
    ├── prepare           (the engine tokenizes the prompt and resolves the adapter)
    ├── queue             (in the engine's waiting queue until it is first scheduled)
    ├── prefill           (first scheduled -> first token)
    └── decode            (first token -> finished)

Spans are made with explicit start and end times from times already taken: the route's and the gate's by the two
ASGI middlewares that wrap the gate (`RouteSpans` outside it, `GateSpans` inside it); the adapter fetch's by the
replica; the engine's phases from the `RequestTimes` of a request's finished output (engine/outputs.py), so the
engine knows nothing of tracing. Every time is a time.perf_counter() reading, turned into the wall clock's
nanoseconds by one `Clock` per request, so a request's spans nest exactly. The engine's spans of a request are
made when it finishes (a request aborted before that has its route and gate spans only); a request with several
choices has one set per choice, each naming its engine request id. A request forwarded to a peer carries its
trace and tenant (`TraceCarrier`), so the peer's spans join the same trace; a request with no trace around it
(a Serve handle's caller) gets a root span, `generate`, over its engine spans.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from starlette.middleware import Middleware

from deployments.gate.gate import OPEN_PATHS
from deployments.replica.engine_events import Watches

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer
    from starlette.applications import Starlette

    from deployments.api.events import TokenEvent
    from deployments.replica.engine_events import AdapterFetch, RequestWatch
    from engine.outputs import RequestOutput, RequestTimes

PROPAGATOR = TraceContextTextMapPropagator()
ROUTE = otel_context.create_key("lora_serve.route")  # the request's RouteTrace, in the route's context
OtlpProtocol = Literal["grpc", "http/protobuf"]


@dataclass(frozen=True)
class TracingConfig:
    """Where a replica sends its traces; no endpoint: tracing off."""
    otlp_traces_endpoint: str | None = None
    protocol: OtlpProtocol = "grpc"
    service_name: str = "lora-serve"
    sample_ratio: float = 1.0


@dataclass(frozen=True)
class TraceCarrier:
    """A forwarded request's trace (W3C trace context) and tenant, for the peer that serves it."""
    traceparent: str
    tracestate: str
    tenant: str | None


@dataclass(frozen=True)
class Clock:
    """One request's mapping from time.perf_counter() seconds to the wall clock's nanoseconds (span times)."""
    offset_ns: int = field(default_factory=lambda: time.time_ns() - time.perf_counter_ns())

    def ns(self, perf_s: float) -> int:
        return round(perf_s * 1e9) + self.offset_ns


@dataclass(frozen=True)
class SpanParent:
    """Where a request's spans go: its tracer, the context of the span they belong under, and its clock."""
    tracer: Tracer
    context: Context
    clock: Clock

    def child(self, name: str, start: float, end: float, attributes: dict) -> Span:
        span = self.tracer.start_span(name, self.context, attributes=attributes, start_time=self.clock.ns(start))
        span.end(self.clock.ns(end))
        return span


@dataclass
class RouteTrace:
    """One HTTP request's route span, open while the request is served, and what its children need."""
    span: Span
    spans: SpanParent  # under the route span
    started: float  # perf_counter
    tenant: str | None = None
    gated: bool = False  # the gate's span is made

    def admitted(self, tenant: str | None) -> None:
        self.tenant = tenant
        if tenant is not None:
            self.span.set_attribute("lora_serve.tenant", tenant)
        self._gate({"lora_serve.tenant": tenant} if tenant is not None else {})

    def _gate(self, attributes: dict) -> None:
        if not self.gated:
            self.gated = True
            self.spans.child("gate", self.started, time.perf_counter(), attributes)

    def close(self, scope: dict, status: int | None) -> None:
        """The request was answered: a gate that never admitted it refused it with `status`."""
        if status is not None:
            self.span.set_attribute("http.response.status_code", status)
        self._gate({"http.response.status_code": status} if status is not None else {})
        route = scope.get("route")
        if getattr(route, "path", None):
            self.span.set_attribute("http.route", route.path)
            self.span.update_name(f"{scope['method']} {route.path}")
        if status is not None and status >= 500:
            self.span.set_status(trace.StatusCode.ERROR)
        self.span.end(self.spans.clock.ns(time.perf_counter()))


class RouteSpans:
    """ASGI middleware outside the gate: each HTTP request's route span, continuing an incoming `traceparent`."""

    def __init__(self, app, tracer: Tracer):
        self.app = app
        self.tracer = tracer

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        route = self._start(scope)
        answer = _Status(send)
        token = otel_context.attach(otel_context.set_value(ROUTE, route, route.spans.context))
        try:
            await self.app(scope, receive, answer.send)
        except Exception as exc:  # answered 500 by Starlette's outermost middleware
            route.span.record_exception(exc)
            answer.status = answer.status or 500
            raise
        finally:
            otel_context.detach(token)
            route.close(scope, answer.status)

    def _start(self, scope) -> RouteTrace:
        parent, started, clock = PROPAGATOR.extract(_trace_headers(scope)), time.perf_counter(), Clock()
        span = self.tracer.start_span(f"{scope['method']} {scope['path']}", parent, trace.SpanKind.SERVER,
                                      {"http.request.method": scope["method"], "url.path": scope["path"]},
                                      start_time=clock.ns(started))
        return RouteTrace(span, SpanParent(self.tracer, trace.set_span_in_context(span, parent), clock), started)


class GateSpans:
    """ASGI middleware inside the gate: reached once the gate admitted a request, as its tenant."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        route = otel_context.get_value(ROUTE)
        if route is not None:
            tenant = scope.get("state", {}).get("tenant")
            route.admitted(tenant.name if tenant is not None else None)
        await self.app(scope, receive, send)


class _Status:
    """The status of the answer an ASGI app sends."""

    def __init__(self, send):
        self._send = send
        self.status: int | None = None

    async def send(self, message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        await self._send(message)


def _trace_headers(scope) -> dict[str, str]:
    """The request's W3C trace context headers, as the propagator reads them."""
    wanted = {b"traceparent", b"tracestate"}
    return {key.decode("latin-1"): value.decode("latin-1") for key, value in scope["headers"] if key in wanted}


@dataclass(frozen=True)
class RequestAttributes:
    """What every engine span of one engine request says: which request, adapter (None: the base model), tenant."""
    request_id: str
    adapter: str | None
    tenant: str | None

    def of(self, output: RequestOutput) -> dict:
        named = {"lora_serve.request_id": self.request_id, "lora_serve.adapter": self.adapter,
                 "lora_serve.tenant": self.tenant}
        return {**{key: value for key, value in named.items() if value is not None},
                "gen_ai.usage.input_tokens": len(output.prompt_token_ids),
                "gen_ai.usage.output_tokens": len(output.token_ids),
                "gen_ai.response.finish_reasons": (output.finish_reason or "",),
                "lora_serve.cached_tokens": output.num_cached_tokens,
                "lora_serve.preemptions": output.num_preemptions}


class RequestSpans:
    """A RequestWatch (deployments/replica/engine_events.py) that makes one engine request's spans when it
    finishes: its adapter fetch and its phases in the engine. parent None: they go under a root span of their own."""

    def __init__(self, tracer: Tracer, parent: SpanParent | None, attributes: RequestAttributes):
        self.tracer = tracer
        self.parent = parent
        self.attributes = attributes
        self.fetch: AdapterFetch | None = None

    def token(self) -> None:
        pass

    def sent(self, event: TokenEvent) -> None:
        pass

    def adapter_fetched(self, fetch: AdapterFetch) -> None:
        self.fetch = fetch

    def finished(self, output: RequestOutput) -> None:
        times, attributes = output.times, self.attributes.of(output)
        if times is None or times.finished is None:
            return
        parent = self.parent or self._root(times, attributes)
        if self.fetch is not None:
            parent.child("adapter_load", self.fetch.start, self.fetch.end,
                         {**attributes, "lora_serve.adapter_cache_hit": self.fetch.hit})
        for name, start, end in phases(times):
            parent.child(name, start, end, attributes)

    def _root(self, times: RequestTimes, attributes: dict) -> SpanParent:
        """A root span over the request's engine spans, for a request with no trace around it."""
        clock = Clock()
        start = self.fetch.start if self.fetch is not None else times.arrival
        root = self.tracer.start_span("generate", attributes=attributes, start_time=clock.ns(start))
        root.end(clock.ns(times.finished))
        return SpanParent(self.tracer, trace.set_span_in_context(root), clock)


def phases(times: RequestTimes) -> list[tuple[str, float, float]]:
    """A finished request's phases in the engine, each with its start and end: those it reached."""
    marks = [("prepare", times.arrival), ("queue", times.prepared), ("prefill", times.first_scheduled),
             ("decode", times.first_token), ("", times.finished)]
    return [(name, start, end) for (name, start), (_, end) in itertools.pairwise(marks)
            if start is not None and end is not None]


class RequestTracing:
    """A replica's tracing: the TracerProvider it owns, or None (off: every method hands back what it was given)."""

    def __init__(self, provider: TracerProvider | None = None):
        self.provider = provider
        self.tracer = provider.get_tracer("lora-serve") if provider is not None else None

    @classmethod
    def of(cls, config: TracingConfig, instance: str) -> RequestTracing:
        """Spans batched to config's OTLP endpoint, from a replica named `instance`; off without an endpoint."""
        if config.otlp_traces_endpoint is None:
            return cls()
        resource = Resource.create({"service.name": config.service_name, "service.instance.id": instance})
        provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)), resource=resource)
        provider.add_span_processor(BatchSpanProcessor(otlp_exporter(config)))
        return cls(provider)

    @property
    def enabled(self) -> bool:
        return self.tracer is not None

    def instrument(self, app: Starlette) -> Starlette:
        """The app, with the route's span around its gate and the gate's span ending where the gate admits."""
        if self.enabled:
            app.user_middleware.append(Middleware(GateSpans))  # innermost: inside the gate, which http_app added
            app.add_middleware(RouteSpans, tracer=self.tracer)  # outermost
        return app

    def watch(self, inner: RequestWatch, request_id: str, adapter: str | None,
              forwarded: TraceCarrier | None = None) -> RequestWatch:
        """The watch of one engine request: `inner`, and its spans when tracing is on, under the current HTTP
        request's route span or the trace a forwarded request carries."""
        if not self.enabled:
            return inner
        route: RouteTrace | None = otel_context.get_value(ROUTE)
        if route is not None:
            if adapter is not None:
                route.span.set_attribute("lora_serve.adapter", adapter)
            parent, tenant = route.spans, route.tenant
        else:
            parent, tenant = self._remote_parent(forwarded), forwarded.tenant if forwarded is not None else None
        return Watches((inner, RequestSpans(self.tracer, parent, RequestAttributes(request_id, adapter, tenant))))

    def _remote_parent(self, forwarded: TraceCarrier | None) -> SpanParent | None:
        if forwarded is None:
            return None
        context = PROPAGATOR.extract({"traceparent": forwarded.traceparent, "tracestate": forwarded.tracestate})
        valid = trace.get_current_span(context).get_span_context().is_valid
        return SpanParent(self.tracer, context, Clock()) if valid else None

    def carrier(self, adapter: str | None = None) -> TraceCarrier | None:
        """The current request's trace and tenant, for the peer it is forwarded to (its route span names the
        adapter here, since its engine spans are the peer's); None when off."""
        if not self.enabled:
            return None
        headers: dict[str, str] = {}
        PROPAGATOR.inject(headers)
        route: RouteTrace | None = otel_context.get_value(ROUTE)
        if route is not None and adapter is not None:
            route.span.set_attribute("lora_serve.adapter", adapter)
        return TraceCarrier(headers.get("traceparent", ""), headers.get("tracestate", ""),
                            route.tenant if route is not None else None)

    def shutdown(self) -> None:
        """Export what is buffered and stop."""
        if self.provider is not None:
            self.provider.shutdown()


def otlp_exporter(config: TracingConfig) -> SpanExporter:
    """The OTLP exporter of config's protocol, imported here: only a replica with an endpoint loads it. The
    standard OTEL_EXPORTER_OTLP_* variables set the rest (headers, certificates, timeout, compression)."""
    if config.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter(endpoint=config.otlp_traces_endpoint)
