"""The batched engine on the embedded model: same texts as one-at-a-time runs, per-request
cancellation and failures that leave the other sequences running."""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any, Iterator

import pytest

from service.engine.base import Cancel, Chunk, GenerationParams
from service.errors import ContextLengthExceeded, InsufficientMemory
from sizing.devices import host_memory
from sizing.gguf import probe_path
from sizing.plan import Plan, PlanRequest, make_plan

PROMPTS = ("The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors are")
GREEDY = GenerationParams(max_tokens=16, temperature=0.0)


def _plan(path: str, n_ctx: int, slots: int, *, unified: bool = False) -> Plan:
    plan = make_plan(probe_path(path), [], host_memory(),
                     PlanRequest(n_ctx=n_ctx, n_seq_max=slots, cache_type="f16", min_ctx=256))
    return replace(plan, cfg=replace(plan.cfg, kv_unified=unified))


def _run(chunks: Iterator[Chunk]) -> tuple[str, Chunk]:
    got = list(chunks)
    return "".join(c.text for c in got), got[-1]


def _concurrently(fns: list[Any]) -> list[Any]:
    """Run each function in its own thread at once; their results (or exceptions) in order."""
    out: list[Any] = [None] * len(fns)
    start = threading.Barrier(len(fns))

    def call(i: int) -> None:
        start.wait()
        try:
            out[i] = fns[i]()
        except Exception as exc:  # returned for the test to inspect
            out[i] = exc

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return out


@pytest.fixture(scope="module")
def invariant(embedded_model: str) -> Iterator[Any]:
    """4 slots of 512 tokens, batch-invariant weights (no repacked CPU layouts)."""
    from service.engine.batched import BatchedEngine

    eng = BatchedEngine(n_threads=1, batch_invariant=True)
    eng.load(embedded_model, _plan(embedded_model, 2048, 4))
    yield eng
    eng.unload()


@pytest.mark.slow
def test_one_at_a_time_matches_the_single_sequence_engine(embedded_model: str) -> None:
    """Same plan, same weights layout: token for token, with usage counts and a stop string."""
    from service.engine.batched import BatchedEngine
    from service.engine.llama import LlamaEngine

    single = LlamaEngine(n_threads=1)
    single.load(embedded_model, _plan(embedded_model, 512, 1))
    params = [GREEDY, replace(GREEDY, stop=("\n",)), replace(GREEDY, temperature=0.9, seed=7)]
    try:
        ref = [_run(single.complete(PROMPTS[2], p, Cancel())) for p in params]
    finally:
        single.unload()
    batched = BatchedEngine(n_threads=1)
    batched.load(embedded_model, _plan(embedded_model, 2048, 4))
    try:
        assert batched.n_ctx == 512 and batched.slots == 4
        got = [_run(batched.complete(PROMPTS[2], p, Cancel())) for p in params]
    finally:
        batched.unload()
    assert got == ref
    assert ref[0][1].completion_tokens == 16 and ref[0][1].finish_reason == "length"
    assert ref[1][1].finish_reason == "stop" and "\n" not in ref[1][0]


@pytest.mark.slow
def test_four_concurrent_greedy_generations_match_sequential_runs(invariant: Any) -> None:
    sequential = [_run(invariant.complete(p, GREEDY, Cancel())) for p in PROMPTS]
    together = _concurrently([lambda p=p: _run(invariant.complete(p, GREEDY, Cancel())) for p in PROMPTS])
    assert [t for t, _ in together] == [t for t, _ in sequential]
    assert all(c.finish_reason == "length" and c.completion_tokens == 16 for _, c in together)
    assert [c.prompt_tokens for _, c in together] == [invariant.count_tokens(p) for p in PROMPTS]
    assert invariant.kv_cells_used == 0  # every sequence's cells were freed


