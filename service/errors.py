"""The service's domain errors, one tree. They say what went wrong, never how HTTP says it.

    ServiceError                 (an unexpected failure of ours)
    ├── BadRequest               the client's request cannot be served as sent (``param`` names the field)
    │   ├── ContextLengthExceeded   the prompt (and max_tokens) do not fit the context
    │   └── PreviousResponseNotFound  previous_response_id names no stored response of this key
    ├── Unauthorized             no API key, or a wrong one
    ├── Forbidden                the key may not do this (an admin's action asked with an ordinary key)
    ├── ModelNotFound            no model of that name
    ├── NotFound                 no stored object of that id (for this key)
    ├── SplitNotHonoured         the split asked for cannot be honoured
    ├── Busy                     a load or unload waited its limit for running generations
    ├── PayloadTooLarge          the body is beyond the limit
    ├── QueueFull                the model's queue is at its bound
    ├── InsufficientMemory       the model does not fit the memory (a refusal with figures, or an OOM)
    ├── NotReady                 no model to serve it now (loading, draining, unloaded, failed)
    │   └── RunnerDied              the model's runner process died mid-request; it restarts
    ├── Upstream                 the model hub or a remote GGUF failed
    └── EngineFailure            llama.cpp failed for another reason

``service.api.errors`` is the one table that turns each class into its HTTP status, error type and string code,
per API family (the OpenAI envelope on /v1, Anthropic's on /v1/messages, the management API on /api), with
``Retry-After`` when an error carries ``retry_after_s``.
"""

from __future__ import annotations

from typing import Any


class ServiceError(Exception):
    """A failure of the service's own; ``param`` names the request field it is about, ``details`` are figures the
    answer carries (``prompt_tokens``, ``plan``...)."""

    retry_after_s: int | None = None
    """Seconds a client should wait before retrying (None: no advice)."""

    def __init__(self, message: str, *, param: str | None = None, retry_after_s: int | None = None,
                 **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.details = details
        if retry_after_s is not None:
            self.retry_after_s = retry_after_s


class BadRequest(ServiceError):
    """The client's request cannot be served as sent."""


class ContextLengthExceeded(BadRequest):
    """The prompt (and max_tokens) do not fit the context."""


class PreviousResponseNotFound(BadRequest):
    """``previous_response_id`` names no response stored for this API key (never stored, dropped, or forgotten by a
    restart)."""


class Unauthorized(ServiceError):
    """No API key, or a wrong one."""


class Forbidden(ServiceError):
    """The request's key is valid but may not do this: an admin's action (load, unload, pull, delete, shortening a
    model's keep_alive) asked with an ordinary key."""


class ModelNotFound(ServiceError):
    """No model of that name (or alias)."""


class NotFound(ServiceError):
    """No stored object of that id (a response of /v1/responses), or not one of this API key's."""


class SplitNotHonoured(ServiceError):
    """The split over the cards asked for cannot be honoured."""


class PayloadTooLarge(ServiceError):
    """The request body is beyond the limit."""


class Busy(ServiceError):
    """A load or unload waited its limit for running generations (nothing changed)."""

    retry_after_s = 5


class QueueFull(ServiceError):
    """The model's queue is at its bound."""

    retry_after_s = 1


class InsufficientMemory(ServiceError):
    """The model does not fit the memory: a refusal before loading (with every device's figures), or an
    out-of-memory during generation."""


class NotReady(ServiceError):
    """No model can serve the request now: loading, draining, unloaded, failed."""


class RunnerDied(NotReady):
    """The model's runner process died (a signal, an abort, the OOM killer) while this request was in it: the
    request is lost, the runner is restarted with the same plan, and a retry after ``retry_after_s`` is served."""

    retry_after_s = 5


class EngineFailure(ServiceError):
    """llama.cpp failed for a reason other than memory."""


class Upstream(ServiceError):
    """The model hub or a remote GGUF failed (its answer, its network)."""
