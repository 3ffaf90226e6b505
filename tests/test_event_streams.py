"""The routes' streams when the replica serving a forwarded request dies after its first events
(deployments/api/events.py PeerLost): an error event in the API's own shape ends the response, which then
closes as a finished one would, and the request's other choices are stopped. A peer that dies before its first
event costs no error at all: tests/two_nodes/test_faults.py kills real Serve replicas for both cases.
"""

from __future__ import annotations

import asyncio
import json
import threading

import openai
import pytest

from deployments.api import openai_protocol as oai
from deployments.api.events import PeerLost, TokenEvent
from deployments.api.openai_render import CompletionRenderer
from deployments.api.responses_protocol import ResponsesRequest
from deployments.api.responses_render import ResponseRenderer
from deployments.api.tgi_protocol import GenerateRequest
from deployments.api.tgi_render import TgiRenderer
from deployments.routes.choice_streams import Choice, openai_sse, response_events
from deployments.routes.engine_client import Served
from engine import EngineConfig


class _PeerDiesAfter:
    """A forwarded request's events whose peer dies once these have come back (or that fail with `error`)."""

    def __init__(self, events: list[TokenEvent], every_s: float = 0.0, error: Exception | None = None):
        self._events = iter(events)
        self._every_s = every_s  # how long each event takes to come
        self._error = error or PeerLost()
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> TokenEvent:
        await asyncio.sleep(self._every_s)
        event = next(self._events, None)
        if event is None:
            raise self._error
        return event

    def cancel(self) -> None:
        self.cancelled = True


@pytest.fixture(scope="module")
def routes(tiny_llama_path, tokenizer) -> Served:
    """What the routes keep beside an engine: these tests feed the streams themselves, so no engine is asked."""
    return Served(None, EngineConfig.from_overrides(str(tiny_llama_path)), tokenizer)


async def _lines(stream) -> list[str]:
    return [chunk async for chunk in stream]


def _event(tokenizer, text: str) -> TokenEvent:
    [token] = tokenizer(text, add_special_tokens=False).input_ids
    return TokenEvent([token], [text])


def test_a_tgi_stream_ends_with_an_error_event(routes, tokenizer):
    events = _PeerDiesAfter([_event(tokenizer, " world")])
    render = TgiRenderer(GenerateRequest(inputs="Hello"), routes.tgi)
    lines = asyncio.run(_lines(render.sse(_event(tokenizer, "Hello"), events)))
    payloads = [json.loads(chunk.removeprefix("data:")) for chunk in "".join(lines).split("\n\n") if chunk]
    assert [p["token"]["text"] for p in payloads[:2]] == ["Hello", " world"]
    assert payloads[2] == {"error": "the replica serving this request stopped before it finished; retry the "
                                    "request", "error_type": "server_error"}
    assert len(payloads) == 3


@pytest.mark.parametrize("n", [1, 2])
def test_an_openai_stream_ends_with_an_error_event_and_stops_the_other_choices(routes, tokenizer, n):
    request = oai.CompletionRequest(model=routes.model_name, prompt="Hello", stream=True, max_tokens=8, n=n)
    dying = _PeerDiesAfter([_event(tokenizer, " world")])
    others = [_PeerDiesAfter([_event(tokenizer, " there")] * 50, every_s=0.01) for _ in range(n - 1)]
    firsts = [_event(tokenizer, "Hello")] * n
    lines = asyncio.run(_lines(openai_sse(request, CompletionRenderer(request, routes.token_texts), "cmpl-test",
                                          firsts, [dying] + others)))
    assert lines[-1] == "data: [DONE]\n\n"
    error = json.loads(lines[-2].removeprefix("data: "))
    assert error == {"error": {"message": "the replica serving this request stopped before it finished; retry "
                                          "the request", "type": "server_error", "param": None, "code": None}}
    texts = [json.loads(line.removeprefix("data: "))["choices"][0]["text"] for line in lines[:-2]]
    assert texts.count(" there") < 10  # the other choice was not waited for
    assert dying.cancelled and all(other.cancelled for other in others)
    with pytest.raises(openai.APIError, match="stopped before it finished"):
        _read_with_openai(lines)


def test_an_engine_that_stops_mid_stream_ends_it_with_a_503_event(routes, tokenizer):
    """The engine of the replica serving a stream stops after its first tokens: each API's stream ends with an
    error event naming 503 (a retry lands on a live replica), not a connection cut off without one."""
    from engine import EngineDeadError

    stopped = EngineDeadError("engine loop died: boom")
    render = TgiRenderer(GenerateRequest(inputs="Hello"), routes.tgi)
    tgi = asyncio.run(_lines(render.sse(_event(tokenizer, "Hello"), _PeerDiesAfter([], error=stopped))))
    assert json.loads(tgi[-1].removeprefix("data:")) == {"error": "engine loop died: boom", "error_type": "overloaded"}
    request = oai.CompletionRequest(model=routes.model_name, prompt="Hello", stream=True, max_tokens=8)
    lines = asyncio.run(_lines(openai_sse(request, CompletionRenderer(request, routes.token_texts), "cmpl-test",
                                          [_event(tokenizer, "Hello")], [_PeerDiesAfter([], error=stopped)])))
    assert lines[-1] == "data: [DONE]\n\n"
    assert json.loads(lines[-2].removeprefix("data: "))["error"]["type"] == "overloaded_error"


