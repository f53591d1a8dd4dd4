"""Structured output is valid or says it is not (issue 29), on the embedded model over real HTTP: each reproduction
of a constrained answer that came back invalid with ``finish_reason: "stop"``, now ``length`` (cut by max_tokens)
or a 400 naming the field, streamed or not, the same server process serving afterwards:

- a thinking template (its generation prompt opens ``<think>``) with ``json_object`` / ``json_schema``: the JSON is
  the answer (``content``), never ``reasoning_content``;
- schema ``const 1`` with the token ``1`` banned by ``logit_bias``; a ``$ref`` that requires itself; a pattern
  ``(a{4096}){4096}`` beyond the grammar: never ``stop`` with an empty or cut answer;
- ``tool_choice: "required"`` (and a named tool, and Anthropic's ``any``) cut by ``max_tokens``: ``length``, the
  cut call never returned as content; a forced call the grammar cannot finish (its opening tokens banned): 400.

The same rules without a server at the end (the parser's ``cut``, the choices' finish; a llama3 head that was no
call looped the parser forever).
"""

from __future__ import annotations

import json
from typing import Any, Callable

import httpx
import jsonschema
import pytest

from service.chat.choices import Choices, _whole_json
from service.chat.tools import ToolCallParser
from service.engine.base import Chunk
from service.chat.format import ChatFormat
from service.errors import BadRequest
from tests.conftest import EMBEDDED_NAME, ROOT, ServiceProcess

slow = pytest.mark.slow
"""The tests against the real server (the pure ones at the end are not)."""

ENV = {"GGUF_CONFIRM_LOADS": "false", "GGUF_CONTEXT_LENGTH": "2048", "GGUF_EMBEDDINGS": "off"}
ASK = [{"role": "user", "content": "Give me a JSON object describing a cat."}]
NAME_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"],
               "additionalProperties": False}
SELF_REF = {"$ref": "#/$defs/a", "$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}},
                                                  "required": ["x"]}}}
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER: dict[str, Any] = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}


@pytest.fixture(scope="module")
def svc(service_factory: Callable[..., ServiceProcess]) -> ServiceProcess:
    s = service_factory(**ENV)
    s.wait_ready()
    return s


@pytest.fixture(scope="module")
def thinker(service_factory: Callable[..., ServiceProcess]) -> ServiceProcess:
    s = service_factory(**ENV, GGUF_CHAT_TEMPLATE_FILE=str(ROOT / "tests" / "fixtures" / "thinking_template.jinja"))
    s.wait_ready()
    return s


@pytest.fixture(scope="module")
def vocab(embedded_model: str) -> Any:
    from llama_cpp import Llama

    return Llama(model_path=embedded_model, vocab_only=True, verbose=False)


