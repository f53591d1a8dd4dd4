"""The llama.cpp engine on the embedded model: slots that keep their prompts' KV (prefix reuse, exact where it
can be), one slot equal to four, concurrent requests equal to one-at-a-time runs in batch-invariant mode,
per-request cancellation and failures that leave the other sequences running."""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any, Iterator

import pytest

from service.engine.base import Cancel, Chunk, GenerationParams
from service.engine.llama import LlamaEngine
from service.text.served import ServedModel
from service.engine.slots import INVARIANT_MIN_ROWS, common_prefix
from service.errors import ContextLengthExceeded, InsufficientMemory
from sizing.probe.devices import host_memory
from sizing.probe import probe_path
from sizing.plan.make import Plan, PlanRequest, make_plan

pytestmark = pytest.mark.slow

PROMPTS = ("The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors are")
# One token a step: these tests compare engines and batch layouts; drafts (tests/service/engine/test_speculation.py) add
# rows to a step, which repacked CPU weights round otherwise than a row alone.
GREEDY = GenerationParams(max_tokens=16, temperature=0.0, speculative=False)
COLD = replace(GREEDY, cache_prompt=False)
HISTORY = ("The keeper of the lighthouse on the northern cape wrote in his log every evening. "
           "He noted the wind, the height of the waves, the ships that passed and the birds. ") * 6


def _plan(path: str, n_ctx: int, slots: int, *, unified: bool = False, cache_type: str = "q8_0") -> Plan:
    """The service's default cache type (q8_0, flash attention on)."""
    return make_plan(probe_path(path), [], host_memory(),
                     PlanRequest(n_ctx=n_ctx, n_seq_max=slots, kv_unified=unified, cache_type=cache_type, min_ctx=256))


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
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a request still ran after 600 s: the scheduler is stuck"
    return out


@pytest.fixture(scope="module")
def invariant(embedded_model: str) -> Iterator[LlamaEngine]:
    """4 slots of 512 tokens, batch-invariant weights (no repacked CPU layouts)."""
    eng = ServedModel.of(LlamaEngine(batch_invariant=True))
    eng.load(embedded_model, _plan(embedded_model, 2048, 4))
    yield eng
    eng.unload()


@pytest.fixture(scope="module")
def unified(embedded_model: str) -> Iterator[LlamaEngine]:
    """The defaults' shape: 4 slots sharing one unified cache of 4096 cells, repacked weights."""
    eng = ServedModel.of(LlamaEngine())
    eng.load(embedded_model, _plan(embedded_model, 4096, 4, unified=True))
    yield eng
    eng.unload()


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([5], [6]) == 0
    a = list(range(1000))
    for k in (0, 1, 499, 998, 999):
        b = a[:k] + [-1] + a[k + 1:]
        assert common_prefix(a, b) == k


def test_one_slot_gives_what_four_unified_slots_give_one_request_at_a_time(embedded_model: str,
                                                                          unified: LlamaEngine) -> None:
    """``parallel = 1`` is the same engine: token for token, with usage counts, a stop string and a seed."""
    params = [COLD, replace(COLD, stop=("\n",)), replace(COLD, temperature=0.9, seed=7)]
    got = [_run(unified.complete(PROMPTS[2], p, Cancel())) for p in params]
    single = ServedModel.of(LlamaEngine())
    single.load(embedded_model, _plan(embedded_model, 4096, 1))
    try:
        assert single.n_ctx == 4096 and single.slots == 1
        ref = [_run(single.complete(PROMPTS[2], p, Cancel())) for p in params]
    finally:
        single.unload()
    assert unified.n_ctx == 4096 and unified.slots == 4  # unified: one request may use every cell
    assert got == ref
    assert ref[0][1].completion_tokens == 16 and ref[0][1].finish_reason == "length"
    assert ref[1][1].finish_reason == "stop" and "\n" not in ref[1][0]
    assert ref[0][1].prompt_seconds > 0 and ref[0][1].decode_seconds > 0  # measured for every request


