"""End to end through a real Ray Serve instance: HTTP generate, SSE streaming, clear 4xx errors."""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

from engine import LLM, SamplingParams
from lora_cache.local_cache import local_adapters
from tests.helpers import PROMPTS, serving, write_tiny_adapters

pytestmark = pytest.mark.slow
METRICS = {}  # the Ray metrics endpoint of the module's server
MAX_ADAPTER_BYTES = 100_000  # the tiny model's rank-4 attention adapters take 30 KB, a rank-16 one on every module 130


def _poll(condition, timeout=30.0, interval=0.5):
    """condition()'s first truthy value within timeout seconds."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(interval)
    return value


@pytest.fixture(scope="module")
def adapters_root(tiny_llama_path, tmp_path_factory):
    return write_tiny_adapters(tiny_llama_path, tmp_path_factory.mktemp("serve-adapters"), ("alpha", "beta"))


@pytest.fixture(scope="module")
def server(serve_cluster, tiny_llama_path, adapters_root, tmp_path_factory):
    from deployments.app import build_app

    METRICS["url"] = serve_cluster.metrics_url
    engine = {"model": str(tiny_llama_path), "log_stats": False, "max_loras": 2, "adapters_root": str(adapters_root),
              "adapter_disk_cache": str(tmp_path_factory.mktemp("disk-tier")), "adapter_cache_timeout_s": 3,
              "max_adapter_bytes": MAX_ADAPTER_BYTES}
    with serving(serve_cluster, build_app({"engine": engine})) as url:
        yield url


def test_generate_matches_offline_engine(server, tiny_llama_path):
    expected = LLM(str(tiny_llama_path), log_stats=False).generate(
        [PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0, prompt_logprobs=0), use_tqdm=False)[0]
    r = requests.post(f"{server}/generate", json={"inputs": PROMPTS[0], "parameters": {
        "max_new_tokens": 12, "details": True, "decoder_input_details": True}}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["generated_text"] == expected.text
    assert [t["id"] for t in body["details"]["tokens"]] == expected.token_ids
    prefill = body["details"]["prefill"]
    assert [t["id"] for t in prefill] == expected.prompt_token_ids
    assert prefill[0]["logprob"] is None  # TGI: the first prompt token has no logprob
    assert [t["logprob"] for t in prefill[1:]] == pytest.approx(expected.prompt_logprobs[1:], abs=1e-4)

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
    ({"inputs": "hi", "parameters": {"api_token": "hf_x"}}, 422, "api_token is not supported"),
    ({"inputs": "hi", "parameters": {"best_of": 2, "do_sample": True, "seed": 3}}, 422, "seed must not be set"),
    ({"inputs": "hi", "parameters": {"best_of": 2}}, 422, "best_of > 1 needs sampling"),
    ({"inputs": "hi", "parameters": {"best_of": 17, "do_sample": True}}, 422, "best_of"),
    ({"inputs": "hi", "parameters": {"return_k_alternatives": 50}}, 422, "return_k_alternatives"),
    ({"inputs": "hi", "parameters": {"truncate": 0}}, 422, "truncate"),
    ({"inputs": "hi", "parameters": {"do_sample": True, "seed": 2 ** 64}}, 422, "seed"),
    ({"inputs": "\ud800"}, 422, "unicode"),  # a lone surrogate: FastAPI's 422 echoes it, and it is not UTF-8
    ({"inputs": "hi", "parameters": {"typical_p": 1.5}}, 422, "typical_p"),
    ({"inputs": "word " * 600}, 400, "limit"),
])
def test_bad_requests_get_clear_4xx_and_server_keeps_serving(server, body, status, words):
    r = requests.post(f"{server}/generate", json=body, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["error_type"] == "validation" and words in r.json()["error"], r.text  # LoRAX's error shape
    ok = requests.post(f"{server}/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}}, timeout=60)
    assert ok.status_code == 200


@pytest.mark.parametrize("path, body, words", [
    ("completions", {"prompt": [[]]}, "prompt.list[list[int]].0: List should have at least 1 item"),
    ("completions", {"prompt": [1, -5]}, "out of range"),
    ("completions", {"prompt": [10 ** 9]}, "out of range"),
    ("completions", {"prompt": ["a"] * 65}, "at most 64 items"),
    ("completions", {"prompt": "hi", "n": 0}, "n"),
    ("completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("completions", {"prompt": "hi", "stop": [""]}, "at least 1 character"),
    ("completions", {"prompt": "hi", "suffix": "!"}, "suffix: not supported by this server"),
    ("completions", {"prompt": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("completions", {"prompt": "hi", "min_p": 1.5}, "min_p"),
    ("completions", {"prompt": "hi", "seed": 2 ** 70}, "seed: Input should be less than or equal to"),
    ("completions", {"prompt": ["hi"] * 64, "n": 16}, "64 prompts x n=16 is 1024 sequences; this server queues"),
    ("completions", {"prompt": "\ud800"}, "unicode"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "seed": -2 ** 63 - 1}, "seed"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "best_of": 2}, "best_of: not supported"),
    ("completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs is not supported with"),
    ("completions", {"prompt": "hi", "priority": 2 ** 40}, "priority: Input should be less than or equal to"),
    ("completions", {"prompt": "hi", "priority": 1.5}, "priority"),
    ("completions", {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "object"}, "bogus": 1}}}, "json_schema.bogus: not supported"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 21}, "prompt_logprobs"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "role"),
    ("completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options is only for streams"),
])
def test_bad_openai_requests_get_400_with_the_reason(server, tiny_llama_path, path, body, words):
    r = requests.post(f"{server}/v1/{path}", json={"model": str(tiny_llama_path), "max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]
    ok = requests.post(f"{server}/v1/completions", timeout=60,
                       json={"model": str(tiny_llama_path), "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_openai_request_ids_name_the_response_as_vllm(server, tiny_llama_path):
    """The body's request_id (vLLM's) or else the X-Request-Id header becomes the response's id; Serve sends the
    header back (the client's, or one it made, which then names the response), whole and streamed."""
    body = {"model": str(tiny_llama_path), "prompt": "hi", "max_tokens": 2}
    url = f"{server}/v1/completions"
    named = requests.post(url, json=body, headers={"X-Request-Id": "trace-42"}, timeout=60)
    assert named.json()["id"] == "cmpl-trace-42" and named.headers["X-Request-Id"] == "trace-42"
    both = requests.post(url, json={**body, "request_id": "from-body"}, headers={"X-Request-Id": "hdr"}, timeout=60)
    assert both.json()["id"] == "cmpl-from-body" and both.headers["X-Request-Id"] == "hdr"
    field = requests.post(f"{server}/v1/chat/completions", timeout=60, json={
        "model": str(tiny_llama_path), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "request_id": "from-body"})
    assert field.json()["id"] == "chatcmpl-from-body"
    with requests.post(url, json={**body, "stream": True}, headers={"X-Request-Id": "s-1"}, stream=True,
                       timeout=60) as streamed:
        chunks = [json.loads(line[6:]) for line in streamed.iter_lines(decode_unicode=True)
                  if line.startswith("data: {")]
    assert streamed.headers["X-Request-Id"] == "s-1" and {c["id"] for c in chunks} == {"cmpl-s-1"}
    fresh = [requests.post(url, json=body, timeout=60) for _ in range(2)]
    ids = [f.json()["id"] for f in fresh]
    assert ids[0] != ids[1] and all(f"cmpl-{f.headers['X-Request-Id']}" == i for f, i in zip(fresh, ids))
    bad = requests.post(url, json=body, headers={"X-Request-Id": "a b"}, timeout=60)
    assert bad.status_code == 400 and "X-Request-Id" in bad.json()["error"]["message"]
    long = requests.post(url, json={**body, "request_id": "x" * 129}, timeout=60)
    assert long.status_code == 400 and long.json()["error"]["message"] == (
        "request_id: must be 1-128 printable ASCII characters without spaces")


def test_openai_nulls_are_not_given(server, tiny_llama_path):
    """As OpenAI's API: null for an optional field is the field not given. A multi-turn client sends the SDK's
    assistant message back with "refusal": null and "audio": null; some send "temperature": null."""
    turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "and?"}]
    plain = {"model": str(tiny_llama_path), "max_tokens": 6, "temperature": 0, "messages": turn}
    nulls = {**plain, "n": None, "seed": None, "frequency_penalty": None, "stream_options": None, "messages": [
        turn[0], {**turn[1], "refusal": None, "audio": None, "function_call": None, "tool_calls": None}, turn[2]]}
    answers = [requests.post(f"{server}/v1/chat/completions", json=body, timeout=60) for body in (plain, nulls)]
    assert [a.status_code for a in answers] == [200, 200], answers[1].text
    assert answers[0].json()["choices"] == answers[1].json()["choices"]
    refused = requests.post(f"{server}/v1/chat/completions", timeout=60, json={**plain, "messages": [
        turn[0], {**turn[1], "refusal": "no"}, turn[2]]})
    assert refused.status_code == 400 and "refusal: not supported" in refused.json()["error"]["message"]


