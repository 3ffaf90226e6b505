"""Chat messages and the prompt they make through the model's chat template.

Messages take OpenAI's shapes: content as a string or a list of text parts (joined with newlines, as vLLM does;
image and audio parts are refused: the models served here read text), "developer" as the newer name of
"system", an assistant message's tool_calls and the "tool" messages that answer them. A template that renders
tools gets them as transformers passes them, each earlier call's arguments as an object. A template that does not
(SmolLM2's) gets the tools described in a system message (deployments/api/tools.py), and an earlier call written as
the JSON the grammar made the model write, so the model sees its own calls as it made them.

vLLM's template controls come too: `add_generation_prompt` (false: the prompt ends after the last message),
`continue_final_message` (the model continues the last message, an assistant's prefill, instead of starting a new
one) and `chat_template_kwargs` (variables the template reads, such as Qwen3's `enable_thinking`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from jinja2 import TemplateError
from pydantic import Field, model_validator

from deployments.api.strict import OpenAIModel
from deployments.api.tools import FunctionName, ToolMode, ToolUse, check_template, is_json_object, renders_tools

# the arguments chat_prompt passes itself: chat_template_kwargs may not set them
TEMPLATE_ARGUMENTS = frozenset({"conversation", "messages", "tools", "documents", "add_generation_prompt",
                                "continue_final_message", "tokenize", "return_dict", "chat_template"})
MAX_TEMPLATE_KWARGS = 32


@dataclass(frozen=True)
class TemplateOptions:
    """How the chat template ends the prompt, and the extra variables it reads."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    variables: dict[str, Any] = field(default_factory=dict)


class TemplateControls(OpenAIModel):
    """vLLM's chat template fields, in the chat route's request and the chat form of /tokenize."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict, max_length=MAX_TEMPLATE_KWARGS)

    @model_validator(mode="after")
    def _consistent(self):
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("continue_final_message continues the last message; it needs add_generation_prompt: "
                             "false")
        taken = sorted(TEMPLATE_ARGUMENTS & set(self.chat_template_kwargs))
        if taken:
            raise ValueError(f"chat_template_kwargs cannot set {', '.join(taken)}: the request's own fields do")
        return self

    def template_options(self) -> TemplateOptions:
        return TemplateOptions(self.add_generation_prompt, self.continue_final_message, self.chat_template_kwargs)


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class FunctionCall(OpenAIModel):
    name: FunctionName
    arguments: str  # JSON text of an object


class MessageToolCall(OpenAIModel):
    """A call an assistant message made, given back in the conversation."""
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=256)  # passed to the template, which may show it
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = Field(None, min_length=1, max_length=256)

    @model_validator(mode="after")
    def _shape(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls are made by assistant messages, not {self.role!r} ones")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message needs the tool_call_id it answers, and only a tool message has one")
        if self.content is None and not self.tool_calls:
            raise ValueError(f"a {self.role} message needs content")
        for call in self.tool_calls or []:
            if not is_json_object(call.function.arguments):
                raise ValueError(f"tool call {call.id!r}: arguments must be a JSON object, as text")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""

    def template_message(self, renders_tools: bool) -> dict:
        """The message as the chat template takes it."""
        role = "system" if self.role == "developer" else self.role
        message = {"role": role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls and renders_tools:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in self.tool_calls]
        elif self.tool_calls:  # as a "required" answer: the shape the grammar makes the model write
            calls = [{"name": c.function.name, "parameters": json.loads(c.function.arguments)}
                     for c in self.tool_calls]
            message["content"] = "\n".join(filter(None, [self.text(), json.dumps(calls)]))
        return message


def chat_prompt(tokenizer, messages: list[ChatMessage], tools: ToolUse | None,
                options: TemplateOptions = TemplateOptions()) -> str:
    """The prompt of a conversation, ending where the assistant's answer starts (or as `options` say); ValueError
    when the template cannot render it, or cannot take the request's tool_choice."""
    template = tokenizer.chat_template
    check_template(tools, template)
    native = renders_tools(template)
    rendered = [m.template_message(native) for m in messages]
    extra = {}
    if tools is not None and tools.mode is not ToolMode.NONE:
        if native:
            extra["tools"] = tools.template_tools()
        else:
            rendered = _with_system(rendered, tools.system_prompt())
    try:
        return tokenizer.apply_chat_template(
            rendered, tokenize=False, add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message, **options.variables, **extra)
    except TemplateError as e:
        raise ValueError(f"the model's chat template cannot render these messages: {e}") from None


def _with_system(messages: list[dict], text: str) -> list[dict]:
    """The messages with `text` leading the system message (a new one when there is none)."""
    if messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{text}\n\n{messages[0]['content']}"}] + messages[1:]
    return [{"role": "system", "content": text}] + messages
