"""End to end through a real Ray Serve instance: HTTP generate, SSE streaming, clear 4xx errors."""

from __future__ import annotations

import json
import socket

import pytest
import requests

from engine import LLM, SamplingParams
from tests.conftest import PROMPTS

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def adapters_root(tiny_llama_path, tmp_path_factory):
    from transformers import AutoConfig

    from benchmarks.lora_adapters import write_random_adapter

    root = tmp_path_factory.mktemp("serve-adapters")
    config = AutoConfig.from_pretrained(tiny_llama_path)
    for seed, name in enumerate(("alpha", "beta")):
        write_random_adapter(root / name, config, rank=4, seed=seed)
    return root


@pytest.fixture(scope="module")
def server(tiny_llama_path, adapters_root, tmp_path_factory):
    import ray
    from ray import serve

    from deployments.app import build_app

    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(tmp_path_factory.mktemp("ray")))
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    engine = {"model": str(tiny_llama_path), "log_stats": False, "max_loras": 2, "adapters_root": str(adapters_root)}
    serve.run(build_app({"engine": engine}), name="lora-serve", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def test_generate_matches_offline_engine(server, tiny_llama_path):
    expected = LLM(str(tiny_llama_path), log_stats=False).generate(
        [PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)[0]
    r = requests.post(f"{server}/generate", json={"inputs": PROMPTS[0], "parameters": {
        "max_new_tokens": 12, "details": True, "decoder_input_details": True}}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["generated_text"] == expected.text
    assert [t["id"] for t in body["details"]["tokens"]] == expected.token_ids
    assert [t["id"] for t in body["details"]["prefill"]] == expected.prompt_token_ids

    root = requests.post(f"{server}/", json={"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 12}}, timeout=60)
    assert root.json() == [{"generated_text": expected.text}]


def test_generate_stream_sends_tokens_then_final_text(server):
    r = requests.post(f"{server}/generate_stream", json={"inputs": PROMPTS[1], "parameters": {
        "max_new_tokens": 8, "ignore_eos_token": True}}, stream=True, timeout=60)
    assert r.status_code == 200
    events = [json.loads(line[len("data:"):]) for line in r.iter_lines(decode_unicode=True) if line]
    assert len(events) == 8
    assert all(e["generated_text"] is None for e in events[:-1])
    assert events[-1]["generated_text"] == "".join(e["token"]["text"] for e in events)
    assert events[-1]["details"]["finish_reason"] == "length"


@pytest.mark.parametrize("body, status, words", [
    ({"inputs": ""}, 422, "inputs"),
    ({"inputs": "hi", "parameters": {"max_new_tokens": "many"}}, 422, "max_new_tokens"),
    ({"inputs": "hi", "parameters": {"top_p": 2}}, 422, "top_p"),
    ({"inputs": "hi", "parameters": {"bogus": 1}}, 422, "bogus"),
    ({"inputs": "hi", "parameters": {"best_of": 3, "watermark": True}}, 422, "not supported yet: best_of, watermark"),
    ({"inputs": "word " * 600}, 400, "limit"),
])
def test_bad_requests_get_clear_4xx_and_server_keeps_serving(server, body, status, words):
    r = requests.post(f"{server}/generate", json=body, timeout=60)
    assert r.status_code == status, r.text
    assert words in r.text
    ok = requests.post(f"{server}/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}}, timeout=60)
    assert ok.status_code == 200


def test_malformed_json_is_422(server):
    r = requests.post(f"{server}/generate", data="{not json", headers={"content-type": "application/json"},
                      timeout=60)
    assert r.status_code == 422


def test_adapter_requests_match_offline_engine(server, tiny_llama_path, adapters_root):
    llm = LLM(str(tiny_llama_path), max_loras=2, adapters_root=str(adapters_root), log_stats=False)
    params = SamplingParams(max_tokens=10, temperature=0)
    for adapter in ("alpha", "beta", None):
        expected = llm.generate([PROMPTS[2]], params, use_tqdm=False, adapters=[adapter])[0]
        body = {"inputs": PROMPTS[2], "parameters": {"max_new_tokens": 10, "details": True, "adapter_id": adapter,
                                                      "adapter_source": "local"}}
        r = requests.post(f"{server}/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert [t["id"] for t in r.json()["details"]["tokens"]] == expected.token_ids, adapter


@pytest.mark.parametrize("parameters, words", [
    ({"adapter_id": "missing"}, "not found"),
    ({"adapter_id": "../alpha"}, ".."),
    ({"adapter_id": "alpha", "adapter_source": "hub"}, "not served here"),
])
def test_bad_adapter_requests_get_400_with_reason(server, parameters, words):
    r = requests.post(f"{server}/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2, **parameters}},
                      timeout=60)
    assert r.status_code == 400 and words in r.text, r.text


def test_openai_completions_and_chat_match_offline_engine(server, tiny_llama_path, adapters_root, tokenizer):
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    llm = LLM(str(tiny_llama_path), max_loras=2, adapters_root=str(adapters_root), log_stats=False)
    params = SamplingParams(max_tokens=8, temperature=0)
    for model, adapter in ((str(tiny_llama_path), None), ("alpha", "alpha")):
        expected = llm.generate([PROMPTS[3]], params, use_tqdm=False, adapters=[adapter])[0]
        done = client.completions.create(model=model, prompt=PROMPTS[3], max_tokens=8, temperature=0)
        assert done.choices[0].text == expected.text
        assert done.usage.completion_tokens == len(expected.token_ids)
        streamed = client.completions.create(model=model, prompt=PROMPTS[3], max_tokens=8, temperature=0,
                                             stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed) == expected.text

    messages = [{"role": "user", "content": "Name a colour."}]
    chat_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = llm.generate([chat_prompt], params, use_tqdm=False, adapters=["beta"])[0]
    chat = client.chat.completions.create(model="beta", messages=messages, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == expected.text
    stream = client.chat.completions.create(model="beta", messages=messages, max_tokens=8, temperature=0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected.text

    listed = {m.id for m in client.models.list()}
    assert {str(tiny_llama_path), "alpha", "beta"} <= listed
    with pytest.raises(openai.BadRequestError, match="not found"):
        client.completions.create(model="no-such-adapter", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="n=1"):
        client.completions.create(model=str(tiny_llama_path), prompt="hi", max_tokens=2, n=2)


def test_lorax_client_generate_stream_and_async(server, tiny_llama_path, adapters_root):
    import asyncio

    from lorax import AsyncClient, Client

    llm = LLM(str(tiny_llama_path), max_loras=2, adapters_root=str(adapters_root), log_stats=False)
    expected = llm.generate([PROMPTS[5]], SamplingParams(max_tokens=10, temperature=0), use_tqdm=False,
                            adapters=["alpha"])[0]
    client = Client(server)
    response = client.generate(PROMPTS[5], max_new_tokens=10, adapter_id="alpha", adapter_source="local")
    assert response.generated_text == expected.text
    tokens = [r.token.text for r in client.generate_stream(PROMPTS[5], max_new_tokens=10, adapter_id="alpha",
                                                           adapter_source="local") if not r.token.special]
    assert "".join(tokens) == expected.text

    async def three_streams():
        finished = []

        async def run(name, n):
            async for r in AsyncClient(server).generate_stream(PROMPTS[0], max_new_tokens=n, ignore_eos_token=True):
                if r.details is not None:
                    finished.append(name)

        await asyncio.gather(run("long", 100), run("short-1", 10), run("short-2", 10))
        return finished

    assert asyncio.run(three_streams())[-1] == "long"
