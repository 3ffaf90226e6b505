"""How the HTTP app answers an exception, in the error shape of the path's API (deployments/api/errors.py): a refusal
with its status, a stopped engine with 503 and Retry-After, FastAPI's own refusals, and a body that fails
validation with each field at fault and why."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.api.errors import RequestRefused, error_response
from engine.errors import EngineDeadError

# Serve finds a stopped engine at its next health checks (every 10 s, llm_server.py) and starts another replica
ENGINE_STOPPED_RETRY_AFTER_S = 10


def answer_errors(app: FastAPI) -> None:
    app.add_exception_handler(RequestRefused, _refused_response)
    app.add_exception_handler(EngineDeadError, _engine_stopped)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _invalid_request)


async def _refused_response(request: Request, exc: RequestRefused) -> JSONResponse:
    return error_response(request.url.path, str(exc), exc.status, exc.retry_after_s, exc.param)


async def _engine_stopped(request: Request, exc: EngineDeadError) -> JSONResponse:
    """A replica whose engine loop ended fails Serve's health checks and is replaced; until then its requests
    are told to come back, not given a bare 500."""
    return error_response(request.url.path, f"this replica's engine stopped ({exc}); it is being replaced, retry",
                          503, ENGINE_STOPPED_RETRY_AFTER_S)


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    """FastAPI's own refusals (an unknown path, a wrong method) in the error shape of the path's API, whose
    clients read the message from it: OpenAI's under /v1/, LoRAX's elsewhere."""
    response = error_response(request.url.path, str(exc.detail), exc.status_code)
    response.headers.update(exc.headers or {})
    return response


async def _invalid_request(request: Request, exc: RequestValidationError) -> Response:
    """A body that is not JSON or does not fit the route's model: 400 under /v1/ (as OpenAI answers), 422 on the
    LoRAX routes (as LoRAX and TGI answer; lorax-client raises its ValidationError with the message). The message
    names each field and why, not its input, and escapes what UTF-8 cannot encode (a lone surrogate); OpenAI's
    `param` names the first field."""
    status = 400 if request.url.path.startswith("/v1/") else 422
    errors = exc.errors()
    message = "; ".join(_reason(e) for e in errors).encode("utf-8", "backslashreplace").decode()
    return error_response(request.url.path, message, status, param=_field(errors[0]) if errors else None)


def _location(error: dict) -> str:
    """Where one of pydantic's errors is: a field's path in the body ("" for the body as a whole), or for a body
    that is not JSON the character at fault."""
    return ".".join(str(part) for part in error["loc"][1:])  # the first part is "body"


def _field(error: dict) -> str | None:
    """The field one of pydantic's errors is about, as OpenAI's `param` names it (None: the body as a whole)."""
    return None if error["type"] == "json_invalid" else _location(error) or None


def _reason(error: dict) -> str:
    """One of pydantic's errors as a client reads it: the field's path in the body, then why."""
    where = _location(error)
    if error["type"] == "json_invalid":
        return f"the body is not valid JSON: {error.get('ctx', {}).get('error', error['msg'])} (at character {where})"
    if error["type"] == "extra_forbidden":
        why = "not supported by this server"
    else:  # a model validator's ValueError comes as "Value error, <its message>"
        why = error["msg"].removeprefix("Value error, ")
    return f"{where}: {why}" if where else why
