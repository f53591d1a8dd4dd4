"""Prompts as the engine takes them: text or chat messages to tokens, then a generation.

The engine (``service.engine.llama``) provides how to tokenize and how to generate from tokens.

Turn markers are the template's, never the client's: a rendered chat prompt is tokenized with
control tokens parsed (``special``), except the messages' own text. A message whose text holds a
control token's spelling (``<end_of_turn>``, ``<start_of_turn>model``) is tokenized as plain text
inside the prompt, so typing a marker cannot forge a turn. (The prompt of /v1/completions is the
client's whole input and keeps llama-server's behaviour: control tokens parsed.)
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

    def _tokenize(self, text: str, *, add_bos: bool, special: bool = True) -> list[int]:
        """Tokens of ``text``; ``special``: control-token spellings become control tokens (llama_tokenize's parse_special)."""
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

    def _chat_tokens(self, messages: list[dict[str, Any]]) -> list[int]:
        """The rendered prompt's tokens, each message's text tokenized as text (see the module docstring)."""
        prompt, add_bos = self._chat_prompt(messages)
        forged = [t for t in _message_texts(messages)
                  if self._tokenize(t, add_bos=False) != self._tokenize(t, add_bos=False, special=False)]
        if not forged:  # nothing in the messages spells a control token: one tokenization, as llama-server's
            return self._tokenize(prompt, add_bos=add_bos)
        spans = _locate(prompt, _message_texts(messages), set(forged))
        tokens: list[int] = []
        pos = 0
        for start, end in spans:
            if start > pos:
                tokens += self._tokenize(prompt[pos:start], add_bos=add_bos and not tokens)
            tokens += self._tokenize(prompt[start:end], add_bos=add_bos and not tokens, special=False)
            pos = end
        if pos < len(prompt):
            tokens += self._tokenize(prompt[pos:], add_bos=add_bos and not tokens)
        return tokens

    def count_chat_tokens(self, messages: list[dict[str, Any]]) -> int:
        return len(self._chat_tokens(messages))

    def complete(self, prompt: str, params: GenerationParams, cancel: Cancel) -> Iterator[Chunk]:
        return self._generate_tokens(self._tokenize(prompt, add_bos=True), params, cancel)

    def chat(self, messages: list[dict[str, Any]], params: GenerationParams, cancel: Cancel) -> Iterator[Chunk]:
        return self._generate_tokens(self._chat_tokens(messages), params, cancel)


def _message_texts(messages: list[dict[str, Any]]) -> list[str]:
    """The client's text in each message, in order (string content, or the text of its text parts)."""
    out: list[str] = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out += [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return [t for t in out if t]


def _locate(prompt: str, texts: list[str], forged: set[str]) -> list[tuple[int, int]]:
    """Where each text in ``forged`` sits in the rendered prompt: spans in order, searched after the previous
    message's text (as a template writes them). A forged text the template changed beyond a trim cannot be
    told from the template's own markers: refused."""
    spans: list[tuple[int, int]] = []
    cursor = 0
    for text in texts:
        for candidate in (text, text.strip()):
            i = prompt.find(candidate, cursor) if candidate else -1
            if i >= 0:
                if text in forged:
                    spans.append((i, i + len(candidate)))
                cursor = i + len(candidate)
                break
        else:
            if text in forged:
                raise BadRequest("a message spells one of the model's control tokens, and the chat template changes "
                                 "it so that it cannot be kept as plain text", param="messages")
    return spans
