"""Structured output: a request's grammar (JSON schema, JSON object or GBNF), bounded and compiled.

The grammar engine is llguidance (PyPI ``llguidance``, the library llama.cpp itself integrates as
``LLAMA_LLGUIDANCE``), not llama.cpp's GBNF sampler, for two reasons measured here
(``bench/grammar_bench.py``, gemma-3-270m's 262,144-token vocabulary):

- **safety**: llama-cpp-python 0.3.36's ``LlamaGrammar.from_string`` parses nothing; a grammar
  llama.cpp's parser rejects makes ``llama_sampler_init_grammar`` return NULL, and the NULL sampler
  in a chain segfaults the process. llguidance is Rust: a bad grammar is an error value, and
  compilation and every mask step run under ``LLParserLimits`` (lexer fuel, Earley items,
  grammar size). Those limits do not bound every compilation (a few intersected regex patterns
  take seconds and gigabytes before llguidance refuses them: issue 29), so the API compiles each
  new grammar first in a process it can kill, under a memory limit (``grammar_worker``);
- **speed**: llama.cpp's GBNF sampler tests every candidate token against the grammar, about 35 to
  50 ms per token for this vocabulary; llguidance computes the token mask in well under a
  millisecond (figures in docs/reliability.md).

Before a request is queued, the API runs ``compile_source`` on the request's grammar (``grammar_source``) in
a compilation process (``grammar_worker``): it checks the schema against fixed bounds (size, depth,
nodes, and every count keyword such as ``maxItems`` or ``minLength``), turns it into an llguidance
grammar and validates it; any failure, a time-out or the memory limit is ``BadRequest`` naming the
reason, a 400 before any byte is streamed. Only a grammar that compiled there reaches the engine,
whose ``compile_grammar`` (in ``check`` and at generation, in the runner process) runs the same
``compile_source`` under the same ``LLParserLimits``: the work the worker finished within the budget.
Results are cached by their text, so the engine's second call costs a dictionary look-up.
The engine's side (llguidance's matcher over llama.cpp's vocabulary, as a sampler) is
``service.engine.grammar_sampler``; this module imports neither llama.cpp nor the web framework.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import BadRequest

log = logging.getLogger(__name__)

MAX_SCHEMA_BYTES = 64 * 1024
"""Largest JSON schema or grammar text, bytes (UTF-8)."""
MAX_SCHEMA_DEPTH = 32
"""Deepest nesting of objects and arrays in a schema."""
MAX_SCHEMA_NODES = 4096
"""Most objects, arrays and values in a schema, counted while walking it."""
MAX_SCHEMA_COUNT = 4096
"""Largest value of a count keyword (``minLength``, ``maxItems``...): structured output is an answer that fits a
context; a bound beyond this is a mistake or an attack (``{"minLength": 1000000000}`` cannot be satisfied)."""
COUNT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
                  "minContains", "maxContains")

JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON as ``json.dumps`` writes it: a model cannot spend its tokens on whitespace the schema allows."""

MAX_REASON_CHARS = 300

MAX_INTEGER_DIGITS = 16
"""Digits of an integer (and of a number's integer part) in a schema-constrained answer when the schema bounds it
on neither side, as llama.cpp's JSON-schema grammar allows (``common/json-schema-to-grammar.cpp``,
``[1-9] [0-9]{0,15}``). Unbounded, a small model fills an ``integer`` field with digits until ``max_tokens``
(issue 25: ``"population": 1000000000000...``, 256 tokens, finish ``length``)."""
INTEGER_LIMIT = 2 ** 53 - 1
"""The bound put on an open side: 9,007,199,254,740,991 (16 digits), the largest integer a double holds exactly
(JavaScript's ``Number.MAX_SAFE_INTEGER``, what most JSON parsers read without loss). llguidance compares bounds as
doubles: 10^16 - 1 became 10^16 and let a 17th digit through (measured)."""
MAX_FRACTION_DIGITS = 10
"""Digits after a ``number``'s point in a schema-constrained answer when the schema sets no ``multipleOf`` of its
own. Unbounded, the embedded model wrote ``"area_km2": 105.4000000000...`` and ``105.46666...`` until
``max_tokens`` (issue 25, langchain's and instructor's tool calls). llama.cpp allows 16 (``decimal-part``,
``[0-9]{1,16}``); llguidance bounds a fraction only through ``multipleOf``, which it reads as the double's
shortest decimal: 1e-10 is the smallest power of ten it accepts (1e-11 to 1e-16 are refused, "too many digits")."""
FRACTION_STEP = 1e-10
"""``multipleOf`` put on a ``number`` the schema does not step: ``MAX_FRACTION_DIGITS`` digits after the point."""
_NOT_SCHEMAS = ("const", "enum", "default", "examples")
"""Keywords whose values are JSON data, not schemas: never rewritten."""
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
"""Keywords whose values map names to schemas: the names are not keywords (a property may be called ``type``)."""
_INTERSECTED = ("allOf", "not", "if", "then", "else", "dependentSchemas", "$ref")
"""Keywords whose schemas apply together with their parent's (``anyOf`` and ``oneOf`` too, beside ``properties``):
closing one (``closed``) would refuse the keys the other declares (``allOf: [{properties: a}, {properties: b}]``
would allow neither), so neither is closed."""