def test_the_next_turn_evaluates_only_what_is_new(unified: LlamaEngine) -> None:
    unified.forget()
    first = HISTORY + "Question: what did he note?\nAnswer:"
    text, last = _run(unified.complete(first, GREEDY, Cancel()))
    assert last.cached_tokens == 0
    n_first = last.prompt_tokens
    assert unified.kv_cells_used == n_first + last.completion_tokens - 1  # the slot keeps prompt and output
    second = first + text + "\nQuestion: and the birds?\nAnswer:"
    _, last2 = _run(unified.complete(second, GREEDY, Cancel()))
    # Everything the slot holds that the new prompt repeats: the first prompt and (retokenized alike) the reply.
    assert n_first <= last2.cached_tokens < last2.prompt_tokens
    assert last2.cached_tokens >= n_first + last.completion_tokens - 2
    assert last2.prompt_seconds < last.prompt_seconds  # generous: a few tokens against a whole history


def test_the_same_prompt_again_gives_the_same_output_as_its_first_run(unified: LlamaEngine) -> None:
    """The first token comes from the logits the first run sampled from (kept with the slot), so greedy,
    seeded and logprobs outputs of a repeated request equal the first run's, whatever the weights' layout."""
    unified.forget()
    prompt = HISTORY + "In the morning"
    for params in (GREEDY, replace(GREEDY, temperature=0.9, seed=11), replace(GREEDY, max_tokens=6, logprobs=3)):
        cold = list(unified.complete(prompt, replace(params, cache_prompt=False), Cancel()))
        again = list(unified.complete(prompt, params, Cancel()))
        assert again[-1].cached_tokens == again[-1].prompt_tokens  # nothing evaluated before the first token
        assert again == cold  # text, logprobs, finish reason, usage


def test_a_reused_prefix_gives_the_cold_output_in_batch_invariant_mode(invariant: LlamaEngine) -> None:
    """Measured: with the repacked weights (the default), a token's logits depend on the rows beside it in its
    batch (docs/batching.md), so a prompt evaluated over a cached prefix may differ from a cold evaluation.
    Batch-invariant mode reuses only tokens computed as a cold evaluation computes them and evaluates at least
    INVARIANT_MIN_ROWS tokens: outputs equal a cold cache's."""
    prefix = HISTORY[:400]
    for suffix in (" The next day", " He wrote about the storm of the night before and the", " A"):
        invariant.forget()
        _run(invariant.complete(prefix + " Then", COLD, Cancel()))  # the prefix, cached by a cold evaluation
        _run(invariant.complete(prefix + " Then", GREEDY, Cancel()))
        warm = _run(invariant.complete(prefix + suffix, GREEDY, Cancel()))
        cold = _run(invariant.complete(prefix + suffix, COLD, Cancel()))
        assert warm[0] == cold[0]
        n = warm[1].prompt_tokens
        assert 0 < warm[1].cached_tokens <= n - INVARIANT_MIN_ROWS


def test_requests_go_to_the_slot_holding_their_prefix_and_the_least_recently_used_is_evicted(
        unified: LlamaEngine) -> None:
    unified.forget()
    convs = [f"Conversation {i}. " + HISTORY[i * 20:i * 20 + 300] for i in range(5)]
    for c in convs[:4]:  # four conversations, one per slot (sharing their first few tokens, "Conversation")
        assert _run(unified.complete(c, GREEDY, Cancel()))[1].cached_tokens < 8
    for c in convs[:4]:  # each finds its own slot again
        last = _run(unified.complete(c + " More.", GREEDY, Cancel()))[1]
        assert last.cached_tokens >= last.prompt_tokens - 4
    _run(unified.complete(convs[4], GREEDY, Cancel()))  # a fifth takes the least recently used slot (conv 0's)
    assert _run(unified.complete(convs[0] + " More.", GREEDY, Cancel()))[1].cached_tokens < 8
    last = _run(unified.complete(convs[3] + " More. Again.", GREEDY, Cancel()))[1]
    assert last.cached_tokens >= last.prompt_tokens - 6


