"""Chat templates from GGUF metadata, rendered in a sandbox with a time and a size limit.

A template comes from the model file (``tokenizer.chat_template``), i.e. from
whoever published the file, so it renders in Jinja's immutable sandbox, and:

- a template that reaches for Python internals fails that request with 400 (and is logged);
- every value it builds is bounded: ``*``, ``**``, ``+``, ``%``, ``~``, calls, filters and
  namespace assignments refuse a string or list beyond ``MAX_RENDERED_CHARS`` *before*
  allocating it where the size is known in advance (``"x" * 10**9``, ``"x"|center(10**9)``);
- the render has a deadline (``RENDER_TIMEOUT_S``), checked on every line the template's
  Python executes (a per-thread trace hook, only while rendering): nested loops end with a
  400 instead of holding the engine thread.
"""

from __future__ import annotations

import functools
import logging
import re
import sys
import time
from types import FrameType
from typing import Any, Callable

from jinja2 import TemplateError, nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import SecurityError
from jinja2.runtime import markup_join, str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from ..errors import BadRequest

log = logging.getLogger(__name__)

MAX_RENDERED_CHARS = 4 * 1024 * 1024
"""Largest rendered prompt, and largest value (string, list) a template may build, characters."""
RENDER_TIMEOUT_S = 2.0
"""Time limit of one render; real templates take about a millisecond."""
MAX_EXPONENT = 256
MAX_INT_BITS = 1 << 16
"""Largest integer a template may build by ``*`` or ``**`` (a huge one is a single uninterruptible C operation)."""


