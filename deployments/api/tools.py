"""Tool calling on chat completions (and on the Responses API, whose function tools become these): `tools` and
`tool_choice`, and the model's calls parsed into `tool_calls`.

tool_choice "required" and a named function constrain the output with a JSON schema through the grammar engine
(engine/grammar.py), so they work with any model, as vLLM's do: "required" makes the model write a JSON array
of calls, each {"name": one of the tools, "parameters": valid for that tool's schema}; a named function makes it
write that function's arguments. The grammar tightens the tools' schemas as it tightens any schema (closed
objects, bounded numbers), and a "required" answer holds at most MAX_PARALLEL_CALLS calls (one when
parallel_tool_calls is false), so a small model cannot list calls until its token budget runs out.

"auto" lets the model decide whether to call, so the model must have been taught a call format: it needs a chat
template that renders `tools` and writes calls as Hermes' <tool_call>{"name": ..., "arguments": ...}</tool_call>
(Qwen2.5, Hermes, SmolLM3 and others); a call in it is parsed out of the text, anything else stays content. Other
models get "auto" refused by name, as vLLM refuses it without a tool parser. SmolLM2's template renders no tools:
for "required" and a named function the tools are described to it in a system message instead.

An answer the grammar could not finish (finish_reason "length") is returned as content, not as a broken call.
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import Field

from deployments.api.strict import OpenAIModel
from engine.sampling import ResponseFormat

MAX_TOOLS = 128  # as OpenAI
MAX_PARALLEL_CALLS = 16  # calls in one "required" answer
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class FunctionDefinition(OpenAIModel):
    name: FunctionName
    description: str | None = None
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None  # calls made through the grammar always follow the schema: strict or not


class Tool(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionChoice(OpenAIModel):
    name: FunctionName


class NamedToolChoice(OpenAIModel):
    """tool_choice {"type": "function", "function": {"name": ...}}: call this function."""
    type: Literal["function"]
    function: FunctionChoice


class ToolMode(enum.Enum):
    NONE = "none"  # no calls: the tools are not shown to the model
    AUTO = "auto"  # the model decides (a template with tools and Hermes calls)
    REQUIRED = "required"  # one or more calls, through the grammar
    NAMED = "named"  # one call of the named function, through the grammar


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object, as OpenAI's function.arguments
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict:
        """The call as a message's tool_calls entry; with an index, as a stream delta's."""
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class Reply:
    """A finished choice's assistant message: its text content and the calls parsed out of it."""
    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str  # OpenAI's: "tool_calls" when "required" or "auto" calls were made

    def message(self) -> dict:
        message = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in self.tool_calls]
        return message

    def delta(self) -> dict:
        """The message as one stream delta (the calls complete, each with its index)."""
        delta = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            delta["tool_calls"] = [call.to_openai(i) for i, call in enumerate(self.tool_calls)]
        return delta


def plain_reply(text: str, finish_reason: str) -> Reply:
    return Reply(text, [], finish_reason)


