"""The engine's refusals, apart from the engine: the serving side catches them and names their retry delay in its
HTTP answers, and imports this module without torch (deployments/app.py is imported by Serve's build step).

One refusal type travels from the engine to the edge: `Refusal`, made once from whatever refused a request (the
engine's exceptions, and an adapter cache's, each say their RefusalKind), and turned into an HTTP status only at the
edge (deployments/routes/edge.py).

A refused max_tokens carries its figures (TokenBudget), so that each API words the refusal with its own name for the
parameter (max_new_tokens, max_completion_tokens, max_output_tokens): the engine knows it only as max_tokens.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

OVERLOADED_RETRY_AFTER_S = 1.0


@dataclass(frozen=True, slots=True)
class TokenBudget:
    """A max_tokens the engine refused, with what it allows: the context left after the prompt (max_model_len and
    prompt_tokens set), or the server's ceiling, max_tokens_limit (both None)."""
    asked: int
    allowed: int
    max_model_len: int | None = None
    prompt_tokens: int | None = None

    def message(self, name: str = "max_tokens") -> str:
        """The refusal, naming the parameter as the client's API does."""
        if self.max_model_len is None:
            return f"{name} is {self.asked}; this server allows at most {self.allowed} (max_tokens_limit)"
        return (f"this model's context is {self.max_model_len} tokens (max_model_len): the prompt has "
                f"{self.prompt_tokens}, so {name} may be at most {self.allowed}, got {self.asked}")


class RefusalKind(enum.Enum):
    BAD_REQUEST = "bad_request"  # the prompt, parameters or adapter are invalid
    NOT_FOUND = "not_found"  # no such adapter
    OVERLOADED = "overloaded"  # the engine's waiting queue is full: retry later
    UNAVAILABLE = "unavailable"  # the adapter cache does not answer: retry later


class Refuses:
    """What an exception that refuses a request says of it: its kind, and when to come back. Any other ValueError
    or TypeError is a bad request."""
    refusal_kind = RefusalKind.BAD_REQUEST
    retry_after_s: float | None = None


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request was not served, as the edge is told: the kind picks the HTTP status there."""
    reason: str
    kind: RefusalKind = RefusalKind.BAD_REQUEST
    retry_after_s: float | None = None
    budget: TokenBudget | None = None  # a refused max_tokens, which the edge words with its API's name for it

    @classmethod
    def of(cls, exc: Exception, reason: str) -> Refusal:
        """The refusal of what `exc` refused, in the words `reason` gives the client."""
        says = exc if isinstance(exc, Refuses) else Refuses()  # any other ValueError or TypeError: a bad request
        budget = exc.budget if isinstance(exc, TokenBudgetError) else None
        return cls(reason, says.refusal_kind, says.retry_after_s, budget)


class TokenBudgetError(Refuses, ValueError):
    """max_tokens past the context or above the server's ceiling."""

    def __init__(self, budget: TokenBudget):
        super().__init__(budget.message())
        self.budget = budget

    def __reduce__(self):  # pickled (across a Ray hop) with its figures, not its message
        return type(self), (self.budget,)


class EngineDeadError(RuntimeError):
    pass


class EngineOverloadedError(Refuses, RuntimeError):
    """The waiting queue is full (max_waiting_requests): the caller should retry later."""
    refusal_kind = RefusalKind.OVERLOADED

    def __init__(self, waiting: int, retry_after_s: float):
        super().__init__(f"the engine is overloaded: {waiting} requests are already waiting; retry later")
        self.waiting = waiting
        self.retry_after_s = retry_after_s

    def __reduce__(self):  # pickled (across a Ray hop) with what made it
        return type(self), (self.waiting, self.retry_after_s)


# A registered adapter's key is "name#generation" (lora_cache/registry.py); '#' is never part of a valid id
KEY_SEPARATOR = "#"


def key_name(key: str) -> str:
    """The adapter's name in a key: what a client asked for and every message shows."""
    return key.partition(KEY_SEPARATOR)[0]


class AdapterError(Refuses, ValueError):
    """An adapter that cannot be served; the message names the adapter as requested (not its key's generation)
    and the reason."""

    def __init__(self, adapter_id: str, reason: str):
        name = key_name(adapter_id)
        shown = name if len(name) <= 100 else name[:100] + "..."
        super().__init__(f"adapter {shown!r}: {reason}")
        self.adapter_id = adapter_id
        self.reason = reason

    def __reduce__(self):  # exceptions cross Ray process boundaries pickled; rebuild from both fields
        return type(self), (self.adapter_id, self.reason)


class AdapterNotFoundError(AdapterError):
    """No such adapter where it was looked for (HTTP 404); other AdapterErrors are bad adapters (HTTP 400)."""
    refusal_kind = RefusalKind.NOT_FOUND
