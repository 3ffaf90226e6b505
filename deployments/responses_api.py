"""OpenAI's Responses API (POST /v1/responses), stateless: its request schema, its response and its stream's events.

A response here is one chat turn. `input` (a string, or messages) after `instructions` (a system message) is rendered
by the model's chat template as /v1/chat/completions renders messages, and the answer is one output message of
`output_text`. Messages an earlier response returned (`response.output`) may be given back in `input`, so a client
keeps a conversation itself. Nothing is stored, so what needs a stored response is refused by name
(`store: true`, `previous_response_id`, `background`), as are tools, reasoning, `include` and every other field
this module does not declare (tools and logprobs: /v1/chat/completions).

A stream sends the API's typed events, each with its `sequence_number`: `response.created`, `response.in_progress`,
the output message and its text part added, a `response.output_text.delta` per engine event (a few tokens under
load, deployments/pacing.py), the text, part and message done, then `response.completed`, or
`response.incomplete` when `max_output_tokens` (or the context) cut the answer. A failure after the stream began is
an `error` event, which ends it.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from deployments.chat import ChatMessage
from deployments.events import TokenEvent
from deployments.openai_protocol import JSONSchemaSpec, OpenAIBookkeeping, OpenAIResponseFormat, RequestId
from deployments.strict import OpenAIModel
from engine.sampling import PRIORITY_MAX, PRIORITY_MIN, ResponseFormat, SamplingParams


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
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def chat_message(self) -> ChatMessage:
        parts = [self.content] if isinstance(self.content, str) else [part.text for part in self.content]
        return ChatMessage(role=self.role, content="\n".join(parts))


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


class ResponsesRequest(OpenAIBookkeeping):
    truncation: Literal["disabled"] | None = None  # a prompt past the context is refused, never cut

    model: str = Field(min_length=1)
    input: str | list[InputMessage] = Field(min_length=1)
    instructions: str | None = None  # a system message before the input
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stream: bool = False
    text: TextConfig = TextConfig()
    priority: int = Field(0, ge=PRIORITY_MIN, le=PRIORITY_MAX)  # vLLM's: lower is admitted first
    request_id: RequestId | None = None  # vLLM's: names the response (its id); else the X-Request-Id header does

    @model_validator(mode="before")
    @classmethod
    def _messages_only(cls, data):
        """An input item that is not a message (a function call's output, a reasoning item) is refused by its type,
        not by every field it has that a message has not."""
        items = data.get("input") if isinstance(data, dict) else None
        for i, item in enumerate(items if isinstance(items, list) else []):
            kind = item.get("type", "message") if isinstance(item, dict) else "message"
            if kind != "message":
                raise ValueError(f"input[{i}]: items of type {kind!r} are not supported by this server (messages are)")
        return data

    @property
    def n(self) -> int:
        """One output message a response (the routes' choices count)."""
        return 1

    def messages(self) -> list[ChatMessage]:
        given = [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        system = [ChatMessage(role="system", content=self.instructions)] if self.instructions is not None else []
        return system + [message.chat_message() for message in given]

    def to_sampling_params(self, default_max_tokens: int | None, choice: int = 0) -> SamplingParams:
        """The engine's parameters; without max_output_tokens the answer may fill the context, as chat's."""
        return SamplingParams(max_tokens=self.max_output_tokens or default_max_tokens, temperature=self.temperature,
                              top_p=self.top_p, response_format=self.text.format.to_engine())


class ResponseRenderer:
    """One request's response object and, on a stream, its events in order (each numbered)."""
    default_max_tokens = None  # the answer may fill the context, up to max_tokens_limit

    def __init__(self, request: ResponsesRequest):
        self.request = request
        self.created = int(time.time())
        self._sequence = 0
        self._id = self._message_id = ""

    def name(self, request_id: str) -> None:
        """The response's id and its message's, from the request's id (OpenAI's resp_ and msg_ prefixes)."""
        self._id, self._message_id = f"resp_{request_id}", f"msg_{request_id}"

    def body(self, last: TokenEvent) -> dict:
        """The finished response: its one message, its status and usage."""
        status = _status(last)
        return self._response(status, [self._message(status, last.final.generated_text)], last)

    def opening(self) -> list[dict]:
        """A stream's first events: the response created and in progress, its message and text part added."""
        started = self._response("in_progress", [], None)
        return [self._event("response.created", response=started),
                self._event("response.in_progress", response=started),
                self._event("response.output_item.added", output_index=0, item=self._message("in_progress", None)),
                self._event("response.content_part.added", item_id=self._message_id, output_index=0,
                            content_index=0, part=_text_part(""))]

    def delta(self, event: TokenEvent) -> dict | None:
        """The text an engine event adds (None when the detokenizer holds all of it back)."""
        if not event.text:
            return None
        return self._event("response.output_text.delta", item_id=self._message_id, output_index=0,
                           content_index=0, delta=event.text, logprobs=[])

    def closing(self, last: TokenEvent) -> list[dict]:
        """A stream's last events: the text, part and message done, then the whole response."""
        text, status = last.final.generated_text, _status(last)
        done = "response.completed" if status == "completed" else "response.incomplete"
        return [self._event("response.output_text.done", item_id=self._message_id, output_index=0,
                            content_index=0, text=text, logprobs=[]),
                self._event("response.content_part.done", item_id=self._message_id, output_index=0,
                            content_index=0, part=_text_part(text)),
                self._event("response.output_item.done", output_index=0, item=self._message(status, text)),
                self._event(done, response=self.body(last))]

    def error(self, message: str, status: int) -> dict:
        """A failure after the stream began: the event that ends it."""
        return self._event("error", code=str(status), message=message, param=None)

    def _event(self, kind: str, **fields) -> dict:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **fields}

    def _message(self, status: str, text: str | None) -> dict:
        return {"id": self._message_id, "type": "message", "role": "assistant", "status": status,
                "content": [] if text is None else [_text_part(text)]}

    def _response(self, status: str, output: list[dict], last: TokenEvent | None) -> dict:
        request = self.request
        return {"id": self._id, "object": "response", "created_at": self.created, "status": status,
                "model": request.model, "output": output, "usage": _usage(last) if last is not None else None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "error": None, "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
                "temperature": request.temperature, "top_p": request.top_p,
                "text": {"format": request.text.format.model_dump(by_alias=True, exclude_none=True)},
                "tools": [], "tool_choice": "none", "parallel_tool_calls": False, "truncation": "disabled",
                "store": False, "metadata": request.metadata or {}, "previous_response_id": None,
                "reasoning": None, "user": request.user}


def _status(last: TokenEvent) -> str:
    """completed, or incomplete when the answer was cut at max_output_tokens or the context's end."""
    return "incomplete" if last.final.finish_reason == "length" else "completed"


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


def _usage(last: TokenEvent) -> dict:
    """The Responses API's usage (without input_tokens_details: a request's prefix-cache hits are not counted)."""
    prompt, output = last.prompt_tokens, last.final.generated_tokens
    return {"input_tokens": prompt, "output_tokens": output, "total_tokens": prompt + output,
            "output_tokens_details": {"reasoning_tokens": 0}}
