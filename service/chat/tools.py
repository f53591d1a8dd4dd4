"""Tool calling: the request's tools checked, the grammar that constrains calls, and the calls parsed as they stream.

- ``check_tools`` validates ``tools`` and ``tool_choice`` (names, parameter schemas within the structured-output
  bounds) and picks the tools a choice allows.
- ``tool_grammar`` writes an llguidance Lark grammar (``GenerationParams.lark``) in the model's native format
  (``service.chat.format``): ``required`` and a named choice constrain the whole output to calls whose
  arguments match the function's JSON schema (``%json``); ``auto`` leaves the text free until the format's
  trigger (``<tool_call>``, ``[TOOL_CALLS]``, ``{"name": "``, ``{"tool_calls": [``) and constrains what follows
  (a lazy lexeme, llguidance's answer to llama.cpp's lazy grammars).
- ``ToolCallParser`` turns the generated text into content and tool-call deltas (index, id, name, argument
  fragments) as it arrives: the text before a trigger is content, held back only while it may be a trigger;
  a call's arguments stream as the model writes them. Non-streamed answers run the same parser, so a streamed
  call reassembles to exactly the non-streamed one. Under a forced choice (``required``, a named function) the
  text is call syntax only: a call cut by max_tokens is a partial call or nothing, never content; ``cut`` says
  when the output ended inside a call (``service.chat.choices`` decides ``length`` or an error from it).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from ..errors import BadRequest
from ..grammar.schema import JSON_OPTIONS, bounded_schema, check_schema_bounds
from .format import ChatFormat

MAX_TOOLS = 128
"""Most tools one request may declare (OpenAI's limit)."""
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
"""A function's name (``fullmatch``): OpenAI's ``^[a-zA-Z0-9_-]{1,64}$`` and the dot; also a message's ``name``."""
CALL_ID = re.compile(r"[A-Za-z0-9_.:-]{1,256}")
"""A tool call's id (``fullmatch``): what OpenAI (``call_...``), Anthropic (``toolu_...``) and other clients write.
Names and ids reach the prompt; neither can spell a turn marker (no ``<``, ``|``, ``[``, whitespace)."""
EMPTY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolDelta:
    """A piece of a streamed answer: content text, or part of tool call ``index`` (its id and name come first)."""

    content: str = ""
    index: int = -1
    id: str | None = None
    name: str | None = None
    arguments: str = ""


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def check_name(value: Any, param: str) -> None:
    """``BadRequest`` naming ``param`` unless ``value`` is a function name (``NAME``)."""
    if not isinstance(value, str) or not NAME.fullmatch(value):
        raise BadRequest(f"{param}: 1 to 64 characters of A-Z, a-z, 0-9, _, . and -", param=param)


def check_call_id(value: Any, param: str) -> str:
    """``value`` when it is a tool call id (``CALL_ID``), else ``BadRequest`` naming ``param``."""
    if not isinstance(value, str) or not CALL_ID.fullmatch(value):
        raise BadRequest(f"{param}: a tool call id, 1 to 256 characters of A-Z, a-z, 0-9, _, ., : and -", param=param)
    return value


def check_tools(tools: list[dict[str, Any]] | None, choice: Any, param: str = "tools") -> list[dict[str, Any]]:
    """The tools the model may call under ``choice`` (all of them, the named one, none), in OpenAI's shape.

    ``BadRequest`` for a malformed tool (a name beyond ``[A-Za-z0-9_.-]{1,64}``, twice the same name, parameters
    that are not an object schema within the structured-output bounds) or a choice naming no declared tool."""
    tools = tools or []
    if len(tools) > MAX_TOOLS:
        raise BadRequest(f"{param}: at most {MAX_TOOLS} tools", param=param)
    seen: set[str] = set()
    for i, t in enumerate(tools):
        fn = t.get("function")
        where = f"{param}[{i}]"
        if t.get("type") != "function" or not isinstance(fn, dict):
            raise BadRequest(f"{where}: a tool is {{\"type\": \"function\", \"function\": {{...}}}}", param=where)
        check_name(fn.get("name"), f"{where}.function.name")
        name: str = fn["name"]
        if name in seen:
            raise BadRequest(f"{where}.function.name: '{name}' is declared twice", param=f"{where}.function.name")
        seen.add(name)
        schema = fn.get("parameters")
        if schema is not None:
            if not isinstance(schema, dict) or schema.get("type", "object") != "object":
                raise BadRequest(f"{where}.function.parameters: a JSON schema of an object", param=f"{where}.function.parameters")
            try:
                check_schema_bounds(schema)
            except BadRequest as exc:
                raise BadRequest(exc.message.replace("response_format", f"{where}.function.parameters"),
                                 param=f"{where}.function.parameters") from None
    if choice is None or choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise BadRequest("tool_choice: 'required' needs tools", param="tool_choice")
        return [] if choice == "none" else tools
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        chosen = [t for t in tools if t["function"]["name"] == name]
        if not chosen:
            raise BadRequest(f"tool_choice: no tool named {str(name)[:64]!r} among the tools", param="tool_choice")
        return chosen
    raise BadRequest("tool_choice: 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                     param="tool_choice")


# -- grammars (llguidance Lark) ---------------------------------------------------------------------------


def _lit(s: str) -> str:
    return json.dumps(s)


def _marker(text: str, fmt: ChatFormat) -> str:
    """A marker as a grammar item: its control token when the vocabulary has one, else its characters."""
    tok = fmt.special.get(text)
    return f"<[{tok}]>" if tok is not None else _lit(text)


def _args_key(fmt: ChatFormat) -> str:
    return "parameters" if fmt.tools == "llama3" else "arguments"


def _call_rules(tools: list[dict[str, Any]], fmt: ChatFormat, *, opened: bool = False) -> list[str]:
    """One rule per tool: ``{"name": "<name>", "arguments": <schema>}`` written as json.dumps writes it.

    ``opened``: the text up to the name's opening quote was the trigger (``{"name": "``)."""
    rules = []
    key = _args_key(fmt)
    for i, t in enumerate(tools):
        fn = t["function"]
        # JSON as json.dumps writes it (grammar.JSON_OPTIONS): flexible whitespace lets a small model wander
        # into newlines and indentation (measured: 24 tokens in 38 s on gemma-3-270m instead of 16 in 4 s).
        # Numbers with at most 16 integer and 10 fraction digits where the schema leaves them open, objects closed
        # to the keys they list where it says nothing of others (grammar.bounded_schema).
        schema = json.dumps({**bounded_schema(fn.get("parameters") or EMPTY_OBJECT), "x-guidance": JSON_OPTIONS},
                            separators=(",", ":"))
        head = "" if opened else '{"name": "'
        rules.append(f'call_{i}: {_lit(head + fn["name"] + chr(34) + ", " + _lit(key) + ": ")} %json {schema} "}}"')
    return rules


def tool_grammar(fmt: ChatFormat, tools: list[dict[str, Any]], *, required: bool, parallel: bool,
                 answer: dict[str, Any] | None = None) -> str | None:
    """The Lark grammar constraining tool calls (None: no tools to call).

    ``answer``: the JSON schema an answer that is not a call follows (``response_format`` beside tools, as an agent
    with an output type sends them): the output is then the calls or one JSON value of it, after any thinking."""
    if not tools:
        return None
    calls = " | ".join(f"call_{i}" for i in range(len(tools)))
    lines = ["%llguidance {}"]
    sep = {"hermes": '"\\n"', "mistral": '", "', "llama3": '"; "', "generic": '", "'}[fmt.tools]
    more = f"({sep} block)*" if parallel else ""
    if fmt.tools == "hermes":
        block = f'{_marker("<tool_call>", fmt)} "\\n" call "\\n" {_marker("</tool_call>", fmt)}'
        trigger, body = "<tool_call>", f'"\\n" call "\\n" {_marker("</tool_call>", fmt)}'
    elif fmt.tools == "mistral":
        block = "call"
        trigger, body = "[TOOL_CALLS]", f'"[" call{more.replace("block", "call")} "]"'
    elif fmt.tools == "llama3":
        block = "call"
        trigger, body = '{"name": "', "callo"
    else:
        block = "call"
        trigger, body = '{"tool_calls": [', f'call{more.replace("block", "call")} "]}}"'
    think = ""
    if fmt.think is not None:
        o, c = fmt.think
        # The thinking ends at its first closing tag (a lazy lexeme), then whitespace, then the calls.
        think = "thought SP? " if fmt.thinking_open else "(thought SP?)? "
        lines.append(f"thought[lazy]: {'' if fmt.thinking_open else _marker(o, fmt) + ' '}/(.|\\n)*/ {_marker(c, fmt)}")
        # Bounded: unbounded, a small model writes whitespace after its thinking until max_tokens instead of the
        # call (measured: the embedded model under a thinking template with a system message, 200 tokens of "\n  ").
        lines.append("SP: /[ \\t\\n]{1,8}/")
    if required:
        if fmt.tools == "mistral":
            lines.append(f'start: {think}{_marker("[TOOL_CALLS]", fmt)} "[" call{more.replace("block", "call")} "]"')
        elif fmt.tools == "generic":
            lines.append(f'start: {think}"{{\\"tool_calls\\": [" call{more.replace("block", "call")} "]}}"')
        else:
            lines.append(f"start: {think}block{more}")
            lines.append(f"block: {block}")
        lines.append(f"call: {calls}")
        lines += _call_rules(tools, fmt)
        return "\n".join(lines)
    trig = _marker(trigger, fmt) if trigger in fmt.special else _lit(trigger)
    if answer is not None:
        schema = json.dumps({**bounded_schema(answer), "x-guidance": JSON_OPTIONS}, separators=(",", ":"))
        lines.append(f"start: {think}(answer | {trig} {body})")
        lines.append(f"answer: %json {schema}")
    else:
        # auto: free text, then a call wherever the trigger appears (the lazy lexeme ends at the trigger's first
        # match)
        lines.append(f"start: {think if fmt.thinking_open else ''}(tagged)* TAIL")  # open thinking first, then free
        lines.append("TAIL: /(.|\\n)*/")
        if trigger in fmt.special:
            lines.append(f"tagged: TAIL {trig} {body}")
        else:
            lines.append(f"trig[lazy]: TAIL {trig}")
            lines.append(f"tagged: trig {body}")
    lines.append(f"call: {calls}")
    if fmt.tools == "llama3":
        lines.append("callo: " + " | ".join(f"call_{i}" for i in range(len(tools))))
        lines += _call_rules(tools, fmt, opened=True)
    else:
        lines += _call_rules(tools, fmt)
    return "\n".join(lines)


# -- parsing ------------------------------------------------------------------------------------------------

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def value_end(s: str, i: int) -> int | None:
    """Where the JSON value starting at ``s[i]`` (after whitespace) ends; None while it is incomplete."""
    n = len(s)
    while i < n and s[i] in " \t\r\n":
        i += 1
    if i >= n:
        return None
    if s[i] in "{[":
        depth, j, in_str = 0, i, False
        while j < n:
            ch = s[j]
            if in_str:
                if ch == "\\":
                    j += 1
                elif ch == '"':
                    in_str = False
            elif ch == '"':
                in_str = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    if s[i] == '"':
        j = i + 1
        while j < n:
            if s[j] == "\\":
                j += 2
                continue
            if s[j] == '"':
                return j + 1
            j += 1
        return None
    m = re.compile(r"-?[0-9.eE+-]+|true|false|null").match(s, i)
    if m and m.end() < n:
        return m.end()
    return None


def _held(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


_FORMATS: dict[str, tuple[str, bool, str, str, str]] = {
    # trigger, the object starts at the trigger, after the trigger, between calls, after the calls
    "hermes": ("<tool_call>", False, r"\s*", r"\s*</tool_call>\s*<tool_call>\s*", r"\s*</tool_call>"),
    "mistral": ("[TOOL_CALLS]", False, r"\s*\[\s*", r"\s*,\s*", r"\s*\]"),
    "llama3": ('{"name"', True, r"", r"\s*;\s*", r""),
    "generic": ('{"tool_calls"', False, r'\s*:\s*\[\s*', r"\s*,\s*", r"\s*\]\s*\}"),
}


class ToolCallParser:
    """Generated text in, ``ToolDelta`` pieces out (``feed`` per piece, ``finish`` at the end).

    A call goes out whole: its id and name, then its arguments in one piece, once the arguments' JSON value is
    complete. A call the output cuts short (``max_tokens``, a stop string) is never sent, streamed or not: its
    arguments would not parse, and an agent that ran it would run a call the model never finished (openai-agents
    took one for a call and failed; llama-server's parser drops it too). The answer then has the whole calls before
    it, and ``cut`` says one was dropped (``finish_reason: length``)."""

    def __init__(self, fmt: ChatFormat, *, enabled: bool = True, forced: bool = False,
                 calls_only: bool = False) -> None:
        """``forced``: ``tool_choice`` required or named, whose grammar ends only after a whole call.
        ``calls_only``: forced, and no thinking reaches the parser as text (the split takes it): everything it
        sees is call syntax, so what is not a whole call is a call cut short, never content."""
        self.trigger, self.keep, self.after, self.between, self.close = _FORMATS[fmt.tools]
        self.enabled = enabled
        self.forced = forced and enabled
        self.calls_only = calls_only and self.forced
        self.buf = ""
        self.state = "text"
        self.n_calls = 0
        self._args_start = -1
        self._id: str | None = None
        self._name = ""
        self._sent = False
        self._cut = False
        self._stray = False
        self._lead: str | None = None
        """From a trigger to a call's head: the text consumed so far (content again if no call follows)."""

    @property
    def called(self) -> bool:
        return self.n_calls > 0

    @property
    def cut(self) -> bool:
        """After ``finish``: the output ended inside a call's syntax (a call begun and not closed, its closing
        marker missing) or, forced, with no whole call. The grammar allows the end of generation only after a
        whole call, so a cut that the model ended (not max_tokens, not a stop string) means the grammar failed."""
        return self._cut or (self.forced and (self._stray or not self.n_calls))

    def feed(self, text: str) -> list[ToolDelta]:
        if not self.enabled:
            return [ToolDelta(content=text)] if text else []
        self.buf += text
        return self._calls_only(self._run(final=False))

    def finish(self) -> list[ToolDelta]:
        if not self.enabled:
            return []
        out = self._run(final=True)
        if self.state == "object" and self._id is not None:
            self._cut = True  # the arguments cut short: the call is dropped, never sent with arguments that do not parse
        if self.state == "text" and self.buf:
            out.append(ToolDelta(content=self.buf))
        elif self.state == "object" and self._id is None and self.buf and not self.n_calls:
            out.append(ToolDelta(content=self.buf))  # cut off before any call began: it was text
        # Anything else left is the calls' own syntax cut short (a closing bracket, the start of another call).
        self.buf = ""
        return self._calls_only(out)

    def _calls_only(self, out: list[ToolDelta]) -> list[ToolDelta]:
        """Forced calls: text outside a call is the call syntax cut short (OpenAI never returns it as content)."""
        if not self.calls_only:
            return out
        self._stray = self._stray or any(d.index < 0 and d.content.strip() for d in out)
        return [d for d in out if d.index >= 0]

    def _match(self, pattern: str, final: bool) -> int | None:
        """Length of ``pattern`` at the start of the buffer; -1: it cannot match; None: wait for more text."""
        m = re.match(pattern, self.buf)
        if m and (m.end() < len(self.buf) or final or not pattern):
            return m.end()
        if not final and (not self.buf.strip() or re.match(pattern, self.buf + "\x00") is None) and len(self.buf) < 64:
            lit = re.sub(r"\\s\*", "", pattern).replace("\\", "")
            if lit.startswith(self.buf.strip()) or not self.buf.strip():
                return None
        return m.end() if m else -1

    def _run(self, final: bool) -> list[ToolDelta]:
        """Advance the state machine over the buffer: each state's step returns True when it waits for more output
        (or the end), False when the state changed and the next step runs."""
        out: list[ToolDelta] = []
        steps = {"text": self._text, "after": self._after, "object": self._object, "between": self._between}
        while not steps[self.state](out, final):
            pass
        return out

    def _text(self, out: list[ToolDelta], final: bool) -> bool:
        """Text until a trigger; True to wait for more output."""
        i = self.buf.find(self.trigger)
        if i == -1:
            keep = 0 if final else _held(self.buf, self.trigger)
            emit = self.buf[: len(self.buf) - keep]
            if emit:
                out.append(ToolDelta(content=emit))
            self.buf = self.buf[len(self.buf) - keep:]
            return True
        if i:
            out.append(ToolDelta(content=self.buf[:i]))
        self.buf = self.buf[i:] if self.keep else self.buf[i + len(self.trigger):]
        self._lead = "" if self.keep else self.trigger
        self.state = "after"
        return False

    def _after(self, out: list[ToolDelta], final: bool) -> bool:
        """What follows a trigger up to the call's object."""
        k = self._match(self.after, final)
        if k is None:
            return True
        if k < 0:
            self._not_a_call(out)
            return False
        if self._lead is not None:
            self._lead += self.buf[:k]
        self.buf = self.buf[k:]
        self.state = "object"
        self._id, self._args_start, self._sent = None, -1, False
        return False

    def _object(self, out: list[ToolDelta], final: bool) -> bool:
        """One call's object: its name, then its arguments once whole."""
        if self._id is None:
            m = _HEAD.match(self.buf)
            if m is None:
                if final and self.n_calls and self._could_head():
                    self.buf = ""  # another call cut short by the end of the output
                    self._cut = True
                    return True
                if final or (len(self.buf) > 2 and not self._could_head()):
                    self._not_a_call(out)
                    return False
                return True
            self._id = call_id()
            self._lead = None
            self._name = json.loads(f'"{m.group(1)}"')
            self._args_start = m.end()
        end = value_end(self.buf, self._args_start)
        if end is None:
            return True  # held until its arguments are whole
        if not self._sent:
            out.append(ToolDelta(index=self.n_calls, id=self._id, name=self._name))
            out.append(ToolDelta(index=self.n_calls, arguments=self.buf[self._args_start:end].strip()))
            self._sent = True  # its closing brace may still be to come
        rest = self.buf[end:]
        brace = re.match(r"\s*\}", rest)
        if brace is None:
            if not final and not rest.strip():
                return True
            self._cut = self._cut or (final and not rest.strip())  # the call's closing brace missing
            self.buf = rest
        else:
            self.buf = rest[brace.end():]
        self.n_calls += 1
        self._id = None
        self.state = "between"
        return False

    def _between(self, out: list[ToolDelta], final: bool) -> bool:
        """Between two calls: another call, or the close."""
        k = self._match(self.between, final) if self.between else -1
        if k is None:
            return True
        if k >= 0 and k > 0:
            self.buf = self.buf[k:]
            self.state = "object"
            self._id, self._args_start, self._sent = None, -1, False
            if self.keep and not self.buf.lstrip().startswith("{"):
                self.state = "text"
            return False
        c = self._match(self.close, final) if self.close else 0
        if c is None:
            return True
        if c < 0 and final:
            self.buf = ""  # a close cut short by the end of the output
            self._cut = True
        self.buf = self.buf[max(c, 0):]
        self.state = "text"
        return False

    def _not_a_call(self, out: list[ToolDelta]) -> None:
        """Back to text: what followed a trigger was no call, so the trigger and what was consumed after it are
        content, and the search goes on past the trigger. (Left in the buffer, a kept trigger, llama3's
        ``{"name"``, was found again at once: ``{"name": "Bob"}`` or a head cut by max_tokens looped forever.)"""
        lead, self._lead = self._lead, None
        if lead is not None and self.keep:
            lead, self.buf = lead + self.buf[: len(self.trigger)], self.buf[len(self.trigger):]
        if lead:
            out.append(ToolDelta(content=lead))
        self.state = "text"

    def _could_head(self) -> bool:
        """Whether the buffer may still become ``{"name": "...", "arguments": ``."""
        probe = self.buf.lstrip()
        target = '{"name": "'
        return target.startswith(probe[: len(target)].replace(" ", "")[: len(probe)]) or probe.startswith('{"name"')
