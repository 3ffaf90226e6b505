"""Per-request OpenTelemetry traces (deployments/replica/tracing.py) through the real app over an engine in one
process (deployments/replica/in_process.py), served by uvicorn on the loopback: each request's route span, its gate
span and its engine phases, their nesting, order, times and attributes, collected by the SDK's in-memory exporter;
and the OTLP export itself, to a real OTLP/HTTP and OTLP/gRPC receiver on the loopback."""

from __future__ import annotations

import itertools
import time

import pytest
import requests
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from pydantic import ValidationError

from deployments.app import AppArgs
from deployments.gate.auth import ApiKeyConfig, hash_key
from deployments.gate.gate import Gate, GateConfig
from deployments.replica.engine_events import Unwatched
from deployments.replica.in_process import InProcessEngine
from deployments.replica.tracing import RequestTracing, TraceCarrier
from deployments.routes.routes import http_app
from engine import EngineConfig
from engine.outputs import RequestOutput, RequestTimes
from lora_cache.local_cache import local_adapters
from tests.helpers import PROMPTS, uvicorn_serving, write_tiny_adapters
from tests.otlp_receivers import exported_names, grpc_receiver, http_receiver

KEY = "tracing-test-key-0123456789"
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "b7ad6b7169203331"
PHASES = ["prepare", "queue", "prefill", "decode"]


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def engine(tiny_llama_path, tmp_path_factory, exporter):
    root = write_tiny_adapters(tiny_llama_path, tmp_path_factory.mktemp("tracing-adapters"), ("alpha",))
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    config = EngineConfig.from_overrides(str(tiny_llama_path), max_loras=2, adapters_root=str(root), log_stats=False,
                                         num_threads=1, kv_cache_bytes=32 << 20)
    engine = InProcessEngine(config, local_adapters, RequestTracing(provider))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def url(engine):
    key = ApiKeyConfig(name="team-a", key_sha256=hash_key(KEY).hex()).to_key()
    with uvicorn_serving(engine.tracing.instrument(http_app(engine.served, Gate(GateConfig((key,)))))) as url:
        yield url


@pytest.fixture
def spans(exporter):
    """The spans of one test: finished(route name) waits for the route span (it ends once the answer is sent) and
    returns the route span and its children by name."""
    exporter.clear()

    def finished(route_name: str, children: int):
        deadline = time.monotonic() + 30
        while True:
            done = exporter.get_finished_spans()
            routes = [s for s in done if s.name == route_name]
            if routes and len(done) >= children + 1:
                return routes[0], {s.name: s for s in done if s is not routes[0]}
            assert time.monotonic() < deadline, [s.name for s in done]
            time.sleep(0.02)
    return finished


def post(url: str, body: dict, **headers) -> requests.Response:
    return requests.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}", **headers},
                         timeout=60)


