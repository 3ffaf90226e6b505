"""Two engine replicas of one application, behind Serve's own router (which spreads requests between them at
random). A key's limits hold for the whole application: the replicas share one quota ledger, so a key limited to
R requests per minute gets R, not 2R, and its max_concurrent counts the requests running on both. And each
replica exports its requests' traces over OTLP, to a real gRPC receiver on the loopback."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from deployments.gate.auth import hash_key
from tests.helpers import serving
from tests.otlp_receivers import grpc_receiver

pytestmark = pytest.mark.slow
APP = "shared-limits"
SHARED, PAIR, TRACED = "shared-key-0123456789abcdef", "pair-key-0123456789abcdef", "traced-key-0123456789abcdef"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
RPM = 8
BOUND = 2  # one lease per replica (deployments/gate/quota_ledger.py)
METRICS = {}


@pytest.fixture(scope="module")
def received():
    """What the replicas' OTLP exporters sent (ExportTraceServiceRequests)."""
    with grpc_receiver() as (endpoint, requests_):
        METRICS["otlp"] = endpoint
        yield requests_


@pytest.fixture(scope="module")
def server(serve_cluster, tiny_llama_path, received):
    from ray.serve.config import RequestRouterConfig

    from deployments.gate.auth import ApiKeyConfig, KeyRing
    from deployments.gate.gate import GateConfig
    from deployments.replica.llm_server import LLMServer
    from deployments.replica.tracing import TracingConfig

    keys = [ApiKeyConfig(name="shared", key_sha256=hash_key(SHARED).hex(), requests_per_minute=RPM),
            ApiKeyConfig(name="pair", key_sha256=hash_key(PAIR).hex(), max_concurrent=2),
            ApiKeyConfig(name="traced", key_sha256=hash_key(TRACED).hex())]
    engine = {"model": str(tiny_llama_path), "log_stats": False, "num_threads": 1, "max_loras": 0,
              "kv_cache_bytes": 32 << 20}
    server = LLMServer.options(num_replicas=2, ray_actor_options={"num_cpus": 1},
                               request_router_config=RequestRouterConfig())
    METRICS["url"] = serve_cluster.metrics_url
    app = server.bind(engine, gate=GateConfig(KeyRing.from_config(keys, None).keys), routing=None,
                      tracing=TracingConfig(METRICS["otlp"], service_name="shared-limits"))
    with serving(serve_cluster, app, APP) as url:
        yield url


def _generate(url: str, key: str, max_new_tokens: int = 2) -> requests.Response:
    return requests.post(f"{url}/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": max_new_tokens, "ignore_eos_token": True}},
                         headers={"Authorization": f"Bearer {key}"}, timeout=120)


def test_a_keys_requests_per_minute_hold_across_two_replicas(server):
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: _generate(server, SHARED), range(3 * RPM)))
    codes = [r.status_code for r in answers]
    print(f"{RPM} requests per minute, 2 replicas: {codes.count(200)} of {len(codes)} admitted")
    assert set(codes) <= {200, 429}, codes
    assert RPM - BOUND <= codes.count(200) <= RPM + BOUND, codes  # per replica, it would have been 2 * RPM
    refused = [r for r in answers if r.status_code == 429]
    assert all(int(r.headers["Retry-After"]) >= 1 and f"{RPM} requests per minute" in r.json()["error"]
               for r in refused)
    assert len(_replicas_that_counted("shared")) == 2, "Serve's router sent the key's requests to one replica only"


def _replicas_that_counted(tenant: str) -> set[str]:
    """The replicas whose exported request counts name `tenant` (Ray tags each series with its replica)."""
    pattern = re.compile(r'lora_serve_tenant_requests[^{]*\{([^}]*tenant="' + tenant + r'"[^}]*)\}')
    deadline = time.monotonic() + 60
    while True:
        text = requests.get(METRICS["url"], timeout=10).text
        replicas = {re.search(r'replica="([^"]+)"', labels).group(1) for labels in pattern.findall(text)}
        if len(replicas) >= 2 or time.monotonic() > deadline:
            return replicas
        time.sleep(2)


def test_a_keys_max_concurrent_counts_the_requests_on_both_replicas(server):
    """Six long requests at once, Serve spreading them over both replicas: two run, four are refused, whichever
    replica they reached."""
    with ThreadPoolExecutor(6) as pool:
        codes = sorted(pool.map(lambda _: _generate(server, PAIR, 300).status_code, range(6)))
    assert codes == [200, 200, 429, 429, 429, 429], codes
    assert _generate(server, PAIR).status_code == 200  # both slots went back when their requests ended


def test_a_replica_exports_a_requests_spans_in_the_clients_trace(server, received):
    """Through Serve's proxy to a replica: the request's route, gate and engine spans reach the OTLP receiver (the
    batching processor sends within seconds), in the trace of the client's traceparent, naming the tenant."""
    answer = requests.post(f"{server}/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 4}},
                           headers={"Authorization": f"Bearer {TRACED}",
                                    "traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"}, timeout=120)
    assert answer.status_code == 200, answer.text
    deadline = time.monotonic() + 60
    while not {"POST /generate", "gate", "queue", "prefill", "decode"} <= set(spans := _spans_of(received)):
        assert time.monotonic() < deadline, f"spans of the trace received: {sorted(spans)}"
        time.sleep(1)
    assert spans["POST /generate"]["lora_serve.tenant"] == "traced" and spans["decode"]["lora_serve.tenant"] == "traced"


def _spans_of(received) -> dict[str, dict[str, str]]:
    """The received spans of TRACE_ID: each one's string attributes, by span name."""
    return {span.name: {a.key: a.value.string_value for a in span.attributes}
            for request in list(received) for resources in request.resource_spans
            for scope in resources.scope_spans for span in scope.spans if span.trace_id.hex() == TRACE_ID}
