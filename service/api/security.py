"""The service's gates, as pure ASGI middleware: API keys, body size, drain, CORS; and log escaping.

Order, outermost first (``install``): CORS (a preflight needs no key) -> metrics (counts refusals
too) -> drain (503 once SIGTERM arrived) -> API key (401) -> body limits (413 for size, 400 for JSON nested
deeper than ``validation.MAX_JSON_DEPTH``) -> the routes.

Keys: from ``GGUF_API_KEYS`` (comma-separated) and ``GGUF_API_KEY_FILE`` (one per line), compared
in constant time against every key (``hmac.compare_digest``, no early exit), never logged. Every
path needs a key except the explicit public list (liveness, readiness, the page and its two
assets): a route added later is protected without anyone remembering to protect it.

Roles: a key is an admin's (``GGUF_ADMIN_KEYS``, or ``KEY admin`` in the key file) or an ordinary one. The routes
that change what every tenant gets (load, unload, pull, delete) or read across tenants (``/api/kv-cache``) are
``ADMIN_PATHS``: an ordinary key gets 403 ``permission_denied`` there. The role travels to the routes in the
request's scope (``is_admin``): what a route lets an ordinary key do (a keep_alive that may only lengthen, answers
without host paths) is decided there. With no key configured every client is the local user, an admin.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..hosts import is_loopback
from ..errors import BadRequest, Forbidden, NotReady, PayloadTooLarge, ServiceError, Unauthorized
from ..settings import Settings
from . import errors as api_errors
from .validation import MAX_JSON_DEPTH, body_surrogate, esc, json_too_deep

log = logging.getLogger(__name__)

PUBLIC_PATHS = frozenset({"/health", "/ready", "/", "/static/page.js", "/static/page.css", "/static/common.js",
                          "/static/models.js", "/static/chat.js"})
"""Paths answered without a key. Everything else, including routes added later and unknown paths, needs one."""
ADMIN_PATHS = frozenset({"/api/models/load", "/api/models/unload", "/api/models/pull", "/api/models/pull/cancel",
                         "/api/pull", "/api/delete", "/api/kv-cache"})
"""Paths only an admin key may use (any method): they change which models every tenant is served, fetch or delete
files, or read what every tenant's prompts hold. tests/reliability/test_roles.py lists every route's role, so a
management route added later must be placed on one side or the other."""
ROLE_KEY = "gguf_admin"
"""Where the role of the request's key is kept in its ASGI scope's ``state`` (``request.state.gguf_admin``)."""

class ConfigurationError(Exception):
    """The service must not start with these settings (a clear message, a non-zero exit)."""


@dataclass(frozen=True)
class Keys:
    """The configured keys: every valid key, and the admins' among them (also in ``all``)."""

    all: tuple[bytes, ...] = ()
    admin: tuple[bytes, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.all)


def _split(value: str) -> list[str]:
    return [k.strip() for k in value.split(",")]


def load_keys(settings: Settings) -> Keys:
    """The configured keys (environment and file) with their roles; the file must be readable if it is named. A file
    line is ``KEY``, ``KEY user`` or ``KEY admin``."""
    users: list[str] = []
    admins: list[str] = []
    if settings.api_keys is not None:
        users += _split(settings.api_keys.get_secret_value())
    if settings.admin_keys is not None:
        admins += _split(settings.admin_keys.get_secret_value())
    if settings.api_key_file:
        try:
            with open(settings.api_key_file, encoding="utf-8") as fh:
                lines = fh.read().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigurationError(
                f"GGUF_API_KEY_FILE {settings.api_key_file!r} cannot be read: {type(exc).__name__}"
            ) from None  # the exception text could quote the file's content
        for n, line in enumerate(lines, 1):
            words = line.split()
            if not words or words[0].startswith("#"):
                continue
            if len(words) > 2 or (len(words) == 2 and words[1] not in ("admin", "user")):
                # The line itself is never quoted: it holds a key.
                raise ConfigurationError(f"GGUF_API_KEY_FILE {settings.api_key_file!r} line {n}: expected KEY, "
                                         "KEY user or KEY admin")
            (admins if words[1:] == ["admin"] else users).append(words[0])
    admin = tuple(dict.fromkeys(k.encode("utf-8") for k in admins if k))
    out = Keys(tuple(dict.fromkeys([*(k.encode("utf-8") for k in users if k), *admin])), admin)
    if settings.api_key_file and not out.all:
        raise ConfigurationError(f"GGUF_API_KEY_FILE {settings.api_key_file!r} holds no key")
    return out


def load_api_keys(settings: Settings) -> tuple[bytes, ...]:
    """Every configured key, whatever its role."""
    return load_keys(settings).all


def is_admin(request: Any) -> bool:
    """Whether the request's key is an admin's (always, with no key configured). ``request``: a Starlette
    ``Request`` (its ``state``); the middleware set the role before any route ran."""
    return bool(getattr(request.state, ROLE_KEY, True))


