"""Property-based fuzz of the HTTP API from its own OpenAPI schema (schemathesis over hypothesis).

Every route of the app gets a bounded number of generated requests, valid for the schema and not, through a real
Ray Serve app with LoRA on. None may get a server error (5xx) or hang past its timeout, and the server must still
answer a plain request afterwards. Then every numeric field of the generation routes' bodies, one at a time, gets
the extremes that the schema's own bounds keep hypothesis from drawing (a seed of 2**70 once ended the engine's loop
for every request), each followed by a plain request that must still be served.
"""

from __future__ import annotations

import json

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings

from deployments.routes.routes import routes_app
from tests.helpers import serving, write_tiny_adapters

pytestmark = pytest.mark.slow
EXAMPLES = 25  # per route and mode: about 500 requests in all, under two minutes on 2 cores
OPENAPI = routes_app().openapi()
schema = schemathesis.openapi.from_dict(OPENAPI)
schema.config.generation.update(modes=[schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE])
SERVER = {}


@pytest.fixture(scope="module", autouse=True)
def server(serve_cluster, tiny_llama_path, tmp_path_factory):
    from deployments.app import build_app

    root = write_tiny_adapters(tiny_llama_path, tmp_path_factory.mktemp("fuzz-adapters"), ("alpha",))
    engine = {"model": str(tiny_llama_path), "log_stats": False, "max_loras": 2, "adapters_root": str(root),
              "max_tokens_limit": 32, "adapter_disk_cache": str(tmp_path_factory.mktemp("disk-tier"))}
    with serving(serve_cluster, build_app({"engine": engine})) as url:
        SERVER["url"] = url
        yield url


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_no_request_gets_a_server_error_or_hangs(case):
    response = case.call(base_url=SERVER["url"], timeout=60)
    assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])


def test_the_server_still_answers_after_the_fuzz():
    r = requests.post(f"{SERVER['url']}/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}},
                      timeout=60)
    assert r.status_code == 200, r.text


EXTREMES = (2 ** 70, -2 ** 70, 2 ** 63, 1e308, -1e308, float("nan"), float("inf"), 5e-324)
BODIES = {  # a valid body per generation route; numeric fields under "parameters" for LoRAX's
    "/v1/completions": ("CompletionRequest", {"prompt": "hi", "max_tokens": 2}),
    "/v1/chat/completions": ("ChatRequest", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    "/generate": ("GenerateParameters", {"inputs": "hi", "parameters": {"max_new_tokens": 2}}),
}


def _numeric_fields(model: str) -> list[str]:
    properties = OPENAPI["components"]["schemas"][model]["properties"]
    kinds = lambda spec: {s.get("type") for s in spec.get("anyOf", [spec])}  # noqa: E731
    return sorted(name for name, spec in properties.items() if kinds(spec) & {"integer", "number"})


@pytest.mark.parametrize("path", sorted(BODIES))
def test_extreme_numbers_are_refused_or_served_and_the_engine_keeps_serving(path, tiny_llama_path):
    model, body = BODIES[path]
    if path.startswith("/v1/"):
        body = {"model": str(tiny_llama_path), **body}
    fields = _numeric_fields(model)
    assert len(fields) >= 5, fields  # the schema walk found the sampling parameters
    for field in fields:
        for value in EXTREMES:
            sent = json.loads(json.dumps(body))
            (sent["parameters"] if path == "/generate" else sent)[field] = value
            r = requests.post(f"{SERVER['url']}{path}", data=json.dumps(sent), timeout=60,
                              headers={"content-type": "application/json"})
            assert r.status_code < 500, (path, field, value, r.text[:300])
            ok = requests.post(f"{SERVER['url']}/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}},
                               timeout=60)
            assert ok.status_code == 200, (path, field, value, ok.text[:300])