@pytest.mark.slow
def test_seeded_sampling_does_not_depend_on_the_batch(invariant: Any) -> None:
    seeded = GenerationParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234)
    alone = _run(invariant.complete(PROMPTS[1], seeded, Cancel()))[0]
    others = [lambda p=p: _run(invariant.complete(p, replace(seeded, seed=None), Cancel())) for p in PROMPTS[1:]]
    crowded = _concurrently([lambda: _run(invariant.complete(PROMPTS[1], seeded, Cancel())), *others])
    assert crowded[0][0] == alone
    other_seed = _run(invariant.complete(PROMPTS[1], replace(seeded, seed=99), Cancel()))[0]
    assert other_seed != alone  # the seed is what fixed the text


@pytest.mark.slow
def test_cancelling_one_request_leaves_the_others_untouched(invariant: Any) -> None:
    long = GenerationParams(max_tokens=48, temperature=0.0)
    ref = [_run(invariant.complete(p, long, Cancel()))[0] for p in PROMPTS[1:]]
    cancel = Cancel()

    def cancelled() -> tuple[str, Chunk]:
        got = []
        for c in invariant.complete(PROMPTS[0], long, cancel):
            got.append(c)
            if c.text:
                cancel.set()
        return "".join(c.text for c in got), got[-1]

    out = _concurrently([cancelled, *[lambda p=p: _run(invariant.complete(p, long, Cancel())) for p in PROMPTS[1:]]])
    text, last = out[0]
    assert last.finish_reason == "cancelled"
    assert 1 <= last.completion_tokens <= 3  # stopped within a step of the cancel
    assert [t for t, _ in out[1:]] == ref
    assert all(c.finish_reason == "length" and c.completion_tokens == 48 for _, c in out[1:])


@pytest.mark.slow
def test_a_prompt_longer_than_its_slot_fails_typed_while_others_finish(invariant: Any) -> None:
    too_long = "hello " * 600  # > 512 tokens, the per-sequence context of 2048 cells over 4 slots
    out = _concurrently([
        lambda: _run(invariant.complete(too_long, GREEDY, Cancel())),
        *[lambda p=p: _run(invariant.complete(p, GREEDY, Cancel())) for p in PROMPTS[:2]],
    ])
    assert isinstance(out[0], ContextLengthExceeded)
    assert out[0].details["n_ctx"] == 512 and out[0].details["prompt_tokens"] > 512
    assert all(c.finish_reason == "length" and c.completion_tokens == 16 for _, c in out[1:])


@pytest.mark.slow
def test_a_full_unified_cache_fails_the_request_that_does_not_fit(embedded_model: str) -> None:
    """llama_decode returns 1 (no KV slot): that request gets InsufficientMemory, the other finishes."""
    from service.engine.batched import BatchedEngine

    eng = BatchedEngine(n_threads=1)
    eng.load(embedded_model, _plan(embedded_model, 512, 2, unified=True))
    try:
        assert eng.n_ctx == 512  # unified: each sequence may use every cell, together they share them
        running = GenerationParams(max_tokens=200, temperature=0.0)
        started = threading.Event()
        result: dict[str, Any] = {}

        def first() -> None:
            got = []
            for c in eng.complete(PROMPTS[1], running, Cancel()):
                got.append(c)
                if sum(x.completion_tokens or bool(x.text) for x in got) >= 120:
                    started.set()
            started.set()
            result["first"] = got[-1]

        t = threading.Thread(target=first)
        t.start()
        assert started.wait(120)
        big = "hello " * 420  # about 420 prompt tokens: with the first's 120+ cells, more than 512
        with pytest.raises(InsufficientMemory) as info:
            _run(eng.complete(big, GenerationParams(max_tokens=8, temperature=0.0), Cancel()))
        t.join(120)
        err = info.value
        assert err.details["device"] == "CPU" and err.details["max_tokens"] == 8
        assert err.details["prompt_tokens"] == eng.count_tokens(big)
        assert "CPU" in err.message and str(err.details["prompt_tokens"]) in err.message
        assert result["first"].finish_reason == "length" and result["first"].completion_tokens == 200
        # The failed sequence's cells were freed: the same prompt fits now the cache is empty.
        assert _run(eng.complete(big, GenerationParams(max_tokens=4, temperature=0.0), Cancel()))[1].completion_tokens == 4
    finally:
        eng.unload()
