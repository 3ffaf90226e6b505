"""Tokenizing over HTTP through a real Ray Serve app: vLLM's /tokenize and /detokenize, TGI's /tokenize, and
OpenAI's model retrieve; each checked against the tokenizer itself and against what the generation routes count."""

from __future__ import annotations

import pytest
import requests

from tests.helpers import PROMPTS, serving, write_tiny_adapters

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPTS[0]}]


@pytest.fixture(scope="module")
def server(serve_cluster, tiny_llama_path, tmp_path_factory):
    from deployments.app import build_app

    root = write_tiny_adapters(tiny_llama_path, tmp_path_factory.mktemp("tokenize-adapters"), ("alpha",))
    engine = {"model": str(tiny_llama_path), "log_stats": False, "max_loras": 1, "adapters_root": str(root),
              "max_model_len": 384}
    with serving(serve_cluster, build_app({"engine": engine})) as url:
        yield url


def _post(url: str, path: str, body: dict) -> requests.Response:
    return requests.post(f"{url}{path}", json=body, timeout=60)


def test_a_prompts_tokens_are_the_tokenizers_and_what_completions_count(server, tiny_llama_path, tokenizer):
    r = _post(server, "/tokenize", {"model": str(tiny_llama_path), "prompt": PROMPTS[1], "return_token_strs": True})
    assert r.status_code == 200, r.text
    ids = tokenizer(PROMPTS[1]).input_ids
    assert r.json() == {"count": len(ids), "max_model_len": 384, "tokens": ids,
                        "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    completion = _post(server, "/v1/completions", {"model": str(tiny_llama_path), "prompt": PROMPTS[1],
                                                   "max_tokens": 1}).json()
    assert completion["usage"]["prompt_tokens"] == len(ids)


def test_messages_tokenize_as_the_chat_route_renders_them(server, tiny_llama_path, tokenizer):
    r = _post(server, "/tokenize", {"messages": MESSAGES})
    assert r.status_code == 200, r.text
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert r.json()["tokens"] == tokenizer(text, add_special_tokens=False).input_ids
    chat = _post(server, "/v1/chat/completions", {"model": str(tiny_llama_path), "messages": MESSAGES,
                                                  "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == r.json()["count"]


def test_tgi_tokenize_gives_each_tokens_characters(server, tokenizer):
    text = "Hello, wörld! 42"
    r = _post(server, "/tokenize", {"inputs": text})
    assert r.status_code == 200, r.text
    tokens = r.json()
    assert [t["id"] for t in tokens] == tokenizer(text).input_ids
    assert "".join(t["text"] for t in tokens) == text
    assert all(text[t["start"]:t["stop"]] == t["text"] for t in tokens)


def test_detokenize_inverts_tokenize(server, tokenizer):
    ids = tokenizer(PROMPTS[2]).input_ids
    r = _post(server, "/detokenize", {"tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": tokenizer.decode(ids)}, r.text
    outside = _post(server, "/detokenize", {"tokens": [1, len(tokenizer)]})
    assert outside.status_code == 400 and "outside the vocabulary" in outside.json()["error"], outside.text


def test_a_tokenizing_request_names_a_served_model(server, tiny_llama_path, tokenizer):
    unknown = _post(server, "/tokenize", {"model": "nope", "prompt": "hi"})
    assert unknown.status_code == 404 and "'nope' is not served here" in unknown.json()["error"], unknown.text
    served = _post(server, "/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 1, "adapter_id": "alpha"}})
    assert served.status_code == 200, served.text
    adapter = _post(server, "/tokenize", {"model": "alpha", "prompt": "hi"})  # adapters share the base tokenizer
    assert adapter.status_code == 200 and adapter.json()["tokens"] == tokenizer("hi").input_ids, adapter.text


@pytest.mark.parametrize("body, words", [
    ({"prompt": "hi", "add_generation_prompt": False}, "add_generation_prompt: not supported by this server"),
    ({"inputs": "hi", "parameters": {"max_new_tokens": 2}}, "parameters: not supported by this server"),
    ({"messages": []}, "messages: List should have at least 1 item"),
    ({}, "prompt: Field required"),
])
def test_bad_tokenize_requests_get_the_reason(server, body, words):
    r = _post(server, "/tokenize", body)
    assert r.status_code == 422 and r.json()["error_type"] == "validation", r.text
    assert words in r.json()["error"], r.text


def test_openai_client_retrieves_a_model(server, tiny_llama_path):
    from openai import NotFoundError, OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key="unused")
    assert client.models.retrieve(str(tiny_llama_path)).id == str(tiny_llama_path)
    with pytest.raises(NotFoundError, match="not served here"):
        client.models.retrieve("nope")
