"""Structured output: a request's grammar (JSON schema, JSON object or GBNF), compiled, and its sampler.

The engines call ``compile_grammar`` before a request is admitted (a bad grammar is a 400 before
any byte is streamed) and ``grammar_sampler`` when they build the request's sampler chain; nothing
else in the engines knows how a grammar is represented.
"""

from __future__ import annotations

from typing import Any

from ..errors import BadRequest
from .base import GenerationParams


def compile_grammar(params: GenerationParams) -> Any:
    """The request's grammar (json_schema, json_object or GBNF), compiled; None without one.

    ``BadRequest`` when it cannot be, so a bad schema is a 400 before any byte is streamed.
    """
    from llama_cpp import llama_grammar

    try:
        if params.json_schema is not None:
            text = llama_grammar.json_schema_to_gbnf(params.json_schema)
        elif params.json_object:
            text = llama_grammar.JSON_GBNF
        elif params.grammar:
            text = params.grammar
        else:
            return None
        return llama_grammar.LlamaGrammar.from_string(text, verbose=False)
    except (ValueError, KeyError, TypeError, RecursionError, NotImplementedError) as exc:
        raise BadRequest(f"response_format: the JSON schema cannot be turned into a grammar: {exc}",
                         param="response_format") from exc


def grammar_sampler(vocab: Any, grammar: Any) -> Any:
    """A llama.cpp sampler constraining tokens to ``grammar`` (a ``compile_grammar`` result)."""
    import llama_cpp

    return llama_cpp.llama_sampler_init_grammar(vocab, grammar._grammar.encode("utf-8"), grammar._root.encode("utf-8"))
