"""The request schema of OpenAI's Responses API (POST /v1/responses), stateless; deployments/api/responses_render.py
renders the response and its stream.

A response here is one chat turn, made with chat's machinery: `instructions` (a system message) and `input` (a
string, or items) become chat messages that the model's chat template renders as /v1/chat/completions renders
them, and function tools become chat's tools (deployments/api/tools.py: "required" and a named function through the
grammar with any model, "auto" with a template that renders tools and writes Hermes calls). The input items are
messages and, given back from earlier responses, their output messages, function calls (an assistant message's
tool_calls) and the calls' outputs (tool messages), so a client keeps a conversation itself. Nothing is stored,
so what needs a stored response is refused by name (`store: true`, `previous_response_id`, `background`), as are
reasoning, other item and tool types and every field not declared here. Of `include`'s values only the output
text's logprobs are made (`message.output_text.logprobs`, with `top_logprobs` alternatives a token); the others
name what this server has not (search results, images, encrypted reasoning) and are refused by name.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Discriminator, Field, PrivateAttr, Tag, ValidationError, model_validator

from deployments.api.chat import ChatMessage, FunctionCall, MessageToolCall
from deployments.api.openai_protocol import JSONSchemaSpec, OpenAIBookkeeping, OpenAIResponseFormat, RequestId
from deployments.api.strict import OpenAIModel
from deployments.api.tools import (
    MAX_TOOLS,
    FunctionChoice,
    FunctionDefinition,
    FunctionName,
    NamedToolChoice,
    Tool,
    ToolUse,
    may_call,
    tool_use,
)
from engine.sampling import (
    LOGPROBS,
    MAX_TOKENS,
    PRIORITY,
    PROBABILITY_MASS,
    TEMPERATURE,
    ResponseFormat,
    SamplingParams,
)

ITEM_TYPES = ("message", "function_call", "function_call_output")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
CallId = Annotated[str, Field(min_length=1, max_length=256)]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class InputPart(OpenAIModel):
    """A message's text: input_text, or output_text in an assistant message given back from an earlier response
    (with the annotations and logprobs that response carried, which do not change the prompt)."""
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list | None = None
    logprobs: list | None = None


class InputMessage(OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputPart]
    id: str | None = Field(None, max_length=256)  # an earlier response's output message, given back
    status: ItemStatus | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)


class FunctionCallItem(OpenAIModel):
    """A call an earlier response made, given back."""
    type: Literal["function_call"]
    call_id: CallId
    name: FunctionName
    arguments: str  # JSON text of an object
    id: str | None = Field(None, max_length=256)
    status: ItemStatus | None = None

    def tool_call(self) -> MessageToolCall:
        return MessageToolCall(id=self.call_id, type="function",
                               function=FunctionCall(name=self.name, arguments=self.arguments))


class FunctionCallOutputItem(OpenAIModel):
    """What the client's function returned for a call: a tool message."""
    type: Literal["function_call_output"]
    call_id: CallId
    output: str
    id: str | None = Field(None, max_length=256)
    status: ItemStatus | None = None


def _item_type(item) -> str:
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")


