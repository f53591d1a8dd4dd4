"""Property-based fuzz of ``response_format`` JSON schemas (hypothesis): every schema is a grammar or a 400.

In process: ``compile_grammar`` on generated schemas (valid, unsatisfiable, misspelt, huge bounds, bad
patterns, dangling ``$ref``) returns a grammar or raises ``BadRequest``, nothing else; each grammar then
drives an llguidance matcher over the embedded model's real vocabulary for a few tokens (mask, pick an
allowed token, consume it) without error or hang. Over HTTP: generated schemas sent to the real
service get 200 or 400, and the same process keeps serving. ``make soak`` runs ten times as many.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.engine.base import GenerationParams
from service.errors import BadRequest
from tests.conftest import ServiceProcess

from .conftest import SOAK
from tests.figures import figure

N_LOCAL = 1500 if SOAK else 150
N_HTTP = 200 if SOAK else 25

_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8)
_types = st.sampled_from(["string", "integer", "number", "boolean", "object", "array", "null", "banana", ""])
_counts = st.one_of(st.integers(-3, 20), st.integers(0, 10**10), st.floats(allow_nan=False, allow_infinity=False))
_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.text(max_size=12))
_patterns = st.sampled_from(["^a+$", "(", "[a-z]{2,5}", "(a|aa)*b", "\\d{3}-\\d{4}", ".*", "a{1000000}", "[^]"])
_formats = st.sampled_from(["date-time", "email", "uuid", "uri", "date", "time", "nope"])
_counted = st.sampled_from(["minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties"])


def _schemas() -> st.SearchStrategy[Any]:
    leaf = st.one_of(
        st.fixed_dictionaries({"type": _types}),
        st.builds(lambda t, k, n: {"type": t, k: n}, _types, _counted, _counts),
        st.fixed_dictionaries({"type": st.just("string"), "pattern": _patterns}),
        st.fixed_dictionaries({"type": st.just("string"), "format": _formats}),
        st.fixed_dictionaries({"enum": st.lists(_scalars, max_size=4)}),
        st.fixed_dictionaries({"const": _scalars}),
        st.builds(lambda a, b: {"type": "integer", "minimum": a, "maximum": b}, st.integers(-9, 9), st.integers(-9, 9)),
        st.fixed_dictionaries({"$ref": st.sampled_from(["#/$defs/a", "#/nothing", "#", "http://127.0.0.1:9/x"])}),
        st.booleans(),
    )

    def extend(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        return st.one_of(
            st.builds(lambda p, r, a: {"type": "object", "properties": p, "required": r, "additionalProperties": a},
                      st.dictionaries(_names, inner, max_size=4), st.lists(_names, max_size=3), st.booleans()),
            st.builds(lambda i, n: {"type": "array", "items": i, "maxItems": n}, inner, _counts),
            st.builds(lambda xs: {"anyOf": xs}, st.lists(inner, max_size=3)),
            st.builds(lambda xs: {"allOf": xs}, st.lists(inner, max_size=3)),
            st.builds(lambda xs: {"oneOf": xs}, st.lists(inner, max_size=3)),
            st.builds(lambda d, r: {"$defs": {"a": d}, **r}, inner, st.fixed_dictionaries({"$ref": st.just("#/$defs/a")})),
        )

    return st.recursive(leaf, extend, max_leaves=12)


SCHEMAS = _schemas()


@pytest.fixture(scope="module")
def vocab(embedded_model: str) -> Any:
    import llama_cpp

    mp = llama_cpp.llama_model_default_params()
    mp.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(embedded_model.encode(), mp)
    assert model
    vocab = llama_cpp.llama_model_get_vocab(model)
    from service.engine.grammar_sampler import _tokenizer

    _tokenizer(vocab)  # built once per model (about 2 s, more on a busy host): not part of any example's time
    yield vocab
    llama_cpp.llama_model_free(model)


@pytest.mark.slow
@pytest.mark.timeout(900 if SOAK else 300)
def test_every_schema_is_a_grammar_or_a_400(vocab: Any) -> None:
    import numpy as np

    from service.grammar.schema import compile_grammar
    from service.engine.grammar_sampler import _Mask

    tally = {"grammar": 0, "refused": 0, "steps": 0}
    slowest = [0.0]

    @settings(max_examples=N_LOCAL, deadline=None, database=None, derandomize=not SOAK,
              suppress_health_check=list(HealthCheck))
    @given(schema=SCHEMAS)
    def check(schema: Any) -> None:
        t0 = time.monotonic()
        try:
            g = compile_grammar(GenerationParams(json_schema=json.dumps(schema)))
        except BadRequest as exc:
            assert exc.param == "response_format" and exc.message.startswith("response_format: ")
            tally["refused"] += 1
            return
        assert g is not None
        tally["grammar"] += 1
        mask = _Mask(vocab, g)
        for _ in range(4):
            ok = mask.allowed()
            assert ok.dtype == np.bool_ and ok.any(), "a mask always allows something (at worst the end)"
            ids = np.flatnonzero(ok)
            mask.accept(int(ids[len(ids) // 2]))
            tally["steps"] += 1
        slowest[0] = max(slowest[0], time.monotonic() - t0)
        assert time.monotonic() - t0 < 10, "generous: a schema's compile and 4 mask steps take milliseconds"

    check()
    assert tally["grammar"] > N_LOCAL // 10 and tally["refused"] > N_LOCAL // 10, tally
    figure(f"schema fuzz (in process): {N_LOCAL} schemas: {tally['grammar']} grammars "
           f"({tally['steps']} mask steps on the 262k vocabulary), {tally['refused']} refused with 400; "
           f"slowest compile + 4 steps {slowest[0] * 1e3:.0f} ms")


@pytest.mark.slow
@pytest.mark.timeout(900 if SOAK else 300)
def test_generated_schemas_over_http_get_200_or_400(service_factory: Callable[..., ServiceProcess]) -> None:
    from .conftest import rss_kib

    svc = service_factory(GGUF_CONFIRM_LOADS="false", GGUF_CONTEXT_LENGTH="2048", GGUF_PARALLEL="2")
    svc.wait_ready()
    pid = svc.proc.pid
    seen: dict[int, int] = {}

    @settings(max_examples=N_HTTP, deadline=None, database=None, derandomize=not SOAK,
              suppress_health_check=list(HealthCheck))
    @given(schema=SCHEMAS, stream=st.booleans())
    def check(schema: Any, stream: bool) -> None:
        body = {"prompt": "JSON:", "max_tokens": 6, "stream": stream,
                "response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": schema}}}
        r = svc.client.post("/v1/completions", json=body)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code in (200, 400), (schema, r.text[:300])
        if stream and r.status_code == 200:
            assert r.text.rstrip().endswith("data: [DONE]")
        assert svc.proc.poll() is None, schema

    check()
    r = svc.client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200 and svc.proc.pid == pid
    figure(f"schema fuzz (HTTP, batched engine): {N_HTTP} requests: {dict(sorted(seen.items()))}; "
           f"RSS {rss_kib(pid) // 1024} MiB; same PID")