def _rf(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def _chat(s: ServiceProcess, **body: Any) -> httpx.Response:
    return s.client.post("/v1/chat/completions", json={"messages": ASK, "temperature": 0, **body})


def _stream(s: ServiceProcess, **body: Any) -> list[dict[str, Any]]:
    """Every SSE payload of a streamed chat (``[DONE]`` last, checked), parsed."""
    with s.client.stream("POST", "/v1/chat/completions",
                         json={"messages": ASK, "temperature": 0, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", data[-3:]
    return [json.loads(d) for d in data[:-1]]


def _deltas(events: list[dict[str, Any]], key: str) -> str:
    return "".join(ch["delta"].get(key) or "" for ev in events for ch in ev.get("choices", []))


def _finishes(events: list[dict[str, Any]]) -> list[str]:
    return [ch["finish_reason"] for ev in events for ch in ev.get("choices", []) if ch.get("finish_reason")]


def _serves_on(s: ServiceProcess, pid: int) -> None:
    """The same process, still answering."""
    assert s.proc.pid == pid and s.proc.poll() is None
    r = s.client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200, r.text


def _refused(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def _refused_streamed(events: list[dict[str, Any]], param: str) -> None:
    """Streamed: the error event ends it (then ``[DONE]``), never a ``stop``."""
    assert "stop" not in _finishes(events), events
    assert events[-1].get("error", {}).get("param") == param, events[-1]


@slow
def test_json_on_a_thinking_template_is_the_answer_not_reasoning(thinker: ServiceProcess) -> None:
    pid = thinker.proc.pid
    # The template's generation prompt opens <think>: before, the whole JSON came back as reasoning_content.
    for rf, max_tokens in (({"type": "json_object"}, 64), (_rf(NAME_SCHEMA), 32)):
        r = _chat(thinker, max_tokens=max_tokens, response_format=rf)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        msg = choice["message"]
        assert "reasoning_content" not in msg, msg
        assert msg["content"].startswith("{"), msg
        if choice["finish_reason"] == "stop":
            value = json.loads(msg["content"])
            assert isinstance(value, dict)
            if rf["type"] == "json_schema":
                jsonschema.validate(value, NAME_SCHEMA)
        else:
            assert choice["finish_reason"] == "length", choice
        events = _stream(thinker, max_tokens=max_tokens, response_format=rf)
        assert _deltas(events, "reasoning_content") == "" and _deltas(events, "content") == msg["content"]
        assert _finishes(events) == [choice["finish_reason"]]
    # The schema's small answer ends by itself: a whole object, in content.
    r = _chat(thinker, max_tokens=32, response_format=_rf(NAME_SCHEMA))
    assert r.json()["choices"][0]["finish_reason"] == "stop", r.text
    # Without response_format the same template still thinks into reasoning_content.
    r = _chat(thinker, max_tokens=24)
    assert r.json()["choices"][0]["message"].get("reasoning_content"), r.text
    _serves_on(thinker, pid)


@slow
def test_a_const_whose_token_logit_bias_bans_is_an_error_not_an_empty_stop(svc: ServiceProcess, vocab: Any) -> None:
    pid = svc.proc.pid
    banned = {str(t): -100 for t in vocab.tokenize(b"1", add_bos=False, special=False)}
    body = dict(max_tokens=20, response_format=_rf({"const": 1}), logit_bias=banned)
    # Unbanned, the answer is the constant.
    r = _chat(svc, max_tokens=20, response_format=_rf({"const": 1}))
    assert r.json()["choices"][0]["message"]["content"] == "1", r.text
    # Banned: before, content "" with finish_reason stop.
    r = _chat(svc, **body)
    _refused(r, "response_format")
    assert "logit_bias" in r.json()["error"]["message"]
    _refused_streamed(_stream(svc, **body), "response_format")
    _serves_on(svc, pid)


@slow
@pytest.mark.parametrize("s", ["svc", "thinker"])
def test_a_schema_that_requires_itself_is_an_error_not_a_cut_stop(s: str, request: pytest.FixtureRequest) -> None:
    server: ServiceProcess = request.getfixturevalue(s)
    pid = server.proc.pid
    # Before: content '{"' with finish_reason stop. Either refused before generation (llguidance knows) or after.
    _refused(_chat(server, max_tokens=20, response_format=_rf(SELF_REF)), "response_format")
    r = server.client.post("/v1/chat/completions", json={"messages": ASK, "temperature": 0, "stream": True,
                                                         "max_tokens": 20, "response_format": _rf(SELF_REF)})
    if r.status_code == 200:
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        _refused_streamed(events, "response_format")
    else:
        _refused(r, "response_format")
    _serves_on(server, pid)


@pytest.mark.parametrize("schema", [
    {"type": "string", "pattern": "(a{4096}){4096}"},
    {"type": "object", "properties": {"a": {"type": "string", "pattern": "(a{4096}){4096}"}}, "required": ["a"]},
])
@slow
def test_a_pattern_beyond_the_grammar_is_never_a_stop_with_invalid_content(svc: ServiceProcess,
                                                                           schema: dict[str, Any]) -> None:
    """llguidance accepts such a pattern and then constrains nothing: refused before generation (16,777,216
    repetitions in all, beyond the count limit), as a count keyword that large is."""
    pid = svc.proc.pid
    r = _chat(svc, max_tokens=8, response_format=_rf(schema))
    _refused(r, "response_format")
    assert "repeats 16777216 times" in r.json()["error"]["message"]
    _serves_on(svc, pid)


def test_the_counted_repetitions_of_a_pattern_multiply_as_they_nest() -> None:
    from service.grammar.schema import pattern_repetition

    assert pattern_repetition("(a{4096}){4096}") == 4096 * 4096
    assert pattern_repetition(r"^\d{1,16}$") == 16
    assert pattern_repetition("[a-z]{3}(-[a-z]{3}){2}") == 6
    assert pattern_repetition(r"(\{a\}){5}") == 5  # escaped braces are characters
    assert pattern_repetition("[{]{9}") == 9  # so is a brace in a class
    assert pattern_repetition("x*(ab)+c?") == 1  # loops, not copies


def _no_call_text(content: Any) -> None:
    assert content in (None, ""), content


@slow
@pytest.mark.parametrize("s", ["svc", "thinker"])
def test_a_forced_call_cut_by_max_tokens_is_length_not_content(s: str, request: pytest.FixtureRequest) -> None:
    server: ServiceProcess = request.getfixturevalue(s)
    pid = server.proc.pid
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice_, max_tokens in (("required", 3), ("required", 14), (named, 5)):
        body = dict(max_tokens=max_tokens, tools=[WEATHER], tool_choice=choice_)
        r = _chat(server, **body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        # Before: finish_reason length, but the cut call ('{"tool_') returned as content.
        assert choice["finish_reason"] == "length", choice
        _no_call_text(choice["message"]["content"])
        assert all(c["function"]["name"] == "get_weather" for c in choice["message"].get("tool_calls") or [])
        events = _stream(server, **body)
        assert _deltas(events, "content") == "" and _finishes(events) == ["length"], events
    # Anthropic's forced call (tool_choice any): max_tokens, and no text block holding the call's syntax.
    r = server.client.post("/v1/messages", json={
        "model": EMBEDDED_NAME, "max_tokens": 3, "temperature": 0, "messages": ASK, "tool_choice": {"type": "any"},
        "tools": [{"name": "get_weather", "input_schema": CITY}]})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["stop_reason"] == "max_tokens", out
    assert all(b["text"] == "" for b in out["content"] if b["type"] == "text"), out
    _serves_on(server, pid)


@slow
def test_a_forced_call_cut_after_its_name_is_dropped_with_length(svc: ServiceProcess) -> None:
    """Cut after the call's name, inside its arguments: no call and no content, finish_reason length, streamed or
    not (before, the partial call was returned with arguments that do not parse, as OpenAI returns one)."""
    body = dict(max_tokens=24, tools=[WEATHER], tool_choice="required")
    choice = _chat(svc, **body).json()["choices"][0]
    assert choice["finish_reason"] == "length", choice
    _no_call_text(choice["message"]["content"])
    assert not choice["message"].get("tool_calls"), choice
    events = _stream(svc, **body)
    assert _finishes(events) == ["length"] and _deltas(events, "content") == "", events
    assert not any(ch["delta"].get("tool_calls") for ev in events for ch in ev.get("choices", [])), events


@slow
def test_a_forced_call_the_grammar_cannot_finish_is_an_error(svc: ServiceProcess, vocab: Any) -> None:
    pid = svc.proc.pid
    # Every token that can open the call's JSON banned: the grammar fails, and the model ends at once.
    banned = {str(t): -100 for text in (b"{", b'{"', b' {', b' {"')
              for t in vocab.tokenize(text, add_bos=False, special=False)[:1]}
    body = dict(max_tokens=40, tools=[WEATHER], tool_choice="required", logit_bias=banned)
    _refused(_chat(svc, **body), "tool_choice")
    _refused_streamed(_stream(svc, **body), "tool_choice")
    _serves_on(svc, pid)


# -- the same rules without a server: the parser's and the choices' end of a constrained answer -------------------


def _run(parser: ToolCallParser, text: str) -> tuple[str, list[str]]:
    out = parser.feed(text) + parser.finish()
    return "".join(d.content for d in out), [d.name or "" for d in out if d.id is not None]


def test_a_forced_call_cut_short_is_no_content_and_is_cut() -> None:
    generic, hermes = ChatFormat(), ChatFormat(tools="hermes")
    for fmt, text in ((generic, '{"tool_'), (generic, '{"tool_calls": [{"na'), (hermes, "<tool_call>\n{")):
        p = ToolCallParser(fmt, forced=True, calls_only=True)
        assert _run(p, text) == ("", []) and p.cut, text
    p = ToolCallParser(generic, forced=True, calls_only=True)
    assert _run(p, '{"tool_calls": [{"name": "get_weather", "arguments": {"ci') == ("", []) and p.cut  # dropped
    p = ToolCallParser(hermes, forced=True, calls_only=True)  # the whole call, its closing marker missing
    assert _run(p, '<tool_call>\n{"name": "f", "arguments": {}}\n')[1] == ["f"] and p.cut
    for fmt, text in ((generic, '{"tool_calls": [{"name": "f", "arguments": {}}]}'),
                      (hermes, '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>')):
        p = ToolCallParser(fmt, forced=True, calls_only=True)
        assert _run(p, text) == ("", ["f"]) and not p.cut, text
    # Thinking that reaches the parser as text (reasoning none/inline) stays content; a whole call is still needed.
    p = ToolCallParser(generic, forced=True)
    assert _run(p, "Hm.</think>")[0] == "Hm.</think>" and p.cut


@pytest.mark.timeout(30)
def test_free_text_under_auto_is_content_and_not_cut() -> None:
    # llama3's trigger ({"name") stays in the text: a head that was no call, or one cut by max_tokens, looped forever
    # at the end (in the event loop: the whole server hung); other formats lost the trigger's text.
    llama3 = ChatFormat(tools="llama3")
    for fmt, text in ((llama3, '{"name": "Bob", "age": 3}'), (llama3, '{"name": "get_wea'),
                      (ChatFormat(), '{"tool_calls"'), (ChatFormat(), '{"tool_calls": [1, 2]}'),
                      (ChatFormat(tools="mistral"), "[TOOL_CALLS] no"),
                      (ChatFormat(tools="hermes"), "Plain <tool text")):
        for step in (1, 4, 1000):
            p = ToolCallParser(fmt)
            out = [d for i in range(0, len(text), step) for d in p.feed(text[i:i + step])] + p.finish()
            assert "".join(d.content for d in out) == text and not p.cut, (text, step)
    p = ToolCallParser(llama3)
    assert _run(p, '{"name":"x"} then {"name": "f", "parameters": {}}') == ('{"name":"x"} then ', ["f"])
    p = ToolCallParser(llama3, forced=True, calls_only=True)
    assert _run(p, '{"name": "get_wea') == ("", []) and p.cut
    p = ToolCallParser(ChatFormat(tools="hermes"))  # a call begun under auto, cut: cut, and dropped
    assert _run(p, 'Sure.<tool_call>\n{"name": "f", "arguments": {"a": ') == ("Sure.", []) and p.cut


def test_whole_json() -> None:
    assert not _whole_json("", "schema") and not _whole_json('{"', "object") and not _whole_json("1 x", "schema")
    assert _whole_json("1", "schema") and not _whole_json("1", "object") and _whole_json('{"a": [1]}', "object")
    deep = "[" * 100_000 + "]" * 100_000  # deeper than Python's parser: checked without recursion
    assert _whole_json(deep, "schema") and not _whole_json(deep[:-1], "schema") and not _whole_json(deep, "object")


def _feed(choices: Choices, *chunks: Chunk) -> list[Any]:
    return [e for c in chunks for e in choices.feed(c)]


def test_the_end_of_a_constrained_answer_decides_its_finish() -> None:
    cut = Chunk(text='{"a": ')
    with pytest.raises(BadRequest) as e:
        _feed(Choices(json_kind="object"), cut, Chunk(finish_reason="stop"))
    assert e.value.param == "response_format"
    with pytest.raises(BadRequest) as e:
        _feed(Choices(json_kind="schema", biased=True), Chunk(finish_reason="stop"))
    assert "logit_bias" in e.value.message
    # Cut by max_tokens: length, honest; cut by the request's own stop string: stop; cancelled: nobody reads it.
    assert _feed(Choices(json_kind="object"), cut, Chunk(finish_reason="length"))[-1].finish_reason == "length"
    assert _feed(Choices(json_kind="object"), cut, Chunk(finish_reason="stop", stop_sequence="x"))[-1].kind == "finish"
    assert _feed(Choices(json_kind="object"), cut, Chunk(finish_reason="cancelled"))[-1].kind == "finish"
    whole = _feed(Choices(json_kind="object"), Chunk(text='{"a": 1}'), Chunk(finish_reason="stop"))
    assert whole[-1].finish_reason == "stop"
    # Forced tools: the model ending inside the call is an error naming tool_choice; cut by max_tokens, length.
    with pytest.raises(BadRequest) as e:
        _feed(Choices(ChatFormat(), tools=True, forced=True), Chunk(text='{"tool_calls": [{"na'),
              Chunk(finish_reason="stop"))
    assert e.value.param == "tool_choice"
    events = _feed(Choices(ChatFormat(), tools=True, forced=True), Chunk(text='{"tool_'),
                   Chunk(finish_reason="length"))
    assert [ev.kind for ev in events] == ["finish"] and events[-1].finish_reason == "length"


def test_json_after_a_generation_prompt_that_opened_the_thinking_is_content() -> None:
    fmt = ChatFormat(think=("<think>", "</think>"), thinking_open=True)
    events = _feed(Choices(fmt, reasoning="separate", json_kind="object"), Chunk(text='{"a": 1}'),
                   Chunk(finish_reason="stop"))
    assert [(ev.kind, ev.text) for ev in events[:-1]] == [("content", '{"a": 1}')]
    # Without response_format the same output starts inside the thinking.
    events = _feed(Choices(fmt, reasoning="separate"), Chunk(text="Hm.</think>Paris."), Chunk(finish_reason="stop"))
    assert [(ev.kind, ev.text) for ev in events[:-1]] == [("reasoning", "Hm."), ("content", "Paris.")]
