"""Structured output: a request's grammar (JSON schema, JSON object or GBNF), bounded, compiled, and its sampler.

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

Before a request is queued, the API runs ``_compile`` on the request's grammar (``grammar_source``) in
a compilation process (``grammar_worker``): it checks the schema against fixed bounds (size, depth,
nodes, and every count keyword such as ``maxItems`` or ``minLength``), turns it into an llguidance
grammar and validates it; any failure, a time-out or the memory limit is ``BadRequest`` naming the
reason, a 400 before any byte is streamed. Only a grammar that compiled there reaches the engine,
whose ``compile_grammar`` (in ``check`` and at generation, in the runner process) runs the same
``_compile`` under the same ``LLParserLimits``: the work the worker finished within the budget.
Results are cached by their text, so the engine's second call costs a dictionary look-up.
``grammar_sampler`` (the batched engine's sampler chain) and ``grammar_logits_processor``
(llama-cpp-python's ``Llama.generate``) mask the tokens the grammar forbids; nothing else in the
engines knows how a grammar is represented.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import BadRequest
from .base import GenerationParams

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

_MAX_REASON_CHARS = 300


@dataclass(frozen=True)
class Grammar:
    """A validated llguidance grammar (its JSON text), ready for a matcher."""

    text: str
    kind: str
    """``json_schema``, ``json_object`` or ``gbnf``: what the request asked for."""


def _limits() -> Any:
    from llguidance import LLParserLimits

    # llguidance's defaults (2000 items per row, 1M initial lexer fuel, 200k step fuel, 50k Earley items per
    # step, 250k lexer states, 500k grammar symbols), with error messages that do not quote parser state.
    return LLParserLimits(verbose_errors=False)


def _refuse(reason: str, param: str = "response_format") -> BadRequest:
    reason = " ".join(reason.split())
    if len(reason) > _MAX_REASON_CHARS:
        reason = reason[:_MAX_REASON_CHARS] + "..."
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


@functools.lru_cache(maxsize=256)
def _compile(kind: str, text: str) -> Grammar:
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import gbnf_to_lark

    if kind == "lark":  # the tool-call grammars (service/api/tools.py): their schemas are the tools' parameters
        if len(text.encode("utf-8", "surrogatepass")) > 4 * MAX_SCHEMA_BYTES:
            raise _refuse(f"the tools' schemas are larger than {4 * MAX_SCHEMA_BYTES} bytes", "tools")
        try:
            grammar = LLMatcher.grammar_from_lark(text)
        except Exception as exc:
            raise _refuse(f"the tools' parameters cannot be compiled: {exc}", "tools") from None
        error = LLMatcher.validate_grammar(grammar, None, limits=_limits())
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
            grammar = LLMatcher.grammar_from_json_schema(text, defaults=dict(JSON_OPTIONS))  # type: ignore[arg-type]
    except BadRequest:
        raise
    except Exception as exc:  # llguidance's and the GBNF converter's errors: all about the request's text
        raise _refuse(f"the {'grammar' if kind == 'gbnf' else 'JSON schema'} cannot be compiled: {exc}") from None
    error = LLMatcher.validate_grammar(grammar, None, limits=_limits())
    if error:
        raise _refuse(f"the {'grammar' if kind == 'gbnf' else 'JSON schema'} cannot be used: {error}")
    return Grammar(text=grammar, kind=kind)


def grammar_source(params: GenerationParams) -> tuple[str, str] | None:
    """The request's grammar as ``_compile`` takes it, ``(kind, text)``; None without one."""
    if params.json_schema is not None:
        return ("json_schema", params.json_schema)
    if params.json_object:
        return ("json_object", '{"type": "object"}')
    if params.grammar:
        return ("gbnf", params.grammar)
    if params.lark:
        return ("lark", params.lark)
    return None