@dataclass(frozen=True)
class Grammar:
    """A validated llguidance grammar (its JSON text), ready for a matcher."""

    text: str
    kind: str
    """``json_schema``, ``json_object`` or ``gbnf``: what the request asked for."""


def parser_limits() -> Any:
    from llguidance import LLParserLimits

    # llguidance's defaults (2000 items per row, 1M initial lexer fuel, 200k step fuel, 50k Earley items per
    # step, 250k lexer states, 500k grammar symbols), with error messages that do not quote parser state.
    return LLParserLimits(verbose_errors=False)


def _refuse(reason: str, param: str = "response_format") -> BadRequest:
    reason = " ".join(reason.split())
    if len(reason) > MAX_REASON_CHARS:
        reason = reason[:MAX_REASON_CHARS] + "..."
    return BadRequest(f"{param}: {reason}", param=param)


_COUNTED = re.compile(r"\{(\d+)(?:,(\d*))?\}")


def pattern_repetition(pattern: str) -> int:
    """The largest product of nested counted repetitions (``{n}``, ``{m,n}``) in a regex: ``(a{4096}){4096}`` is
    16,777,216. llguidance accepts such a pattern and then constrains nothing (measured, llguidance 1.9.1: the
    output ignored it and decoded at 3 tokens/s), so it is refused before generation like a count keyword beyond
    ``MAX_SCHEMA_COUNT``. ``*``, ``+`` and ``?`` cost nothing here: they are loops, not copies."""
    stack = [1]  # per open group: the largest product inside it
    i, n = 0, len(pattern)
    last = 1  # the product of the atom or group just read (what a quantifier after it multiplies)
    while i < n:
        ch = pattern[i]
        if ch == "\\":
            i, last = i + 2, 1
            continue
        if ch == "[":  # a character class is one atom
            j = i + 1
            if j < n and pattern[j] == "^":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            i, last = j + 1, 1
            stack[-1] = max(stack[-1], 1)
            continue
        if ch == "(":
            stack.append(1)
            i += 1
            continue
        if ch == ")" and len(stack) > 1:
            last = stack.pop()
            stack[-1] = max(stack[-1], last)
            i += 1
            continue
        m = _COUNTED.match(pattern, i) if ch == "{" else None
        if m is not None:
            upper = int(m.group(2)) if m.group(2) else int(m.group(1))
            stack[-1] = max(stack[-1], last * max(upper, 1))
            last = last * max(upper, 1)
            i = m.end()
            continue
        last = 1
        i += 1
    return max(stack)


def check_schema_bounds(schema: Any) -> None:
    """``BadRequest`` for a schema beyond the fixed bounds (depth, nodes, count keywords, counted repetitions in a
    pattern); walks it iteratively."""
    stack: list[tuple[Any, int]] = [(schema, 1)]
    nodes = 0
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise _refuse(f"the schema has more than {MAX_SCHEMA_NODES} nodes")
        if depth > MAX_SCHEMA_DEPTH:
            raise _refuse(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        if isinstance(node, dict):
            for key in COUNT_KEYWORDS:
                value = node.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool) and value > MAX_SCHEMA_COUNT:
                    raise _refuse(f"{key} {value:g} is above the limit of {MAX_SCHEMA_COUNT}")
            pattern = node.get("pattern")
            if isinstance(pattern, str) and pattern_repetition(pattern) > MAX_SCHEMA_COUNT:
                raise _refuse(f"the pattern {pattern[:60]!r} repeats {pattern_repetition(pattern)} times in all, "
                              f"above the limit of {MAX_SCHEMA_COUNT}")
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)


def bounded_schema(schema: Any) -> Any:
    """``schema`` as an answer is generated from it: its numbers bounded (``bounded_numbers``) and its objects
    closed (``closed``), so that a small model's answer ends (issue 25). A copy: the request's text is not
    changed, and every answer it allows is one the request's schema allows."""
    return _rewrite(schema, numbers=True, objects=True)