class RenderTimeout(BaseException):
    """Raised inside the template's frames at the deadline; a BaseException so no ``except Exception`` swallows it."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0


def _bound(value: Any) -> Any:
    if _size(value) > MAX_RENDERED_CHARS:
        raise SecurityError(f"the template built a value of {_size(value)} items (limit {MAX_RENDERED_CHARS})")
    return value


def _check_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse a call whose arguments announce a huge result: a large count, width or value."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_RENDERED_CHARS:
            raise SecurityError(f"the template passed {a} to a call (limit {MAX_RENDERED_CHARS})")
        _bound(a)


_FORMAT_WIDTH = re.compile(r"%[-#0 +]*(\d+)?(?:\.(\d+))?")


class _BoundedNamespace(Namespace):
    def __setitem__(self, name: str, value: Any) -> None:
        super().__setitem__(name, _bound(value))


class _BoundedCodeGenerator(CodeGenerator):
    """``a ~ b`` goes through the environment, so a concatenation is bounded like ``+``."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.bounded_concat(context, (")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, with every value a template builds bounded in size."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _BoundedCodeGenerator

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.filters = {name: _bounded_filter(f) for name, f in self.filters.items()}
        self.globals["namespace"] = _BoundedNamespace

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # Jinja's sandbox answers an unsafe attribute with an undefined that stays silent when printed;
        # reaching for internals is an attack, not a typo: fail the request.
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} object is unsafe")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > MAX_EXPONENT:
            raise SecurityError(f"the template raised to the power {right} (limit {MAX_EXPONENT})")
        if operator in ("*", "**") and isinstance(left, int) and isinstance(right, int):
            bits = left.bit_length() * abs(right) if operator == "**" else left.bit_length() + right.bit_length()
            if bits > MAX_INT_BITS:
                raise SecurityError(f"the template built an integer of about {bits} bits (limit {MAX_INT_BITS})")
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if _size(seq) and isinstance(n, int) and _size(seq) * n > MAX_RENDERED_CHARS:
                    raise SecurityError("the template repeated a value beyond the size limit")
        if operator == "+" and _size(left) + _size(right) > MAX_RENDERED_CHARS:
            raise SecurityError("the template concatenated values beyond the size limit")
        if operator == "%" and isinstance(left, str):
            for width, precision in _FORMAT_WIDTH.findall(left):
                if max(int(width or 0), int(precision or 0)) > MAX_RENDERED_CHARS:
                    raise SecurityError("the template formatted with a width beyond the size limit")
        return _bound(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (Jinja's signature)
        _check_args(args, kwargs)
        return _bound(super().call(__context, __obj, *args, **kwargs))

    def bounded_concat(self, context: Any, values: tuple[Any, ...]) -> str:
        parts = [v if isinstance(v, str) else str(v) for v in values]
        if sum(len(p) for p in parts) > MAX_RENDERED_CHARS:
            raise SecurityError("the template concatenated values beyond the size limit")
        join = markup_join if context.eval_ctx.volatile or context.eval_ctx.autoescape else str_join
        return join(parts)


def _bounded_filter(f: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(f)  # keeps jinja_pass_arg (pass_context, pass_environment...)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _check_args(args[1:], kwargs)  # the first is the filtered value (or the context)
        return _bound(f(*args, **kwargs))

    return bounded


def _with_deadline(fn: Callable[[], Any], timeout_s: float) -> Any:
    """Run ``fn``, raising ``RenderTimeout`` in its frames once ``timeout_s`` has passed.

    A trace function on this thread only, for the duration of the call: it sees every line the
    template's compiled Python runs (loops included), which a thread-with-a-deadline cannot stop.
    """
    deadline = time.monotonic() + timeout_s
    lines = 0

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal lines
        lines += 1
        if lines & 127 == 0 and time.monotonic() > deadline:
            raise RenderTimeout()
        return local

    def global_(frame: FrameType, event: str, arg: Any) -> Any:
        return local

    previous = sys.gettrace()
    sys.settrace(global_)
    try:
        return fn()
    finally:
        sys.settrace(previous)


def check_template(source: str | None) -> None:
    """``ValueError`` naming the line when ``source`` (an operator's template, ``GGUF_CHAT_TEMPLATE_FILE``) does not
    compile in the sandbox that renders it; None passes (no template given)."""
    if source is None:
        return
    try:
        ChatTemplate(source, "", "")
    except TemplateError as exc:
        line = getattr(exc, "lineno", None)
        raise ValueError("GGUF_CHAT_TEMPLATE_FILE is not a valid chat template"
                         + (f" (line {line})" if line else "") + f": {exc}") from None


class ChatTemplate:
    """A compiled chat template and the special tokens it refers to."""

    def __init__(self, source: str, bos_token: str, eos_token: str, timeout_s: float = RENDER_TIMEOUT_S) -> None:
        env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        self._template = env.from_string(source)
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.timeout_s = timeout_s

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> tuple[str, bool]:
        """The prompt text, and whether a BOS token must still be added (the template did not).

        ``tools``: the request's tools, as Hugging Face templates and llama-server give them (None: none)."""
        def render() -> str:
            out: list[str] = []
            size = 0
            extra = {"tools": tools} if tools else {}  # absent, not None: templates test ``tools is defined``
            for piece in self._template.generate(
                messages=messages, add_generation_prompt=True, bos_token=self.bos_token, eos_token=self.eos_token,
                **extra,
            ):
                size += len(piece)
                if size > MAX_RENDERED_CHARS:
                    raise BadRequest("the rendered chat prompt is too large", param="messages")
                out.append(piece)
            return "".join(out)

        try:
            text = _with_deadline(render, self.timeout_s)
        except RenderTimeout:
            log.warning("chat template: render stopped at its %.1f s limit", self.timeout_s)
            raise BadRequest(
                f"the chat template did not finish within {self.timeout_s:g} s", param="messages"
            ) from None
        except MemoryError as exc:
            log.warning("chat template: out of memory while rendering")
            raise BadRequest("the chat template used too much memory", param="messages") from exc
        except SecurityError as exc:
            log.warning("chat template refused an unsafe operation: %s", exc)
            raise BadRequest("the chat template attempted an unsafe operation", param="messages") from exc
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
            raise BadRequest(f"the chat template failed on these messages: {exc}", param="messages") from exc
        if len(text) > MAX_RENDERED_CHARS:
            raise BadRequest("the rendered chat prompt is too large", param="messages")
        add_bos = not (self.bos_token and text.startswith(self.bos_token))
        return text, add_bos


# llama.cpp's built-in templates (llm_chat_template names) for files that carry no template.
def text_content(content: Any) -> str:
    """OpenAI message content: a string, or a list of parts of which the text parts count."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    raise BadRequest("message content must be a string or a list of text parts", param="messages")