def require_admin(request: Any, what: str) -> None:
    """403 unless the request's key is an admin's: ``what`` names the action in the answer."""
    if not is_admin(request):
        raise Forbidden(f"{what} needs an admin key (GGUF_ADMIN_KEYS); this key may only infer")


def check_startup(settings: Settings, keys: tuple[bytes, ...]) -> None:
    """Refuse to serve beyond loopback without keys."""
    if not keys and not is_loopback(settings.host):
        raise ConfigurationError(
            f"refusing to bind {settings.host}: a non-loopback address needs API keys. Set GGUF_API_KEYS "
            "(comma-separated) or GGUF_API_KEY_FILE (one key per line), or bind 127.0.0.1."
        )


def key_matches(presented: bytes, keys: Iterable[bytes]) -> bool:
    """Whether ``presented`` is one of ``keys``, comparing against all of them in constant time."""
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(presented, key)
    return ok


def presented_key(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The key of ``Authorization: Bearer <key>`` or ``X-Api-Key: <key>``."""
    for name, value in headers:
        name = name.lower()
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
        elif name == b"x-api-key" and value.strip():
            return value.strip()
    return None


def _header(scope: Scope, name: bytes) -> str:
    for k, v in scope.get("headers", []):
        if k.lower() == name:
            return bytes(v).decode("latin-1")
    return ""


async def send_error(send: Send, exc: ServiceError, path: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """A domain error in the OpenAI envelope, from middleware (the same table as the routes)."""
    status, body = api_errors.service_error_body(exc, path)
    headers = headers or []
    data = json.dumps(body).encode()
    await send({
        "type": "http.response.start", "status": status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *headers],
    })
    await send({"type": "http.response.body", "body": data})


class ApiKeyMiddleware:
    """401 ``invalid_api_key`` (with ``WWW-Authenticate: Bearer``) for any non-public path without a valid key; 403
    ``permission_denied`` for an ordinary key on ``ADMIN_PATHS``. The key's role goes into the scope's state."""

    def __init__(self, app: ASGIApp, keys: Keys | tuple[bytes, ...], public: frozenset[str] = PUBLIC_PATHS) -> None:
        self.app = app
        self.keys = keys if isinstance(keys, Keys) else Keys(keys)
        self.public = public  # PUBLIC_PATHS, plus /metrics with GGUF_METRICS_PUBLIC (scrapers that send no key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        if not self.keys:
            state[ROLE_KEY] = True  # no keys: the local single user
            await self.app(scope, receive, send)
            return
        key = presented_key(scope.get("headers", []))
        valid = key is not None and key_matches(key, self.keys.all)
        # Both compared in full whatever the first found: the time does not tell which kind a key is.
        admin = key is not None and key_matches(key, self.keys.admin) and valid
        state[ROLE_KEY] = admin
        if scope["path"] in self.public:
            await self.app(scope, receive, send)
            return
        if valid:
            if scope["path"] in ADMIN_PATHS and not admin:
                log.warning("403 %s %s from %s (an ordinary key on an admin route)", scope.get("method"),
                            esc(scope["path"]), (scope.get("client") or ("?", 0))[0])
                await send_error(send, Forbidden(f"{scope['path']} needs an admin key (GGUF_ADMIN_KEYS); this key "
                                                 "may only infer"), scope["path"])
                return
            await self.app(scope, receive, send)
            return
        client = scope.get("client") or ("?", 0)
        log.warning(
            "401 %s %s from %s (%s key) user-agent %s", scope.get("method"), esc(scope["path"]), client[0],
            "no" if key is None else "wrong", esc(_header(scope, b"user-agent")),
        )
        msg = "missing API key: send Authorization: Bearer <key> or X-Api-Key" if key is None else "invalid API key"
        await send_error(send, Unauthorized(msg), scope["path"], [(b"www-authenticate", b"Bearer")])


class _Refused(Exception):
    """Raised into the app's read of the body: the middleware answers ``error`` instead of the app."""

    def __init__(self, error: ServiceError, headers: list[tuple[bytes, bytes]]) -> None:
        super().__init__(error.message)
        self.error = error
        self.headers = headers


class BodyLimitMiddleware:
    """413 for a body over ``max_bytes``: refused on its Content-Length, or counted while it is read (chunked).

    400 for a body whose JSON nests deeper than ``max_depth``, checked on the whole body once it is read and before
    any route parses it, on every route: Python's parser, pydantic, ``json.dumps`` and the templates recurse per
    level, and would raise ``RecursionError`` (a 500) somewhere past it. 400 naming the field for a string holding
    a lone UTF-16 surrogate (``validation.body_surrogate``), on every route too.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, max_depth: int = MAX_JSON_DEPTH) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_depth = max_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = PayloadTooLarge(f"the request body is larger than {self.max_bytes} bytes", max_bytes=self.max_bytes)
        declared = _header(scope, b"content-length")
        if declared:
            try:
                n = int(declared)
            except ValueError:
                n = -1
            if n > self.max_bytes:
                await send_error(send, too_large, scope["path"], [(b"connection", b"close")])
                return
        seen = 0
        chunks: list[bytes] = []  # the same bytes objects the app holds; dropped once the body is checked
        refused: _Refused | None = None
        started = False

        async def counted_receive() -> Message:
            nonlocal seen, refused
            message = await receive()
            if message["type"] == "http.request":
                body = message.get("body", b"")
                seen += len(body)
                if seen > self.max_bytes:
                    refused = _Refused(too_large, [(b"connection", b"close")])
                    raise refused
                chunks.append(body)
                if not message.get("more_body", False):
                    whole = b"".join(chunks)
                    chunks.clear()
                    if json_too_deep(whole, self.max_depth):
                        refused = _Refused(BadRequest(
                            f"the request body nests arrays and objects deeper than {self.max_depth} levels",
                            max_depth=self.max_depth), [])
                        raise refused
                    bad = body_surrogate(whole)
                    if bad is not None:
                        refused = _Refused(bad, [])
                        raise refused
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if refused is not None:  # the app's answer to the aborted read (FastAPI makes it a 400) is replaced
                return
            started = True
            await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except _Refused:
            pass
        except Exception:
            if refused is None:
                raise
        if refused is not None and not started:
            await send_error(send, refused.error, scope["path"], refused.headers)


DRAIN_GRACE_S = 5.0
"""After the drain deadline ended the generations, how long uvicorn still waits for their last bytes to go out."""


@dataclass
class DrainState:
    """Set when SIGTERM arrives: new requests are refused while the ones in flight finish.

    ``begin(timeout_s)`` (from the signal handler) starts the drain; when ``timeout_s`` passes, every
    ``on_expire`` callback runs on the event loop: the app's ends the generations still queued (503 with
    Retry-After) or running (a stream's error event, then ``[DONE]``) before uvicorn closes the connections.
    """

    draining: bool = False
    expired: bool = False
    loop: asyncio.AbstractEventLoop | None = None
    _callbacks: list[Callable[[], None]] = field(default_factory=list)

    def on_expire(self, loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
        self.loop = loop
        self._callbacks.append(callback)

    def begin(self, timeout_s: float) -> None:
        """Start draining; safe to call from a signal handler."""
        self.draining = True
        loop = self.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.call_later, timeout_s, self._expire)

    def _expire(self) -> None:
        if self.expired:
            return
        self.expired = True
        log.warning("drain: the timeout passed; ending the generations still queued or running")
        for callback in self._callbacks:
            try:
                callback()
            except Exception:  # one failing callback must not keep the others from running
                log.exception("drain callback failed")


DRAIN_EXEMPT = frozenset({"/health"})


class DrainMiddleware:
    """503 ``model_not_ready`` (state ``draining``) for new requests once the drain began; /health stays 200."""

    def __init__(self, app: ASGIApp, state: DrainState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.state.draining and scope["path"] not in DRAIN_EXEMPT:
            exc = NotReady("the server is shutting down", state="draining")
            await send_error(send, exc, scope["path"], [(b"connection", b"close"), (b"retry-after", b"1")])
            return
        await self.app(scope, receive, send)


def cors_origins(settings: Settings) -> list[str]:
    origins = [o.strip() for o in (settings.cors_origins or "").split(",") if o.strip()]
    for o in origins:
        if o != "*" and not re.fullmatch(r"https?://[A-Za-z0-9.-]+(:\d{1,5})?", o):
            raise ConfigurationError(f"GGUF_CORS_ORIGINS: {o!r} is not an origin (scheme://host[:port])")
    return origins


def cors_options(settings: Settings) -> dict[str, object] | None:
    """The CORSMiddleware options for the configured origins, or None when CORS is off."""
    origins = cors_origins(settings)
    if not origins:
        return None
    return {
        "allow_origins": origins,
        "allow_credentials": False,  # keys travel in a header the page sets, never as cookies; so never "*" with credentials
        "allow_methods": ["GET", "POST", "OPTIONS"],
        "allow_headers": ["Authorization", "X-Api-Key", "Content-Type"],
        "max_age": 600,
    }


__all__ = [
    "ApiKeyMiddleware", "BodyLimitMiddleware", "CORSMiddleware", "ConfigurationError", "DrainMiddleware", "DrainState",
    "ADMIN_PATHS", "Keys", "PUBLIC_PATHS", "check_startup", "cors_options", "esc", "is_admin", "is_loopback",
    "key_matches", "load_api_keys", "load_keys", "require_admin",
]
