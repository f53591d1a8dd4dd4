"""Chat templates from GGUF metadata, rendered in a sandbox.

A template comes from the model file (``tokenizer.chat_template``), i.e. from
whoever published the file, so it renders in Jinja's immutable sandbox with a
bound on its output; a template that reaches for Python internals fails that
request with 400.
"""

from __future__ import annotations

import logging
from typing import Any

from jinja2 import TemplateError
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import BadRequest

log = logging.getLogger(__name__)

MAX_RENDERED_CHARS = 4 * 1024 * 1024


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


class ChatTemplate:
    """A compiled chat template and the special tokens it refers to."""

    def __init__(self, source: str, bos_token: str, eos_token: str) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        self._template = env.from_string(source)
        self.bos_token = bos_token
        self.eos_token = eos_token

    @classmethod
    def from_llama(cls, llm: Any) -> "ChatTemplate | BuiltinChatTemplate | None":
        source = llm.metadata.get("tokenizer.chat_template")
        if not source:
            arch = str(llm.metadata.get("general.architecture", ""))
            name = next((v for k, v in BUILTIN_BY_ARCH if arch.startswith(k)), "chatml")
            return BuiltinChatTemplate(name)

        def piece(tok: int) -> str:
            if tok < 0:
                return ""
            return bytes(llm.detokenize([tok], special=True)).decode("utf-8", "replace")

        try:
            return cls(source, piece(llm.token_bos()), piece(llm.token_eos()))
        except TemplateError as exc:
            log.warning("the model's chat template does not compile: %s", exc)
            return None

    def render(self, messages: list[dict[str, Any]]) -> tuple[str, bool]:
        """The prompt text, and whether a BOS token must still be added (the template did not)."""
        try:
            text = self._template.render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
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
BUILTIN_BY_ARCH: tuple[tuple[str, str], ...] = (
    ("gemma", "gemma"),
    ("llama", "llama3"),
    ("mistral", "mistral-v7"),
    ("phi3", "phi3"),
    ("qwen", "chatml"),
)


class BuiltinChatTemplate:
    """One of llama.cpp's built-in templates (``llama_chat_apply_template``), for files without one."""

    def __init__(self, name: str) -> None:
        self.name = name

    def render(self, messages: list[dict[str, Any]]) -> tuple[str, bool]:
        import ctypes

        import llama_cpp

        keep: list[bytes] = []
        arr = (llama_cpp.llama_chat_message * len(messages))()
        for i, m in enumerate(messages):
            role = str(m.get("role", "user")).encode("utf-8")
            content = _text_content(m.get("content")).encode("utf-8")
            keep += [role, content]
            arr[i].role = role
            arr[i].content = content
        size = 4096 + sum(len(b) for b in keep) * 2
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_chat_apply_template(self.name.encode(), arr, len(messages), True, buf, size)
            if n < 0:
                raise BadRequest(f"llama.cpp's '{self.name}' chat template cannot render these messages", param="messages")
            if n <= size:
                return buf.raw[:n].decode("utf-8", "replace"), True
            size = n + 1
        raise BadRequest("the rendered chat prompt is too large", param="messages")  # pragma: no cover


def _text_content(content: Any) -> str:
    """OpenAI message content: a string, or a list of parts of which the text parts count."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    raise BadRequest("message content must be a string or a list of text parts", param="messages")