def compile_grammar(params: GenerationParams) -> Grammar | None:
    """The request's grammar (json_schema, json_object or GBNF), bounded and validated; None without one.

    ``BadRequest`` when it cannot be, so a bad schema is a 400 before any byte is streamed. Cheap
    after the first call for the same text (cached), so callers may call it more than once. In this
    process, unbounded but for ``LLParserLimits``: the engine's call, for grammars the API's worker
    compiled (``grammar_worker``); a request's grammar is compiled there first.
    """
    source = grammar_source(params)
    return _compile(*source) if source is not None else None


# -- per-model tokenizer (llguidance's view of the vocabulary) ---------------------------------------------

_tok_lock = threading.Lock()
_tokenizers: dict[tuple[Any, ...], Any] = {}
_MAX_TOKENIZERS = 2


def _vocab_key(vocab: Any) -> tuple[Any, ...]:
    """The vocabulary's identity: its address, size and a sample of its pieces (an unloaded model's address
    may be reused by the next one; the pieces tell them apart)."""
    import llama_cpp

    n = int(llama_cpp.llama_vocab_n_tokens(vocab))
    buf = ctypes.create_string_buffer(256)
    sample = []
    for tok in range(0, n, max(1, n // 64)):
        k = llama_cpp.llama_token_to_piece(vocab, tok, buf, 256, 0, True)
        sample.append(bytes(buf[: max(k, 0)]))
    address = ctypes.cast(vocab, ctypes.c_void_p).value
    return (address, n, int(llama_cpp.llama_vocab_eos(vocab)), tuple(sample))


def _tokenizer(vocab: Any) -> Any:
    """llguidance's tokenizer for this vocabulary, built once per model (about 1 s for 262k tokens)."""
    import llama_cpp
    from llguidance.llamacpp import lltokenizer_from_vocab

    key = _vocab_key(vocab)
    with _tok_lock:
        tok = _tokenizers.get(key)
        if tok is None:
            n = key[1]
            # Every end-of-generation token may end a grammar's output (gemma: <eos> and <end_of_turn>).
            eog = [t for t in range(n) if llama_cpp.llama_vocab_is_eog(vocab, t)] or [key[2]]
            tok = lltokenizer_from_vocab(vocab, eos_token=eog)
            while len(_tokenizers) >= _MAX_TOKENIZERS:
                _tokenizers.pop(next(iter(_tokenizers)))
            _tokenizers[key] = tok
        return tok


class _Mask:
    """One request's grammar state: an llguidance matcher and the mask of the tokens it allows next."""

    def __init__(self, vocab: Any, grammar: Grammar) -> None:
        import numpy as np
        from llguidance import LLMatcher

        tok = _tokenizer(vocab)
        self.n_vocab = int(tok.vocab_size)
        self.eos = np.array(sorted(set(tok.eos_tokens)), dtype=np.int64)
        self.matcher = LLMatcher(tok, grammar.text, log_level=0, limits=_limits())
        if self.matcher.is_error():
            log.warning("grammar matcher refused a validated grammar: %s", self.matcher.get_error()[:_MAX_REASON_CHARS])
        self._words = np.zeros((self.n_vocab + 31) // 32, dtype=np.int32)

    def allowed(self) -> Any:
        """A boolean array over token ids: what may come next (only end-of-generation once done or failed)."""
        import numpy as np

        m = self.matcher
        if m.is_error() or m.is_stopped():
            out = np.zeros(self.n_vocab, dtype=bool)
            out[self.eos] = True
            return out
        m.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        return np.unpackbits(self._words.view(np.uint8), bitorder="little")[: self.n_vocab].astype(bool)

    def accept(self, token: int) -> None:
        if not (self.matcher.is_error() or self.matcher.is_stopped()):
            self.matcher.consume_token(int(token))


# -- the batched engine: a llama.cpp sampler (llama_sampler_init with our interface) ---------------------

_TOKEN_DATA = None  # numpy dtype of llama_token_data, built on first use
_live: dict[int, tuple[Any, ...]] = {}
"""Samplers llama.cpp holds, by context id: their Python state must outlive every call into them."""
_freed: list[int] = []
"""Ids whose ``free`` callback ran: released at the next creation, never inside the callback itself (its
thunk would be freed while it runs)."""
_next_id = 0
_live_lock = threading.Lock()


def _token_data_view(cur_p: Any) -> Any:
    import llama_cpp
    import numpy as np

    global _TOKEN_DATA
    if _TOKEN_DATA is None:
        _TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)], align=True)
        assert _TOKEN_DATA.itemsize == ctypes.sizeof(llama_cpp.llama_token_data)
    arr = cur_p.contents
    size = int(arr.size)
    buf = (llama_cpp.llama_token_data * size).from_address(ctypes.addressof(arr.data.contents))
    return np.frombuffer(buf, dtype=_TOKEN_DATA, count=size)


