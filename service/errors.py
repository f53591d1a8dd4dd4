"""The service's domain errors, one tree, and the one table that maps them to HTTP.

    ServiceError
    ├── BadRequest               400 invalid_request_error (param names the field)
    │   └── ContextLengthExceeded   400 context_length_exceeded
    ├── Unauthorized             401
    ├── ModelNotFound            404 model_not_found
    ├── SplitNotHonoured         409 SPLIT_NOT_HONOURED
    ├── Busy                     409 model_busy (a load or unload waited its limit for running generations)
    ├── PayloadTooLarge          413
    ├── QueueFull                429 (Retry-After)
    ├── InsufficientMemory       503 insufficient_memory on /v1, 507 INSUFFICIENT_MEMORY on /api
    ├── NotReady                 503 model_not_ready (Retry-After when it passes: draining, queued at shutdown)
    │   └── RunnerDied              503 runner_died (the model's runner process died mid-request; it restarts)
    ├── Upstream                 502 upstream_error (the model hub or a remote GGUF failed)
    └── EngineFailure            500 engine_error

Routes raise these; ``service.api.errors`` renders them in the OpenAI envelope
``{"error": {"message", "type", "param", "code"}}``, with ``Retry-After`` when an error carries
``retry_after_s``. Every ``code`` is a string.
"""

from __future__ import annotations

from typing import Any


class ServiceError(Exception):
    status = 500
    type = "server_error"
    code = "internal_error"

    retry_after_s: int | None = None
    """Seconds a client should wait before retrying (the ``Retry-After`` header); None: no header."""

    def __init__(self, message: str, *, param: str | None = None, retry_after_s: int | None = None,
                 **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.details = details
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s

    def status_for(self, path: str) -> int:
        return self.status

    def code_for(self, path: str) -> str:
        return self.code


class BadRequest(ServiceError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class ContextLengthExceeded(BadRequest):
    code = "context_length_exceeded"


class Unauthorized(ServiceError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class ModelNotFound(ServiceError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class SplitNotHonoured(ServiceError):
    status = 409
    type = "invalid_request_error"
    code = "SPLIT_NOT_HONOURED"


class PayloadTooLarge(ServiceError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class Busy(ServiceError):
    status = 409
    type = "invalid_request_error"
    code = "model_busy"
    retry_after_s = 5


class QueueFull(ServiceError):
    status = 429
    type = "rate_limit_error"
    code = "queue_full"
    retry_after_s = 1


class InsufficientMemory(ServiceError):
    """Out of memory: 503 ``insufficient_memory`` on /v1, 507 ``INSUFFICIENT_MEMORY`` on the management API."""

    status = 503
    type = "invalid_request_error"
    code = "insufficient_memory"

    def status_for(self, path: str) -> int:
        return 507 if path.startswith("/api/") else 503

    def code_for(self, path: str) -> str:
        return "INSUFFICIENT_MEMORY" if path.startswith("/api/") else "insufficient_memory"


class NotReady(ServiceError):
    status = 503
    type = "unavailable_error"
    code = "model_not_ready"


class RunnerDied(NotReady):
    """The model's runner process died (a signal, an abort, the OOM killer) while this request was in it: the
    request is lost, the runner is restarted with the same plan, and a retry after ``retry_after_s`` is served."""

    code = "runner_died"
    retry_after_s = 5


class EngineFailure(ServiceError):
    status = 500
    type = "server_error"
    code = "engine_error"


class Upstream(ServiceError):
    status = 502
    type = "server_error"
    code = "upstream_error"
