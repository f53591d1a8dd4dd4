"""Numbers in a schema-constrained answer have a bounded number of integer digits (issue 25: a small model filled an
``integer`` field with digits until ``max_tokens``), as llama.cpp's own JSON-schema grammar: 16, unless the schema's
own bounds say otherwise. Checked on the embedded model's real vocabulary with llguidance's matcher, token by
token, for response_format schemas and for tool-call arguments."""

from __future__ import annotations

from typing import Any

import pytest

from service.chat.format import ChatFormat
from service.grammar.schema import INTEGER_LIMIT, MAX_INTEGER_DIGITS, compile_source, bounded_numbers, parser_limits
from service.chat.tools import tool_grammar
from service.engine.grammar_sampler import _tokenizer

pytestmark = pytest.mark.slow


def _answer(model: Any, kind: str, grammar: str, text: str) -> bool:
    """Whether ``text`` (as the model's tokens) is a whole answer the grammar accepts."""
    from llguidance import LLMatcher

    m = LLMatcher(_tokenizer(model.vocab), compile_source(kind, grammar).text, log_level=0, limits=parser_limits())
    for tok in model.tokenize(text.encode(), False, False):
        if not m.consume_token(tok):
            return False
    return not m.is_error() and m.is_accepting()


POPULATION = '{"type": "object", "properties": {"population": {"type": "integer"}}, "required": ["population"]}'


def test_an_integer_the_schema_leaves_open_has_at_most_16_digits(vocab: Any) -> None:
    assert MAX_INTEGER_DIGITS == len(str(INTEGER_LIMIT)) == 16
    for n in ("7", "0", "-42", str(INTEGER_LIMIT), f"-{INTEGER_LIMIT}", "1" + "0" * 15):
        assert _answer(vocab, "json_schema", POPULATION, '{"population": %s}' % n), n
    # The runaway: "population": 1000000000000... is cut at the 17th digit (and beyond 2^53 - 1).
    for n in ("1" + "0" * 16, "-1" + "0" * 16, str(INTEGER_LIMIT + 1), "9" * 16):
        assert not _answer(vocab, "json_schema", POPULATION, '{"population": %s}' % n), n


def test_the_schemas_own_bounds_are_kept(vocab: Any) -> None:
    wide = '{"type": "integer", "minimum": 0, "maximum": 1000000000000000000}'  # 10^18: 19 digits
    assert _answer(vocab, "json_schema", wide, "1" + "0" * 18)
    assert not _answer(vocab, "json_schema", wide, "-1")  # its minimum, kept
    low = '{"type": "integer", "minimum": -5}'  # open above: bounded there only
    assert _answer(vocab, "json_schema", low, str(INTEGER_LIMIT)) and not _answer(vocab, "json_schema", low, "9" * 17)
    assert not _answer(vocab, "json_schema", low, "-6")


def test_a_numbers_integer_part_is_bounded_too(vocab: Any) -> None:
    number = '{"type": "array", "items": {"type": "number"}}'
    assert _answer(vocab, "json_schema", number, "[3.14159, -2.5, 12, 100000]")
    assert not _answer(vocab, "json_schema", number, "[%s.5]" % ("1" * 17))


def test_tool_call_arguments_are_bounded(vocab: Any) -> None:
    tools = [{"type": "function", "function": {"name": "census", "parameters": {
        "type": "object", "properties": {"population": {"type": "integer"}}, "required": ["population"]}}}]
    g = tool_grammar(ChatFormat(), tools, required=True, parallel=False)
    assert g is not None
    call = '{"tool_calls": [{"name": "census", "arguments": {"population": %s}}]}'
    assert _answer(vocab, "lark", g, call % INTEGER_LIMIT)
    assert not _answer(vocab, "lark", g, call % ("9" * 17))


def test_data_keywords_are_not_rewritten() -> None:
    schema = {"type": "object", "properties": {"n": {"type": ["integer", "null"], "exclusiveMaximum": 10}},
              "const": {"type": "integer"}, "enum": [{"type": "number"}], "default": {"type": "integer"}}
    out = bounded_numbers(schema)
    assert out["const"] == {"type": "integer"} and out["enum"] == [{"type": "number"}]
    assert out["default"] == {"type": "integer"}
    assert out["properties"]["n"] == {"type": ["integer", "null"], "exclusiveMaximum": 10, "minimum": -INTEGER_LIMIT}
    assert schema["properties"]["n"] == {"type": ["integer", "null"], "exclusiveMaximum": 10}, "a copy"