def test_a_prefix_held_by_a_busy_slot_is_shared_not_evaluated(unified: LlamaEngine) -> None:
    """Unified cache: a request whose prompt starts like a running one's gets those cells (llama_memory_seq_cp)."""
    unified.forget()
    system = "You are a careful assistant. " + HISTORY
    started = threading.Event()
    result: dict[str, Any] = {}

    def long_one() -> None:
        got = []
        for c in unified.complete(system + "Write a poem.", replace(GREEDY, max_tokens=64, ignore_eos=True), Cancel()):
            got.append(c)
            started.set()
        result["long"] = got[-1]

    t = threading.Thread(target=long_one)
    t.start()
    assert started.wait(60)
    used_before = unified.kv_cells_used
    _, last = _run(unified.complete(system + "Write a song.", replace(GREEDY, max_tokens=4), Cancel()))
    # A generous bound, not a speed figure: 64 tokens took over 60 s once, beside another suite on the 2 cores.
    t.join(600)
    n_system = unified.count_tokens(system)
    assert last.cached_tokens >= n_system - 2  # the shared system prompt was not evaluated again
    assert result["long"].completion_tokens == 64
    assert used_before < n_system + 80  # shared cells are counted once


def test_a_sliding_window_cache_reuses_only_what_it_still_holds(embedded_model: str) -> None:
    """gemma-3's sliding-window layers keep n_swa (512) positions; with swa_full off the SWA cache has
    512 + n_ubatch cells for one sequence and reuses cells beyond the window. A prompt that continues the
    cached one reuses all of it; one that leaves it earlier than the SWA cells still held starts over."""
    eng = ServedModel.of(LlamaEngine())
    eng.load(embedded_model, _plan(embedded_model, 4096, 1))
    try:
        assert eng.engine.loaded.n_swa == 512
        long = HISTORY * 8  # about 1,700 tokens: the 1,024-cell SWA cache has wrapped
        _, first = _run(eng.complete(long, replace(GREEDY, max_tokens=2), Cancel()))
        assert first.prompt_tokens > 1100
        _, cont = _run(eng.complete(long + " And so on.", replace(GREEDY, max_tokens=2), Cancel()))
        assert cont.cached_tokens >= first.prompt_tokens - 2  # (the last token may join the new text)
        cut = long[: len(long) // 3] + " Something else entirely."  # leaves the cache around token 570
        _, early = _run(eng.complete(cut, replace(GREEDY, max_tokens=2), Cancel()))
        assert early.cached_tokens == 0  # the SWA cells before position ~570 - 512 were reused: evaluated again
        _, late = _run(eng.complete(cut + " More.", replace(GREEDY, max_tokens=2), Cancel()))
        assert late.cached_tokens >= early.prompt_tokens - 1  # and that new prompt is cached whole
    finally:
        eng.unload()


def test_prompt_cache_off_keeps_nothing(embedded_model: str) -> None:
    eng = ServedModel.of(LlamaEngine(cache_prompt=False))
    eng.load(embedded_model, _plan(embedded_model, 2048, 2, unified=True))
    try:
        for _ in range(2):
            assert _run(eng.complete(HISTORY, GREEDY, Cancel()))[1].cached_tokens == 0
        assert eng.kv_cells_used == 0
    finally:
        eng.unload()


def test_ignore_eos_generates_past_the_end(unified: LlamaEngine) -> None:
    stop_early = GenerationParams(max_tokens=200, temperature=0.0, cache_prompt=False)
    _, natural = _run(unified.complete("1, 2, 3, 4,", stop_early, Cancel()))
    if natural.finish_reason == "stop":
        _, forced = _run(unified.complete("1, 2, 3, 4,", replace(stop_early, ignore_eos=True), Cancel()))
        assert forced.finish_reason == "length" and forced.completion_tokens == 200
    else:
        assert natural.completion_tokens == 200


def test_four_concurrent_greedy_generations_match_sequential_runs(invariant: LlamaEngine) -> None:
    sequential = [_run(invariant.complete(p, COLD, Cancel())) for p in PROMPTS]
    together = _concurrently([lambda p=p: _run(invariant.complete(p, COLD, Cancel())) for p in PROMPTS])
    assert [t for t, _ in together] == [t for t, _ in sequential]
    assert all(c.finish_reason == "length" and c.completion_tokens == 16 for _, c in together)
    assert [c.prompt_tokens for _, c in together] == [invariant.count_tokens(p) for p in PROMPTS]
    assert invariant.running_sequences == 0


def test_min_p_from_the_wire_keeps_only_the_likeliest_token(unified: Any) -> None:
    """A sampling parameter end to end (issue 46: the wire model, GenerationParams, the sampler chain): min_p 1
    keeps only the most likely token, so a hot seeded sample is the greedy answer; min_p 0 samples the vocabulary."""
    from service.api.openai_wire import CompletionRequest

    def ask(**body: Any) -> str:
        params = CompletionRequest.model_validate({"prompt": PROMPTS[1], "max_tokens": 24, "seed": 7,
                                                   "speculative": False, **body}).params()
        return _run(unified.complete(PROMPTS[1], replace(params, cache_prompt=False), Cancel()))[0]

    greedy = ask(temperature=0.0)
    assert ask(temperature=1.8, min_p=1.0) == greedy
    assert ask(temperature=1.8) != greedy  # the seed and temperature alone do not give it


def test_seeded_sampling_does_not_depend_on_the_batch(invariant: LlamaEngine) -> None:
    seeded = GenerationParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234, cache_prompt=False)
    alone = _run(invariant.complete(PROMPTS[1], seeded, Cancel()))[0]
    others = [lambda p=p: _run(invariant.complete(p, replace(seeded, seed=None), Cancel())) for p in PROMPTS[1:]]
    crowded = _concurrently([lambda: _run(invariant.complete(PROMPTS[1], seeded, Cancel())), *others])
    assert crowded[0][0] == alone
    other_seed = _run(invariant.complete(PROMPTS[1], replace(seeded, seed=99), Cancel()))[0]
    assert other_seed != alone  # the seed is what fixed the text


