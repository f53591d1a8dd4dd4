"""The one table from errors to HTTP: per domain error class and API family, the status, the error type and the
string code; the envelopes (OpenAI's on /v1 and /api, Anthropic's on /v1/messages) and the exception handlers.

Domain errors (``service.errors``) carry no HTTP: a route raises them, and ``http_of`` finds the row of the error's
class (or its nearest ancestor's) for the family the request's path belongs to. Errors of the sizing core that reach
a route uncaught are answered by the same table."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sizing.errors import ConfigError, ProbeError, SizingError

from ..errors import (BadRequest, Busy, ContextLengthExceeded, EngineFailure, Forbidden, InsufficientMemory, ModelNotFound,
                      NotFound,
                      NotReady, PayloadTooLarge, PreviousResponseNotFound, QueueFull, RunnerDied, ServiceError,
                      SplitNotHonoured, Unauthorized, Upstream)
from .paths import redact, redact_text
from .validation import esc

log = logging.getLogger(__name__)


Family = Literal["openai", "anthropic", "management"]
ANTHROPIC_PREFIX = "/v1/messages"
"""Routes of Anthropic's Messages API: their errors are in Anthropic's shape."""
OLLAMA_PATHS = frozenset({"/api/chat", "/api/generate", "/api/tags", "/api/version", "/api/ps", "/api/show",
                          "/api/embed", "/api/embeddings", "/api/delete", "/api/pull"})
"""Routes of Ollama's API (``service.api.ollama``): their errors are Ollama's ``{"error": "..."}``, which its
clients read (``ollama.ResponseError`` takes the ``error`` string), with the management API's statuses."""


@dataclass(frozen=True)
class Http:
    """How one API family answers one error class."""

    status: int
    type: str
    code: str


_OVER = "invalid_request_error"
TABLE: dict[type[Exception], Http | dict[Family, Http]] = {
    ServiceError: Http(500, "server_error", "internal_error"),
    BadRequest: Http(400, "invalid_request_error", "invalid_request"),
    ContextLengthExceeded: Http(400, "invalid_request_error", "context_length_exceeded"),
    Unauthorized: Http(401, "authentication_error", "invalid_api_key"),
    Forbidden: Http(403, "permission_error", "permission_denied"),
    ModelNotFound: Http(404, "invalid_request_error", "model_not_found"),
    NotFound: Http(404, "invalid_request_error", "not_found"),
    PreviousResponseNotFound: Http(400, "invalid_request_error", "previous_response_not_found"),
    SplitNotHonoured: Http(409, "invalid_request_error", "SPLIT_NOT_HONOURED"),
    Busy: Http(409, "invalid_request_error", "model_busy"),
    PayloadTooLarge: Http(413, "invalid_request_error", "payload_too_large"),
    QueueFull: Http(429, "rate_limit_error", "queue_full"),
    # The source document's codes: 503 on the OpenAI API, 507 INSUFFICIENT_MEMORY on the management API.
    InsufficientMemory: {"openai": Http(503, _OVER, "insufficient_memory"),
                         "anthropic": Http(503, _OVER, "insufficient_memory"),
                         "management": Http(507, _OVER, "INSUFFICIENT_MEMORY")},
    NotReady: Http(503, "unavailable_error", "model_not_ready"),
    RunnerDied: Http(503, "unavailable_error", "runner_died"),
    Upstream: Http(502, "server_error", "upstream_error"),
    EngineFailure: Http(500, "server_error", "engine_error"),
    # The sizing core's, where a route lets one through: a file or configuration the client named.
    SizingError: Http(400, "invalid_request_error", "invalid_request"),
    ProbeError: Http(400, "invalid_request_error", "invalid_model_file"),
    ConfigError: Http(400, "invalid_request_error", "invalid_config"),
}
"""Every error class the service answers with, and its answer per family (one row: the same for all three)."""


def family(path: str) -> Family:
    """The API family a request path belongs to."""
    if path.startswith(ANTHROPIC_PREFIX):
        return "anthropic"
    return "management" if path.startswith("/api/") else "openai"


def http_of(exc: Exception, path: str) -> Http:
    """The row of ``exc``'s class, or of its nearest ancestor's, for ``path``'s family."""
    for cls in type(exc).__mro__:
        row = TABLE.get(cls)
        if row is not None:
            return row[family(path)] if isinstance(row, dict) else row
    return TABLE[ServiceError]  # type: ignore[return-value]