def test_a_request_continues_its_traceparent_through_gate_and_engine_phases(url, spans):
    traceparent = f"00-{TRACE_ID}-{PARENT_ID}-01"
    answer = post(url, {"model": "alpha", "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0.0},
                  traceparent=traceparent)
    assert answer.status_code == 200, answer.text
    route, children = spans("POST /v1/completions", 1 + len(PHASES))
    assert route.kind is SpanKind.SERVER
    assert format(route.context.trace_id, "032x") == TRACE_ID and format(route.parent.span_id, "016x") == PARENT_ID
    assert route.parent.is_remote
    assert sorted(children) == sorted(["gate", *PHASES])
    for child in children.values():
        assert child.context.trace_id == route.context.trace_id and child.parent.span_id == route.context.span_id
        assert route.start_time <= child.start_time <= child.end_time <= route.end_time, child.name
    assert dict(route.attributes) == {
        "http.request.method": "POST", "url.path": "/v1/completions", "http.route": "/v1/completions",
        "http.response.status_code": 200, "lora_serve.tenant": "team-a", "lora_serve.adapter": "alpha"}
    assert children["gate"].attributes["lora_serve.tenant"] == "team-a"
    usage = answer.json()["usage"]
    for name in PHASES:
        attributes = children[name].attributes
        assert attributes["lora_serve.adapter"] == "alpha" and attributes["lora_serve.tenant"] == "team-a"
        assert attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
        assert attributes["gen_ai.usage.output_tokens"] == 6
        assert attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert_phases_in_order(children)


def assert_phases_in_order(children: dict) -> None:
    """The gate before the engine; each phase starting where the one before it ends; all but the queue taking
    time (a request alone may be scheduled at once)."""
    assert children["gate"].end_time <= children["prepare"].start_time
    for before, after in itertools.pairwise(PHASES):
        assert children[before].end_time == children[after].start_time, (before, after)
    for name in ("gate", "prepare", "prefill", "decode"):
        assert children[name].end_time > children[name].start_time, name
    assert children["queue"].end_time >= children["queue"].start_time


def test_a_streamed_base_model_request_without_a_traceparent_is_a_trace_of_its_own(url, spans, engine):
    answer = post(url, {"model": engine.served.model_name, "prompt": PROMPTS[1], "max_tokens": 5, "stream": True})
    assert answer.status_code == 200 and answer.text.rstrip().endswith("data: [DONE]")
    route, children = spans("POST /v1/completions", 1 + len(PHASES))
    assert route.parent is None
    assert "lora_serve.adapter" not in route.attributes
    assert all("lora_serve.adapter" not in children[name].attributes for name in PHASES)
    assert children["decode"].attributes["gen_ai.usage.output_tokens"] == 5
    assert children["decode"].attributes["lora_serve.tenant"] == route.attributes["lora_serve.tenant"] == "team-a"
    assert children["decode"].end_time <= route.end_time
    assert_phases_in_order(children)


def test_a_refused_request_has_its_route_and_gate_spans_only(url, spans, exporter):
    answer = requests.post(f"{url}/v1/completions", json={"model": "alpha", "prompt": "x"}, timeout=30)
    assert answer.status_code == 401
    route, children = spans("POST /v1/completions", 1)
    assert list(children) == ["gate"]
    assert route.attributes["http.response.status_code"] == 401 and "lora_serve.tenant" not in route.attributes
    assert children["gate"].attributes["http.response.status_code"] == 401
    assert requests.get(f"{url}/health", timeout=30).status_code == 200
    time.sleep(0.2)
    assert len(exporter.get_finished_spans()) == 2  # /health is not traced


def test_a_forwarded_request_joins_the_trace_it_carries_and_one_without_a_trace_gets_a_root():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = RequestTracing(provider)
    carried = TraceCarrier(f"00-{TRACE_ID}-{PARENT_ID}-01", "", "team-b")
    with tracing.tracer.start_as_current_span("client") as client:  # what the forwarding replica sends
        sent = tracing.carrier("alpha")
    assert sent.traceparent.startswith(f"00-{client.context.trace_id:032x}-{client.context.span_id:016x}-")
    assert tracing.carrier() == TraceCarrier("", "", None)  # no trace around it
    exporter.clear()
    for carrier in (carried, tracing.carrier()):
        tracing.watch(Unwatched(), "r1", "alpha", carrier).finished(finished_output())
    spans = exporter.get_finished_spans()
    joined, alone = spans[:4], spans[4:]
    assert [s.name for s in joined] == PHASES and [s.name for s in alone] == ["generate", *PHASES]
    assert all(format(s.parent.span_id, "016x") == PARENT_ID and s.attributes["lora_serve.tenant"] == "team-b"
               for s in joined)
    root = alone[0]
    assert root.parent is None and all(s.parent.span_id == root.context.span_id for s in alone[1:])
    assert (root.start_time, root.end_time) == (alone[1].start_time, alone[-1].end_time)
    provider.shutdown()


def finished_output() -> RequestOutput:
    now = time.perf_counter()
    times = RequestTimes(now - 0.4, now - 0.3, now - 0.2, now - 0.1, now)
    return RequestOutput("r1", "hi", [1, 2, 3], "abc", "", [4, 5, 6], [], True, "stop", times=times)


def test_tracing_off_leaves_the_app_and_the_watch_as_they_are(engine):
    off = RequestTracing.of(AppArgs().tracing.config(), "replica")
    app = http_app(engine.served, Gate(GateConfig()))
    middleware = list(app.user_middleware)
    watch = Unwatched()
    assert not off.enabled and off.instrument(app) is app and app.user_middleware == middleware
    assert off.watch(watch, "r", "alpha") is watch and off.carrier() is None
    with pytest.raises(ValidationError, match="tracing.endpoint"):
        AppArgs(tracing={"endpoint": "localhost:4317"})


def traced_version_request(engine, protocol: str, endpoint: str) -> None:
    """GET /version through an app traced as AppArgs configure it, then its spans flushed."""
    args = AppArgs(tracing={"otlp_traces_endpoint": endpoint, "protocol": protocol, "service_name": "traced"})
    tracing = RequestTracing.of(args.tracing.config(), "replica-1")
    assert tracing.enabled
    with uvicorn_serving(tracing.instrument(http_app(engine.served, Gate(GateConfig())))) as url:
        assert requests.get(f"{url}/version", timeout=30).status_code == 200
        time.sleep(0.2)  # the route span ends once the answer is sent
    tracing.shutdown()  # exports what the batch holds


def test_an_otlp_http_endpoint_receives_the_spans(engine):
    with http_receiver() as (endpoint, posts):
        traced_version_request(engine, "http/protobuf", endpoint)
    assert posts and all(path == "/v1/traces" and kind == "application/x-protobuf" for path, kind, _ in posts)
    received = [trace_service_pb2.ExportTraceServiceRequest.FromString(body) for _, _, body in posts]
    assert exported_names(received) == ({"GET /version", "gate"}, {"traced"})


def test_an_otlp_grpc_endpoint_receives_the_spans(engine):
    with grpc_receiver() as (endpoint, received):
        traced_version_request(engine, "grpc", endpoint)
    assert exported_names(received) == ({"GET /version", "gate"}, {"traced"})
