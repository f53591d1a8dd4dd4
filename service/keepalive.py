"""keep_alive: how long an idle model stays loaded, with Ollama's semantics (a duration, seconds, 0 or -1)."""

from __future__ import annotations

import math
import re

from .errors import BadRequest

_DURATION_RE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
MAX_KEEP_ALIVE_S = 10 * 365 * 24 * 3600.0
"""Ten years: longer durations are refused (a client's typo, not an intent); -1 is forever."""


def parse_keep_alive(value: object, *, param: str = "keep_alive") -> float:
    """Seconds an idle model stays loaded, with Ollama's semantics: a number of seconds or a Go duration string
    (``"5m"``, ``"1h30m"``, ``"300ms"``, ``"-1"``); 0 unloads after the request; any negative value is forever
    (``math.inf``). Anything else is a ``BadRequest`` naming ``param``."""
    bad = BadRequest(f"{param}: a duration (\"5m\", \"1h30m\"), a number of seconds, 0 or -1", param=param)
    if isinstance(value, bool):
        raise bad
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and 0 < len(value) <= 64:
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            sign = -1.0 if text.startswith("-") else 1.0
            body = text.lstrip("+-")
            parts = _DURATION_RE.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise bad from None
            seconds = sign * sum(float(n) * _UNIT_S[u] for n, u in parts)
    else:
        raise bad
    if math.isnan(seconds):
        raise bad
    if seconds < 0:
        return math.inf
    if seconds > MAX_KEEP_ALIVE_S:
        raise BadRequest(f"{param}: at most ten years; -1 keeps the model loaded", param=param)
    return seconds


def keep_alive_json(seconds: float) -> float:
    """A keep_alive in an answer: seconds, -1 for forever."""
    return -1 if math.isinf(seconds) else round(seconds, 3)


def granted_keep_alive(requested_s: float | None, configured_s: float, *, may_shorten: bool) -> float | None:
    """The keep_alive a request gets (None: its model's configured one, ``configured_s``).

    A client may keep its model loaded longer than configured; only an admin (or every client, with
    ``GGUF_KEEP_ALIVE_POLICY=ollama``: ``may_shorten``) may shorten it or unload the model after the request (0).
    A shorter request is served and its keep_alive dropped, not refused: Ollama's clients send one by default
    (``5m``), and one tenant must not be able to unload a model every other tenant uses."""
    if requested_s is None or may_shorten or requested_s >= configured_s:
        return requested_s
    return None