def test_cancelling_one_request_leaves_the_others_untouched(invariant: LlamaEngine) -> None:
    long = GenerationParams(max_tokens=48, temperature=0.0, cache_prompt=False)
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


def test_a_prompt_longer_than_its_slot_fails_typed_while_others_finish(invariant: LlamaEngine) -> None:
    too_long = "hello " * 600  # > 512 tokens, the per-sequence context of 2048 cells over 4 slots
    out = _concurrently([
        lambda: _run(invariant.complete(too_long, GREEDY, Cancel())),
        *[lambda p=p: _run(invariant.complete(p, COLD, Cancel())) for p in PROMPTS[:2]],
    ])
    assert isinstance(out[0], ContextLengthExceeded)
    assert out[0].details["n_ctx"] == 512 and out[0].details["prompt_tokens"] > 512
    assert all(c.finish_reason == "length" and c.completion_tokens == 16 for _, c in out[1:])


def test_a_full_unified_cache_clears_idle_slots_then_fails_the_request_that_does_not_fit(embedded_model: str) -> None:
    """llama_decode returns 1 (no KV slot): idle slots' cached prompts go first; with none left, that request
    gets InsufficientMemory and the other finishes."""
    eng = ServedModel.of(LlamaEngine())
    eng.load(embedded_model, _plan(embedded_model, 512, 2, unified=True))
    try:
        assert eng.n_ctx == 512  # unified: each sequence may use every cell, together they share them
        running = GenerationParams(max_tokens=200, temperature=0.0, ignore_eos=True)
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
        # The first's slot keeps its 200 cells for reuse; the same big prompt now clears that idle slot and fits.
        assert eng.kv_cells_used > 200
        assert _run(eng.complete(big, GenerationParams(max_tokens=4, temperature=0.0), Cancel()))[1].completion_tokens == 4
        assert eng.kv_cells_used < 430
    finally:
        eng.unload()


