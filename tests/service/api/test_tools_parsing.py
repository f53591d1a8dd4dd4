"""Tool-call parsing and grammars, and the reasoning split: pure, every format, every way the text can be cut."""

from __future__ import annotations

import json
from typing import Any

import pytest

from service.chat.reasoning import ReasoningSplitter
from service.chat.tools import ToolCallParser, ToolDelta, check_tools, tool_grammar
from service.chat.format import ChatFormat, detect, prepare
from service.grammar.schema import compile_source
from service.errors import BadRequest

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"type": "string"}, "days": {"type": "integer"}},
                                                 "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}

OUTPUTS = {
    "hermes": ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
               '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'),
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, {"name": "get_time", "arguments": {}}]',
    "llama3": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; {"name": "get_time", "parameters": {}}',
    "generic": ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
                '{"name": "get_time", "arguments": {}}]}'),
}


def _assemble(deltas: list[ToolDelta]) -> tuple[str, list[dict[str, Any]]]:
    content = "".join(d.content for d in deltas)
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        if d.index < 0:
            continue
        c = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
        if d.id:
            assert c["id"] is None, "an id is sent once, first"
            c["id"], c["name"] = d.id, d.name
        assert c["id"] is not None, "the id and name come before the arguments"
        c["arguments"] += d.arguments
    return content, [calls[i] for i in sorted(calls)]


def _parse(fmt: str, text: str, step: int) -> tuple[str, list[dict[str, Any]]]:
    p = ToolCallParser(ChatFormat(tools=fmt))  # type: ignore[arg-type]
    out: list[ToolDelta] = []
    for i in range(0, len(text), step):
        out += p.feed(text[i:i + step])
    out += p.finish()
    return _assemble(out)


@pytest.mark.parametrize("fmt", sorted(OUTPUTS))
@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_every_format_parses_the_same_however_it_is_cut(fmt: str, step: int) -> None:
    content, calls = _parse(fmt, OUTPUTS[fmt], step)
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 2}
    assert json.loads(calls[1]["arguments"]) == {}
    assert content.strip() == ("Let me check." if fmt == "hermes" else "")


@pytest.mark.parametrize("fmt", sorted(OUTPUTS))
def test_plain_text_stays_content(fmt: str) -> None:
    text = "The weather in Paris is {mild} and [sunny]; <b>nice</b> <tool"
    for step in (1, 5, 100):
        content, calls = _parse(fmt, text, step)
        assert calls == [] and content == text


@pytest.mark.parametrize("fmt", sorted(OUTPUTS))
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_call_cut_short_is_never_sent(fmt: str, step: int) -> None:
    """Cut anywhere inside its arguments, the second call is dropped (no id, no name, no piece of its arguments,
    streamed or not) and ``cut`` says so; the whole first call stays."""
    text = OUTPUTS[fmt]
    second = text.index("get_time") + len("get_time")
    for end in range(second, text.index("{}", second) + 1):
        p = ToolCallParser(ChatFormat(tools=fmt))  # type: ignore[arg-type]
        out: list[ToolDelta] = []
        for i in range(0, end, step):
            out += p.feed(text[i:min(i + step, end)])
        out += p.finish()
        content, calls = _assemble(out)
        assert [c["name"] for c in calls] == ["get_weather"], (end, calls)
        assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 2}
        assert p.cut and "get_time" not in content, (end, content)


def test_a_call_goes_out_whole_once_its_arguments_are() -> None:
    p = ToolCallParser(ChatFormat(tools="hermes"))
    assert p.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa') == []
    assert p.feed('ris"') == []
    first = p.feed("}")
    assert [(d.name, d.arguments) for d in first] == [("get_weather", ""), (None, '{"city": "Paris"}')]


