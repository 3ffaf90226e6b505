"""Typed events from an engine replica to the ingress: the items of one request's Ray stream.

A request's stream is zero or more TokenEvents (one or more new tokens each: every token ready when the ingress
asks), the last of which carries a Final; or a single Refusal when the engine will not take the request
(engine/errors.py: the one refusal type, whose RefusalKind says why); the HTTP edge chooses the status code.

Events are columns (ids, texts, logprobs) rather than one record per token, with slots: a Ray stream pays per item
and per pickled object, and under load each item carries several tokens.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TokenEntry:
    """One token in the shape clients show it: id, its text as released, its logprob, its top alternatives
    (id -> logprob, best first; None unless asked for), and, for a scored prompt token, its rank (1: the likeliest)."""
    id: int | None
    text: str
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None
    rank: int | None = None


@dataclass(slots=True)
class Final:
    """What the last event of a request adds: why it finished, the whole text, and its generated tokens' count (the
    prompt's is on every event)."""
    finish_reason: str
    generated_text: str
    generated_tokens: int
    adapter_version: str | None = None  # the content id of the adapter's weights that answered
    cached_tokens: int = 0  # prompt tokens read from the prefix cache instead of computed


@dataclass(slots=True)
class TokenEvent:
    """New tokens of one request, as columns; logprobs and top_logprobs are None unless asked for."""
    token_ids: list[int]
    texts: list[str]
    logprobs: list[float | None] | None = None
    top_logprobs: list[dict[int, float] | None] | None = None
    final: Final | None = None
    prompt_tokens: int | None = None  # the request's prompt length: the replica sets it on every event
    # The prompt's tokens, scored, on the event with the first token (so a stream can echo them first); only when
    # prompt logprobs were asked for
    prompt_entries: list[TokenEntry] | None = None

    @property
    def finished(self) -> bool:
        return self.final is not None

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def entries(self) -> list[TokenEntry]:
        n = len(self.token_ids)
        logprobs = self.logprobs or [None] * n
        top = self.top_logprobs or [None] * n
        return [TokenEntry(*fields) for fields in zip(self.token_ids, self.texts, logprobs, top)]

    def extend(self, later: TokenEvent) -> TokenEvent:
        """This event followed by `later` as one event (the later one's final, if any)."""
        n, m = len(self.token_ids), len(later.token_ids)
        join = lambda a, b: None if a is None and b is None else (a or [None] * n) + (b or [None] * m)  # noqa: E731
        return TokenEvent(self.token_ids + later.token_ids, self.texts + later.texts,
                          join(self.logprobs, later.logprobs), join(self.top_logprobs, later.top_logprobs),
                          later.final, later.prompt_tokens, self.prompt_entries or later.prompt_entries)


class PeerLost(RuntimeError):
    """The replica serving a forwarded request died after some of its events had reached the client."""

    def __init__(self):
        super().__init__("the replica serving this request stopped before it finished; retry the request")
