"""The tool-call grammars on the embedded model's real vocabulary (llguidance's matcher): what ``required`` and
``auto`` let through, token by token."""

from __future__ import annotations

from typing import Any

import pytest

from service.chat.tools import tool_grammar
from service.chat.format import ChatFormat
from service.grammar.schema import compile_source, parser_limits
from service.engine.grammar_sampler import _tokenizer

pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}]


def _accepts(model: Any, grammar: str, text: str) -> bool:
    """Whether the matcher takes ``text`` (as the model's tokens) without an error."""
    from llguidance import LLMatcher

    m = LLMatcher(_tokenizer(model.vocab), compile_source("lark", grammar).text, log_level=0, limits=parser_limits())
    for tok in model.tokenize(text.encode(), False, False):
        if not m.consume_token(tok):
            return False
    return not m.is_error()


CALL = '{"tool_calls": [{"name": "get_time", "arguments": {"city": "Rome"}}]}'


def test_required_takes_only_a_call_that_matches_the_schema(vocab: Any) -> None:
    g = tool_grammar(ChatFormat(), TOOLS, required=True, parallel=False)
    assert g is not None
    assert _accepts(vocab, g, CALL)
    assert not _accepts(vocab, g, "Sure, let me check.")
    assert not _accepts(vocab, g, CALL.replace("Rome", "London"))  # not in the enum
    assert not _accepts(vocab, g, CALL.replace("get_time", "get_date"))


def test_auto_leaves_text_free_until_the_trigger_then_constrains(vocab: Any) -> None:
    g = tool_grammar(ChatFormat(), TOOLS, required=False, parallel=True)
    assert g is not None
    assert _accepts(vocab, g, "It is sunny in {Paris} today, [really].")
    assert _accepts(vocab, g, "Let me look. " + CALL)
    assert not _accepts(vocab, g, 'Let me look. {"tool_calls": [{"name": "get_weather"')
    assert not _accepts(vocab, g, "Let me look. " + CALL.replace("Rome", "London"))


def test_a_thinking_template_may_think_before_a_required_call(vocab: Any) -> None:
    fmt = ChatFormat(think=("<think>", "</think>"))
    g = tool_grammar(fmt, TOOLS, required=True, parallel=False)
    assert g is not None
    assert _accepts(vocab, g, "<think>The user wants Rome's time.</think>\n" + CALL)
    assert _accepts(vocab, g, CALL)
    opened = tool_grammar(ChatFormat(think=("<think>", "</think>"), thinking_open=True), TOOLS, required=True,
                          parallel=False)
    assert opened is not None and _accepts(vocab, opened, "Rome, then.</think>" + CALL)


def test_auto_after_an_opened_thinking(vocab: Any) -> None:
    g = tool_grammar(ChatFormat(think=("<think>", "</think>"), thinking_open=True), TOOLS, required=False, parallel=True)
    assert g is not None
    assert _accepts(vocab, g, "Hmm.</think> It is noon. " + CALL)
    assert _accepts(vocab, g, "Hmm.</think> It is noon.")


@pytest.mark.parametrize("fmt, text", [
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n</tool_call>'),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {"city": "Rome"}}]'),
    ("llama3", '{"name": "get_time", "parameters": {"city": "Rome"}}'),
])
def test_native_formats_required(vocab: Any, fmt: str, text: str) -> None:
    g = tool_grammar(ChatFormat(tools=fmt), TOOLS, required=True, parallel=True)  # type: ignore[arg-type]
    assert g is not None and _accepts(vocab, g, text)
    assert not _accepts(vocab, g, text.replace("Rome", "Oslo"))