def bounded_numbers(schema: Any) -> Any:
    """``schema`` with every ``integer`` or ``number`` it declares bounded on each side the schema leaves open
    (``minimum`` -``INTEGER_LIMIT``, ``maximum`` ``INTEGER_LIMIT``: at most ``MAX_INTEGER_DIGITS`` integer digits);
    a bound of its own is kept as written. A copy: the request's text is not changed. Data keywords (``const``,
    ``enum``, ``default``, ``examples``) are not walked. With a range llguidance writes a number without an
    exponent (1e5 as 100000). A ``number`` without a ``multipleOf`` of its own gets ``FRACTION_STEP``: at most
    ``MAX_FRACTION_DIGITS`` digits after the point (a range bounds values, not digits)."""
    return _rewrite(schema, numbers=True, objects=False)


def closed(schema: Any) -> Any:
    """``schema`` with every object that lists ``properties`` and says nothing of other keys closed to them
    (``additionalProperties: false``), as llama.cpp's own JSON-schema grammar reads such an object
    (``common/json-schema-to-grammar.cpp``, ``_build_object_rule``: other keys only when ``additionalProperties``
    is ``true`` or a schema). JSON Schema's default lets any other key in, and llguidance follows it: a small model
    then writes invented keys after the declared ones until ``max_tokens`` (issue 25, pydantic's schemas through
    instructor and langchain: ``"population_density": 100, "population_density": 100, ...``, finish ``length``).
    What a closed object allows is a subset of what the open one did, so every answer still validates against the
    request's schema. Left open: an object that speaks of other keys (``additionalProperties``,
    ``patternProperties``, ``unevaluatedProperties``, ``propertyNames``, ``minProperties``, ``dependentRequired``,
    ``dependencies``) or requires a key it does not list, and a schema applied together with another
    (``_INTERSECTED``: both of them, and the ``$ref`` targets such a schema names)."""
    return _rewrite(schema, numbers=False, objects=True)


def _rewrite(schema: Any, *, numbers: bool, objects: bool) -> Any:
    open_refs = _intersected_refs(schema) if objects else set()

    def walk(node: Any, pointer: str, intersected: bool) -> Any:
        if isinstance(node, list):
            return [walk(v, f"{pointer}/{i}", intersected) for i, v in enumerate(node)]
        if not isinstance(node, dict):
            return node
        out: dict[str, Any] = {}
        for k, v in node.items():
            at = f"{pointer}/{_escape(k)}"
            if k in _NOT_SCHEMAS:
                out[k] = v
            elif k in _SCHEMA_MAPS and isinstance(v, dict):
                out[k] = {name: walk(s, f"{at}/{_escape(name)}", _with_parent(node, k)) for name, s in v.items()}
            else:
                out[k] = walk(v, at, _with_parent(node, k))
        types = node.get("type")
        declared = set(t for t in types if isinstance(t, str)) if isinstance(types, list) else {types}
        if numbers and declared & {"integer", "number"}:
            if "minimum" not in node and "exclusiveMinimum" not in node:
                out["minimum"] = -INTEGER_LIMIT
            if "maximum" not in node and "exclusiveMaximum" not in node:
                out["maximum"] = INTEGER_LIMIT
            if "number" in declared and "multipleOf" not in node:
                out["multipleOf"] = FRACTION_STEP
        if (objects and isinstance(node.get("properties"), dict) and (types is None or "object" in declared)
                and not intersected and pointer not in open_refs
                and not any(_with_parent(node, k) for k in node)
                and not {"additionalProperties", "patternProperties", "unevaluatedProperties", "minProperties",
                         "propertyNames", "dependentRequired", "dependencies"} & node.keys()
                and _required_declared(node)):
            out["additionalProperties"] = False
        return out

    return walk(schema, "#", False)


def _required_declared(node: dict[str, Any]) -> bool:
    """Whether every key ``node`` requires is one of its ``properties`` (closed, it could not require another)."""
    required = node.get("required", [])
    return isinstance(required, list) and all(isinstance(k, str) and k in node["properties"] for k in required)


def _with_parent(node: dict[str, Any], key: str) -> bool:
    """Whether the schemas under ``node[key]`` apply together with ``node``'s own keywords."""
    return key in _INTERSECTED or (key in ("anyOf", "oneOf") and isinstance(node.get("properties"), dict))


def _escape(key: str) -> str:
    """A key as a JSON pointer's reference token (RFC 6901)."""
    return key.replace("~", "~0").replace("/", "~1")


