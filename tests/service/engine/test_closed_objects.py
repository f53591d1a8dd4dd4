"""An object schema that lists ``properties`` and says nothing of other keys is closed to them in the grammar, as
llama.cpp's own JSON-schema grammar reads it (issue 25: pydantic's schemas, through instructor and langchain, let
the embedded model invent keys until ``max_tokens``); where it is applied together with another schema it stays
as written. Checked on the embedded model's real vocabulary with llguidance's matcher, token by token, for
response_format schemas and tool-call arguments; and a property named like a keyword is a property."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from service.chat.format import ChatFormat
from service.grammar.schema import FRACTION_STEP, MAX_FRACTION_DIGITS, compile_source, bounded_schema, closed
from service.chat.tools import tool_grammar
from tests.service.engine.test_bounded_numbers import _answer

pytestmark = pytest.mark.slow

CITY = {"type": "object", "properties": {"name": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["name", "population"]}


def test_an_object_listing_its_properties_takes_no_other_key(vocab: Any) -> None:
    g = json.dumps(CITY)
    assert _answer(vocab, "json_schema", g, '{"name": "Paris", "population": 2100000}')
    # The issue's runaway: keys the schema never named, after the ones it did.
    assert not _answer(vocab, "json_schema", g, '{"name": "Paris", "population": 2100000, "population_density": 1}')
    optional = json.dumps({**CITY, "required": ["name"]})
    assert _answer(vocab, "json_schema", optional, '{"name": "Paris"}')
    assert not _answer(vocab, "json_schema", optional, '{"name": "Paris", "mayor": "x"}')


def test_an_object_that_says_what_other_keys_may_be_is_kept(vocab: Any) -> None:
    extra = '{"name": "Paris", "population": 2100000, "mayor": "x"}'
    assert _answer(vocab, "json_schema", json.dumps({**CITY, "additionalProperties": True}), extra)
    assert _answer(vocab, "json_schema", json.dumps({**CITY, "additionalProperties": {"type": "string"}}), extra)
    assert not _answer(vocab, "json_schema", json.dumps({**CITY, "additionalProperties": {"type": "integer"}}), extra)
    assert _answer(vocab, "json_schema", '{"type": "object"}', '{"anything": [1, 2]}')  # no properties: open
    # Requiring a key it does not list: closed, it could not be satisfied (before, it could).
    more = json.dumps({**CITY, "required": ["name", "mayor"]})
    assert _answer(vocab, "json_schema", more, '{"name": "Paris", "mayor": "x"}')
    at_least = json.dumps({**CITY, "minProperties": 3})
    assert _answer(vocab, "json_schema", at_least, '{"name": "Paris", "population": 1, "mayor": "x"}')


def test_schemas_applied_together_are_not_closed_against_each_other(vocab: Any) -> None:
    both = '{"a": "x", "b": "y", "c": "z"}'
    all_of = {"properties": {"a": {"type": "string"}}, "required": ["a"],
              "allOf": [{"properties": {"b": {"type": "string"}}, "required": ["b"]}, {"$ref": "#/$defs/C"}],
              "$defs": {"C": {"properties": {"c": {"type": "string"}}, "required": ["c"]}}}
    assert _answer(vocab, "json_schema", json.dumps(all_of), both)
    assert bounded_schema(all_of) == {**all_of}, "nothing in it closed"
    any_of = {"properties": {"a": {"type": "string"}}, "required": ["a"],
              "anyOf": [{"properties": {"b": {"type": "string"}}, "required": ["b"]}]}
    assert _answer(vocab, "json_schema", json.dumps(any_of), '{"a": "x", "b": "y"}')


def test_nested_and_referenced_objects_are_closed() -> None:
    nested = {"type": "object", "properties": {"home": {"$ref": "#/$defs/City"},
                                               "visited": {"type": "array", "items": {"$ref": "#/$defs/City"}},
                                               "note": {"anyOf": [CITY, {"type": "null"}]}},
              "$defs": {"City": CITY}}
    out = closed(nested)
    assert out["additionalProperties"] is False and out["$defs"]["City"]["additionalProperties"] is False
    assert out["properties"]["note"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in nested and "additionalProperties" not in CITY, "a copy"


def test_a_property_named_like_a_keyword_is_a_property(vocab: Any) -> None:
    # {"properties": {"type": ...}} once read the property's schema as the map's "type" keyword: 400 "unhashable".
    schema = {"type": "object", "properties": {"type": {"type": "string"}, "properties": {"type": "number"},
                                               "required": {"type": "integer"}},
              "required": ["type", "properties", "required"]}
    out = bounded_schema(schema)
    assert out["properties"]["type"] == {"type": "string"}
    assert out["properties"]["properties"]["multipleOf"] == FRACTION_STEP
    assert "additionalProperties" not in out["properties"]
    assert _answer(vocab, "json_schema", json.dumps(schema), '{"type": "a", "properties": 1.5, "required": 3}')


def test_a_numbers_fraction_has_at_most_10_digits(vocab: Any) -> None:
    assert MAX_FRACTION_DIGITS == 10 and FRACTION_STEP == 10 ** -MAX_FRACTION_DIGITS
    number = '{"type": "array", "items": {"type": "number"}}'
    assert _answer(vocab, "json_schema", number, "[105.4, 3.1415926535, -0.5, 12]")
    # The issue's runaways in a float field: 105.4000000000... and 105.46666...
    assert not _answer(vocab, "json_schema", number, "[105.4%s]" % ("0" * 10))
    assert not _answer(vocab, "json_schema", number, "[105.4%s]" % ("6" * 10))
    own = '{"type": "number", "multipleOf": 0.5}'  # a step of the schema's own is kept
    assert _answer(vocab, "json_schema", own, "2.5") and not _answer(vocab, "json_schema", own, "2.25")


def test_tool_call_arguments_are_closed_and_bounded(vocab: Any) -> None:
    params = {"type": "object", "properties": {"city": {"type": "string"}, "area_km2": {"type": "number"}},
              "required": ["city", "area_km2"]}
    g = tool_grammar(ChatFormat(), [{"type": "function", "function": {"name": "City", "parameters": params}}],
                     required=True, parallel=False)
    assert g is not None
    call = '{"tool_calls": [{"name": "City", "arguments": %s}]}'
    assert _answer(vocab, "lark", g, call % '{"city": "Paris", "area_km2": 105.4}')
    assert not _answer(vocab, "lark", g, call % '{"city": "Paris", "area_km2": 105.4, "x": 1}')
    assert not _answer(vocab, "lark", g, call % '{"city": "Paris", "area_km2": 105.40000000000}')


def test_every_answer_of_the_rewritten_schema_validates_against_the_request() -> None:
    for answer in ({"name": "Paris", "population": 7}, {"name": "", "population": -9007199254740991}):
        jsonschema.validate(answer, CITY)
        jsonschema.validate(answer, bounded_schema(CITY))
    assert compile_source("json_schema", json.dumps(CITY)).kind == "json_schema"
