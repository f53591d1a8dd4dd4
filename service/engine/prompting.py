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
from .chat_format import ChatFormat, detect, prepare
from .chat_template import BuiltinChatTemplate, ChatTemplate


class Prompting:
    """Counting, rendering and generating for text prompts and chat messages."""

    _template: ChatTemplate | BuiltinChatTemplate | None = None
    _format: ChatFormat | None = None

    def chat_format(self) -> ChatFormat:
        """The loaded template's tool-call format and thinking tags (``chat_format.detect``), read once."""
        fmt = self._format
        if fmt is None:
            template = self._template
            fmt = detect(template.source if template is not None else None)
            if fmt.think is not None and template is not None:
                try:
                    probe, _ = template.render([{"role": "user", "content": "x"}])
                except Exception:  # a template that needs more than a user turn: assume it does not open
                    probe = ""
                if probe.rstrip().endswith(fmt.think[0]):
                    fmt = ChatFormat(fmt.tools, fmt.native_tools, fmt.arguments_as_object, fmt.think, True)
            fmt = fmt.with_special(self._special_tokens(fmt.markers))
            self._format = fmt
        return fmt

    def _special_tokens(self, markers: tuple[str, ...]) -> dict[str, int]:
        """Which markers are a single control token (parsed as one only with ``special``)."""
        out: dict[str, int] = {}
        for m in markers:
            toks = self._tokenize(m, add_bos=False)
            if len(toks) == 1 and self._tokenize(m, add_bos=False, special=False) != toks:
                out[m] = toks[0]
        return out

    def _require(self) -> Any:
        raise NotImplementedError

    def _tokenize(self, text: str, *, add_bos: bool, special: bool = True) -> list[int]:
        """Tokens of ``text``; ``special``: control-token spellings become control tokens (llama_tokenize's parse_special)."""
        raise NotImplementedError

    def _generate_tokens(self, tokens: list[int], params: GenerationParams, cancel: Cancel) -> Iterator[Chunk]:
        raise NotImplementedError

    def _chat_prompt(self, messages: list[dict[str, Any]],
                     tools: list[dict[str, Any]] | None = None) -> tuple[str, bool]:
        self._require()
        if self._template is None:
            raise BadRequest("this model has no chat template; use /v1/completions", param="messages")
        shown, native_tools = prepare(messages, tools, self.chat_format())
        return self._template.render(shown, native_tools)

    def count_tokens(self, text: str) -> int:
        return len(self._tokenize(text, add_bos=True))

    def _chat_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The rendered prompt's tokens, each message's text tokenized as text (see the module docstring)."""
        prompt, add_bos = self._chat_prompt(messages, tools)
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

    def count_chat_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> int:
        return len(self._chat_tokens(messages, tools))

    def complete(self, prompt: str, params: GenerationParams, cancel: Cancel) -> Iterator[Chunk]:
        return self._generate_tokens(self._tokenize(prompt, add_bos=True), params, cancel)

    def chat(self, messages: list[dict[str, Any]], params: GenerationParams, cancel: Cancel,
             tools: list[dict[str, Any]] | None = None) -> Iterator[Chunk]:
        return self._generate_tokens(self._chat_tokens(messages, tools), params, cancel)


def _message_texts(messages: list[dict[str, Any]]) -> list[str]:
    """The client's text in each message, in order (string content, or the text of its text parts)."""
    out: list[str] = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out += [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
        for call in m.get("tool_calls") or ():  # a past call's name and arguments are the client's text too
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict):
                out += [v for v in (fn.get("name"), fn.get("arguments")) if isinstance(v, str)]
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