def test_malformed_json_is_refused_in_each_apis_shape(server):
    def post(path: str) -> requests.Response:
        return requests.post(f"{server}{path}", data="{not json", headers={"content-type": "application/json"},
                             timeout=60)

    lorax, openai = post("/generate"), post("/v1/completions")
    assert lorax.status_code == 422 and lorax.json()["error_type"] == "validation", lorax.text
    assert lorax.json()["error"].startswith("the body is not valid JSON: Expecting property name"), lorax.text
    assert openai.status_code == 400 and "not valid JSON" in openai.json()["error"]["message"], openai.text


def test_openai_errors_name_the_field_at_fault_in_param(server, tiny_llama_path):
    """OpenAI's `param`: the path of the field that failed validation, or the token budget the engine refused, as the
    client named it; none for a body that is not JSON or a check across fields."""
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=str(tiny_llama_path), messages=[{"role": "user", "content": "hi"}],
                                       max_completion_tokens=10 ** 6)
    assert refused.value.param == "max_completion_tokens" and "max_completion_tokens" in refused.value.message

    def param(path: str, body: dict | str):
        sent = {"data": body} if isinstance(body, str) else {"json": {"model": str(tiny_llama_path), **body}}
        r = requests.post(f"{server}/v1/{path}", timeout=60, headers={"content-type": "application/json"}, **sent)
        assert r.status_code == 400, r.text
        return r.json()["error"]["param"]

    assert param("completions", {"prompt": "hi", "n": 0}) == "n"
    assert param("chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}).startswith("messages.0")
    assert param("responses", {"input": "hi", "max_output_tokens": 10 ** 6}) == "max_output_tokens"
    assert param("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}) is None
    assert param("completions", "{not json") is None


def test_a_model_validators_reason_reads_as_a_sentence(server, tiny_llama_path):
    """A reason from a check across fields has no field path before it, and not pydantic's "Value error, "."""
    r = requests.post(f"{server}/v1/chat/completions", timeout=60, json={
        "model": str(tiny_llama_path), "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["message"] == "top_logprobs needs logprobs: true", r.text


def test_lorax_client_raises_its_errors_with_the_servers_reasons(server):
    """lorax-client reads {"error", "error_type"}: the server's refusals reach its user as its own exceptions,
    with the reason, for what the client does not check itself."""
    from lorax import Client
    from lorax.errors import NotFoundError, ValidationError

    client = Client(server)
    with pytest.raises(ValidationError, match="api_token is not supported"):
        client.generate("hi", max_new_tokens=2, api_token="hf_x")
    with pytest.raises(ValidationError, match="max_model_len"):
        client.generate("hi", max_new_tokens=10 ** 6)
    with pytest.raises(NotFoundError, match="'nope'"):
        client.generate("hi", max_new_tokens=2, adapter_id="nope")
    missing = requests.get(f"{server}/no-such-route", timeout=60)
    assert missing.status_code == 404 and missing.json() == {"error": "Not Found", "error_type": "not_found"}


def test_openai_stop_strings_cut_or_kept_as_asked(server, tiny_llama_path):
    """vLLM's include_stop_str_in_output: the text ends after the stop string instead of before it, streamed too."""
    body = {"model": str(tiny_llama_path), "prompt": PROMPTS[3], "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}
    full = requests.post(f"{server}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    stop = full[4:7]
    assert stop.strip(), "need a non-blank stop string from the generated text"
    for keep in (False, True):
        asked = {**body, "stop": [stop], "include_stop_str_in_output": keep}
        whole = requests.post(f"{server}/v1/completions", json=asked, timeout=60).json()["choices"][0]
        streamed = requests.post(f"{server}/v1/completions", json={**asked, "stream": True}, stream=True, timeout=60)
        chunks = [json.loads(line[len("data: "):]) for line in streamed.iter_lines(decode_unicode=True)
                  if line.startswith("data: {")]
        end = full.index(stop) + (len(stop) if keep else 0)
        assert whole["text"] == "".join(c["choices"][0]["text"] for c in chunks) == full[:end], keep
        assert whole["finish_reason"] == "stop"


def test_lorax_stop_sequences_end_the_text_as_lorax_ends_it(server):
    """LoRAX and TGI keep the stop sequence in the generated text (the OpenAI routes cut it)."""
    from lorax import Client

    client = Client(server)
    full = client.generate(PROMPTS[3], max_new_tokens=16, ignore_eos_token=True).generated_text
    stop = full[4:7]
    assert stop.strip(), "need a non-blank stop string from the generated text"
    cut = client.generate(PROMPTS[3], max_new_tokens=16, ignore_eos_token=True, stop_sequences=[stop])
    assert cut.generated_text == full[:full.index(stop) + len(stop)]
    assert cut.details.finish_reason.value == "stop_sequence"
    streamed = list(client.generate_stream(PROMPTS[3], max_new_tokens=16, ignore_eos_token=True,
                                           stop_sequences=[stop]))
    assert streamed[-1].generated_text == cut.generated_text


def test_adapter_requests_match_offline_engine(server, tiny_llama_path, adapters_root):
    llm = LLM(str(tiny_llama_path), adapters=local_adapters, max_loras=2, adapters_root=str(adapters_root),
              log_stats=False)
    params = SamplingParams(max_tokens=10, temperature=0)
    for adapter in ("alpha", "beta", None):
        expected = llm.generate([PROMPTS[2]], params, use_tqdm=False, adapters=[adapter])[0]
        body = {"inputs": PROMPTS[2], "parameters": {"max_new_tokens": 10, "details": True, "adapter_id": adapter,
                                                      "adapter_source": "local"}}
        r = requests.post(f"{server}/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert [t["id"] for t in r.json()["details"]["tokens"]] == expected.token_ids, adapter


@pytest.mark.parametrize("parameters, status, words", [
    ({"adapter_id": "missing"}, 404, "not found"),
    ({"adapter_id": "../alpha"}, 400, ".."),
    ({"adapter_id": "alpha#1"}, 400, "letters, digits"),  # lora-serve's own keys are not adapter ids
    ({"adapter_id": "alpha", "adapter_source": "hub"}, 400, "not served here"),
])
def test_bad_adapter_requests_get_4xx_with_reason(server, parameters, status, words):
    r = requests.post(f"{server}/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2, **parameters}},
                      timeout=60)
    assert r.status_code == status and words in r.text, r.text


def test_openai_completions_and_chat_match_offline_engine(server, tiny_llama_path, adapters_root, tokenizer):
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    llm = LLM(str(tiny_llama_path), adapters=local_adapters, max_loras=2, adapters_root=str(adapters_root),
              log_stats=False)
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
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.completions.create(model="no-such-adapter", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="n"):
        client.completions.create(model=str(tiny_llama_path), prompt="hi", max_tokens=2, n=17)

    penalised = SamplingParams(max_tokens=16, temperature=0, presence_penalty=-2, frequency_penalty=-2)
    expected = llm.generate([PROMPTS[3]], penalised, use_tqdm=False)[0]
    assert expected.text != llm.generate([PROMPTS[3]], SamplingParams(max_tokens=16, temperature=0),
                                         use_tqdm=False)[0].text  # the penalties change this text
    done = client.completions.create(model=str(tiny_llama_path), prompt=PROMPTS[3], max_tokens=16, temperature=0,
                                     presence_penalty=-2, frequency_penalty=-2)
    assert done.choices[0].text == expected.text
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.completions.create(model=str(tiny_llama_path), prompt="hi", max_tokens=2, presence_penalty=2.5)


def test_openai_requests_ask_the_engine_for_logprobs_only_when_the_client_does():
    """A step whose rows ask no logprobs skips each row's logsumexp over the vocabulary: an OpenAI request without
    logprobs must not ask for them."""
    from deployments.api.openai_protocol import ChatRequest, CompletionRequest

    messages = [{"role": "user", "content": "hi"}]
    asked = {"plain completion": CompletionRequest(model="m", prompt="hi"),
             "completion, logprobs 0": CompletionRequest(model="m", prompt="hi", logprobs=0),
             "completion, logprobs 3": CompletionRequest(model="m", prompt="hi", logprobs=3),
             "plain chat": ChatRequest(model="m", messages=messages),
             "chat, logprobs": ChatRequest(model="m", messages=messages, logprobs=True),
             "chat, top_logprobs 2": ChatRequest(model="m", messages=messages, logprobs=True, top_logprobs=2)}
    got = {name: request.to_sampling_params(8).logprobs for name, request in asked.items()}
    assert got == {"plain completion": None, "completion, logprobs 0": 0, "completion, logprobs 3": 3,
                   "plain chat": None, "chat, logprobs": 0, "chat, top_logprobs 2": 2}


def test_openai_logprobs_match_offline_engine(server, tiny_llama_path, tokenizer):
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    model = str(tiny_llama_path)
    llm = LLM(model, log_stats=False)
    expected = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=8, temperature=0, logprobs=3), use_tqdm=False)[0]

    done = client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=8, temperature=0, logprobs=3)
    got = done.choices[0].logprobs
    assert got.tokens == [tokenizer.decode([t]) for t in expected.token_ids]
    assert got.token_logprobs == pytest.approx(expected.logprobs, abs=1e-4)
    for top, want, chosen in zip(got.top_logprobs, expected.top_logprobs, expected.token_ids):
        named = {tokenizer.decode([i]): lp for i, lp in {**want, chosen: None}.items()}
        assert set(top) == set(named) and 3 <= len(top) <= 4  # the 3 alternatives and the chosen token
    starts = [len(tokenizer.decode(expected.token_ids[:i])) for i in range(len(expected.token_ids))]
    assert got.text_offset == starts  # where each token's text starts in the generated text
    streamed = client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=8, temperature=0, logprobs=3,
                                         stream=True)
    chunks = [c.choices[0].logprobs for c in streamed]
    assert [lp for c in chunks for lp in c.token_logprobs] == got.token_logprobs
    assert [o for c in chunks for o in c.text_offset] == got.text_offset

    messages = [{"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=2)
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, logprobs=2), use_tqdm=False)[0]
    content = chat.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(want.logprobs, abs=1e-4)
    assert [[t.token for t in c.top_logprobs] for c in content] == [[tokenizer.decode([i]) for i in top]
                                                                    for top in want.top_logprobs]
    assert all(bytes(c.bytes).decode() == c.token for c in content)
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None

    scored = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=3, temperature=0, logprobs=1, prompt_logprobs=1),
                          use_tqdm=False)[0]
    echoed = client.completions.create(model=model, prompt=PROMPTS[2], max_tokens=3, temperature=0, logprobs=1,
                                       echo=True)
    prompt_len = len(scored.prompt_token_ids)
    assert echoed.choices[0].text == PROMPTS[2] + scored.text
    got = echoed.choices[0].logprobs
    assert got.tokens == [tokenizer.decode([t]) for t in scored.prompt_token_ids + scored.token_ids]
    assert got.token_logprobs[0] is None and got.top_logprobs[0] is None  # the first prompt token
    assert got.token_logprobs[1:] == pytest.approx(scored.prompt_logprobs[1:] + scored.logprobs, abs=1e-4)
    assert [list(t) for t in got.top_logprobs[1:prompt_len]] == [
        list(dict.fromkeys([tokenizer.decode([i]) for i in top] + [tokenizer.decode([t])]))
        for top, t in zip(scored.prompt_top_logprobs[1:], scored.prompt_token_ids[1:])]
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        client.chat.completions.create(model=model, messages=messages, max_tokens=2, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model=model, prompt="hi", max_tokens=2, logprobs=21)


def _assert_vllm_prompt_logprobs(got: list, want, k: int, tokenizer) -> None:
    """vLLM's prompt_logprobs against the offline engine's: per prompt token after the first, its k likeliest
    alternatives (ranks 1..k) and the token itself with its rank."""
    assert got[0] is None and len(got) == len(want.prompt_token_ids)
    for pos, token in enumerate(want.prompt_token_ids[1:], start=1):
        top = list(want.prompt_top_logprobs[pos] or {})
        assert len(top) == k
        assert [int(i) for i in got[pos]] == list(dict.fromkeys(top + [token]))
        assert got[pos][str(token)]["logprob"] == pytest.approx(want.prompt_logprobs[pos], abs=1e-4)
        # ranks in the middle of a random model's 32,000 logits sit 1e-4 apart: the server's step may order a
        # near-tie the other way
        assert abs(got[pos][str(token)]["rank"] - want.prompt_ranks[pos]) <= 2
        assert [e["rank"] for i, e in got[pos].items() if int(i) != token] == [
            top.index(int(i)) + 1 for i in got[pos] if int(i) != token]
        assert all(e["decoded_token"] == tokenizer.decode([int(i)]) for i, e in got[pos].items())


def test_openai_prompt_logprobs_as_vllm_returns_them(server, tiny_llama_path, tokenizer):
    """vLLM's prompt_logprobs: on completions per choice (each its prompt's), on chat once a response; echo's legacy
    logprobs keep their own k when prompt_logprobs asks more."""
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    model = str(tiny_llama_path)
    llm = LLM(model, log_stats=False)
    prompts = [PROMPTS[2], PROMPTS[5]]
    want = [llm.generate([p], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3), use_tqdm=False)[0]
            for p in prompts]
    done = client.completions.create(model=model, prompt=prompts, max_tokens=2, temperature=0, n=2,
                                     extra_body={"prompt_logprobs": 3})
    for choice in done.choices:
        _assert_vllm_prompt_logprobs(choice.model_extra["prompt_logprobs"], want[choice.index // 2], 3, tokenizer)

    echoed = client.completions.create(model=model, prompt=prompts[0], max_tokens=2, temperature=0, echo=True,
                                       logprobs=1, extra_body={"prompt_logprobs": 3})
    _assert_vllm_prompt_logprobs(echoed.choices[0].model_extra["prompt_logprobs"], want[0], 3, tokenizer)
    echoed_top = echoed.choices[0].logprobs.top_logprobs[1:len(want[0].prompt_token_ids)]
    assert all(1 <= len(t) <= 2 for t in echoed_top)  # logprobs=1: its one alternative and the prompt's token

    messages = [{"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0,
                                          extra_body={"prompt_logprobs": 0})
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    chat_want = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0),
                             use_tqdm=False)[0]
    _assert_vllm_prompt_logprobs(chat.model_extra["prompt_logprobs"], chat_want, 0, tokenizer)
    plain = client.completions.create(model=model, prompt=prompts[0], max_tokens=2)
    assert "prompt_logprobs" not in plain.choices[0].model_extra


def test_a_streamed_echo_sends_what_the_whole_response_holds(server, tiny_llama_path):
    """echo on a stream (as vLLM): each choice's first chunk starts with its prompt, and with logprobs its chunks'
    logprobs joined are the whole response's, prompt tokens and text offsets included."""
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    request = {"model": str(tiny_llama_path), "prompt": [PROMPTS[2], PROMPTS[5]], "n": 2, "max_tokens": 3,
               "temperature": 0, "echo": True}
    for logprobs in (None, 2):
        whole = client.completions.create(**request, logprobs=logprobs)
        joined = {}
        for chunk in client.completions.create(**request, logprobs=logprobs, stream=True):
            for choice in chunk.choices:
                got = joined.setdefault(choice.index, {"text": "", "logprobs": []})
                got["text"] += choice.text
                got["logprobs"].append(choice.logprobs)
        assert sorted(joined) == [0, 1, 2, 3]
        for choice in whole.choices:
            got = joined[choice.index]
            assert got["text"] == choice.text and choice.text.startswith(request["prompt"][choice.index // 2])
            if logprobs is None:
                assert choice.logprobs is None and got["logprobs"] == [None] * len(got["logprobs"])
                continue
            for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                streamed = [x for part in got["logprobs"] for x in getattr(part, field)]
                assert streamed == getattr(choice.logprobs, field), field


def test_usage_counts_the_prompt_tokens_read_from_the_prefix_cache(server, tiny_llama_path):
    """OpenAI's prompt_tokens_details.cached_tokens: none the first time a prompt is seen, its full cached blocks
    (16 tokens each) the next time, on completions and chat."""
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    model, prompt = str(tiny_llama_path), "Cache me, " + PROMPTS[14] * 3
    first, again = (client.completions.create(model=model, prompt=prompt, max_tokens=2) for _ in range(2))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.usage.prompt_tokens and cached % 16 == 0
    messages = [{"role": "user", "content": prompt + " Chat."}]
    chats = [client.chat.completions.create(model=model, messages=messages, max_tokens=2) for _ in range(2)]
    assert chats[0].usage.prompt_tokens_details.cached_tokens < chats[1].usage.prompt_tokens_details.cached_tokens


def test_openai_n_choices(server, tiny_llama_path, tokenizer):
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    model = str(tiny_llama_path)
    llm = LLM(model, log_stats=False)
    sampled = [SamplingParams(max_tokens=10, temperature=1.0, seed=7 + i) for i in range(3)]
    outs = llm.generate([PROMPTS[4]] * 3, sampled, use_tqdm=False)
    expected = [o.text for o in outs]
    assert len(set(expected)) == 3  # seed + i per choice: three different, reproducible texts
    done = client.completions.create(model=model, prompt=PROMPTS[4], max_tokens=10, temperature=1.0, seed=7, n=3)
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert [c.text for c in done.choices] == expected
    prompt_tokens = len(tokenizer(PROMPTS[4]).input_ids)
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (prompt_tokens,
                                                                        sum(len(o.token_ids) for o in outs))

    texts = ["", "", ""]
    for c in client.completions.create(model=model, prompt=PROMPTS[4], max_tokens=10, temperature=1.0, seed=7, n=3,
                                       stream=True):
        texts[c.choices[0].index] += c.choices[0].text
    assert texts == expected

    chunks = list(client.completions.create(model=model, prompt=PROMPTS[4], max_tokens=10, temperature=1.0, seed=7,
                                            n=3, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == done.usage.completion_tokens
    continuous = list(client.completions.create(
        model=model, prompt=PROMPTS[4], max_tokens=10, temperature=1.0, seed=7, n=3, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))  # vLLM's: usage on every chunk
    so_far = [[c.usage.completion_tokens for c in continuous[:-1] if c.choices[0].index == i] for i in range(3)]
    assert all(counts == sorted(counts) and counts[-1] == len(o.token_ids) for counts, o in zip(so_far, outs))
    assert {c.usage.prompt_tokens for c in continuous} == {prompt_tokens}
    assert all(c.usage.total_tokens == prompt_tokens + c.usage.completion_tokens for c in continuous[:-1])
    for options, words in (({"continuous_usage_stats": True}, "needs include_usage"),
                           ({"include_usage": True, "chunk_size": 4}, "chunk_size")):
        with pytest.raises(openai.BadRequestError, match=words):
            client.completions.create(model=model, prompt="hi", max_tokens=2, stream=True, stream_options=options)

    greedy = [o.text for o in llm.generate(PROMPTS[4:6], SamplingParams(max_tokens=6, temperature=0),
                                           use_tqdm=False)]
    ids = tokenizer(PROMPTS[5]).input_ids
    batch = client.completions.create(model=model, prompt=[PROMPTS[4], PROMPTS[5]], max_tokens=6, temperature=0, n=2)
    assert [(c.index, c.text) for c in batch.choices] == [(0, greedy[0]), (1, greedy[0]), (2, greedy[1]),
                                                          (3, greedy[1])]  # choice j of prompt i: i * n + j
    assert batch.usage.prompt_tokens == len(tokenizer(PROMPTS[4]).input_ids) + len(ids)
    by_ids = client.completions.create(model=model, prompt=[ids, ids], max_tokens=6, temperature=0)
    assert [c.text for c in by_ids.choices] == [greedy[1], greedy[1]]
    assert client.completions.create(model=model, prompt=ids, max_tokens=6, temperature=0).choices[0].text == greedy[1]
    with pytest.raises(openai.BadRequestError, match="prompt"):
        client.completions.create(model=model, prompt=[], max_tokens=2)

    messages = [{"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0, n=2,
                                          logprobs=True)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content  # greedy
    assert len(chat.choices[1].logprobs.content) == chat.usage.completion_tokens // 2


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompts_later_choices_find_its_blocks_cached(server, tiny_llama_path, stream):
    """The first choice runs alone until its first token; the other n - 1 then start together and read the prompt's
    KV blocks from the cache instead of prefilling it again, as n choices started together would."""
    def hits() -> int:
        return requests.get(f"{server}/info", timeout=10).json()["prefix_cache"]["hit_tokens"]

    prompt = f"{stream} " + " ".join(PROMPTS) * 3  # a prompt no other test sends: nothing of it is cached yet
    body = {"model": str(tiny_llama_path), "prompt": prompt, "max_tokens": 4, "n": 3, "stream": stream}
    before = hits()
    r = requests.post(f"{server}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    after_n = hits()
    requests.post(f"{server}/v1/completions", json={**body, "n": 1, "stream": False}, timeout=60)
    cacheable = hits() - after_n  # the same prompt again: every block that can come from the cache
    assert cacheable > 0 and after_n - before == 2 * cacheable


def test_openai_accepts_vllm_extra_sampling_parameters(server, tiny_llama_path):
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    model = str(tiny_llama_path)
    llm = LLM(model, log_stats=False)
    greedy = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0, repetition_penalty=1.5),
                          use_tqdm=False)[0]
    done = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=1.0,
                                     extra_body={"top_k": 1, "repetition_penalty": 1.5, "priority": -3})  # greedy
    assert done.choices[0].text == greedy.text
    stop_at = greedy.token_ids[2]
    expected = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0, repetition_penalty=1.5,
                                                         stop_token_ids=[stop_at]), use_tqdm=False)[0]
    assert len(expected.token_ids) == 3 and expected.finish_reason == "stop"
    cut = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                    extra_body={"repetition_penalty": 1.5, "stop_token_ids": [stop_at]})
    assert (cut.choices[0].text, cut.choices[0].finish_reason, cut.usage.completion_tokens) == (expected.text,
                                                                                                "stop", 3)
    with pytest.raises(openai.BadRequestError, match="top_k"):
        client.completions.create(model=model, prompt="hi", max_tokens=2, extra_body={"top_k": -5})
    held = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                     extra_body={"repetition_penalty": 1.5, "stop_token_ids": [stop_at],
                                                 "min_tokens": 5})
    assert held.usage.completion_tokens >= 5
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        client.completions.create(model=model, prompt="hi", max_tokens=2, extra_body={"min_tokens": 3})

    forced = greedy.token_ids[3]
    biased = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                       logit_bias={str(forced): 100})
    assert biased.choices[0].text == llm.generate([PROMPTS[0]], SamplingParams(
        max_tokens=4, temperature=0, logit_bias={forced: 100}), use_tqdm=False)[0].text
    for bias, words in (({"99999999": 1}, "outside the vocabulary"), ({"7": 150}, "logit_bias"),
                        ({"x": 1}, "logit_bias")):
        with pytest.raises(openai.BadRequestError, match=words):
            client.completions.create(model=model, prompt="hi", max_tokens=2, logit_bias=bias)
    with pytest.raises(openai.BadRequestError, match="stop.*at least 1 character"):
        client.completions.create(model=model, prompt="hi", max_tokens=2, stop=[""])

    constrained = {"allowed_token_ids": list(range(500, 540)), "bad_words": ["the", "and"]}
    asked = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                      extra_body=constrained)
    assert asked.choices[0].text == llm.generate([PROMPTS[0]], SamplingParams(
        max_tokens=8, temperature=0, **constrained), use_tqdm=False)[0].text
    with pytest.raises(openai.BadRequestError, match="allowed_token_ids: List should have at least 1 item"):
        client.completions.create(model=model, prompt="hi", max_tokens=2, extra_body={"allowed_token_ids": []})