def grammar_sampler(vocab: Any, grammar: Grammar) -> Any:
    """A llama.cpp sampler constraining tokens to ``grammar`` (a ``compile_grammar`` result).

    Allocated by llama.cpp (``llama_sampler_init``), so ``llama_sampler_free`` on its chain frees it as it
    frees its own; our ``free`` callback releases the Python state.
    """
    import llama_cpp
    import numpy as np

    global _next_id
    mask = _Mask(vocab, grammar)

    def apply(_smpl: Any, cur_p: Any) -> None:
        data = _token_data_view(cur_p)
        ok = mask.allowed()
        ids = data["id"]
        inside = ids < mask.n_vocab
        keep = np.zeros(len(ids), dtype=bool)
        keep[inside] = ok[ids[inside]]
        data["logit"][~keep] = -np.inf

    def accept(_smpl: Any, token: int) -> None:
        mask.accept(token)

    def reset(_smpl: Any) -> None:
        mask.matcher.reset()

    def name(_smpl: Any) -> bytes:
        return b"llguidance"

    with _live_lock:
        while _freed:
            _live.pop(_freed.pop(), None)
        _next_id += 1
        sid = _next_id

    def free(_smpl: Any) -> None:
        with _live_lock:
            _freed.append(sid)

    iface = llama_cpp.llama_sampler_i()
    callbacks = (
        llama_cpp.llama_sampler_i_name(name),
        llama_cpp.llama_sampler_i_accept(accept),
        llama_cpp.llama_sampler_i_apply(apply),
        llama_cpp.llama_sampler_i_reset(reset),
        llama_cpp.llama_sampler_i_free(free),
    )
    iface.name, iface.accept, iface.apply, iface.reset, iface.free = callbacks
    smpl = llama_cpp.llama_sampler_init(ctypes.pointer(iface), ctypes.c_void_p(sid))
    with _live_lock:
        _live[sid] = (iface, callbacks, mask)
    return smpl


# -- the single-sequence engine: a logits processor for llama-cpp-python's Llama.generate ----------------

def grammar_logits_processor(vocab: Any, grammar: Grammar) -> Callable[[Any, Any], Any]:
    """``Llama.generate``'s ``logits_processor``: masks the scores (in token-id order) to what ``grammar`` allows.

    ``Llama.generate`` does not tell a processor which token it sampled; the processor sees the tokens
    evaluated so far (``input_ids``), so on each call it feeds the matcher those it has not seen.
    """
    import numpy as np

    mask = _Mask(vocab, grammar)
    state = {"start": -1, "seen": 0}

    def process(input_ids: Any, scores: Any) -> Any:
        n = len(input_ids)
        if state["start"] < 0:
            state["start"] = n
        for tok in input_ids[state["start"] + state["seen"] : n]:
            mask.accept(int(tok))
        state["seen"] = n - state["start"]
        ok = mask.allowed()
        m = min(len(scores), len(ok))
        scores[:m][~ok[:m]] = -np.inf
        return scores

    return process