def test_check_tools() -> None:
    assert check_tools([WEATHER, TIME], "auto") == [WEATHER, TIME]
    assert check_tools([WEATHER, TIME], "none") == []
    assert check_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}) == [TIME]
    bad: list[tuple[Any, Any, str]] = [
        ([{"type": "function", "function": {"name": "a b"}}], "auto", "tools[0].function.name"),
        ([WEATHER, WEATHER], "auto", "tools[1].function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], "auto",
         "tools[0].function.parameters"),
        ([{"type": "function", "function": {"name": "f", "parameters": json.loads('{"items":' * 40 + "{}" + "}" * 40)}}],
         "auto", "tools[0].function.parameters"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        ([], "required", "tool_choice"),
        ([WEATHER], "sometimes", "tool_choice"),
        ([{"type": "retrieval"}], "auto", "tools[0]"),
    ]
    for tools, choice, param in bad:
        with pytest.raises(BadRequest) as e:
            check_tools(tools, choice)
        assert e.value.param == param, (tools, choice, e.value.message)


@pytest.mark.parametrize("fmt", sorted(OUTPUTS))
@pytest.mark.parametrize("required", [True, False])
@pytest.mark.parametrize("think", [None, ("<think>", "</think>")])
def test_every_grammar_compiles(fmt: str, required: bool, think: tuple[str, str] | None) -> None:
    f = ChatFormat(tools=fmt, think=think)  # type: ignore[arg-type]
    for parallel in (True, False):
        text = tool_grammar(f, [WEATHER, TIME], required=required, parallel=parallel)
        assert text is not None
        compile_source("lark", text)


def test_detect_formats() -> None:
    assert detect(None).tools == "generic" and not detect(None).native_tools
    qwen = "{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>{{ tool_call.arguments | tojson }}</tool_call><think></think>"
    f = detect(qwen)
    assert (f.tools, f.native_tools, f.arguments_as_object, f.think) == ("hermes", True, True, ("<think>", "</think>"))
    assert detect("{{ tools }}[TOOL_CALLS]{{ tool_calls }}").tools == "mistral"
    assert detect("<|start_header_id|>ipython{{ tools }}").tools == "llama3"


def test_generic_prepare_describes_tools_and_turns_tool_messages_into_text() -> None:
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    shown, tools = prepare(msgs, [WEATHER], ChatFormat())
    assert tools is None
    assert shown[0]["role"] == "system" and "get_weather" in shown[0]["content"]
    assert json.loads(shown[2]["content"]) == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}
    assert shown[3]["role"] == "user" and "sunny" in shown[3]["content"] and "call_1" in shown[3]["content"]
    native, ntools = prepare(msgs, [WEATHER], ChatFormat(tools="hermes", native_tools=True, arguments_as_object=True))
    assert ntools == [WEATHER] and native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


def _split(tags: Any, mode: Any, text: str, step: int, starts_open: bool = False) -> tuple[str, str]:
    s = ReasoningSplitter(tags, mode, starts_open=starts_open)
    out = []
    for i in range(0, len(text), step):
        out += s.feed(text[i:i + step])
    out += s.finish()
    return "".join(t for k, t in out if k == "reasoning"), "".join(t for k, t in out if k == "content")


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_reasoning_split(step: int) -> None:
    tags = ("<think>", "</think>")
    text = "\n<think>Paris is in France.</think>\n\nParis."
    assert _split(tags, "separate", text, step) == ("Paris is in France.", "Paris.")
    assert _split(tags, "inline", text, step) == ("Paris is in France.", text)
    assert _split(tags, "none", text, step) == ("", text)
    assert _split(tags, "separate", "Paris is in France.</think>Paris.", step, starts_open=True) == (
        "Paris is in France.", "Paris.")
    assert _split(tags, "separate", "No thinking <think>here</think>", step) == ("", "No thinking <think>here</think>")
    assert _split(tags, "separate", "<think>unfinished", step) == ("unfinished", "")
    assert _split(None, "separate", text, step) == ("", text)


def test_the_syntax_of_calls_cut_short_is_not_content() -> None:
    for fmt, text in (("generic", '{"tool_calls": [{"name": "get_time", "arguments": {}}]'),
                      ("generic", '{"tool_calls": [{"name": "get_time", "arguments": {}}, {"name": "get'),
                      ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool')):
        for step in (1, 3, 100):
            content, calls = _parse(fmt, text, step)
            assert content == "" and calls[0]["name"] == "get_time", (fmt, text, step, content)


HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
<tools>{% for t in tools %}{{ t.function | tojson }}{% endfor %}</tools><|im_end|>
{% endif %}{%- for m in messages %}{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{% for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}{%- endfor %}<|im_start|>assistant
"""


def test_a_native_template_renders_tools_and_tool_turns() -> None:
    from service.chat.sandbox import ChatTemplate

    fmt = detect(HERMES_TEMPLATE)
    assert (fmt.tools, fmt.native_tools, fmt.arguments_as_object) == ("hermes", True, True)
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    shown, tools = prepare(msgs, [WEATHER], fmt)
    text, _ = ChatTemplate(HERMES_TEMPLATE, "", "").render(shown, tools)
    assert '<tools>{' in text and '"name": "get_weather"' in text.split("</tools>")[0]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>sunny</tool_response>" in text
    # Without tools the template sees none (absent, not null).
    plain, _ = ChatTemplate(HERMES_TEMPLATE, "", "").render([msgs[0]], None)
    assert "<tools>" not in plain