def test_lorax_return_k_alternatives(server, tiny_llama_path, tokenizer):
    from lorax import Client

    llm = LLM(str(tiny_llama_path), log_stats=False)
    expected = llm.generate([PROMPTS[6]], SamplingParams(max_tokens=5, temperature=0, logprobs=3), use_tqdm=False)[0]
    response = Client(server).generate(PROMPTS[6], max_new_tokens=5, return_k_alternatives=3)
    for token, want in zip(response.details.tokens, expected.top_logprobs):
        assert [(a.id, a.text) for a in token.alternative_tokens] == [(i, tokenizer.decode([i])) for i in want]
        assert [a.logprob for a in token.alternative_tokens] == pytest.approx(list(want.values()), abs=1e-4)
    r = requests.post(f"{server}/generate_stream", json={"inputs": PROMPTS[6], "parameters": {
        "max_new_tokens": 5, "return_k_alternatives": 3}}, timeout=60)  # the client's stream lacks the parameter
    streamed = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]
    assert [[a["id"] for a in e["token"]["alternative_tokens"]] for e in streamed] == [list(w)
                                                                                    for w in expected.top_logprobs]
    plain = Client(server).generate(PROMPTS[6], max_new_tokens=2)
    assert all(t.alternative_tokens is None for t in plain.details.tokens)


