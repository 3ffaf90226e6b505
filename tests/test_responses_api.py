"""OpenAI's Responses API over HTTP through a real Ray Serve app, with the openai client: the answer equals the
offline engine's on the prompt the chat template renders, whole and streamed (the typed events in order, their
deltas joined), a conversation given back as input (messages, function calls and their outputs, rendered as chat
renders them), function tools through the grammar, text.format's JSON, the output text's logprobs (chat's, whole
and streamed), an adapter as the model, and the refusals of what a stateless server cannot do."""

from __future__ import annotations

import json

import pytest
import requests

from engine import LLM, SamplingParams
from tests.helpers import PROMPTS, serving, write_tiny_adapters

pytestmark = pytest.mark.slow
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
                         "additionalProperties": False}},
         {"type": "function", "name": "get_time",
          "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
                         "additionalProperties": False}}]


@pytest.fixture(scope="module")
def server(serve_cluster, tiny_llama_path, tmp_path_factory):
    from deployments.app import build_app

    root = write_tiny_adapters(tiny_llama_path, tmp_path_factory.mktemp("responses-adapters"), ("alpha",))
    engine = {"model": str(tiny_llama_path), "log_stats": False, "max_loras": 1, "adapters_root": str(root)}
    with serving(serve_cluster, build_app({"engine": engine})) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused")


@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    return LLM(str(tiny_llama_path), log_stats=False)


def _offline(llm, tokenizer, messages: list[dict], max_tokens: int):
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=False)[0]


def test_a_response_is_the_engines_answer_to_the_chat_prompt(client, llm, tokenizer, tiny_llama_path):
    response = client.responses.create(model=str(tiny_llama_path), input=PROMPTS[0], instructions="Be brief.",
                                       max_output_tokens=8, temperature=0)
    want = _offline(llm, tokenizer, [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": PROMPTS[0]}], 8)
    assert response.output_text == want.text
    assert response.status == ("incomplete" if want.finish_reason == "length" else "completed")
    assert (response.incomplete_details is not None) == (want.finish_reason == "length")
    assert response.id.startswith("resp_") and response.output[0].id.startswith("msg_")
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (len(want.prompt_token_ids), len(want.token_ids))
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert response.instructions == "Be brief." and response.max_output_tokens == 8
    again = client.responses.create(model=str(tiny_llama_path), input=PROMPTS[0], instructions="Be brief.",
                                    max_output_tokens=8, temperature=0)
    assert again.output_text == response.output_text
    assert 0 < again.usage.input_tokens_details.cached_tokens < usage.input_tokens  # the prompt's cached blocks


def test_a_streamed_response_sends_the_apis_events_in_order(client, tiny_llama_path):
    request = {"model": str(tiny_llama_path), "input": PROMPTS[1], "max_output_tokens": 12, "temperature": 0}
    whole = client.responses.create(**request)
    events = list(client.responses.create(**request, stream=True))
    kinds = [event.type for event in events]
    done = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          done]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == events[-4].text == whole.output_text
    last = events[-1].response
    assert last.output_text == whole.output_text and last.status == whole.status
    assert last.usage.output_tokens == whole.usage.output_tokens


def test_a_conversation_given_back_as_input_continues_it(client, llm, tokenizer, tiny_llama_path):
    """The client keeps the conversation: an earlier response's output items go back in the next input."""
    model = str(tiny_llama_path)
    first = client.responses.create(model=model, input=PROMPTS[2], max_output_tokens=6, temperature=0)
    given = [{"role": "user", "content": PROMPTS[2]}, *[item.model_dump() for item in first.output],
             {"role": "user", "content": [{"type": "input_text", "text": PROMPTS[3]}]}]
    second = client.responses.create(model=model, input=given, max_output_tokens=6, temperature=0)
    want = _offline(llm, tokenizer, [{"role": "user", "content": PROMPTS[2]},
                                     {"role": "assistant", "content": first.output_text},
                                     {"role": "user", "content": PROMPTS[3]}], 6)
    assert second.output_text == want.text


def test_text_format_makes_json_for_the_schema(client, tiny_llama_path):
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}}, "required": ["colour"],
              "additionalProperties": False}
    request = {"model": str(tiny_llama_path), "input": "A colour?", "max_output_tokens": 32, "temperature": 0,
               "text": {"format": {"type": "json_schema", "name": "c", "schema": schema}}}
    response = client.responses.create(**request)
    assert json.loads(response.output_text)["colour"] in ("red", "green") and response.status == "completed"
    assert response.text.format.type == "json_schema"
    with client.responses.stream(**request) as stream:  # the SDK's helper rebuilds it from the events, checking them
        assert stream.get_final_response().output_text == response.output_text


def test_required_and_named_tools_answer_with_calls_whole_and_streamed(client, tiny_llama_path):
    """tool_choice "required" and a named function make the model call through the grammar (chat's machinery):
    function_call items, and on a stream each call's events once the text is whole."""
    request = {"model": str(tiny_llama_path), "input": "Weather in Rome?", "tools": TOOLS, "max_output_tokens": 64,
               "temperature": 0, "parallel_tool_calls": False}
    for choice, names in (("required", {"get_weather", "get_time"}), ({"type": "function", "name": "get_time"},
                                                                      {"get_time"})):
        whole = client.responses.create(**request, tool_choice=choice)
        assert whole.status == "completed" and [item.type for item in whole.output] == ["function_call"]
        call = whole.output[0]
        assert call.name in names and call.call_id.startswith("call_") and call.id.startswith("fc_")
        assert set(json.loads(call.arguments)) == {"city" if call.name == "get_weather" else "zone"}
        events = list(client.responses.create(**request, tool_choice=choice, stream=True))
        assert [e.type for e in events] == [
            "response.created", "response.in_progress", "response.output_item.added",
            "response.function_call_arguments.delta", "response.function_call_arguments.done",
            "response.output_item.done", "response.completed"]
        streamed = events[-1].response.output[0]
        assert (streamed.name, streamed.arguments) == (call.name, call.arguments) == (
            events[4].name, events[3].delta)
        assert events[2].item.call_id == streamed.call_id == events[5].item.call_id
        with client.responses.stream(**request, tool_choice=choice) as stream:
            rebuilt = stream.get_final_response().output[0]
        assert (rebuilt.type, rebuilt.name, rebuilt.arguments) == ("function_call", call.name, call.arguments)


