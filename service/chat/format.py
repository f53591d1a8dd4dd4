"""What a chat template says about tools and thinking, and the messages it is given.

A ``ChatFormat`` is read once per loaded template (``detect``), as llama-server's
``common_chat_templates_init`` reads the template's source (common/chat.cpp of the
llama.cpp that llama-cpp-python 0.3.36 vendors):

- **tool-call format**: ``hermes`` (Hermes 2 Pro, Qwen 2.5/3: ``<tool_call>{json}</tool_call>``),
  ``llama3`` (Llama 3.1+ JSON: ``{"name": ..., "parameters": {...}}``), ``mistral``
  (``[TOOL_CALLS][{...}]``), else ``generic`` (``{"tool_calls": [...]}``, described to the model in a
  system message, llama-server's generic format);
- **native tools**: the template renders ``tools`` and tool turns itself (its source reads them); without,
  the tools are described in a system message and tool turns become plain text (``prepare``);
- **thinking tags**: ``<think>``/``</think>`` and the like when the template writes them, and whether
  its generation prompt already opens them (the output then starts inside the thinking);
- **argument objects**: templates that write ``arguments | tojson`` get the arguments of past tool calls
  as objects (Hugging Face's convention), the others as the JSON string the client sent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from .sandbox import text_content

ToolFormat = Literal["hermes", "llama3", "mistral", "generic"]

THINK_TAGS: tuple[tuple[str, str], ...] = (
    ("<think>", "</think>"),
    ("<|START_THINKING|>", "<|END_THINKING|>"),
    ("<thinking>", "</thinking>"),
)
"""Opening and closing tags of a model's thinking (DeepSeek R1 and Qwen 3; Command R7B; others)."""


@dataclass(frozen=True)
class ChatFormat:
    """How the loaded chat template calls tools and thinks (values read from its source)."""

    tools: ToolFormat = "generic"
    native_tools: bool = False
    """The template renders ``tools``, ``tool_calls`` and ``tool`` messages itself."""
    arguments_as_object: bool = False
    think: tuple[str, str] | None = None
    """(opening, closing) thinking tags the template writes; None: none known."""
    thinking_open: bool = False
    """The generation prompt ends with the opening tag: the output starts inside the thinking."""
    special: dict[str, int] = field(default_factory=dict, compare=False)
    """Markers (``<tool_call>``, ``[TOOL_CALLS]``, thinking tags) that are one control token of the vocabulary."""

    def with_special(self, special: dict[str, int]) -> "ChatFormat":
        return replace(self, special=dict(special))

    @property
    def markers(self) -> tuple[str, ...]:
        """The strings whose tokens the engine checks (``special``)."""
        out = [m for m in ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>")]
        if self.think:
            out += list(self.think)
        return tuple(out)


def detect(source: str | None) -> ChatFormat:
    """The format a template's Jinja source implies (None: a built-in template without tools)."""
    if not source:
        return ChatFormat()
    if "<tool_call>" in source:
        fmt: ToolFormat = "hermes"
    elif "[TOOL_CALLS]" in source:
        fmt = "mistral"
    elif "<|python_tag|>" in source or ("ipython" in source and "<|start_header_id|>" in source):
        fmt = "llama3"
    else:
        fmt = "generic"
    native = "tools" in source and ("tool_calls" in source or fmt != "generic")
    as_object = any(p in source for p in ("arguments|tojson", "arguments | tojson", "arguments|items",
                                          "arguments | items", "parameters|tojson", "parameters | tojson"))
    think = next(((o, c) for o, c in THINK_TAGS if o in source and c in source), None)
    return ChatFormat(tools=fmt, native_tools=native, arguments_as_object=as_object, think=think)


def tool_prompt(tools: list[dict[str, Any]], fmt: ChatFormat) -> str:
    """The system text that describes ``tools`` to a template that cannot render them (generic format)."""
    described = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
                  "parameters": t["function"].get("parameters", {"type": "object", "properties": {}})}
                 for t in tools]
    return ("You can call these tools (JSON schemas of their arguments):\n"
            + json.dumps(described, ensure_ascii=False)
            + '\nTo call tools, answer with this JSON only: {"tool_calls": [{"name": "<tool name>", '
            '"arguments": {<the arguments>}}]}. Otherwise answer in plain text.')


def _arguments(raw: Any, as_object: bool) -> Any:
    if as_object and isinstance(raw, str):
        try:
            value = json.loads(raw)
        except ValueError:
            return raw
        return value if isinstance(value, dict) else raw
    if not as_object and not isinstance(raw, str):
        return json.dumps(raw, ensure_ascii=False)
    return raw


def _call_text(calls: list[dict[str, Any]]) -> str:
    """Past tool calls written as the generic format asks the model to write them."""
    out = []
    for c in calls:
        fn = c.get("function") or {}
        args = fn.get("arguments")
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            parsed = args
        out.append({"name": fn.get("name"), "arguments": parsed})
    return json.dumps({"tool_calls": out}, ensure_ascii=False)


def prepare(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
            fmt: ChatFormat) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools a template is given.

    A native template gets the tools, and past tool calls with their arguments as it expects them. Any
    other template gets the tools as a system message and tool turns as text: an assistant's calls as the
    JSON it is asked to write, a tool's result as a user turn naming its call."""
    tools = tools or None
    if fmt.native_tools:
        out = []
        for m in messages:
            if m.get("tool_calls"):
                m = dict(m)
                m["tool_calls"] = [
                    {**c, "function": {**(c.get("function") or {}),
                                       "arguments": _arguments((c.get("function") or {}).get("arguments"),
                                                               fmt.arguments_as_object)}}
                    for c in m["tool_calls"]
                ]
            out.append(m)
        return out, tools
    out = []
    for m in messages:
        role = m.get("role")
        if role == "tool":
            who = m.get("name") or m.get("tool_call_id") or "tool"
            out.append({"role": "user", "content": f"Result of tool call {who}:\n{text_content(m.get('content'))}"})
        elif role == "assistant" and m.get("tool_calls"):
            text = text_content(m.get("content"))
            out.append({"role": "assistant", "content": (text + "\n" if text else "") + _call_text(m["tool_calls"])})
        else:
            out.append({k: v for k, v in m.items() if k != "tool_calls"})
    if tools:
        note = tool_prompt(tools, fmt)
        if out and out[0].get("role") in ("system", "developer"):
            out[0] = {**out[0], "role": "system", "content": text_content(out[0].get("content")) + "\n\n" + note}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out, None