def test_truncate_through_lorax_and_openai_clients_keeps_the_prompts_last_tokens(server, tiny_llama_path,
                                                                                   tokenizer):
    import openai
    from lorax import Client

    ids = tokenizer(PROMPTS[1]).input_ids
    tail = LLM(str(tiny_llama_path), log_stats=False).generate([ids[-4:]], SamplingParams(max_tokens=6, temperature=0),
                                                                 use_tqdm=False)[0]
    cut = Client(server).generate(PROMPTS[1], max_new_tokens=6, truncate=4, decoder_input_details=True)
    assert [t.id for t in cut.details.prefill] == ids[-4:]
    assert [t.id for t in cut.details.tokens] == tail.token_ids
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    done = client.completions.create(model=str(tiny_llama_path), prompt=PROMPTS[1], max_tokens=6, temperature=0,
                                     extra_body={"truncate_prompt_tokens": 4})
    assert (done.choices[0].text, done.usage.prompt_tokens) == (tail.text, 4)


def test_openai_min_p_draws_only_tokens_near_the_most_likely(server, tiny_llama_path):
    """vLLM's min_p in the openai client's extra_body: every token drawn at temperature 1 is at least min_p times
    as likely as the step's most likely one; without it the random model's flat rows give tokens below that."""
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")

    def gaps(extra: dict) -> list[float]:
        done = client.completions.create(model=str(tiny_llama_path), prompt=PROMPTS[3], max_tokens=16, seed=3,
                                         temperature=1.0, logprobs=1, extra_body={"ignore_eos": True, **extra})
        logprobs = done.choices[0].logprobs
        return [lp - max(top.values()) for lp, top in zip(logprobs.token_logprobs, logprobs.top_logprobs)]

    assert min(gaps({"min_p": 0.8})) >= math.log(0.8) - 1e-4
    assert min(gaps({})) < math.log(0.8)


