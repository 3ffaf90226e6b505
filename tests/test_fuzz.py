"""Property-based fuzz of the HTTP API from its own OpenAPI schema (schemathesis over hypothesis).

Every route of the app gets a bounded number of generated requests, valid for the schema and not, through a real
Ray Serve app with LoRA on. None may get a server error (5xx) or hang past its timeout, and the server must still
answer a plain request afterwards.
"""

from __future__ import annotations

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings

from deployments.llm_server import app
from tests.helpers import serving, write_tiny_adapters

pytestmark = pytest.mark.slow
EXAMPLES = 25  # per route and mode: about 500 requests in all, under two minutes on 2 cores
schema = schemathesis.openapi.from_dict(app.openapi())
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