def _intersected_refs(schema: Any) -> set[str]:
    """The ``$ref`` targets applied together with another schema: named by an ``allOf`` member (or any schema in an
    ``_INTERSECTED`` place), or beside keywords of the referring schema's own (``properties``, ``allOf``...)."""
    refs: set[str] = set()
    stack: list[tuple[Any, bool]] = [(schema, False)]
    while stack:
        node, intersected = stack.pop()
        if isinstance(node, list):
            stack.extend((v, intersected) for v in node)
        elif isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and (intersected or "properties" in node
                                         or any(_with_parent(node, k) for k in node if k != "$ref")):
                refs.add(ref)
            for k, v in node.items():
                if k in _NOT_SCHEMAS:
                    continue
                if k in _SCHEMA_MAPS and isinstance(v, dict):
                    stack.extend((s, _with_parent(node, k)) for s in v.values())
                else:
                    stack.append((v, _with_parent(node, k)))
    return refs


@functools.lru_cache(maxsize=256)
def compile_source(kind: str, text: str) -> Grammar:
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import gbnf_to_lark

    if kind == "lark":  # the tool-call grammars (service/chat/tools.py): their schemas are the tools' parameters
        if len(text.encode("utf-8", "surrogatepass")) > 4 * MAX_SCHEMA_BYTES:
            raise _refuse(f"the tools' schemas are larger than {4 * MAX_SCHEMA_BYTES} bytes", "tools")
        try:
            grammar = LLMatcher.grammar_from_lark(text)
        except Exception as exc:
            raise _refuse(f"the tools' parameters cannot be compiled: {exc}", "tools") from None
        error = LLMatcher.validate_grammar(grammar, None, limits=parser_limits())
        if error:
            raise _refuse(f"the tools' parameters cannot be used: {error}", "tools")
        return Grammar(text=grammar, kind=kind)
    if len(text.encode("utf-8", "surrogatepass")) > MAX_SCHEMA_BYTES:
        raise _refuse(f"the {'grammar' if kind == 'gbnf' else 'schema'} is larger than {MAX_SCHEMA_BYTES} bytes")
    try:
        if kind == "gbnf":
            grammar = LLMatcher.grammar_from_lark(gbnf_to_lark(text))
        else:
            try:
                schema = json.loads(text)
            except (ValueError, RecursionError) as exc:
                raise _refuse(f"the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise _refuse("a JSON schema is an object (or true/false)")
            check_schema_bounds(schema)
            grammar = LLMatcher.grammar_from_json_schema(json.dumps(bounded_schema(schema)),
                                                         defaults=dict(JSON_OPTIONS))  # type: ignore[arg-type]
    except BadRequest:
        raise
    except Exception as exc:  # llguidance's and the GBNF converter's errors: all about the request's text
        raise _refuse(f"the {'grammar' if kind == 'gbnf' else 'JSON schema'} cannot be compiled: {exc}") from None
    error = LLMatcher.validate_grammar(grammar, None, limits=parser_limits())
    if error:
        raise _refuse(f"the {'grammar' if kind == 'gbnf' else 'JSON schema'} cannot be used: {error}")
    return Grammar(text=grammar, kind=kind)


class Constrained(Protocol):
    """What a request says of its grammar (``service.engine.base.GenerationParams`` has these fields)."""

    @property
    def json_schema(self) -> str | None: ...
    @property
    def json_object(self) -> bool: ...
    @property
    def grammar(self) -> str | None: ...
    @property
    def lark(self) -> str | None: ...


def grammar_source(params: Constrained) -> tuple[str, str] | None:
    """The request's grammar as ``compile_source`` takes it, ``(kind, text)``; None without one."""
    if params.json_schema is not None:
        return ("json_schema", params.json_schema)
    if params.json_object:
        return ("json_object", '{"type": "object"}')
    if params.grammar:
        return ("gbnf", params.grammar)
    if params.lark:
        return ("lark", params.lark)
    return None


def compile_grammar(params: Constrained) -> Grammar | None:
    """The request's grammar (json_schema, json_object or GBNF), bounded and validated; None without one.

    ``BadRequest`` when it cannot be, so a bad schema is a 400 before any byte is streamed. Cheap
    after the first call for the same text (cached), so callers may call it more than once. In this
    process, unbounded but for ``LLParserLimits``: the engine's call, for grammars the API's worker
    compiled (``grammar_worker``); a request's grammar is compiled there first.
    """
    source = grammar_source(params)
    return compile_source(*source) if source is not None else None


# -- per-model tokenizer (llguidance's view of the vocabulary) ---------------------------------------------