def test_a_responses_stream_ends_with_an_error_event(routes, tokenizer):
    """The Responses API's stream: its opening events, the text so far, then an `error` event that ends it (no
    completed response, no [DONE]), and the request behind it stopped."""
    request = ResponsesRequest(model=routes.model_name, input="Hello", stream=True)
    render = ResponseRenderer(request, routes.token_texts)
    render.name("test")
    dying = _PeerDiesAfter([_event(tokenizer, " world")])
    lines = asyncio.run(_lines(response_events(render, Choice(_event(tokenizer, "Hello"), dying))))
    events = [json.loads(line.split("\ndata: ", 1)[1]) for line in lines]
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.output_item.added",
                                           "response.content_part.added", "response.output_text.delta",
                                           "response.output_text.delta", "error"]
    assert all(line.startswith(f"event: {e['type']}\n") for line, e in zip(lines, events))
    assert [e["sequence_number"] for e in events] == list(range(7))
    assert events[-1]["code"] == "500" and "stopped before it finished" in events[-1]["message"]
    assert dying.cancelled


def _read_with_openai(lines: list[str]) -> list:
    """The stream as OpenAI's own client reads a response's body."""
    import httpx2
    from openai.types import Completion

    url = "http://127.0.0.1:9/v1"
    response = httpx2.Response(200, content="".join(lines).encode(), headers={"content-type": "text/event-stream"},
                               request=httpx2.Request("POST", f"{url}/completions"))
    return list(openai.Stream(cast_to=Completion, response=response, client=openai.OpenAI(api_key="-", base_url=url)))


def test_a_stopped_engine_is_a_503_with_retry_after_in_each_api_shape(routes):
    """A replica whose engine loop ended answers its requests with 503 and Retry-After (Serve replaces it after
    failed health checks), each in its API's error shape, not a bare 500 (tests/test_in_process.py: /health)."""
    from starlette.requests import Request

    from deployments.routes.error_handlers import _engine_stopped
    from engine import EngineDeadError

    def request(path: str) -> Request:
        return Request({"type": "http", "method": "POST", "path": path, "headers": [], "query_string": b""})

    for path, message in (("/v1/completions", lambda body: body["error"]["message"]),
                          ("/generate", lambda body: body["error"])):
        answer = asyncio.run(_engine_stopped(request(path), EngineDeadError("engine loop died: boom")))
        assert answer.status_code == 503 and int(answer.headers["retry-after"]) >= 1
        assert "engine stopped" in message(json.loads(answer.body)) and "boom" in message(json.loads(answer.body))


def _served_here(events: list[TokenEvent]):
    """A forward's serve_here: these events, from a request this replica serves itself."""
    from deployments.replica.event_streams import LocalEvents

    async def here():
        for event in events:
            yield event

    async def abort():
        pass

    return lambda: LocalEvents(here(), abort)


@pytest.mark.parametrize("error", ["returned", "peer died"])
def test_a_forwarded_request_back_before_its_first_event_is_served_here_from_the_start(tokenizer, error):
    """Returned to its sender, or its peer dead, before any event: the events are this replica's, from the start."""
    from ray.exceptions import RayActorError

    from deployments.replica.event_streams import ForwardedEvents, ReturnedToSender

    events = [_event(tokenizer, " the"), _event(tokenizer, " cat")]
    forwarded = _PeerDiesAfter([], error=ReturnedToSender("me") if error == "returned" else RayActorError())
    ended = []
    stream = ForwardedEvents(forwarded, _served_here(events), lambda: ended.append(True))
    assert asyncio.run(_lines(stream)) == events
    assert forwarded.cancelled and ended == [True]


def test_a_forwarded_request_marked_back_is_served_here_though_its_ray_stream_never_ends(tokenizer):
    """Returned to its sender, whose Ray stream onto itself never ends: the sender serves it once the receiving call
    marks it come back (from another thread, as a call on another event loop would), and gives up the stream;
    forwards that have not come back still wait for their peer."""
    from deployments.replica.event_streams import Comebacks, ForwardedEvents

    events = [_event(tokenizer, " the"), _event(tokenizer, " cat")]
    comebacks = Comebacks()
    (forward_id, came_back), (_, waiting) = comebacks.open(), comebacks.open()
    never_ends = _PeerDiesAfter([], every_s=3600)
    stream = ForwardedEvents(never_ends, _served_here(events), lambda: comebacks.close(forward_id),
                             came_back)
    threading.Timer(0.2, comebacks.came_back, (forward_id,)).start()
    assert asyncio.run(asyncio.wait_for(_lines(stream), 30)) == events
    assert never_ends.cancelled and not waiting.done()
    comebacks.came_back(forward_id)  # closed: a late mark is a no-op
