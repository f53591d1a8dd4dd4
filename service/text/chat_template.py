"""The chat template a loaded model renders with: its own Jinja template (``service.chat.sandbox``), the
operator's (``GGUF_CHAT_TEMPLATE_FILE``), or, for files without one, one of llama.cpp's built-in templates
(``llama_chat_apply_template``), which only llama.cpp can render: so this part lives with the engine.
"""

from __future__ import annotations

import logging
from typing import Any

from jinja2 import TemplateError

from ..chat.sandbox import ChatTemplate, text_content
from ..errors import BadRequest

log = logging.getLogger(__name__)


BUILTIN_BY_ARCH: tuple[tuple[str, str], ...] = (
    ("gemma", "gemma"),
    ("llama", "llama3"),
    ("mistral", "mistral-v7"),
    ("phi3", "phi3"),
    ("qwen", "chatml"),
)


class BuiltinChatTemplate:
    """One of llama.cpp's built-in templates (``llama_chat_apply_template``), for files without one."""

    source: str | None = None
    """No Jinja source: a built-in template renders no tools (``chat_format.detect``: the generic format)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> tuple[str, bool]:
        import ctypes

        import llama_cpp

        keep: list[bytes] = []
        arr = (llama_cpp.llama_chat_message * len(messages))()
        for i, m in enumerate(messages):
            role = str(m.get("role", "user")).encode("utf-8")
            content = text_content(m.get("content")).encode("utf-8")
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


def template_for(llm: Any, override: str | None = None) -> "ChatTemplate | BuiltinChatTemplate | None":
    """The model's template (``override``: a Jinja template given by the operator instead)."""
    source = override or llm.metadata.get("tokenizer.chat_template")
    if not source:
        arch = str(llm.metadata.get("general.architecture", ""))
        name = next((v for k, v in BUILTIN_BY_ARCH if arch.startswith(k)), "chatml")
        return BuiltinChatTemplate(name)

    def piece(tok: int) -> str:
        if tok < 0:
            return ""
        return bytes(llm.detokenize([tok], special=True)).decode("utf-8", "replace")

    try:
        return ChatTemplate(source, piece(llm.token_bos()), piece(llm.token_eos()))
    except TemplateError as exc:
        log.warning("the model's chat template does not compile: %s", exc)
        return None