def code_of(exc: Exception, path: str) -> str:
    """The string code a client and the metrics see for ``exc`` on ``path``."""
    return http_of(exc, path).code


def envelope(message: str, type_: str, code: str | None, param: str | None = None, **extra: Any) -> dict[str, Any]:
    err: dict[str, Any] = {"message": message, "type": type_, "param": param, "code": code}
    err.update({k: v for k, v in extra.items() if v is not None})
    return {"error": err}


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                    507: "overloaded_error", 529: "overloaded_error"}


def anthropic_envelope(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape: ``{"type": "error", "error": {"type": ..., "message": ...}}``, its type from the status
    (docs.anthropic.com, errors: 400 invalid_request_error ... 529 overloaded_error; other 5xx api_error)."""
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_body(path: str, status: int, message: str, type_: str, code: str | None, param: str | None = None,
               **extra: Any) -> dict[str, Any]:
    """The error envelope a route's clients read: Anthropic's on /v1/messages, Ollama's on its routes, OpenAI's
    everywhere else. No host path reaches a client (``service.api.paths``: a file by its name only)."""
    message = redact_text(message)
    extra = redact(extra)
    if path.startswith(ANTHROPIC_PREFIX):
        return anthropic_envelope(status, message)
    if path in OLLAMA_PATHS:
        return {"error": message}
    return envelope(message, type_, code, param, **extra)


def service_error_body(exc: ServiceError, path: str) -> tuple[int, dict[str, Any]]:
    """Status and envelope for a domain error; the same for plain responses and stream events."""
    row = http_of(exc, path)
    return row.status, error_body(path, row.status, exc.message, row.type, row.code, exc.param, **exc.details)


def status_code_name(status: int) -> str:
    """A string ``code`` for a bare HTTP status (``405`` -> ``method_not_allowed``): codes are never integers."""
    try:
        return HTTPStatus(status).phrase.lower().replace(" ", "_").replace("-", "_")
    except ValueError:
        return f"http_{status}"


def retry_headers(exc: ServiceError) -> dict[str, str] | None:
    return {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else None


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list", "json-or-python"})


def param_of(loc: tuple[Any, ...]) -> str | None:
    """The request field an error is about: pydantic's location without ``body`` and union-member tags
    (``prompt.str`` -> ``prompt``, ``stream_options.StreamOptions.include_usage`` -> ``stream_options.include_usage``)."""
    parts = [
        str(p) for p in loc
        if p != "body" and not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p or p[:1].isupper()))
    ]
    return ".".join(parts) or None


def install(app: FastAPI) -> None:
    @app.exception_handler(SizingError)
    async def _sizing(request: Request, exc: SizingError) -> JSONResponse:
        row = http_of(exc, request.url.path)
        return JSONResponse(error_body(request.url.path, row.status, str(exc), row.type, row.code),
                            status_code=row.status)

    @app.exception_handler(ServiceError)
    async def _service(request: Request, exc: ServiceError) -> JSONResponse:
        status, body = service_error_body(exc, request.url.path)
        if status >= 500 and status not in (503, 507):  # a server fault: logged with its cause
            cause = exc.__cause__
            log.error("%s %s -> %d %s%s", request.method, esc(request.url.path), status, esc(exc.message, 500),
                      f" (cause: {type(cause).__name__}: {esc(cause, 300)})" if cause is not None else "")
        elif status >= 500:
            log.warning("%s %s -> %d %s", request.method, esc(request.url.path), status, esc(exc.message, 500))
        return JSONResponse(body, status_code=status, headers=retry_headers(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = tuple(first.get("loc", ()))
        path = request.url.path
        if first.get("type") == "json_invalid":
            msg = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": ")
            return JSONResponse(error_body(path, 400, msg, "invalid_request_error", "invalid_json"), status_code=400)
        param = param_of(loc)
        msg = f"{param}: {first.get('msg', 'invalid value')}" if param else str(first.get("msg", "invalid request"))
        return JSONResponse(error_body(path, 400, msg, "invalid_request_error", "invalid_value", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = status_code_name(exc.status_code)
        return JSONResponse(
            error_body(request.url.path, exc.status_code, str(exc.detail), "invalid_request_error", code),
            status_code=exc.status_code, headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, esc(request.url.path))
        return JSONResponse(error_body(request.url.path, 500, "internal server error", "server_error", "internal_error"),
                            status_code=500)


def sse(data: dict[str, Any] | str) -> bytes:
    """One Server-Sent Event."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode("utf-8")
