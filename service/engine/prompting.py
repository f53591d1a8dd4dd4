"""Prompts as the engines take them: text or chat messages to tokens, then a generation.

Shared by the single-sequence engine (``service.engine.llama``) and the batched one
(``service.engine.batched``); each provides how to tokenize and how to generate from tokens.
"""

from __future__ import annotations

from typing import Any, Iterator

from ..errors import BadRequest
from .base import Cancel, Chunk, GenerationParams
from .chat_template import BuiltinChatTemplate, ChatTemplate


class Prompting:
    """Counting, rendering and generating for text prompts and chat messages."""

    _template: ChatTemplate | BuiltinChatTemplate | None = None

    def _require(self) -> Any:
        raise NotImplementedError

    def _tokenize(self, text: str, *, add_bos: bool) -> list[int]:
        raise NotImplementedError

    def _generate_tokens(self, tokens: list[int], params: GenerationParams, cancel: Cancel) -> Iterator[Chunk]:
        raise NotImplementedError

    def _chat_prompt(self, messages: list[dict[str, Any]]) -> tuple[str, bool]:
        self._require()
        if self._template is None:
            raise BadRequest("this model has no chat template; use /v1/completions", param="messages")
        return self._template.render(messages)

    def count_tokens(self, text: str) -> int:
        return len(self._tokenize(text, add_bos=True))

    def count_chat_tokens(self, messages: list[dict[str, Any]]) -> int:
        prompt, add_bos = self._chat_prompt(messages)
        return len(self._tokenize(prompt, add_bos=add_bos))

    def complete(self, prompt: str, params: GenerationParams, cancel: Cancel) -> Iterator[Chunk]:
        return self._generate_tokens(self._tokenize(prompt, add_bos=True), params, cancel)

    def chat(self, messages: list[dict[str, Any]], params: GenerationParams, cancel: Cancel) -> Iterator[Chunk]:
        prompt, add_bos = self._chat_prompt(messages)
        return self._generate_tokens(self._tokenize(prompt, add_bos=add_bos), params, cancel)