def test_lorax_best_of_answers_with_the_likeliest_of_its_sequences(server):
    from lorax import Client

    response = Client(server).generate(PROMPTS[2], max_new_tokens=6, best_of=3, do_sample=True)
    others = response.details.best_of_sequences
    assert len(others) == 2
    sums = [sum(t.logprob for t in s.tokens) for s in [response.details, *others]]
    assert sums[0] == max(sums)  # TGI's pick: the highest sum of the tokens' logprobs
    sequences = [(response.generated_text, response.details.tokens)] + [(s.generated_text, s.tokens) for s in others]
    assert all(text == "".join(t.text for t in tokens if not t.special) for text, tokens in sequences)
    assert len({response.generated_text, *(s.generated_text for s in others)}) > 1  # drawn apart
    r = requests.post(f"{server}/generate_stream", json={"inputs": "hi", "parameters": {
        "best_of": 2, "do_sample": True}}, timeout=60)
    assert r.status_code == 422 and "streaming" in r.text
    r = requests.post(f"{server}/generate", json={"inputs": "hi", "parameters": {
        "best_of": 2, "do_sample": True, "adapter_id": "missing"}}, timeout=60)
    assert r.status_code == 404 and "not found" in r.text  # a refused sequence refuses the request


def test_lorax_typical_p_samples_from_the_typical_set(server):
    """A tiny typical_p leaves one token a step: sampled, yet the same text every time, and not the greedy one.
    (Which token that is on a random model's near-uniform rows is rounding, so it is compared with transformers on
    the real model, in test_sampling.py.)"""
    from lorax import Client

    client = Client(server)

    def tokens(**parameters) -> list[int]:
        return [t.id for t in client.generate(PROMPTS[1], max_new_tokens=8, **parameters).details.tokens]

    typical = [tokens(typical_p=1e-6) for _ in range(2)]
    sampled = [tokens(do_sample=True) for _ in range(2)]
    greedy = tokens()
    assert typical[0] == typical[1] != greedy
    assert sampled[0] != sampled[1]  # sampling without the filter varies: the filter is what fixes the text


def test_lorax_client_generate_stream_and_async(server, tiny_llama_path, adapters_root):
    import asyncio

    from lorax import AsyncClient, Client

    llm = LLM(str(tiny_llama_path), adapters=local_adapters, max_loras=2, adapters_root=str(adapters_root),
              log_stats=False)
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


def test_lorax_watermark_is_the_engines(server, tiny_llama_path):
    """watermark: true marks the text with LoRAX's green-list watermark (gamma 0.5, delta 2.0): greedy, the answer
    is the offline engine's with that watermark, streamed too, which differs from the unmarked answer."""
    from lorax import Client

    from engine import Watermark

    llm = LLM(str(tiny_llama_path), log_stats=False)
    marked, plain = (llm.generate([PROMPTS[3]], SamplingParams(max_tokens=24, temperature=0, watermark=watermark),
                                  use_tqdm=False)[0] for watermark in (Watermark(0.5, 2.0), None))
    assert marked.token_ids != plain.token_ids
    client = Client(server)
    response = client.generate(PROMPTS[3], max_new_tokens=24, watermark=True, details=True)
    assert [t.id for t in response.details.tokens] == marked.token_ids
    streamed = [r.token.id for r in client.generate_stream(PROMPTS[3], max_new_tokens=24, watermark=True)]
    assert streamed == marked.token_ids
    assert client.generate(PROMPTS[3], max_new_tokens=24).generated_text == plain.text


def _retrying_503(call, tries: int = 3):
    """call(), tried again after a 503 as a client honouring Retry-After would: this module's cache actor times out
    after 3 s (for the test of its silence), which a merge on a loaded 2-core machine can take."""
    from lorax.errors import OverloadedError

    for attempt in range(tries):
        try:
            return call()
        except OverloadedError:
            if attempt == tries - 1:
                raise
            time.sleep(1)


