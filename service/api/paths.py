"""Host paths out of answers: no client learns where the server keeps its files.

A model's file, the prompt cache's folder, a projector, a key file: their absolute paths reach messages (llama.cpp's
and ours) and values (a plan's ``source``, the prompt cache's ``disk_dir``). An answer to a client names a file by
its last component only (a model's file name is its name, which the client already uses); the full path stays in
the server's log, and admins see it in ``/api/models`` and the dry run (docs/api.md, "What admins see").

A host path here is an absolute path whose first folder exists at this host's root (``/root``, ``/home``, ``/tmp``,
``/var``, a container's ``/models``...), written as a word of its own: URL paths (``/v1/models``: there is no
``/v1`` folder) and paths inside URLs (after a host name) are left alone.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache
from typing import Any

_PATH = re.compile(r"(?<![\w.~:/-])/[^\s'\"`,;()\[\]{}<>|]+")


@lru_cache(maxsize=1)
def _roots() -> frozenset[str]:
    """The folders at this host's root (read once: they do not come and go while the server runs)."""
    try:
        return frozenset(e.name for e in os.scandir("/") if e.is_dir(follow_symlinks=True))
    except OSError:
        return frozenset()


def _one(m: re.Match[str]) -> str:
    path = m.group(0)
    first = path[1:].split("/", 1)[0]
    if first not in _roots():
        return path
    last = path.rstrip("/").rsplit("/", 1)[-1]
    return last or "/"


def redact_text(text: str) -> str:
    """``text`` with every host path cut to its last component."""
    return _PATH.sub(_one, text) if "/" in text else text


def redact(value: Any) -> Any:
    """A JSON value with every string's host paths cut (``redact_text``), keys and structure kept."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {k: redact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    if isinstance(value, tuple):
        return tuple(redact(v) for v in value)
    return value


__all__ = ["redact", "redact_text"]