def test_a_long_prompt_is_abandoned_mid_evaluation_when_its_client_leaves(embedded_model: str) -> None:
    """A batch evaluating a long prompt runs with llama.cpp's abort callback: a cancel stops the evaluation
    itself (llama_decode returns 2), not only the tokens after it; the engine serves on."""
    import time

    eng = ServedModel.of(LlamaEngine(cache_prompt=False))
    eng.load(embedded_model, _plan(embedded_model, 2048, 1))
    try:
        prompt = "the quick brown fox jumps over the lazy dog " * 56  # 505 tokens: one 512-token batch, abortable
        assert 400 <= eng.count_tokens(prompt) <= 512
        params = GenerationParams(max_tokens=1, temperature=0.0)
        t = time.perf_counter()
        assert list(eng.complete(prompt, params, Cancel()))[-1].completion_tokens == 1
        full_s = time.perf_counter() - t
        gone = Cancel()
        threading.Timer(0.1 * full_s, gone.set).start()
        t = time.perf_counter()
        aborted = list(eng.complete(prompt, params, gone))
        aborted_s = time.perf_counter() - t
        assert aborted[-1].finish_reason == "cancelled" and aborted[-1].completion_tokens == 0
        assert aborted_s < 0.6 * full_s, (aborted_s, full_s)  # generous: the machine's load varies
        assert list(eng.complete("Hello", GenerationParams(max_tokens=2, temperature=0.0), Cancel()))[-1].completion_tokens > 0
    finally:
        eng.unload()


def test_greedy_argmax_equals_the_sampler_chain(embedded_model: str, unified: Any,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy requests without penalties or grammar take the logits' argmax instead of llama_sampler_sample:
    the same tokens as the chain (penalties at zero, then greedy)."""
    from service.engine.llama.sequences import Sequences

    params = replace(COLD, max_tokens=40)
    fast = [list(unified.complete(p, params, Cancel())) for p in PROMPTS[:2]]
    chained: list[bool] = []
    samplers = Sequences._samplers

    def chain_only(self: Sequences, r: Any) -> None:
        r.greedy = False
        samplers(self, r)
        chained.append(r.sampler is not None)

    monkeypatch.setattr(Sequences, "_samplers", chain_only)
    chain = ServedModel.of(LlamaEngine())
    chain.load(embedded_model, _plan(embedded_model, 4096, 4, unified=True))
    try:
        slow = [list(chain.complete(p, params, Cancel())) for p in PROMPTS[:2]]
    finally:
        chain.unload()
    assert chained == [True, True]  # both ran llama.cpp's chain, not the argmax
    assert fast == slow


def test_direct_delivery_hands_the_chunks_to_the_runner_from_the_engine_thread(unified: LlamaEngine) -> None:
    from service.engine.base import direct_delivery

    delivered: list[Any] = []
    threads: set[str] = set()

    def deliver(item: Any) -> None:
        threads.add(threading.current_thread().name)
        delivered.append(item)

    with direct_delivery(deliver):
        through_iterator = list(unified.complete(PROMPTS[0], COLD, Cancel()))
    assert through_iterator == []  # everything went to the sink, the iterator only ended
    assert threads == {"llama-scheduler"}
    assert delivered[-1].finish_reason == "length" and delivered[-1].completion_tokens == 16
    assert "".join(c.text for c in delivered) == _run(unified.complete(PROMPTS[0], COLD, Cancel()))[0]
