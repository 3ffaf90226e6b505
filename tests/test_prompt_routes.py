"""The prompts requests make, over HTTP through a real Ray Serve app: vLLM's /tokenize and /detokenize, TGI's
/tokenize, OpenAI's model retrieve, and the chat template's controls; each checked against the tokenizer and its
template, against what the generation routes count, and against the offline engine's tokens."""

from __future__ import annotations

import json
import time

import pytest
import requests

from deployments.api.chat import ChatMessage, TemplateOptions, chat_prompt
from engine import LLM, SamplingParams
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
    card = client.models.retrieve(str(tiny_llama_path))
    assert card.id == card.root == str(tiny_llama_path) and abs(card.created - time.time()) < 60
    tokenized = _post(server, "/tokenize", {"model": str(tiny_llama_path), "prompt": "hi"}).json()
    assert card.model_extra["max_model_len"] == tokenized["max_model_len"] > 0  # vLLM's card field
    with pytest.raises(NotFoundError, match="not served here"):
        client.models.retrieve("nope")


def test_continue_final_message_continues_the_assistants_prefill(server, tiny_llama_path, tokenizer):
    """The prompt ends inside the last (assistant) message, and the answer is the engine's continuation of it."""
    turn = [{"role": "user", "content": PROMPTS[0]}, {"role": "assistant", "content": "Sure, here is"}]
    controls = {"add_generation_prompt": False, "continue_final_message": True}
    text = tokenizer.apply_chat_template(turn, tokenize=False, **controls)
    assert text.endswith("Sure, here is")
    tokens = _post(server, "/tokenize", {"messages": turn, **controls})
    assert tokens.json()["tokens"] == tokenizer(text, add_special_tokens=False).input_ids, tokens.text
    chat = _post(server, "/v1/chat/completions", {"model": str(tiny_llama_path), "messages": turn, "max_tokens": 8,
                                                  "temperature": 0, "ignore_eos": True, **controls})
    assert chat.status_code == 200, chat.text
    expected = LLM(str(tiny_llama_path), log_stats=False).generate(
        [text], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert chat.json()["choices"][0]["message"]["content"] == expected.text
    assert chat.json()["usage"]["prompt_tokens"] == tokens.json()["count"]
    # vLLM's echo: the answer starts with the assistant's message it continues, whole or streamed
    body = {"model": str(tiny_llama_path), "messages": turn, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "echo": True, **controls}
    echoed = _post(server, "/v1/chat/completions", body)
    assert echoed.json()["choices"][0]["message"]["content"] == "Sure, here is" + expected.text, echoed.text
    streamed = requests.post(f"{server}/v1/chat/completions", json={**body, "stream": True}, timeout=120)
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    assert "".join(d.get("content") or "" for d in deltas) == "Sure, here is" + expected.text
    asked = {**body, "messages": turn[:1], "add_generation_prompt": True, "continue_final_message": False}
    answers = [_post(server, "/v1/chat/completions", {**asked, "echo": echo}).json()["choices"][0]["message"]
               for echo in (True, False)]
    assert answers[0] == answers[1]  # the last message is a user's: nothing to echo


def test_without_a_generation_prompt_the_prompt_ends_after_the_last_message(server, tokenizer):
    r = _post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=False)
    assert r.json()["tokens"] == tokenizer(text, add_special_tokens=False).input_ids, r.text
    assert r.json()["count"] < _post(server, "/tokenize", {"messages": MESSAGES}).json()["count"]


def test_chat_template_kwargs_reach_the_template(tokenizer):
    """A template variable (as Qwen3's enable_thinking) is rendered from chat_template_kwargs."""
    templated = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    templated.chat_template = "{% if terse %}TERSE {% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    messages = [ChatMessage(role="user", content="hi")]
    assert chat_prompt(templated, messages, None, TemplateOptions(variables={"terse": True})) == "TERSE hi"
    assert chat_prompt(templated, messages, None) == "hi"


@pytest.mark.parametrize("controls, words", [
    ({"continue_final_message": True}, "continue_final_message continues the last message; it needs "
                                       "add_generation_prompt: false"),
    ({"chat_template_kwargs": {"tools": [], "messages": []}},
     "chat_template_kwargs cannot set messages, tools: the request's own fields do"),
])
def test_contradictory_template_controls_are_refused(server, tiny_llama_path, controls, words):
    r = _post(server, "/v1/chat/completions", {"model": str(tiny_llama_path), "messages": MESSAGES, **controls})
    assert r.status_code == 400 and r.json()["error"]["message"] == words, r.text
