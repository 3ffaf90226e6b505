"""OpenAI's Responses API: the response object and its stream's events (deployments/api/responses_protocol.py has the
request).

The answer is a list of output items: a message of `output_text`, and the function calls the model made (with
tools, chat's parser finds them: deployments/api/tools.py). Its `status` is `completed`, or `incomplete` (with
`incomplete_details.reason` `max_output_tokens`) when the token budget or the context cut it.

A stream sends the API's typed events, each with its `sequence_number`: `response.created`,
`response.in_progress`, the output message and its text part added, a `response.output_text.delta` per engine
event (a few tokens under load, deployments/replica/pacing.py), the text, part and message done, then
`response.completed` or `response.incomplete`. With logprobs asked for, each delta carries its tokens' (a token
whose text the detokenizer still holds goes with the next delta that has text), and the text part all of them.
When the model may call tools its text is held until it finishes, as on chat's streams, since a call is known only
once its text is whole: then each item goes out at once (a message's text in one delta, a call's arguments in one
`response.function_call_arguments.delta`). A failure after the stream began is an `error` event, which ends it.
"""

from __future__ import annotations

import time

from deployments.api.events import TokenEntry, TokenEvent
from deployments.api.openai_render import FINISH_REASONS, logprob_content
from deployments.api.responses_protocol import FunctionToolChoice, ResponsesRequest
from deployments.api.token_texts import TokenTexts
from deployments.api.tools import ToolCall, reply_to


