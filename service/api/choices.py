"""The engine's chunks as what a client reads: per choice, thinking, content and tool calls, streamed or whole.

One path for every API shape (OpenAI chat and completions, Anthropic messages): ``Choices.feed`` takes a
``Chunk`` and returns ``Event`` values in order (the reasoning split first, ``service.api.reasoning``, then
tool-call parsing of the answer, ``service.api.tools``); ``Answer`` collects them for a non-streamed reply,
so a streamed answer reassembles to exactly the non-streamed one.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from ..engine.base import Chunk, TokenLogprob
from ..engine.chat_format import ChatFormat
from .reasoning import ReasoningFormat, ReasoningSplitter
from .tools import ToolCallParser, ToolDelta


@dataclass(frozen=True)
class Event:
    kind: Literal["content", "reasoning", "tool", "logprobs", "finish"]
    index: int
    text: str = ""
    tool: ToolDelta | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    last: Chunk | None = None
    """``finish``: the final chunk (usage, timings)."""
    finish_reason: str = "stop"
    """``finish``: ``stop``, ``length`` or ``tool_calls`` (a call was parsed and the model stopped)."""


class _Choice:
    def __init__(self, fmt: ChatFormat, reasoning: ReasoningFormat, tools: bool) -> None:
        self.split = ReasoningSplitter(fmt.think, reasoning, starts_open=fmt.thinking_open)
        self.parse = ToolCallParser(fmt, enabled=tools)


class Choices:
    """Per-choice state for one generation."""

    def __init__(self, fmt: ChatFormat | None = None, *, reasoning: ReasoningFormat = "none", tools: bool = False) -> None:
        self.fmt = fmt or ChatFormat()
        self.reasoning: ReasoningFormat = reasoning if fmt is not None else "none"
        self.tools = tools
        self._state: dict[int, _Choice] = {}

    def _of(self, index: int) -> _Choice:
        st = self._state.get(index)
        if st is None:
            st = self._state[index] = _Choice(self.fmt, self.reasoning, self.tools)
        return st

    def _answer(self, st: _Choice, index: int, pieces: list[tuple[str, str]], final: bool) -> list[Event]:
        out: list[Event] = []
        for kind, text in pieces:
            if kind == "reasoning":
                out.append(Event("reasoning", index, text=text))
                continue
            for d in st.parse.feed(text):
                out.append(Event("content", index, text=d.content) if d.index < 0 else Event("tool", index, tool=d))
        if final:
            for d in st.parse.finish():
                out.append(Event("content", index, text=d.content) if d.index < 0 else Event("tool", index, tool=d))
        return out

    def feed(self, c: Chunk) -> list[Event]:
        st = self._of(c.index)
        out: list[Event] = []
        if c.text:
            out += self._answer(st, c.index, st.split.feed(c.text), False)
        if c.logprobs:
            out.append(Event("logprobs", c.index, logprobs=c.logprobs))
        if c.finish_reason is not None:
            out += self._answer(st, c.index, st.split.finish(), True)
            reason = "stop" if c.finish_reason in (None, "cancelled") else c.finish_reason
            if st.parse.called and reason == "stop":
                reason = "tool_calls"
            out.append(Event("finish", c.index, last=c, finish_reason=reason))
        return [e for e in out if e.kind != "content" or e.text]


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""


@dataclass
class Answer:
    """One choice, whole: what a non-streamed reply shows."""

    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    last: Chunk = field(default_factory=lambda: Chunk(finish_reason="stop"))
    finish_reason: str = "stop"

    def add(self, e: Event) -> None:
        if e.kind == "content":
            self.content += e.text
        elif e.kind == "reasoning":
            self.reasoning += e.text
        elif e.kind == "tool" and e.tool is not None:
            if e.tool.id is not None:
                self.calls.append(ToolCall(e.tool.id, e.tool.name or ""))
            elif self.calls:
                self.calls[-1].arguments += e.tool.arguments
        elif e.kind == "logprobs":
            self.logprobs += list(e.logprobs)
        elif e.kind == "finish" and e.last is not None:
            self.last, self.finish_reason = e.last, e.finish_reason


def usage_last(answers: dict[int, Answer]) -> Chunk:
    """One usage for every choice: the prompt once (evaluated once), the completions summed."""
    first = answers[min(answers)].last if answers else Chunk(finish_reason="stop")
    return replace(first, completion_tokens=sum(a.last.completion_tokens for a in answers.values()))


def tool_calls_json(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
