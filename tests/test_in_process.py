"""The HTTP routes against a real engine in one process, without Ray (deployments/replica/in_process.py): the same
app a Serve replica builds, over uvicorn on the loopback, through the real `openai` and `lorax-client` clients.
Greedy text through it equals the offline engine's, for the base model and an adapter."""

from __future__ import annotations

import openai
import pytest
import requests
from lorax import Client

from deployments.gate.gate import Gate, GateConfig
from deployments.replica.in_process import InProcessEngine
from deployments.routes.routes import http_app
from engine import LLM, EngineConfig, SamplingParams
from lora_cache.local_cache import local_adapters
from tests.helpers import PROMPTS, uvicorn_serving, write_tiny_adapters


@pytest.fixture(scope="module")
def adapters_root(tiny_llama_path, tmp_path_factory):
    return write_tiny_adapters(tiny_llama_path, tmp_path_factory.mktemp("in-process-adapters"), ("alpha",))


@pytest.fixture(scope="module")
def options(tiny_llama_path, adapters_root) -> dict:
    return {"max_loras": 2, "adapters_root": str(adapters_root), "log_stats": False, "num_threads": 1,
            "kv_cache_bytes": 32 << 20}


@pytest.fixture(scope="module")
def url(tiny_llama_path, options):
    engine = InProcessEngine(EngineConfig.from_overrides(str(tiny_llama_path), **options), local_adapters)
    with uvicorn_serving(http_app(engine.served, Gate(GateConfig()))) as url:
        yield url
    engine.shutdown()


@pytest.fixture(scope="module")
def offline(tiny_llama_path, options) -> list[list[int]]:
    """Greedy tokens of the first two prompts, base model then adapter, from the offline engine."""
    llm = LLM(str(tiny_llama_path), adapters=local_adapters, **options)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    outputs = llm.generate(PROMPTS[:2] * 2, params, use_tqdm=False, adapters=[None, None, "alpha", "alpha"])
    return [o.text for o in outputs]


def test_openai_completions_equal_the_offline_engine(url, tiny_llama_path, offline):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    texts = []
    for model in (str(tiny_llama_path), "alpha"):
        for prompt in PROMPTS[:2]:
            done = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0.0)
            texts.append(done.choices[0].text)
    assert texts == offline


def test_a_streamed_chat_ends_with_usage(url, tiny_llama_path):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    chunks = list(client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=5, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 5
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"  # paced: a chunk may hold more


def test_lorax_client_generates_with_an_adapter(url, offline):
    response = Client(url).generate(PROMPTS[0], adapter_id="alpha", max_new_tokens=8)
    assert response.generated_text == offline[2]


def test_what_the_in_process_server_does_not_do_is_refused_by_name(url):
    load = requests.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "beta", "lora_path": "/nowhere"})
    assert load.status_code == 400 and "cluster's adapter cache" in load.json()["error"]["message"]
    unknown = requests.post(f"{url}/v1/completions", json={"model": "alpha", "prompt": "Hi", "best_of_n": 2})
    assert unknown.status_code == 400 and "best_of_n" in unknown.text
    assert requests.get(f"{url}/health").json() == {"status": "ok"}


def test_a_stopped_engine_answers_health_with_503_and_retry_after(tiny_llama_path):
    from fastapi.testclient import TestClient

    engine = InProcessEngine(EngineConfig.from_overrides(str(tiny_llama_path), log_stats=False, num_threads=1,
                                                        kv_cache_bytes=32 << 20))
    with TestClient(http_app(engine.served, Gate(GateConfig()))) as client:
        assert client.get("/health").json() == {"status": "ok"}
        engine.shutdown()
        stopped = client.get("/health")
    assert stopped.status_code == 503 and int(stopped.headers["retry-after"]) >= 1
    assert "not running" in stopped.json()["error"]