class ResponseRenderer:
    """One request's response object and, on a stream, its events in order (each numbered)."""
    default_max_tokens = None  # the answer may fill the context, up to max_tokens_limit

    def __init__(self, request: ResponsesRequest, texts: TokenTexts):
        self.request = request
        self._texts = texts
        self._logprobs = request.logprobs_wanted() is not None
        self._streamed: list[TokenEntry] = []  # a stream's tokens so far, when their logprobs were asked for
        self._sent = 0  # ... of which a delta carried the first this many
        self.created = int(time.time())
        self._sequence = 0
        self._id = self._message_id = ""
        self._held = request.calls_tools()  # the text goes out whole, once its calls are known
        self._items: list[dict] | None = None  # the finished answer's, made once (each call has its own id)

    def name(self, request_id: str) -> None:
        """The response's id and its message's, from the request's id (OpenAI's resp_ and msg_ prefixes)."""
        self._id, self._message_id = f"resp_{request_id}", f"msg_{request_id}"

    def body(self, last: TokenEvent) -> dict:
        """The finished response: its output items, its status and usage."""
        return self._response(_status(last), self._output(last), last)

    def opening(self) -> list[dict]:
        """A stream's first events: the response created and in progress; unless the text is held, its message and
        text part added."""
        started = self._response("in_progress", [], None)
        events = [self._event("response.created", response=started),
                  self._event("response.in_progress", response=started)]
        return events if self._held else events + self._message_opened(0)

    def delta(self, event: TokenEvent) -> dict | None:
        """The text an engine event adds (None while it is held, or when the detokenizer holds all of it back)."""
        if self._held:
            return None
        if self._logprobs:
            self._streamed += event.entries()
        return self._text_delta(0, event.text) if event.text else None

    def closing(self, last: TokenEvent) -> list[dict]:
        """A stream's last events: each output item done (added first, when the text was held), then the whole
        response."""
        items = self._output(last)
        events = []
        for index, item in enumerate(items):
            if item["type"] == "function_call":
                events += self._call_events(index, item)
            elif self._held:
                text = [self._text_delta(index, _text(item))] if _text(item) else []
                events += self._message_opened(index) + text + self._message_closed(index, item)
            else:
                unsent = [self._text_delta(index, "")] if len(self._streamed) > self._sent else []  # no text added
                events += unsent + self._message_closed(index, item)
        done = "response.completed" if _status(last) == "completed" else "response.incomplete"
        return events + [self._event(done, response=self.body(last))]

    def error(self, message: str, status: int) -> dict:
        """A failure after the stream began: the event that ends it."""
        return self._event("error", code=str(status), message=message, param=None)

    def _output(self, last: TokenEvent) -> list[dict]:
        """The answer's items: its message (when it has text, or made no call), then its calls."""
        if self._items is None:
            reply = reply_to(self.request.tool_use(), last.final.generated_text,
                             FINISH_REASONS[last.final.finish_reason])
            tokens = self._streamed if self.request.stream else last.entries()  # a stream's last event has its own
            logprobs = logprob_content(self._texts, tokens) if self._logprobs else None
            message = [self._message(_status(last), reply.content or "", logprobs)] \
                if reply.content or not reply.tool_calls else []
            self._items = message + [_call_item(call) for call in reply.tool_calls]
        return self._items

    def _message_opened(self, index: int) -> list[dict]:
        return [self._event("response.output_item.added", output_index=index,
                            item={**self._message("in_progress", ""), "content": []}),
                self._event("response.content_part.added", item_id=self._message_id, output_index=index,
                            content_index=0, part=_text_part(""))]

    def _text_delta(self, index: int, text: str) -> dict:
        """A delta of the message's text, with the logprobs of the tokens not yet sent."""
        unsent, self._sent = self._streamed[self._sent:], len(self._streamed)
        return self._event("response.output_text.delta", item_id=self._message_id, output_index=index,
                           content_index=0, delta=text, logprobs=logprob_content(self._texts, unsent))

    def _message_closed(self, index: int, item: dict) -> list[dict]:
        part = item["content"][0]
        return [self._event("response.output_text.done", item_id=self._message_id, output_index=index,
                            content_index=0, text=part["text"], logprobs=part.get("logprobs", [])),
                self._event("response.content_part.done", item_id=self._message_id, output_index=index,
                            content_index=0, part=part),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _call_events(self, index: int, item: dict) -> list[dict]:
        return [self._event("response.output_item.added", output_index=index,
                            item={**item, "arguments": "", "status": "in_progress"}),
                self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                            delta=item["arguments"]),
                self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            name=item["name"], arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _event(self, kind: str, **fields) -> dict:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **fields}

    def _message(self, status: str, text: str, logprobs: list[dict] | None = None) -> dict:
        return {"id": self._message_id, "type": "message", "role": "assistant", "status": status,
                "content": [_text_part(text, logprobs)]}

    def _response(self, status: str, output: list[dict], last: TokenEvent | None) -> dict:
        request = self.request
        choice = request.tool_choice
        return {"id": self._id, "object": "response", "created_at": self.created, "status": status,
                "model": request.model, "output": output, "usage": _usage(last) if last is not None else None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "error": None, "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
                "temperature": request.temperature, "top_p": request.top_p, "top_logprobs": request.top_logprobs,
                "text": {"format": request.text.format.model_dump(by_alias=True, exclude_none=True)},
                "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or []],
                "tool_choice": choice.model_dump() if isinstance(choice, FunctionToolChoice) else choice or (
                    "auto" if request.tools else "none"),
                "parallel_tool_calls": request.parallel_tool_calls is not False, "truncation": "disabled",
                "store": False, "metadata": request.metadata or {}, "previous_response_id": None,
                "reasoning": None, "user": request.user}


def _status(last: TokenEvent) -> str:
    """completed, or incomplete when the answer was cut at max_output_tokens or the context's end."""
    return "incomplete" if last.final.finish_reason == "length" else "completed"


def _text(message: dict) -> str:
    return message["content"][0]["text"]


def _text_part(text: str, logprobs: list[dict] | None = None) -> dict:
    """An output_text part; with its tokens' logprobs when they were asked for."""
    part = {"type": "output_text", "text": text, "annotations": []}
    return part if logprobs is None else {**part, "logprobs": logprobs}


def _call_item(call: ToolCall) -> dict:
    return {"id": "fc_" + call.id.removeprefix("call_"), "type": "function_call", "call_id": call.id,
            "name": call.name, "arguments": call.arguments, "status": "completed"}


def _usage(last: TokenEvent) -> dict:
    """The Responses API's usage: the input's tokens read from the prefix cache among them."""
    prompt, output = last.prompt_tokens, last.final.generated_tokens
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": last.final.cached_tokens},
            "output_tokens": output, "total_tokens": prompt + output, "output_tokens_details": {"reasoning_tokens": 0}}