def test_lorax_merged_adapters_match_the_offline_merge(server, tiny_llama_path, adapters_root):
    from lorax import Client
    from lorax.types import MergedAdapters

    from engine.lora.merge_spec import MergeSpec

    llm = LLM(str(tiny_llama_path), adapters=local_adapters, max_loras=2, adapters_root=str(adapters_root),
              log_stats=False)
    params = SamplingParams(max_tokens=10, temperature=0)
    client = Client(server)
    for strategy, density in (("linear", 1.0), ("ties", 0.7)):
        spec = MergeSpec(("alpha", "beta"), (0.6, 0.6), strategy, density)
        expected = llm.generate([PROMPTS[4]], params, use_tqdm=False, adapters=[llm.merge_adapters(spec)])[0]
        merged = MergedAdapters(ids=list(spec.ids), weights=list(spec.weights), merge_strategy=strategy,
                                density=density, majority_sign_method="total")
        response = _retrying_503(lambda: client.generate(PROMPTS[4], max_new_tokens=10, merged_adapters=merged))
        assert [t.id for t in response.details.tokens] == expected.token_ids, strategy
    bad = requests.post(f"{server}/generate", json={"inputs": "hi", "parameters": {
        "merged_adapters": {"ids": ["alpha", "nope"], "weights": [0.5, 0.5]}}}, timeout=60)
    assert bad.status_code == 404 and "nope" in bad.text, bad.text
    both = requests.post(f"{server}/generate", json={"inputs": "hi", "parameters": {
        "adapter_id": "alpha", "merged_adapters": {"ids": ["alpha"], "weights": [1.0]}}}, timeout=60)
    assert both.status_code == 422 and "not both" in both.text, both.text


def test_tgi_tokens_mark_special_ones_with_their_text(tokenizer):
    from deployments.api.events import TokenEntry
    from deployments.api.tgi_render import TgiTokens
    from deployments.api.token_texts import TokenTexts

    tgi = TgiTokens(TokenTexts(tokenizer))
    eos = {"id": tokenizer.eos_token_id, "text": "", "logprob": -0.5}  # the generated text leaves EOS out
    assert tgi.show(TokenEntry(**eos)) == {**eos, "text": tokenizer.eos_token, "special": True}
    (word,) = tokenizer.encode(" Paris")
    plain = {"id": word, "text": " Paris", "logprob": -0.2}
    assert tgi.show(TokenEntry(**plain)) == {**plain, "special": False}


PICK = {"type": "object", "properties": {"color": {"enum": ["red", "green"]},
                                         "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["color", "n"]}  # a finite language: even the random tiny model finishes it


def _valid_pick(text: str) -> dict:
    import jsonschema

    value = json.loads(text)
    jsonschema.validate(value, PICK)
    return value


def test_structured_output_through_lorax_and_openai_clients(server, tiny_llama_path):
    import openai
    from lorax import Client

    client = Client(server)
    fmt = {"type": "json_object", "schema": PICK}
    response = client.generate(PROMPTS[0], max_new_tokens=40, response_format=fmt, adapter_id="alpha")
    _valid_pick(response.generated_text)
    assert response.details.finish_reason == "eos_token"
    streamed = [r.token.text for r in client.generate_stream(PROMPTS[1], max_new_tokens=40, response_format=fmt)
                if not r.token.special]
    _valid_pick("".join(streamed))

    oai = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    schema_format = {"type": "json_schema", "json_schema": {"name": "pick", "schema": PICK, "strict": True}}
    chat = oai.chat.completions.create(model="beta", messages=[{"role": "user", "content": "Pick one."}],
                                       max_tokens=40, response_format=schema_format)
    _valid_pick(chat.choices[0].message.content)
    assert chat.choices[0].finish_reason == "stop"
    stream = oai.completions.create(model=str(tiny_llama_path), prompt=PROMPTS[2], max_tokens=40, stream=True,
                                    extra_body={"response_format": schema_format})
    _valid_pick("".join(chunk.choices[0].text for chunk in stream))
    short = oai.completions.create(model=str(tiny_llama_path), prompt=PROMPTS[2], max_tokens=3,
                                   extra_body={"response_format": schema_format})
    assert short.choices[0].finish_reason == "length"  # the JSON is cut off: the client must check

    with pytest.raises(openai.BadRequestError, match="invalid JSON schema"):
        oai.chat.completions.create(model="beta", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                    response_format={"type": "json_schema",
                                                     "json_schema": {"name": "x", "schema": {"type": "objekt"}}})


@pytest.mark.parametrize("response_format, status, words", [
    ({"type": "json_object", "schema": {"type": "object", "required": "a"}}, 400, "invalid JSON schema"),
    ({"type": "json_object", "schema": {"$ref": "#/$defs/none"}}, 400, "cannot be used"),
    ({"type": "xml"}, 422, "response_format"),
])
def test_bad_response_formats_get_a_clear_error(server, response_format, status, words):
    r = requests.post(f"{server}/generate", json={"inputs": "hi", "parameters": {
        "max_new_tokens": 4, "response_format": response_format}}, timeout=60)
    assert r.status_code == status and words in r.text, r.text


def test_vllm_structured_output_extras_through_the_openai_client(server, tiny_llama_path):
    """The random tiny model writes garbage, but the grammar forces its shape; each one completes in a few tokens."""
    import re

    import openai

    oai = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    model = str(tiny_llama_path)
    colors = ["red", "green", "blue"]
    chosen = oai.completions.create(model=model, prompt=PROMPTS[0], max_tokens=20, extra_body={"guided_choice": colors})
    assert chosen.choices[0].text in colors and chosen.choices[0].finish_reason == "stop"
    date = "[0-9]{4}-[0-9]{2}-[0-9]{2}"
    dated = oai.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "A date?"}], max_tokens=20,
                                        extra_body={"guided_regex": date})
    assert re.fullmatch(date, dated.choices[0].message.content) and dated.choices[0].finish_reason == "stop"
    constraints = {"choice": colors, "regex": date, "grammar": 'start: "yes" | "no"', "json": PICK}
    fits = {"choice": lambda text: text in colors, "regex": lambda text: re.fullmatch(date, text),
            "grammar": lambda text: text in ("yes", "no"), "json": _valid_pick}
    for key, constraint in constraints.items():
        out = oai.completions.create(model=model, prompt=PROMPTS[1], max_tokens=40,
                                     extra_body={"structured_outputs": {key: constraint}})
        assert out.choices[0].finish_reason == "stop" and fits[key](out.choices[0].text), (key, out.choices[0].text)
    picked = oai.completions.create(model=model, prompt=PROMPTS[2], max_tokens=40,
                                    extra_body={"guided_json": json.dumps(PICK), "guided_decoding_backend": "guidance"})
    _valid_pick(picked.choices[0].text)


@pytest.mark.parametrize("extra, words", [
    ({"guided_choice": ["a"], "guided_regex": "a"}, "at most one structured-output constraint per request, got "
                                                    "guided_regex, guided_choice"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "got response_format, structured_outputs.regex"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern: not supported"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ({"guided_choice": ["x"] * 257}, "guided_choice: List should have at most 256 items"),
    ({"guided_regex": "(abc"}, "invalid regex"),
    ({"guided_grammar": "start: foo"}, "invalid grammar"),
])
def test_bad_structured_output_extras_get_400_naming_them(server, tiny_llama_path, extra, words):
    r = requests.post(f"{server}/v1/completions", timeout=60,
                      json={"model": str(tiny_llama_path), "prompt": "hi", "max_tokens": 2, **extra})
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_info_and_models_show_where_adapters_reside(server):
    r = requests.post(f"{server}/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2,
                                                                                   "adapter_id": "alpha"}}, timeout=60)
    assert r.status_code == 200, r.text

    def alpha_on_device():
        alpha = requests.get(f"{server}/info", timeout=10).json()["adapters"].get("alpha", {})
        return alpha if alpha.get("device_replicas") else None

    alpha = _poll(alpha_on_device)  # replicas report every second
    assert alpha["object_store"] and alpha["source_loads"] == 1 and alpha["cpu_replicas"]
    models = {m["id"]: m for m in requests.get(f"{server}/v1/models", timeout=10).json()["data"]}
    assert models["alpha"]["residence"]["device_replicas"] == alpha["device_replicas"]
    info = requests.get(f"{server}/info", timeout=10).json()
    version = importlib.metadata.version("lora-serve")  # vLLM's /version, and /info's
    assert requests.get(f"{server}/version", timeout=10).json() == {"version": version} and info["version"] == version
    memory = info["memory"]
    assert info["quantization"] == "none" and memory["weight_bytes"]["float32"] == memory["total_weight_bytes"] > 0
    assert memory["kv_bytes"] == memory["kv_bytes_per_token"] * memory["kv_token_capacity"] > 0
    assert memory["adapter_slot_bytes"] > 0
    assert set(info["prefix_cache"]) == {"queried_tokens", "hit_tokens", "hit_rate", "cached_blocks", "evictions"}
    slots = info["adapter_slots"]  # alpha's request above took a slot
    assert slots["acquisitions"] >= slots["loads"] >= 1
    assert slots["hit_rate"] == pytest.approx((slots["acquisitions"] - slots["loads"]) / slots["acquisitions"])