@dataclass(frozen=True)
class ToolUse:
    """The tools of one chat request and how the server uses them."""
    mode: ToolMode
    functions: list[FunctionDefinition]
    name: str | None = None  # the function of ToolMode.NAMED
    parallel: bool = True

    def response_format(self) -> ResponseFormat | None:
        """The grammar of "required" or a named function; None for "auto" and "none"."""
        if self.mode is ToolMode.NAMED:
            return ResponseFormat(schema=self._function(self.name).parameters)
        if self.mode is ToolMode.REQUIRED:
            calls = [{"type": "object", "properties": {"name": {"const": f.name}, "parameters": f.parameters},
                      "required": ["name", "parameters"]} for f in self.functions]
            return ResponseFormat(schema={"type": "array", "items": {"anyOf": calls}, "minItems": 1,
                                          "maxItems": MAX_PARALLEL_CALLS if self.parallel else 1})
        return None

    def reply(self, text: str, finish_reason: str) -> Reply:
        """The choice's message (finish_reason in OpenAI's words); text that holds no complete call is content."""
        if finish_reason == "length" or self.mode is ToolMode.NONE:
            return plain_reply(text, finish_reason)
        if self.mode is ToolMode.NAMED:  # OpenAI finishes a forced function with "stop"
            return Reply(None, [ToolCall(self.name, text)], finish_reason) if is_json_object(text) else \
                plain_reply(text, finish_reason)
        calls = self._required_calls(text) if self.mode is ToolMode.REQUIRED else self._hermes_calls(text)
        if not calls:
            return plain_reply(text, finish_reason)
        content = HERMES_CALL.split(text)[0].strip() if self.mode is ToolMode.AUTO else ""
        return Reply(content or None, calls, "tool_calls")

    def system_prompt(self) -> str:
        """What a model whose template renders no tools is told (the grammar makes it answer in this shape)."""
        if self.mode is ToolMode.NAMED:
            schema = json.dumps(self._function(self.name).parameters)
            return f"Call the function {self.name}. Answer with its arguments as a JSON object for: {schema}"
        tools = json.dumps([f.model_dump(exclude_none=True) for f in self.functions])
        return ('You can call these functions. Answer with a JSON list of calls, each {"name": ..., '
                f'"parameters": {{...}}}}.\nFunctions: {tools}')

    def template_tools(self) -> list[dict]:
        """The tools as a chat template that renders tools takes them."""
        return [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in self.functions]

    def _function(self, name: str) -> FunctionDefinition:
        return next(f for f in self.functions if f.name == name)

    def _required_calls(self, text: str) -> list[ToolCall]:
        """The calls of a "required" answer; none when a stop string cut it short."""
        try:
            calls = json.loads(text)
        except ValueError:
            return []
        names = {f.name for f in self.functions}
        if not isinstance(calls, list) or not all(isinstance(c, dict) and c.get("name") in names
                                                  and isinstance(c.get("parameters"), dict) for c in calls):
            return []
        return [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in calls]

    def _hermes_calls(self, text: str) -> list[ToolCall]:
        """Every <tool_call> of the text, or none when one is not a call of a given function."""
        names = {f.name for f in self.functions}
        calls = []
        for body in HERMES_CALL.findall(text):
            try:
                call = json.loads(body)
            except ValueError:
                return []
            arguments = call.get("arguments") if isinstance(call, dict) else None
            if isinstance(arguments, str) and is_json_object(arguments):
                arguments = json.loads(arguments)
            if call.get("name") not in names or not isinstance(arguments, dict):
                return []
            calls.append(ToolCall(call["name"], json.dumps(arguments, ensure_ascii=False)))
        return calls


def reply_to(use: ToolUse | None, text: str, finish_reason: str) -> Reply:
    """A finished answer's message (finish_reason in OpenAI's words): its calls parsed out when the request has
    tools, else its text as content."""
    return use.reply(text, finish_reason) if use is not None else plain_reply(text, finish_reason)


def may_call(use: ToolUse | None) -> bool:
    """Whether a request's model may answer with calls (tools given and tool_choice not "none"); such an answer's
    text is held on a stream until its calls are known."""
    return use is not None and use.mode is not ToolMode.NONE


def is_json_object(text: str) -> bool:
    """Whether text is JSON of an object (what a function call's arguments must be)."""
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def tool_use(tools: list[Tool] | None, choice: str | NamedToolChoice | None,
             parallel: bool | None) -> ToolUse | None:
    """A request's tool use; ValueError for a tool_choice its tools do not allow. tool_choice defaults to "auto"
    when tools are given, as OpenAI's."""
    if not tools:
        if choice not in (None, "none"):
            raise ValueError("tool_choice needs tools")
        return None
    functions = [t.function for t in tools]
    names = [f.name for f in functions]
    if len(set(names)) < len(names):
        raise ValueError("tools must have distinct function names")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise ValueError(f"tool_choice names function {choice.function.name!r}, which is not among the tools "
                             f"({', '.join(names)})")
        return ToolUse(ToolMode.NAMED, functions, choice.function.name)
    return ToolUse(ToolMode(choice or "auto"), functions, parallel=parallel is not False)


def check_template(use: ToolUse | None, template: str | None) -> None:
    """ValueError for "auto" with a chat template that does not render tools and Hermes calls."""
    if use is None or use.mode is not ToolMode.AUTO:
        return
    if not template or "tools" not in template or "<tool_call>" not in template:
        raise ValueError('tool_choice "auto" needs a model whose chat template renders tools and writes '
                         "<tool_call> calls (Hermes' format); this model's does not: use tool_choice "
                         '"required" or a named function')


def renders_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template
