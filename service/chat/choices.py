"""The engine's chunks as what a client reads: per choice, thinking, content and tool calls, streamed or whole.

One path for every API shape (OpenAI chat and completions, Anthropic messages): ``Choices.feed`` takes a
``Chunk`` and returns ``Event`` values in order (the reasoning split first, ``service.chat.reasoning``, then
tool-call parsing of the answer, ``service.chat.tools``); ``Answer`` collects them for a non-streamed reply,
so a streamed answer reassembles to exactly the non-streamed one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from ..engine.base import Chunk, GenerationParams, TokenLogprob
from .format import ChatFormat
from ..errors import BadRequest
from .reasoning import Piece, ReasoningFormat, ReasoningSplitter
from .tools import ToolCallParser, ToolDelta, value_end


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


JsonConstraint = Literal["object", "schema"]
"""``response_format``: ``json_object`` (an object) or ``json_schema`` (a value of the schema)."""


class _Choice:
    def __init__(self, fmt: ChatFormat, reasoning: ReasoningFormat, tools: bool, forced: bool,
                 json_kind: JsonConstraint | None) -> None:
        # A response_format grammar constrains the output from its first token and writes no thinking tags: the
        # whole output is the answer even where the template's generation prompt opened the thinking
        # (thinking_open), so the split starts outside it and the JSON is never taken for reasoning. A thinking
        # the output itself opens (a grammar that allows one first) is still split.
        # Beside tools the grammar is the tools' (calls or the answer), which starts with the thinking it opened.
        self.split = ReasoningSplitter(fmt.think, reasoning,
                                       starts_open=fmt.thinking_open and (json_kind is None or tools))
        # Forced calls are call syntax only, unless thinking reaches the parser as text (reasoning none/inline).
        self.parse = ToolCallParser(fmt, enabled=tools, forced=forced,
                                    calls_only=forced and (fmt.think is None or reasoning == "separate"))
        self.json_kind = json_kind
        self.answer: list[str] = []
        """The content so far (constrained output only: what the end is checked against)."""


def json_constraint(params: GenerationParams) -> JsonConstraint | None:
    return "schema" if params.json_schema is not None else "object" if params.json_object else None


def _whole_json(text: str, kind: JsonConstraint) -> bool:
    """Whether ``text`` is one whole JSON value (an object for ``json_object``). The engine masks every token the
    grammar forbids, and allows the end of generation only once the grammar accepts; what a failed grammar leaves
    (nothing, a value cut short, a stray token after one) is not a whole value. The text is all the HTTP layer
    sees of the grammar's state, so this is the check it can make."""
    try:
        value = json.loads(text)
    except RecursionError:  # deeper than Python's parser goes (json_object allows any depth): balanced brackets
        s = text.strip()
        return s[:1] in "{[" and value_end(s, 0) == len(s) and (kind == "schema" or s[0] == "{")
    except ValueError:
        return False
    return kind == "schema" or isinstance(value, dict)


class Choices:
    """Per-choice state for one generation.

    ``forced``: ``tool_choice`` required or a named function (the grammar writes calls only). ``json_kind``: a
    ``response_format`` grammar constrains the answer. Either way the end is checked: an answer the model ended
    (an end-of-generation token, not ``max_tokens``, not one of the request's stop strings) while it was cut or
    empty means the grammar failed (a schema that cannot be satisfied: a recursion it requires; a ``logit_bias``
    that bans what it needs), and the request fails with a 400 naming the field instead of a ``stop`` with
    invalid content. Cut by ``max_tokens`` it is ``length``, as OpenAI reports it (a partial call included).
    """

    def __init__(self, fmt: ChatFormat | None = None, *, reasoning: ReasoningFormat = "none", tools: bool = False,
                 forced: bool = False, json_kind: JsonConstraint | None = None, biased: bool = False) -> None:
        self.fmt = fmt or ChatFormat()
        self.reasoning: ReasoningFormat = reasoning if fmt is not None else "none"
        self.tools = tools
        self.forced = forced and tools
        self.json_kind = json_kind
        self.biased = biased
        """The request has a ``logit_bias`` (named in the error as a likely cause)."""
        self._state: dict[int, _Choice] = {}

    def _of(self, index: int) -> _Choice:
        st = self._state.get(index)
        if st is None:
            st = self._state[index] = _Choice(self.fmt, self.reasoning, self.tools, self.forced, self.json_kind)
        return st

    def _check_end(self, st: _Choice, c: Chunk) -> None:
        """``BadRequest`` when the model ended a constrained answer before the grammar accepted it."""
        if c.finish_reason != "stop" or c.stop_sequence is not None:
            return  # length: cut, and said so; cancelled: nobody reads it; a stop string: the client's own cut
        if st.json_kind is not None and not st.parse.called and not _whole_json("".join(st.answer), st.json_kind):
            raise BadRequest(
                "response_format: the model ended its answer before the "
                + ("JSON object" if st.json_kind == "object" else "schema") + " was complete: the schema cannot be "
                "satisfied (a recursion it requires, a pattern beyond the grammar's limits)"
                + (" or logit_bias bans the tokens it needs" if self.biased else ""), param="response_format")
        if st.parse.cut:
            param = "tool_choice" if self.forced else "tools"
            raise BadRequest(f"{param}: the model ended its answer inside a tool call: the call's schema cannot be "
                             "satisfied" + (" or logit_bias bans the tokens it needs" if self.biased else ""),
                             param=param)

    def _answer(self, st: _Choice, index: int, pieces: list[Piece], final: bool) -> list[Event]:
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
        if st.json_kind is not None:
            st.answer += [e.text for e in out if e.kind == "content"]
        if c.finish_reason is not None:
            self._check_end(st, c)
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
