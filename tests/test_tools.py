"""Tool calling: "required" and named functions through the grammar, with the openai client against a real Serve
app on SmolLM2; "auto" parsing of Hermes calls; the chat prompts tools make; and the refusals."""

from __future__ import annotations

import json

import jsonschema
import pytest
import requests

from deployments.api.chat import ChatMessage, chat_prompt
from deployments.api.tools import FunctionDefinition, ToolMode, ToolUse
from tests.helpers import serving

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 24},
                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 32}}, "required": ["timezone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what time is it in Tokyo?"}]
HERMES_TEMPLATE = ("{% if tools %}<|im_start|>system\n<tools>{{ tools | tojson }}</tools><|im_end|>\n{% endif %}"
                   "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                   "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
                   "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _functions() -> list[FunctionDefinition]:
    return [FunctionDefinition(**tool["function"]) for tool in TOOLS]


@pytest.fixture(scope="module")
def server(serve_cluster, smollm2_path):
    from deployments.app import build_app

    with serving(serve_cluster, build_app({"engine": {"model": str(smollm2_path), "log_stats": False}})) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused")


def _check_calls(calls, names=SCHEMAS) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.slow
def test_required_makes_valid_calls_of_the_given_functions(client, smollm2_path):
    response = client.chat.completions.create(model=str(smollm2_path), messages=ASK, tools=TOOLS,
                                              tool_choice="required", max_tokens=200, temperature=0)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    _check_calls(choice.message.tool_calls)
    assert choice.message.content is None

    one = client.chat.completions.create(model=str(smollm2_path), messages=ASK, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=200, temperature=0.8, seed=3)
    assert len(one.choices[0].message.tool_calls) == 1
    _check_calls(one.choices[0].message.tool_calls)


@pytest.mark.slow
def test_a_named_function_is_called_streamed_or_not(client, smollm2_path):
    named = {"type": "function", "function": {"name": "get_time"}}
    response = client.chat.completions.create(model=str(smollm2_path), messages=ASK, tools=TOOLS, tool_choice=named,
                                              max_tokens=100, temperature=0)
    choice = response.choices[0]
    assert choice.finish_reason == "stop"  # as OpenAI, for a forced function
    _check_calls(choice.message.tool_calls, {"get_time"})

    stream = client.chat.completions.create(model=str(smollm2_path), messages=ASK, tools=TOOLS, tool_choice=named,
                                            max_tokens=100, temperature=0, stream=True)
    deltas = [chunk.choices[0] for chunk in stream]
    calls = [call for d in deltas for call in d.delta.tool_calls or []]
    assert [c.index for c in calls] == [0] and deltas[-1].finish_reason == "stop"
    assert calls[0].function.arguments == choice.message.tool_calls[0].function.arguments  # greedy: the same call
    _check_calls(calls, {"get_time"})


@pytest.mark.slow
def test_a_conversation_with_calls_and_their_results_continues(client, smollm2_path):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"},
        {"role": "user", "content": [{"type": "text", "text": "Say it in one sentence."}]}]
    response = client.chat.completions.create(model=str(smollm2_path), messages=messages, tools=TOOLS,
                                              tool_choice="none", max_tokens=30, temperature=0)
    choice = response.choices[0]
    assert choice.message.content and choice.message.tool_calls is None


@pytest.mark.slow
@pytest.mark.parametrize("extra, words", [
    ({"tools": TOOLS}, 'tool_choice "auto" needs a model whose chat template renders tools'),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "distinct function names"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format cannot be given with it"),
    ({"tools": TOOLS, "tool_choice": "required", "stream": True, "logprobs": True}, "logprobs are not supported"),
    ({"functions": [TOOLS[0]["function"]]}, "functions: not supported by this server"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}], "tool_choice": "required"}, "pattern"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array", "maxItems": "x"}}}],
      "tool_choice": "required"}, "invalid JSON schema"),
])
def test_what_cannot_be_served_is_refused_by_name(server, smollm2_path, extra, words):
    body = {"model": str(smollm2_path), "messages": ASK, "max_tokens": 8, **extra}
    r = requests.post(f"{server}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]


@pytest.mark.slow
@pytest.mark.parametrize("message, words", [
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}, "content"),
    ({"role": "tool", "content": "21"}, "tool_call_id"),
    ({"role": "user", "content": "hi", "tool_call_id": "c"}, "tool_call_id"),
    ({"role": "assistant", "content": None}, "needs content"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f",
                                                                                       "arguments": "[1]"}}]},
     "arguments must be a JSON object"),
])
def test_malformed_messages_are_refused(server, smollm2_path, message, words):
    body = {"model": str(smollm2_path), "messages": [message], "max_tokens": 8}
    r = requests.post(f"{server}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_hermes_calls_are_parsed_out_of_auto_answers():
    use = ToolUse(ToolMode.AUTO, _functions())
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
            '\n</tool_call><tool_call>{"name": "get_time", "arguments": "{\\"timezone\\": \\"UTC\\"}"}</tool_call>')
    reply = use.reply(text, "stop")
    assert reply.finish_reason == "tool_calls" and reply.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"}), ("get_time", {"timezone": "UTC"})]
    for text in ["It is sunny.", '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
                 '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>', "<tool_call>{not json</tool_call>"]:
        reply = use.reply(text, "stop")
        assert (reply.content, reply.tool_calls, reply.finish_reason) == (text, [], "stop")


def test_unfinished_or_cut_answers_stay_content():
    required = ToolUse(ToolMode.REQUIRED, _functions())
    assert required.reply('[{"name": "get_time", "parameters": {"timezone": "UTC"}}]', "stop").tool_calls
    for text, reason in [('[{"name": "get_time", "param', "length"), ('[{"name": "get_time"}]', "stop"),
                         ('[{"name": "other", "parameters": {}}]', "stop")]:
        reply = required.reply(text, reason)
        assert (reply.content, reply.tool_calls, reply.finish_reason) == (text, [], reason)
    named = ToolUse(ToolMode.NAMED, _functions(), "get_time")
    assert named.reply('{"timezone": "U', "length").tool_calls == []


def test_prompts_show_the_tools_natively_or_in_a_system_message(tokenizer):
    messages = [ChatMessage(role="developer", content="Be brief."), ChatMessage(**ASK[0])]
    use = ToolUse(ToolMode.REQUIRED, _functions())
    prompt = chat_prompt(tokenizer, messages, use)  # SmolLM2's template renders no tools
    assert prompt.startswith("<|im_start|>system\nYou can call these functions.")
    assert '"name": "get_weather"' in prompt and "Be brief." in prompt
    assert "get_weather" not in chat_prompt(tokenizer, messages, ToolUse(ToolMode.NONE, _functions()))

    hermes = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    hermes.chat_template = HERMES_TEMPLATE
    called = ChatMessage(role="assistant", tool_calls=[{"id": "c1", "type": "function", "function": {
        "name": "get_time", "arguments": '{"timezone": "UTC"}'}}])
    prompt = chat_prompt(hermes, messages + [called], ToolUse(ToolMode.AUTO, _functions()))
    assert prompt.startswith("<|im_start|>system\n<tools>[{") and "You can call" not in prompt
    assert '<tool_call>{"name": "get_time", "arguments": {"timezone": "UTC"}}</tool_call>' in prompt