def test_client_disconnect_cancels_the_request_and_frees_its_kv_blocks(server):
    from ray import serve

    handle = serve.get_deployment_handle("LLMServer", app_name="lora-serve")

    def beta_tokens():
        usage = handle.stats.remote().result().adapters.get("beta")
        return usage.generated_tokens if usage is not None else 0

    before = beta_tokens()
    r = requests.post(f"{server}/generate_stream", json={"inputs": PROMPTS[0], "parameters": {
        "max_new_tokens": 450, "ignore_eos_token": True, "adapter_id": "beta"}}, stream=True, timeout=60)
    assert next(line for line in r.iter_lines() if line).startswith(b"data:")  # the stream is running
    r.close()
    stats = _poll(lambda: (s := handle.stats.remote().result()).running == 0 and s.waiting == 0 and s)
    assert stats.kv_blocks_used == 0
    assert beta_tokens() - before < 450  # cancelled mid-stream, not run to its end

    before = beta_tokens()  # an OpenAI stream of 2 choices: leaving stops both
    r = requests.post(f"{server}/v1/completions", json={"model": "beta", "prompt": PROMPTS[0], "max_tokens": 450,
                                                         "n": 2, "stream": True}, stream=True, timeout=60)
    assert next(line for line in r.iter_lines() if line).startswith(b"data:")
    r.close()
    stats = _poll(lambda: (s := handle.stats.remote().result()).running == 0 and s.waiting == 0 and s)
    assert stats.kv_blocks_used == 0
    assert beta_tokens() - before < 2 * 450


def test_overload_answers_429_or_503_with_retry_after(server, tiny_llama_path):
    from ray import serve

    from deployments.replica.llm_server import LLMServer

    engine = {"model": str(tiny_llama_path), "log_stats": False, "max_num_seqs": 1, "max_waiting_requests": 1}
    no_cpus = {"num_cpus": 0}  # it starts whatever the other apps of the shared cluster hold
    llm = LLMServer.options(max_ongoing_requests=3, max_queued_requests=1, ray_actor_options=no_cpus)
    serve.run(llm.bind(engine), name="tight", route_prefix="/tight")
    body = {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": 300, "ignore_eos_token": True}}
    try:
        with ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(lambda _: requests.post(f"{server}/tight/generate", json=body, timeout=120),
                                      range(8)))
        statuses = sorted(r.status_code for r in responses)
        assert set(statuses) <= {200, 429, 503} and 200 in statuses and statuses[-1] != 200, statuses
        for r in responses:
            if r.status_code != 200:
                assert int(r.headers["Retry-After"]) >= 1, r.headers
            if r.status_code == 429:  # the engine's waiting queue: in the API's error shape
                assert "overloaded" in r.json()["error"], r.text
            if r.status_code == 503:  # Serve's own queue, answered by its proxy in plain text
                assert "backpressure" in r.text, r.text
        assert requests.post(f"{server}/tight/generate", json=body, timeout=120).status_code == 200
    finally:
        serve.delete("tight")



def test_a_silent_adapter_cache_answers_503_while_base_requests_go_on(server, tiny_llama_path, adapters_root):
    """The cache actor's process stopped (alive to Ray, answering nothing): a request for an adapter the replica
    does not hold gets 503 with Retry-After and the cache named, in each API's error shape, after the server's
    adapter_cache_timeout_s, and so does tokenizing for an adapter, which asks the cache whether it is served; base
    requests are served meanwhile; the adapter is served once the actor runs."""
    import ray

    from lora_cache.actor import ACTOR_NAME

    write_tiny_adapters(tiny_llama_path, adapters_root, ("latecomer",))
    [named] = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"] == ACTOR_NAME]
    pid = ray.get(ray.get_actor(ACTOR_NAME, namespace=named["namespace"]).ping.remote())
    lorax = {"inputs": "hi", "parameters": {"max_new_tokens": 3, "adapter_id": "latecomer"}}
    waits = {"/generate": lorax, "/v1/completions": {"model": "latecomer", "prompt": "hi", "max_tokens": 3},
             "/v1/load_lora_adapter": {"lora_name": "refused", "lora_path": str(adapters_root / "latecomer")},
             "/tokenize": {"model": "alpha", "prompt": "hi"}}
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with ThreadPoolExecutor(len(waits)) as pool:
            answers = dict(zip(waits, pool.map(lambda path: requests.post(f"{server}{path}", json=waits[path],
                                                                          timeout=60), waits)))
        assert 3 <= time.monotonic() - start < 20
        base = {"inputs": "hi", "parameters": {"max_new_tokens": 3}}
        assert requests.post(f"{server}/generate", json=base, timeout=60).status_code == 200
    finally:
        os.kill(pid, signal.SIGCONT)
    for path, r in answers.items():
        assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1, (path, r.status_code, r.text)
        error = r.json()["error"]
        reason = error["message"] if isinstance(error, dict) else error  # OpenAI's error shape, or TGI's
        assert "the adapter cache is unavailable" in reason and "for 3 s" in reason, reason
    r = requests.post(f"{server}/generate", json=lorax, timeout=60)
    assert r.status_code == 200, r.text
    served = [card["id"] for card in requests.get(f"{server}/v1/models", timeout=60).json()["data"]]
    assert "latecomer" in served and "refused" not in served, served  # the load refused with 503 did not land


def test_prometheus_metrics_are_exported(server):
    for adapter in ("alpha", None):
        requests.post(f"{server}/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 3,
                                                                                 "adapter_id": adapter}}, timeout=60)
    streamed = requests.post(f"{server}/generate_stream", json={"inputs": "hi", "parameters": {"max_new_tokens": 4}},
                             stream=True, timeout=60)
    assert streamed.status_code == 200 and len([line for line in streamed.iter_lines() if line]) >= 2
    names = ("lora_serve_time_to_first_token_seconds_bucket", "lora_serve_time_per_output_token_seconds",
             "lora_serve_inter_token_latency_seconds_bucket",
             "lora_serve_request_latency_seconds", "lora_serve_generation_tokens", "lora_serve_prompt_tokens",
             "lora_serve_adapter_cache_hits", "lora_serve_kv_cache_utilisation", "lora_serve_running_requests",
             'lora_serve_weight_bytes{', "lora_serve_kv_cache_capacity_tokens", "lora_serve_adapter_slot_bytes",
             "lora_serve_prefix_cache_queried_tokens", "lora_serve_prefix_cache_blocks", "lora_serve_adapter_held",
             "lora_serve_adapter_requests")

    def exported():
        text = requests.get(METRICS["url"], timeout=10).text
        return text if all(n in text for n in names) else None

    text = _poll(exported, timeout=60, interval=2)
    assert 'adapter="alpha"' in text and 'adapter="base"' in text
    held = [line for line in text.splitlines() if "lora_serve_adapter_held{" in line and 'adapter="alpha"' in line]
    assert held and max(float(line.rsplit(" ", 1)[1]) for line in held) == 1, held  # its one replica holds it


