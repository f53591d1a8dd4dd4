"""Checks every request body gets before it reaches a route's logic: nesting, text that cannot be encoded, NUL characters.

JSON may carry a lone UTF-16 surrogate (``"\\ud800"``): valid JSON, a Python ``str``, but not text; the first
``.encode("utf-8")`` (tokenizer, file name, log line) would raise. Such a body is a 400 naming the field.

Python's ``json`` recurses once per array or object level and raises ``RecursionError`` (a 500) near
``sys.getrecursionlimit()``; so do ``json.dumps``, templates and pydantic on what it built. Nesting is bounded
before any parse (``json_too_deep``): the body by the body middleware (``service.api.security``), and each JSON
string the service parses itself (a past tool call's ``arguments``) where it is checked, naming the field.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Annotated, Any, Union

from pydantic import Field, StrictFloat, StrictInt, StrictStr

from ..errors import BadRequest

MAX_LOGGED_CHARS = 200
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def esc(value: object, limit: int = MAX_LOGGED_CHARS) -> str:
    """A request-derived string made safe for one log line: control characters escaped, truncated."""
    text = str(value)
    cut = len(text) > limit
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}",
                        text[:limit])
    return text + ("...(truncated)" if cut else "")

KeepAlive = Annotated[
    Union[StrictStr, StrictInt, StrictFloat, None],
    Field(description="How long the model stays loaded once idle (Ollama's keep_alive): a duration (\"5m\", "
          "\"1h30m\"), seconds, 0 (unload after the request) or -1 (never); default: the model's (GGUF_KEEP_ALIVE).",
          union_mode="left_to_right"),
]
"""The body field ``keep_alive`` (parsed by ``service.keepalive.parse_keep_alive``): strings and numbers only."""

_SURROGATE = re.compile(r"[\ud800-\udfff]")

MAX_JSON_DEPTH = 256
"""Deepest nesting of arrays and objects a body, or a JSON string the service parses, may have. Real requests nest
a few dozen levels; a schema up to this deep still reaches its own check (32 levels, ``service.grammar.schema``),
which names the field. Python's parser fails near ``sys.getrecursionlimit()`` (1000), less the stack in use."""

_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
"""Opening brackets to +1, closing ones to -1 (0xff read as a signed byte)."""


def json_too_deep(data: bytes | str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text ``data`` nests arrays and objects deeper than ``limit``; brackets inside strings do not
    count. A text with no more opening brackets than ``limit`` is not scanned at all; the scan runs in C
    (replace, split, translate, accumulate), linear in the text: about 0.4 s for 8 MB at worst, where a regex
    over the strings took seconds for a body of many short ones."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    encoding = json.detect_encoding(raw)  # what json.loads reads a body as (UTF-16 and UTF-32 too)
    if encoding not in ("utf-8", "utf-8-sig"):
        try:
            raw = raw.decode(encoding).encode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            return False  # not text: the parser refuses it before any nesting matters
    # Escapes first (an escaped backslash, then an escaped quote: left to right, as a JSON parser pairs them);
    # then every quote delimits a string, and the even pieces between quotes are outside the strings.
    unescaped = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside = b"".join(unescaped.split(b'"')[::2]).translate(None, _NOT_BRACKETS)
    return max(itertools.accumulate(memoryview(outside.translate(_STEPS)).cast("b")), default=0) > limit


def check_json_depth(text: str, param: str, limit: int = MAX_JSON_DEPTH) -> None:
    """``BadRequest`` naming ``param`` for a JSON string field nested deeper than ``limit``, before it is parsed."""
    if json_too_deep(text, limit):
        raise BadRequest(f"{param}: nests arrays and objects deeper than {limit} levels", param=param)


def _path(parts: list[str | int]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")


def body_surrogate(body: bytes) -> BadRequest | None:
    """The ``BadRequest`` for a JSON body holding a lone surrogate in a string or key (param: its path), else None;
    checked once for every route by the body middleware (``service.api.security``). A UTF-8 body can spell one
    only as an escape, so a body without ``\\uD800``-``\\uDFFF`` escapes is not parsed here; one that is not JSON
    is the route's to refuse."""
    if not _ESCAPED_SURROGATE.search(body) and json.detect_encoding(body) in ("utf-8", "utf-8-sig"):
        return None
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    try:
        reject_surrogates(value)
    except BadRequest as exc:
        return exc
    return None


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