def test_calls_and_their_outputs_given_back_render_as_chats_do(client, tiny_llama_path):
    """function_call and function_call_output items are the assistant's tool_calls and tool messages of chat: the
    same conversation answers the same through both routes."""
    model, call = str(tiny_llama_path), {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    given = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", **call},
             {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"}]
    response = client.responses.create(model=model, input=given, tools=TOOLS, tool_choice="none",
                                       max_output_tokens=6, temperature=0)
    chat = client.chat.completions.create(
        model=model, max_tokens=6, temperature=0, tool_choice="none",
        tools=[{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS],
        messages=[given[0], {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                                                  "function": call}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}])
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def _scores(logprobs) -> list[tuple]:
    """Each token's text and logprob, with its alternatives'."""
    return [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs or []]) for t in logprobs]


def _close(got: list[tuple], want: list[tuple]) -> bool:
    """The same tokens and alternatives, their logprobs equal to float32's rounding (the runs batch differently)."""
    flat = lambda scores: [(token, lp) for token, lp, top in scores for token, lp in [(token, lp), *top]]  # noqa: E731
    return [t for t, _ in flat(got)] == [t for t, _ in flat(want)] and \
        [lp for _, lp in flat(got)] == pytest.approx([lp for _, lp in flat(want)], abs=1e-4)


def test_the_output_texts_logprobs_are_chats_whole_and_streamed(client, tiny_llama_path):
    """include message.output_text.logprobs with top_logprobs 2: the text part's logprobs are chat's for the same
    conversation, token for token with two alternatives each; a stream's deltas carry them in order, and its
    output_text.done all of them. top_logprobs alone asks for them too; include alone gives no alternatives."""
    model, question = str(tiny_llama_path), PROMPTS[2]
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                          max_tokens=10, temperature=0, logprobs=True, top_logprobs=2)
    want = _scores(chat.choices[0].logprobs.content)
    request = {"model": model, "input": question, "max_output_tokens": 10, "temperature": 0}
    whole = client.responses.create(**request, include=["message.output_text.logprobs"], top_logprobs=2)
    part = whole.output[0].content[0]
    assert _close(_scores(part.logprobs), want) and whole.top_logprobs == 2
    assert all(len(t.top_logprobs) == 2 for t in part.logprobs) and len(part.logprobs) == whole.usage.output_tokens
    assert part.logprobs[0].bytes == list(part.logprobs[0].token.encode())
    events = list(client.responses.create(**request, top_logprobs=2, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert _close(_scores([t for e in deltas for t in e.logprobs]), want)
    assert "".join(e.delta for e in deltas) == part.text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert _close(_scores(done.logprobs), want)
    bare = client.responses.create(**request, include=["message.output_text.logprobs"]).output[0].content[0]
    assert [t for t, _, top in _scores(bare.logprobs) if not top] == [t for t, _, _ in want]
    assert client.responses.create(**request).output[0].content[0].logprobs is None  # not asked for, not computed


def test_an_adapter_answers_as_the_model(client):
    response = client.responses.create(model="alpha", input=PROMPTS[4], max_output_tokens=4, temperature=0)
    assert response.model == "alpha" and response.usage.output_tokens >= 1


@pytest.mark.parametrize("body, status, words", [
    ({"previous_response_id": "resp_1"}, 400, "previous_response_id: not supported"),
    ({"store": True}, 400, "store"),
    ({"reasoning": {"effort": "low"}}, 400, "reasoning: not supported"),
    ({"input": ""}, 400, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, 400, "role"),
    ({"input": [{"type": "reasoning", "summary": []}]}, 400, "input[0]: items of type 'reasoning' are not supported"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
    ({"tools": [TOOLS[0]], "tool_choice": {"type": "function", "name": "nope"}}, 400, "names function 'nope'"),
    ({"tools": [TOOLS[0]], "tool_choice": "auto"}, 400, 'tool_choice "auto" needs a model whose chat template'),
    ({"tools": [TOOLS[0]], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, 400,
     "text.format cannot be given"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, 400,
     "arguments must be a JSON object"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "needs a \"schema\""),
    ({"max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"include": ["reasoning.encrypted_content"]}, 400, "include 'reasoning.encrypted_content' is not supported"),
    ({"tools": [TOOLS[0]], "tool_choice": "required", "top_logprobs": 1}, 400, "not supported with tools"),
    ({"top_logprobs": 21}, 400, "top_logprobs"),
    ({"model": "nope"}, 404, "nope"),
])
def test_what_a_stateless_server_cannot_do_is_refused_by_name(server, tiny_llama_path, body, status, words):
    r = requests.post(f"{server}/v1/responses", timeout=60,
                      json={"model": str(tiny_llama_path), "input": "hi", "max_output_tokens": 2, **body})
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]