def test_lora_lifecycle_over_http_while_another_request_streams(server, tiny_llama_path, tmp_path):
    """load_lora_adapter, use, reload with new weights (a request already running finishes on the old ones; the
    content id and the outputs change), unload (then 404), while a base-model stream runs throughout."""
    from transformers import AutoConfig

    from benchmarks.lora_adapters import write_random_adapter

    config = AutoConfig.from_pretrained(tiny_llama_path)
    for seed, version in ((10, "v1"), (11, "v2")):
        write_random_adapter(tmp_path / version, config, rank=4, seed=seed)
    llm = LLM(str(tiny_llama_path), adapters=local_adapters, max_loras=2, adapters_root=str(tmp_path), log_stats=False)
    short, long = SamplingParams(max_tokens=8, temperature=0), SamplingParams(max_tokens=300, temperature=0,
                                                                               ignore_eos=True)
    expect = {v: llm.generate([PROMPTS[2]], short, use_tqdm=False, adapters=[v])[0].text for v in ("v1", "v2")}
    assert expect["v1"] != expect["v2"]
    long_v1 = llm.generate([PROMPTS[2]], long, use_tqdm=False, adapters=["v1"])[0].text

    def complete(**extra):
        return requests.post(f"{server}/v1/completions", json={"model": "gamma", "prompt": PROMPTS[2], "max_tokens": 8,
                                                                "temperature": 0, **extra}, timeout=60)

    def load(path):
        return requests.post(f"{server}/v1/load_lora_adapter", json={"lora_name": "gamma", "lora_path": str(path)},
                             timeout=60)

    base = requests.post(f"{server}/generate_stream", json={"inputs": PROMPTS[0], "parameters": {
        "max_new_tokens": 400, "ignore_eos_token": True}}, stream=True, timeout=60)
    base_lines = base.iter_lines()
    assert next(line for line in base_lines if line).startswith(b"data:")

    assert complete().status_code == 404
    first = load(tmp_path / "v1")
    assert first.status_code == 200, first.text
    v1_id = first.json()["content_id"]
    body = complete().json()
    assert body["choices"][0]["text"] == expect["v1"] and body["system_fingerprint"] == v1_id
    models = {m["id"]: m for m in requests.get(f"{server}/v1/models", timeout=10).json()["data"]}
    assert models["gamma"]["content_id"] == v1_id and models["gamma"]["lora_path"] == str(tmp_path / "v1")
    assert models["gamma"]["root"] == str(tmp_path / "v1") and models["gamma"]["parent"] == str(tiny_llama_path)

    running = complete(max_tokens=300, ignore_eos=True, stream=True)
    running_lines = running.iter_lines()
    assert next(line for line in running_lines if line).startswith(b"data:")  # started on v1
    second = load(tmp_path / "v2")
    assert second.status_code == 200, second.text
    v2_id = second.json()["content_id"]
    assert v2_id != v1_id
    chunks = [json.loads(line[6:]) for line in running_lines if line.startswith(b"data: {")]
    assert chunks[-1]["system_fingerprint"] == v1_id  # the request that was running finished on the old weights
    assert long_v1.endswith("".join(c["choices"][0]["text"] for c in chunks))
    body = complete().json()
    assert body["choices"][0]["text"] == expect["v2"] and body["system_fingerprint"] == v2_id

    unloaded = requests.post(f"{server}/v1/unload_lora_adapter", json={"lora_name": "gamma"}, timeout=60)
    assert unloaded.status_code == 200, unloaded.text
    gone = complete()
    assert gone.status_code == 404 and "not found" in gone.json()["error"]["message"], gone.text
    assert "gamma" not in {m["id"] for m in requests.get(f"{server}/v1/models", timeout=10).json()["data"]}

    for route, body, status, words in [
            ("unload", {"lora_name": "gamma"}, 404, "cannot be unloaded"),
            ("load", {"lora_name": "gamma", "lora_path": str(tmp_path / "absent")}, 404, "not found"),
            ("load", {"lora_name": "gamma", "lora_path": "relative/path"}, 400, "must be absolute"),
            ("load", {"lora_name": "gamma", "lora_path": "ftp://x/y"}, 400, "known schemes"),
            ("load", {"lora_name": "../gamma", "lora_path": str(tmp_path / "v1")}, 400, ".."),
            ("load", {"lora_name": "gamma", "lora_path": str(tmp_path / "v1"), "lora_int_id": 3}, 400, "lora_int_id"),
            ("load", {"lora_name": str(tiny_llama_path), "lora_path": str(tmp_path / "v1")}, 400, "base model's name")]:
        r = requests.post(f"{server}/v1/{route}_lora_adapter", json=body, timeout=60)
        assert r.status_code == status and words in r.json()["error"]["message"], (route, body, r.text)

    rest = [json.loads(line[5:]) for line in base_lines if line.startswith(b"data:")]
    assert rest[-1]["details"]["generated_tokens"] == 400  # the base stream ran through it all


def _bad_adapters(tiny_llama_path, folder):
    """lora_name -> (its folder, words its refusal states): one adapter for each thing checked at load."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from benchmarks.lora_adapters import write_random_adapter

    config = AutoConfig.from_pretrained(tiny_llama_path)
    narrow = AutoConfig.from_pretrained(tiny_llama_path, hidden_size=32, intermediate_size=64)
    every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    bad = {"too-big-rank": (write_random_adapter(folder / "rank", config, rank=32, targets=("q_proj",)),
                            "rank 32 is above this server's max_lora_rank 16"),
           "mis-shaped": (write_random_adapter(folder / "shape", narrow, rank=4), "different base model"),
           "integer-weights": (write_random_adapter(folder / "dtype", config, rank=4), "must be a 2-D float tensor"),
           "oversized": (write_random_adapter(folder / "size", config, rank=16, targets=every),
                         f"over the limit of {MAX_ADAPTER_BYTES} bytes (max_adapter_bytes)")}
    weights = folder / "dtype" / "adapter_model.safetensors"
    save_file({name: t.to(torch.int8) for name, t in load_file(weights).items()}, weights)
    return bad


def test_bad_adapters_are_refused_at_load_naming_the_problem_and_nothing_registers(server, tiny_llama_path,
                                                                                   adapters_root, tmp_path):
    """Rank, shapes, dtype and size are checked when the adapter is loaded: a 400 that names the adapter and the
    limit, with no internal key and no server path; the name is then not served. Asking for or unloading an adapter
    that does not exist names no path either."""
    for name, (folder, words) in _bad_adapters(tiny_llama_path, tmp_path).items():
        r = requests.post(f"{server}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(folder)},
                          timeout=60)
        message = r.json()["error"]["message"]
        assert r.status_code == 400 and f"adapter {name!r}" in message and words in message, (name, r.text)
        assert "#" not in message and str(tmp_path) not in message, message
        used = requests.post(f"{server}/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 2},
                             timeout=60)
        assert used.status_code == 404, used.text
        assert name not in {m["id"] for m in requests.get(f"{server}/v1/models", timeout=10).json()["data"]}
    missing = [requests.post(f"{server}/v1/completions", json={"model": "absent", "prompt": "hi"}, timeout=60),
               requests.post(f"{server}/generate", json={"inputs": "hi", "parameters": {"adapter_id": "absent"}},
                             timeout=60),
               requests.post(f"{server}/v1/unload_lora_adapter", json={"lora_name": "absent"}, timeout=60)]
    for r in missing:
        assert r.status_code == 404 and "'absent'" in r.text and str(adapters_root) not in r.text, r.text


def test_a_forwarded_request_that_comes_back_to_its_sender_is_handed_back_at_once(server):
    """One replica: a request it forwarded whose target stopped meanwhile can only come back to it through Serve's
    router; it refuses it at once, for the sender to serve it itself (deployments/replica/event_streams.py)."""
    from ray import serve

    from deployments.replica.event_streams import ReturnedToSender
    from deployments.routing.policy import RouteRequest

    handle = serve.get_deployment_handle("LLMServer", app_name="lora-serve")
    me = handle.stats.remote().result().replica
    route = RouteRequest(target="gone@node-0", sender=me)
    started = time.monotonic()
    with pytest.raises(ReturnedToSender):
        list(handle.options(stream=True).forwarded.remote(route, PROMPTS[0], SamplingParams(max_tokens=2), False))
    assert time.monotonic() - started < 30
    elsewhere = list(handle.options(stream=True).forwarded.remote(RouteRequest(target=me, sender="peer@node-0"),
                                                                  PROMPTS[0], SamplingParams(max_tokens=2), False))
    assert elsewhere[-1].final is not None  # another sender's request is served
