"""HTTP error answers in the shape each API's clients parse.

OpenAI clients (paths under /v1/) read {"error": {"message", "type", "param", "code"}} and raise by status
(openai.AuthenticationError for 401, RateLimitError for 429, ...); `param` names the body's field at fault when
one is (a field that failed validation, a token budget past the context), as OpenAI's API names it. LoRAX / TGI
clients read {"error", "error_type"}. Answers that ask the client to come back later (429, 503) carry
Retry-After; a 401 carries WWW-Authenticate, as RFC 6750 asks of a bearer-token server.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse
from ray.exceptions import RayTaskError

from engine.errors import EngineDeadError

OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error"}
LORAX_TYPES = {400: "validation", 401: "unauthorized", 403: "forbidden", 404: "not_found", 413: "validation",
               422: "validation", 429: "overloaded", 503: "overloaded"}


def error_body(path: str, message: str, status: int, param: str | None = None) -> dict:
    return openai_error(message, status, param) if path.startswith("/v1/") else lorax_error(message, status)


def openai_error(message: str, status: int, param: str | None = None) -> dict:
    kind = OPENAI_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def lorax_error(message: str, status: int) -> dict:
    return {"error": message, "error_type": LORAX_TYPES.get(status, "validation" if status < 500 else "server_error")}


def error_headers(status: int, retry_after_s: float | None) -> dict[str, str]:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else {}
    if retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(retry_after_s)))
    return headers


def error_response(path: str, message: str, status: int = 400, retry_after_s: float | None = None,
                   param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(path, message, status, param), status_code=status,
                        headers=error_headers(status, retry_after_s))


class RequestRefused(Exception):
    """A request answered with an HTTP error: 400 for a bad request, 401 without a valid API key, 403 or 404
    outside the key's scope, 413 for a body too large, 429 or 503 (with Retry-After) when over a limit."""

    def __init__(self, message: str, status: int = 400, retry_after_s: float | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s
        self.param = param  # the body's field at fault, when one is


def client_message(exc: BaseException) -> str:
    """An exception's message for the client: for one raised in another Ray process (the cache actor), the
    original message, not Ray's wrapper, whose text names processes, addresses and code."""
    return str(exc.cause) if isinstance(exc, RayTaskError) else str(exc)


def mid_stream_status(exc: Exception) -> int:
    """The status an error event names when a stream fails after its first token: 503 when this replica's engine
    stopped (a retry lands on a live one), 500 when the peer serving it died."""
    return 503 if isinstance(exc, EngineDeadError) else 500
