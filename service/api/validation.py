"""Checks every request body gets before it reaches a route's logic: text that cannot be encoded, NUL characters.

JSON may carry a lone UTF-16 surrogate (``"\\ud800"``): valid JSON, a Python ``str``, but not text; the first
``.encode("utf-8")`` (tokenizer, file name, log line) would raise. Such a body is a 400 naming the field.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Union

from pydantic import Field, StrictFloat, StrictInt, StrictStr

from ..errors import BadRequest

KeepAlive = Annotated[
    Union[StrictStr, StrictInt, StrictFloat, None],
    Field(description="How long the model stays loaded once idle (Ollama's keep_alive): a duration (\"5m\", "
          "\"1h30m\"), seconds, 0 (unload after the request) or -1 (never); default: the model's (GGUF_KEEP_ALIVE).",
          union_mode="left_to_right"),
]
"""The body field ``keep_alive`` (parsed by ``service.keepalive.parse_keep_alive``): strings and numbers only."""

_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _path(parts: list[str | int]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def reject_surrogates(value: Any, root: str = "") -> None:
    """``BadRequest`` (param: the field's path) for the first string, key included, holding a lone surrogate.

    Walks iteratively: a deeply nested body cannot exhaust the stack.
    """
    stack: list[tuple[Any, list[str | int]]] = [(value, [root] if root else [])]
    while stack:
        node, where = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                param = _path(where) or None
                raise BadRequest(f"{param or 'the request'}: contains a lone UTF-16 surrogate, which is not text",
                                 param=param)
        elif isinstance(node, dict):
            for k, v in node.items():
                if isinstance(k, str) and _SURROGATE.search(k):
                    param = _path(where) or None
                    raise BadRequest(f"{param or 'the request'}: a key contains a lone UTF-16 surrogate", param=param)
                stack.append((v, [*where, str(k)]))
        elif isinstance(node, (list, tuple)):
            stack.extend((v, [*where, i]) for i, v in enumerate(node))