InputItem = Annotated[Annotated[InputMessage, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")], Discriminator(_item_type)]


class TextFormat(OpenAIModel):
    """text.format: plain text, any JSON object, or JSON for a schema (chat's response_format, flattened)."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    json_schema: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None  # the output always follows the schema: strict or not

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('text.format of type "json_schema" needs a "schema"')
        return self

    def to_engine(self) -> ResponseFormat | None:
        """As chat's response_format, whose json_schema object holds what this format has beside its type."""
        spec = JSONSchemaSpec(schema=self.json_schema) if self.type == "json_schema" else None
        return OpenAIResponseFormat(type=self.type, json_schema=spec).to_engine()


class TextConfig(OpenAIModel):
    format: TextFormat = TextFormat(type="text")


class FunctionTool(OpenAIModel):
    """A function tool: chat's function, flattened beside its type."""
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None  # calls made through the grammar always follow the schema: strict or not

    def chat_tool(self) -> Tool:
        definition = FunctionDefinition(name=self.name, description=self.description, parameters=self.parameters)
        return Tool(type="function", function=definition)


class FunctionToolChoice(OpenAIModel):
    """tool_choice {"type": "function", "name": ...}: call this function."""
    type: Literal["function"]
    name: FunctionName


class ResponsesRequest(OpenAIBookkeeping):
    truncation: Literal["disabled"] | None = None  # a prompt past the context is refused, never cut

    model: str = Field(min_length=1)
    input: str | Annotated[list[InputItem], Field(min_length=1)] = Field(min_length=1)
    instructions: str | None = None  # a system message before the input
    max_output_tokens: int | None = Field(None, **MAX_TOKENS.field())
    temperature: float = Field(1.0, **TEMPERATURE.field(), le=2)  # OpenAI's ceiling
    top_p: float = Field(1.0, **PROBABILITY_MASS.field())
    stream: bool = False
    text: TextConfig = TextConfig()
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    include: list[str] | None = Field(None, max_length=8)
    top_logprobs: int | None = Field(None, **LOGPROBS.field())  # alternatives a token, with the output text's logprobs
    priority: int = Field(0, **PRIORITY.field())  # vLLM's: lower is admitted first
    request_id: RequestId | None = None  # vLLM's: names the response (its id); else the X-Request-Id header does
    # Derived once, when the request is validated
    _tool_use: ToolUse | None = PrivateAttr(None)
    _messages: list[ChatMessage] = PrivateAttr(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _known_items(cls, data):
        """An input item of another type (a reasoning item, a web search call) is refused by its type, not by every
        field it has that a message has not."""
        items = data.get("input") if isinstance(data, dict) else None
        for i, item in enumerate(items if isinstance(items, list) else []):
            if _item_type(item) not in ITEM_TYPES:
                raise ValueError(f"input[{i}]: items of type {_item_type(item)!r} are not supported by this server "
                                 f"({', '.join(ITEM_TYPES)} are)")
        return data

    @model_validator(mode="after")
    def _tools_fit(self):
        # ValueError for a tool_choice the tools do not allow
        choice = self.tool_choice
        named = NamedToolChoice(type="function", function=FunctionChoice(name=choice.name)) \
            if isinstance(choice, FunctionToolChoice) else choice
        use = self._tool_use = tool_use([t.chat_tool() for t in self.tools or []], named, self.parallel_tool_calls)
        if use is not None and use.response_format() is not None and self.text.format.type != "text":
            label = f"function {choice.name!r}" if isinstance(choice, FunctionToolChoice) else repr(choice)
            raise ValueError(f"tool_choice {label} sets the output's grammar: text.format cannot be given with it")
        return self

    @model_validator(mode="after")
    def _logprobs_of_text(self):
        for value in self.include or []:
            if value != LOGPROBS_INCLUDE:
                raise ValueError(f"include {value!r} is not supported by this server (only {LOGPROBS_INCLUDE!r} is)")
        if self.logprobs_wanted() is not None and self.calls_tools():
            raise ValueError("logprobs (include message.output_text.logprobs, top_logprobs) are not supported with "
                             "tools the model may call: its text is parsed into calls")
        return self

    def logprobs_wanted(self) -> int | None:
        """None: no logprobs, and none computed; k: the output text's tokens' logprobs with k alternatives each,
        asked for by include's message.output_text.logprobs or a top_logprobs above 0 (never ignored)."""
        if LOGPROBS_INCLUDE in (self.include or []) or self.top_logprobs:
            return self.top_logprobs or 0
        return None

    @property
    def n(self) -> int:
        """One answer a response (the routes' choices count)."""
        return 1

    def tool_use(self) -> ToolUse | None:
        return self._tool_use

    def calls_tools(self) -> bool:
        return may_call(self._tool_use)

    @model_validator(mode="after")
    def _conversation(self):
        # a call whose arguments are not a JSON object is refused here, as a chat message's would be
        try:
            self._messages = self._chat_messages()
        except ValidationError as exc:
            raise ValueError("; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())) from None
        return self

    def messages(self) -> list[ChatMessage]:
        return self._messages

    def _chat_messages(self) -> list[ChatMessage]:
        """The conversation as chat messages: a function call joins the assistant message before it (an output
        message, or the calls before it), and a call's output is a tool message."""
        system = [ChatMessage(role="system", content=self.instructions)] if self.instructions is not None else []
        items = [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        messages: list[ChatMessage] = []
        for item in items:
            if isinstance(item, InputMessage):
                messages.append(ChatMessage(role=item.role, content=item.text()))
            elif isinstance(item, FunctionCallOutputItem):
                messages.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=item.output))
            elif messages and messages[-1].role == "assistant":
                last = messages.pop()
                messages.append(ChatMessage(role="assistant", content=last.content,
                                            tool_calls=[*(last.tool_calls or []), item.tool_call()]))
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=[item.tool_call()]))
        return system + messages

    def engine_response_format(self) -> ResponseFormat | None:
        calls = self._tool_use.response_format() if self._tool_use is not None else None
        return calls or self.text.format.to_engine()

    def max_tokens_name(self) -> str:
        """The parameter a refused token budget is named by."""
        return "max_output_tokens"

    def to_sampling_params(self, default_max_tokens: int | None, choice: int = 0) -> SamplingParams:
        """The engine's parameters; without max_output_tokens the answer may fill the context, as chat's."""
        return SamplingParams(max_tokens=self.max_output_tokens or default_max_tokens, temperature=self.temperature,
                              top_p=self.top_p, response_format=self.engine_response_format(),
                              logprobs=self.logprobs_wanted())
