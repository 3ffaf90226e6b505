"""Responses of the OpenAI-compatible API: completion and chat bodies, stream chunks, logprobs and usage.

The request schemas (deployments/api/openai_protocol.py) say what a client asked for; a renderer, made per request,
turns the engine's events into that API's JSON. The routes differ only in their renderer (CompletionRenderer,
ChatRenderer), which also carries what the route needs to know: the default max_tokens and the id prefix.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import uuid
from dataclasses import dataclass

from deployments.api.events import TokenEntry, TokenEvent
from deployments.api.openai_protocol import ChatRequest, CompletionRequest, OpenAISampling
from deployments.api.token_texts import TokenTexts
from deployments.api.tools import Reply, ToolUse, reply_to

FINISH_REASONS = {"length": "length", "eos": "stop", "stop": "stop", "abort": "abort"}


@dataclass
class FinishedChoice:
    """A finished choice, from its one event with every token: its text, its logprobs object and, when asked for,
    its prompt's logprobs in vLLM's shape."""
    text: str
    last: TokenEvent
    logprobs: dict | None
    prompt_logprobs: list[dict | None] | None = None


def request_id(given: str | None) -> str:
    """A response's request id: the client's (vLLM's X-Request-Id header or `request_id` field), else a fresh one."""
    return given or uuid.uuid4().hex[:24]


def completion_id(prefix: str, request: str) -> str:
    """The response's `id`, as vLLM forms it from the request id."""
    return f"{prefix}-{request}"


def usage(lasts: list[TokenEvent], n: int) -> dict:
    """Token counts of a request's choices (their last events), n per prompt: each prompt once (its cached tokens
    as its first choice read them), every choice's completion."""
    prompt = sum(last.prompt_tokens for last in lasts[::n])
    counts = usage_counts(prompt, sum(last.final.generated_tokens for last in lasts))
    return {**counts, "prompt_tokens_details": {"cached_tokens": sum(last.final.cached_tokens for last in lasts[::n])}}


def usage_counts(prompt: int, completion: int) -> dict:
    """OpenAI's usage object: a response's, or (vLLM's continuous usage) a choice's so far."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _fingerprint(event: TokenEvent) -> str | None:
    """system_fingerprint: the content id of the adapter weights that answered (None for the base model), on a
    request's last chunk, once the replica knows it."""
    return event.final.adapter_version if event.finished else None


class Renderer:
    """One request's responses; subclasses give the API's shapes."""
    object: str  # the "object" of a whole response
    chunk_object: str  # ... and of a stream chunk
    id_prefix: str
    default_max_tokens: int | None  # None: the output may fill the context

    def __init__(self, request: OpenAISampling, texts: TokenTexts):
        self.request = request
        self.texts = texts

    def logprobs(self, tokens: list[TokenEntry], offset: int) -> dict | None:
        """The response's `logprobs` for these generated tokens (None when not asked for); offsets count from
        `offset` characters into the generated text."""
        return None

    def finished(self, last: TokenEvent, prompt: str | list[int]) -> FinishedChoice:
        return FinishedChoice(last.final.generated_text, last, self.logprobs(last.entries(), 0),
                              self.prompt_logprobs(last))

    def prompt_logprobs(self, last: TokenEvent) -> list[dict | None] | None:
        """vLLM's `prompt_logprobs` (None when not asked for): per prompt token, None for the first (nothing before
        it to score it on), else token id -> {logprob, rank, decoded_token} for its k likeliest alternatives (ranks
        1..k) and the prompt's own token with its rank."""
        k = self.request.prompt_logprobs
        if k is None:
            return None
        return [None if t.logprob is None else self._scored(t, k) for t in last.prompt_entries or []]

    def _scored(self, token: TokenEntry, k: int) -> dict:
        scored = {i: (lp, rank) for rank, (i, lp) in enumerate(_top(token, k).items(), start=1)}
        scored[token.id] = (token.logprob, token.rank)
        return {str(i): {"logprob": lp, "rank": rank, "decoded_token": self.texts.text(i)}
                for i, (lp, rank) in scored.items()}

    def body(self, cid: str, finals: list[FinishedChoice], usage: dict) -> dict:
        return {"id": cid, "object": self.object, "created": int(time.time()), "model": self.request.model,
                "system_fingerprint": finals[0].last.final.adapter_version,
                "choices": [self._choice(i, final) for i, final in enumerate(finals)], "usage": usage}

    def chunk(self, cid: str, index: int, event: TokenEvent, text: str, first: bool) -> dict | None:
        """The stream chunk of one event of choice `index`, whose text is `text` (None: nothing to send yet)."""
        raise NotImplementedError

    def usage_chunk(self, cid: str, usage: dict) -> dict:
        """stream_options.include_usage: the stream's last chunk."""
        return {"id": cid, "object": self.chunk_object, "created": int(time.time()), "model": self.request.model,
                "choices": [], "usage": usage}

    def _chunk(self, cid: str, choice: dict, event: TokenEvent) -> dict:
        return {"id": cid, "object": self.chunk_object, "created": int(time.time()), "model": self.request.model,
                "system_fingerprint": _fingerprint(event), "choices": [choice]}

    def _choice(self, index: int, final: FinishedChoice) -> dict:
        raise NotImplementedError


def _reason(event: TokenEvent) -> str | None:
    return FINISH_REASONS[event.final.finish_reason] if event.finished else None


class CompletionRenderer(Renderer):
    object = chunk_object = "text_completion"
    id_prefix = "cmpl"
    default_max_tokens = 16  # OpenAI's
    request: CompletionRequest

    def __init__(self, request: CompletionRequest, texts: TokenTexts):
        super().__init__(request, texts)
        self._offsets: dict[int, int] = {}  # per choice: characters sent, where the next chunk's offsets start

    def logprobs(self, tokens: list[TokenEntry], offset: int) -> dict | None:
        """The legacy completions shape."""
        if self.request.logprobs is None:
            return None
        text = self.texts.text
        starts = itertools.accumulate((len(t.text) for t in tokens[:-1]), initial=offset)
        return {"tokens": [text(t.id) for t in tokens],
                "token_logprobs": [t.logprob for t in tokens],
                "top_logprobs": [None if t.logprob is None else  # the first prompt token, echoed
                                 {text(i): lp for i, lp in _with_chosen(t, self.request.logprobs).items()}
                                 for t in tokens],
                "text_offset": list(starts) if tokens else []}

    def finished(self, last: TokenEvent, prompt: str | list[int]) -> FinishedChoice:
        if not self.request.echo:
            return super().finished(last, prompt)
        return FinishedChoice(self._text(prompt) + last.final.generated_text, last,
                              self.logprobs(self._echoed(last) + last.entries(), 0), self.prompt_logprobs(last))

    def _text(self, prompt: str | list[int]) -> str:
        return prompt if isinstance(prompt, str) else self.texts.decode(prompt)

    @staticmethod
    def _echoed(event: TokenEvent) -> list[TokenEntry]:
        """The prompt's tokens that echo puts before the generated ones (scored only when logprobs were asked for;
        they come with a choice's first event)."""
        return event.prompt_entries or []

    def _choice(self, index: int, final: FinishedChoice) -> dict:
        choice = {"index": index, "text": final.text, "logprobs": final.logprobs,
                  "finish_reason": FINISH_REASONS[final.last.final.finish_reason]}
        if final.prompt_logprobs is not None:  # vLLM's, per choice: a request's prompts differ
            choice["prompt_logprobs"] = final.prompt_logprobs
        return choice

    def chunk(self, cid: str, index: int, event: TokenEvent, text: str, first: bool) -> dict | None:
        """With echo, a choice's first chunk starts with its prompt (choice i * n + j is prompt i's, as vLLM numbers
        them), and its logprobs with the prompt's tokens."""
        tokens, offset = event.entries(), self._offsets.get(index, 0)
        if first and self.request.echo:
            text = self._text(self.request.prompts[index // self.request.n]) + text
            tokens = self._echoed(event) + tokens
        logprobs = self.logprobs(tokens, offset)
        self._offsets[index] = offset + len(text)
        return self._chunk(cid, {"index": index, "text": text, "logprobs": logprobs,
                                 "finish_reason": _reason(event)}, event)


def logprob_content(texts: TokenTexts, tokens: list[TokenEntry]) -> list[dict]:
    """Chat's logprobs content, which the Responses API's output text takes too: each token's text, bytes and
    logprob, with its alternatives'."""
    return [{**_scored_token(texts, t.id, t.logprob),
             "top_logprobs": [_scored_token(texts, i, lp) for i, lp in (t.top_logprobs or {}).items()]}
            for t in tokens]


def _scored_token(texts: TokenTexts, token_id: int, logprob: float) -> dict:
    text = texts.text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _with_chosen(token: TokenEntry, k: int) -> dict[int, float]:
    """The k best alternatives and the chosen token (vLLM's completions include it, even when it is not among them).
    An echoed prompt token may have been scored with more (prompt_logprobs asked for more than logprobs)."""
    return {**_top(token, k), token.id: token.logprob}


def _top(token: TokenEntry, k: int) -> dict[int, float]:
    """The token's k likeliest alternatives, best first (it may have been scored with more)."""
    return dict(itertools.islice((token.top_logprobs or {}).items(), k))


class ChatRenderer(Renderer):
    """With tools that the model may call, a choice's text is held until it finishes, then goes out as one delta
    with its complete calls (the openai client joins a stream's deltas, so one serves)."""
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"
    default_max_tokens = None  # as vLLM: the answer may fill the context, up to max_tokens_limit
    request: ChatRequest

    def __init__(self, request: ChatRequest, texts: TokenTexts):
        super().__init__(request, texts)
        self.tools: ToolUse | None = request.tool_use()
        self._held: dict[int, str] | None = {} if request.calls_tools() else None  # per choice: text held back

    def logprobs(self, tokens: list[TokenEntry], offset: int) -> dict | None:
        if not self.request.logprobs:
            return None
        return {"content": logprob_content(self.texts, tokens)}

    def body(self, cid: str, finals: list[FinishedChoice], usage: dict) -> dict:
        body = super().body(cid, finals, usage)
        if finals[0].prompt_logprobs is not None:  # vLLM's, once a response: its choices share one prompt
            body["prompt_logprobs"] = finals[0].prompt_logprobs
        return body

    def _reply(self, text: str, last: TokenEvent) -> Reply:
        """The finished choice's message; echo's text goes before its content, after the calls were parsed."""
        reason = FINISH_REASONS[last.final.finish_reason]
        reply = reply_to(self.tools, text, reason)
        echoed = self.request.echoed()
        return dataclasses.replace(reply, content=echoed + (reply.content or "")) if echoed else reply

    def _choice(self, index: int, final: FinishedChoice) -> dict:
        reply = self._reply(final.text, final.last)
        return {"index": index, "message": reply.message(), "logprobs": final.logprobs,
                "finish_reason": reply.finish_reason}

    def chunk(self, cid: str, index: int, event: TokenEvent, text: str, first: bool) -> dict | None:
        if self._held is None:
            delta = {"role": "assistant", "content": self.request.echoed() + text} if first else {"content": text}
            return self._chunk(cid, {"index": index, "delta": delta, "logprobs": self.logprobs(event.entries(), 0),
                                     "finish_reason": _reason(event)}, event)
        self._held[index] = self._held.get(index, "") + text
        if not event.finished:
            return None
        reply = self._reply(self._held.pop(index), event)
        return self._chunk(cid, {"index": index, "delta": reply.delta(), "logprobs": None,
                                 "finish_reason": reply.finish_reason}, event)
