"""Thinking split from the answer as text streams in: ``<think>...</think>`` (and the like) to reasoning.

``ReasoningSplitter`` takes the generated text piece by piece and returns (kind, text) pieces, ``reasoning``
or ``content``, holding back only what may still turn out to be a tag (as stop strings are held back).
Thinking is recognised at the start of the output (after whitespace), or from the first character when the
template's generation prompt already opened it (``ChatFormat.thinking_open``).

The modes, as llama-server's ``--reasoning-format``: ``separate`` (llama-server's ``deepseek``: the thinking
goes to ``reasoning_content``, the tags dropped), ``inline`` (``deepseek-legacy``: the thinking also stays
in ``content`` with its tags), ``none`` (no parsing: ``content`` is the text as generated).
"""

from __future__ import annotations

from typing import Literal

ReasoningFormat = Literal["none", "separate", "inline"]
Piece = tuple[Literal["reasoning", "content"], str]


def _held(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` may be the start of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningSplitter:
    """The streaming state: before the output starts, inside the thinking, or in the answer."""

    def __init__(self, tags: tuple[str, str] | None, mode: ReasoningFormat = "separate", *,
                 starts_open: bool = False) -> None:
        self.open, self.close = tags if tags else ("", "")
        self.mode: ReasoningFormat = mode if tags else "none"
        self.state = "thinking" if starts_open and tags else ("start" if tags else "answer")
        self.buf = ""

    def _pieces(self, reasoning: str, content: str) -> list[Piece]:
        out: list[Piece] = []
        if reasoning:
            out.append(("reasoning", reasoning))
        if content:
            out.append(("content", content))
        return out

    def feed(self, text: str) -> list[Piece]:
        if self.mode == "none":
            return [("content", text)] if text else []
        self.buf += text
        out: list[Piece] = []
        while self.buf:
            if self.state == "start":
                stripped = self.buf.lstrip()
                if stripped.startswith(self.open):
                    lead = self.buf[: len(self.buf) - len(stripped)]
                    self.buf = stripped[len(self.open):]
                    self.state = "thinking"
                    if self.mode == "inline":
                        out.append(("content", lead + self.open))
                    continue
                if self.open.startswith(stripped):  # all whitespace, or a prefix of the tag: wait
                    return out
                self.state = "answer"
            if self.state == "thinking":
                i = self.buf.find(self.close)
                if i == -1:
                    keep = _held(self.buf, self.close)
                    emit, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                    out += self._pieces(emit, emit if self.mode == "inline" else "")
                    return out
                thought, self.buf = self.buf[:i], self.buf[i + len(self.close):]
                out += self._pieces(thought, thought + self.close if self.mode == "inline" else "")
                self.state = "after"
                continue
            if self.state == "after":  # the whitespace between the thinking and the answer is neither
                stripped = self.buf.lstrip()
                if not stripped:
                    if self.mode == "inline":
                        out.append(("content", self.buf))
                    self.buf = ""
                    return out
                if self.mode == "inline":
                    out.append(("content", self.buf[: len(self.buf) - len(stripped)]))
                self.buf = stripped
                self.state = "answer"
            out.append(("content", self.buf))
            self.buf = ""
        return out

    def finish(self) -> list[Piece]:
        """What was held back: the end of the output decides (an unclosed thinking stays reasoning)."""
        rest, self.buf = self.buf, ""
        if not rest:
            return []
        if self.state == "thinking":
            return self._pieces(rest, rest if self.mode == "inline" else "")
        if self.state == "after" and self.mode != "inline":
            return []
        return [("content", rest)]
