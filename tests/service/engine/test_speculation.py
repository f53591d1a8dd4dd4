"""Self-speculative decoding: the n-gram drafter, its length policy and a draft model's pause policy alone, then the
engine on the embedded model, where an answer with drafts must be the answer without them (greedy, seeded
sampling, a grammar, stop strings, limits, choices, a text of few words) and the KV a draft leaves behind must be
only what was kept."""

from __future__ import annotations

from dataclasses import replace
from typing import Iterator

import pytest

from service.engine.base import Cancel, Chunk, GenerationParams
from service.engine.llama import LlamaEngine
from service.text.served import ServedModel
from service.engine.speculation import (DRAFT_START, MATCH_MAX, PAUSE_AFTER_MISSES, PAUSE_TOKENS, DraftPolicy,
                                        NgramDrafter, NgramPolicy, NgramPool)
from sizing.plan.make import Plan, PlanRequest, make_plan
from sizing.probe import probe_path
from sizing.probe.devices import host_memory

TEXT = ("The keeper of the lighthouse on the northern cape wrote in his log every evening. He noted the wind, the "
        "height of the waves, the ships that passed and the birds that rested on the gallery. In winter the storms "
        "came from the west and the lamp burned through the night; in summer the fog rolled in from the sea and the "
        "horn sounded every minute until dawn. ")
COPY = "Original text:\n" + TEXT + "\n\nThe same text, copied exactly:\n" + TEXT[:40]
"""A prompt whose answer repeats it: the embedded base model copies the text on."""
GREEDY = GenerationParams(max_tokens=64, temperature=0.0, cache_prompt=False)
_WORDS = "error warn info debug request user server timeout retry open close cache".split()
WORDS = ("Log words:\n" + " ".join(_WORDS[(i * 7 + i // 5) % len(_WORDS)] for i in range(120))
         + "\n\nThe same words again, copied exactly:\n" + " ".join(_WORDS[(i * 7) % len(_WORDS)] for i in range(3)))
"""A copy of 120 words drawn from 12: the text of few words that short keys find in many places."""


def test_the_draft_is_what_followed_the_last_occurrence_of_the_last_tokens() -> None:
    d = NgramDrafter()
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 1, 2]
    assert d.draft(tokens, 3, 8) == [4, 5, 9, 2, 3, 4, 7, 8]  # what followed 1 2 3
    assert d.draft(tokens, 3, 2) == [4, 5]  # at most k
    assert d.draft(tokens, 6, 8) == []  # 2 6 never occurred
    # 9 2 3 occurred once: what followed it, then on into the tokens it drafts (they are the ones it copies)
    assert NgramDrafter().draft(tokens[:-1] + [9, 2], 3, 8) == [4, 7, 8, 1, 9, 2, 3, 4]
    assert NgramDrafter(sizes=(3,)).draft([5, 1, 2, 8, 1, 2], 3, 4) == []  # 1 2 3 never occurred: no 2-gram look-up


def test_the_longest_n_gram_wins_then_the_latest_occurrence() -> None:
    tokens = [1, 2, 3, 10, 11, 7, 2, 3, 20, 21, 5, 2]
    assert NgramDrafter().draft(tokens, 3, 2) == [20, 21]  # the 2-gram 2 3 last occurred at 6
    tokens = [1, 2, 3, 10, 11, 9, 2, 3, 20, 21, 1, 2]
    assert NgramDrafter().draft(tokens, 3, 2) == [10, 11]  # the 3-gram 1 2 3 first


def test_the_index_grows_with_the_tokens_as_a_new_one_would_be() -> None:
    import random

    rng = random.Random(3)
    tokens = [rng.randrange(6) for _ in range(40)]
    grown = NgramDrafter()
    for n in range(2, len(tokens)):
        last = rng.randrange(6)
        assert grown.draft(tokens[:n], last, 5) == NgramDrafter().draft(tokens[:n], last, 5)
    assert grown.draft([1, 2, 1], 2, 3) == [1, 2, 1]  # fewer tokens than indexed: another sequence, indexed anew


def test_the_draft_length_follows_what_drafts_kept() -> None:
    p = DraftPolicy(draft_max=20)
    assert p.budget(0) == DRAFT_START
    p.record(1, DRAFT_START, DRAFT_START)  # kept whole: twice as long
    assert p.budget(5) == 2 * DRAFT_START
    p.record(6, 8, 8)
    p.record(15, 16, 16)
    assert p.budget(32) == 20  # at most draft_max
    p.record(33, 20, 5)  # 5 kept: the next draft is one longer than what was kept
    assert p.budget(39) == 6
    p.record(40, 6, 0)
    assert p.budget(41) == 1


def test_a_sequence_whose_drafts_keep_failing_pauses_and_the_pause_doubles() -> None:
    p = DraftPolicy(draft_max=8)
    for i in range(PAUSE_AFTER_MISSES):
        assert p.budget(10 + i) > 0
        p.record(10 + i, 4, 0)
    n = 10 + PAUSE_AFTER_MISSES - 1
    assert p.budget(n) == 0 and p.budget(n + PAUSE_TOKENS - 1) == 0 and p.budget(n + PAUSE_TOKENS) == 1
    p.record(40, 1, 1)  # an accepted draft clears the misses
    assert p.misses == 0 and (p.drafted, p.accepted) == (4 * PAUSE_AFTER_MISSES + 1, 1)
    for _ in range(PAUSE_AFTER_MISSES):
        p.record(50, 2, 0)
    assert p.budget(50 + 2 * PAUSE_TOKENS - 1) == 0 and p.budget(50 + 2 * PAUSE_TOKENS) > 0


def _plan(path: str, slots: int, draft_rows: int = 0) -> Plan:
    """Repacked CPU weights off: their gemm rounds rows computed together otherwise than one alone (0.78 logit
    measured, ``LlamaEngine``'s ``batch_invariant``), which a draft's rows are; the weights llama.cpp leaves
    as they are round the same in both to the last bit but where ggml's tinyBLAS takes several rows."""
    return make_plan(probe_path(path), [], host_memory(),
                     PlanRequest(n_ctx=4096, n_seq_max=slots, kv_unified=True, cache_type="q8_0", min_ctx=256,
                                 cpu_repack=False, draft_rows=draft_rows))


@pytest.fixture(scope="module")
def engine(embedded_model: str) -> Iterator[LlamaEngine]:
    eng = ServedModel.of(LlamaEngine())
    eng.load(embedded_model, _plan(embedded_model, 4))
    yield eng
    eng.unload()


def _run(chunks: Iterator[Chunk]) -> tuple[str, Chunk]:
    got = list(chunks)
    return "".join(c.text for c in got), got[-1]


def _both(engine: LlamaEngine, prompt: str, params: GenerationParams) -> tuple[tuple[str, Chunk], tuple[str, Chunk]]:
    off = _run(engine.complete(prompt, replace(params, speculative=False), Cancel()))
    on = _run(engine.complete(prompt, replace(params, speculative=True), Cancel()))
    return off, on


@pytest.mark.slow
def test_greedy_answers_with_drafts_are_the_answers_without(engine: LlamaEngine) -> None:
    (text_off, last_off), (text_on, last_on) = _both(engine, COPY, GREEDY)
    assert text_on == text_off and last_on.completion_tokens == last_off.completion_tokens == 64
    assert last_off.drafted_tokens == 0
    # The copy is drafted, and most drafts are the model's own choice: fewer steps for the same tokens.
    assert last_on.accepted_tokens > 20 and last_on.drafted_tokens >= last_on.accepted_tokens
    other = "The history of the printing press begins"
    (a, _), (b, _) = _both(engine, other, replace(GREEDY, max_tokens=48))
    assert a == b
    # A few words repeated (short keys agree with many places, drafts cut often): the same answer too.
    (a, _), (b, last) = _both(engine, WORDS, replace(GREEDY, max_tokens=48))
    assert a == b and last.accepted_tokens > 0


@pytest.mark.slow
def test_an_answer_asked_again_is_drafted_whole_and_its_usage_counts_every_draft(
        engine: LlamaEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Asked again, the answer comes in drafts kept whole, each as long as the rows allow, and the usage counts
    every drafted row, the draft the limit fell in included (it was left out: 27 of 29 reported)."""
    params = replace(GREEDY, max_tokens=40, ignore_eos=True, cache_prompt=True)
    first, _ = _run(engine.complete(COPY + " Then", params, Cancel()))
    rows = _rows_per_decode(monkeypatch)
    again, last = _run(engine.complete(COPY + " Then", params, Cancel()))
    assert again == first and last.completion_tokens == 40 and len(rows) > 1
    drafted = sum(n - 1 for n in rows)  # the prompt and its logits were cached: every decode is a step
    assert last.drafted_tokens == last.accepted_tokens == drafted == 40 - 1 - len(rows)


@pytest.mark.slow
def test_seeded_samples_with_drafts_are_the_samples_without(engine: LlamaEngine) -> None:
    """One draw of the sampler per kept token, in the same order: the seed gives the same answer."""
    params = replace(GREEDY, temperature=0.3, top_p=0.95, seed=11)  # at 0.8 the copy was left too soon to draft
    (text_off, _), (text_on, last_on) = _both(engine, COPY, params)
    assert text_on == text_off and last_on.drafted_tokens > 0
    pen = replace(GREEDY, frequency_penalty=0.3, presence_penalty=0.2)  # the penalty sampler sees each kept token
    (a, _), (b, _) = _both(engine, COPY, pen)
    assert a == b


@pytest.mark.slow
def test_a_grammar_keeps_only_the_drafts_it_allows(engine: LlamaEngine) -> None:
    schema = '{"type":"object","properties":{"text":{"type":"string","maxLength":120}},"required":["text"]}'
    params = replace(GREEDY, json_schema=schema, max_tokens=60)
    prompt = COPY + '\n\nThe same text as JSON: {"text": "' + TEXT[:30]
    (a, _), (b, last) = _both(engine, prompt, params)
    assert a == b


@pytest.mark.slow
def test_a_stop_string_or_the_limit_inside_a_draft_ends_the_answer_there(engine: LlamaEngine) -> None:
    (full, _), _ = _both(engine, COPY, GREEDY)
    word = full.split()[6]
    stop = replace(GREEDY, stop=(word,))
    (a, la), (b, lb) = _both(engine, COPY, stop)
    assert a == b and word not in b and lb.finish_reason == "stop" and lb.completion_tokens == la.completion_tokens
    for n in (1, 2, 5):
        (a, la), (b, lb) = _both(engine, COPY, replace(GREEDY, max_tokens=n))
        assert a == b and lb.completion_tokens == la.completion_tokens == n and lb.finish_reason == "length"


@pytest.mark.slow
def test_the_kv_a_draft_leaves_is_only_the_tokens_kept(engine: LlamaEngine) -> None:
    """A later prompt that extends a drafted answer reuses the slot's KV (prefix reuse): its answer is the one a
    cold evaluation gives, which it could not be if rejected drafts' cells were left in the sequence."""
    text, _ = _run(engine.complete(COPY, replace(GREEDY, cache_prompt=True, max_tokens=40), Cancel()))
    follow = COPY + text + "\n\nAgain:\n" + TEXT[:20]
    warm, lw = _run(engine.complete(follow, replace(GREEDY, cache_prompt=True, speculative=False, max_tokens=24),
                                    Cancel()))
    cold, _ = _run(engine.complete(follow, replace(GREEDY, speculative=False, max_tokens=24), Cancel()))
    assert lw.cached_tokens > 0 and warm == cold
    assert engine.kv_cells_used <= 4096


@pytest.mark.slow
def test_choices_draft_each_and_give_the_answers_without(engine: LlamaEngine) -> None:
    params = replace(GREEDY, n=2, temperature=0.7, seed=5, max_tokens=40)

    def by_choice(chunks: Iterator[Chunk]) -> dict[int, str]:
        out: dict[int, str] = {}
        for c in chunks:
            out[c.index] = out.get(c.index, "") + c.text
        return out

    off = by_choice(engine.complete(COPY, replace(params, speculative=False), Cancel()))
    on = by_choice(engine.complete(COPY, params, Cancel()))
    assert on == off and len(on) == 2


def _rows_per_decode(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on, each ``llama_decode``'s logits rows (the batch's outputs), appended to the list returned."""
    import llama_cpp

    decode = llama_cpp.llama_decode
    rows: list[int] = []

    def counting(ctx: object, batch: llama_cpp.llama_batch) -> int:
        rows.append(sum(1 for i in range(batch.n_tokens) if batch.logits[i]))
        return int(decode(ctx, batch))

    monkeypatch.setattr(llama_cpp, "llama_decode", counting)
    return rows


@pytest.mark.slow
def test_one_slot_drafts_only_into_the_rows_its_plan_holds(embedded_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafted rows use idle slots' logits rows (what llama.cpp reserved at creation) and the plan's draft rows,
    which the load reserves: one slot without them drafts nothing; with 6 it drafts up to 6 a step, its output
    buffer as the plan predicts it (llama.cpp's figure at creation, and the rows it grew by)."""
    rows = _rows_per_decode(monkeypatch)
    for planned in (0, 6):
        plan = _plan(embedded_model, 1, planned)
        assert plan.estimate is not None and plan.estimate.host.draft_bytes == planned * 262144 * 4
        eng = ServedModel.of(LlamaEngine())
        report = eng.load(embedded_model, plan)
        try:
            rows.clear()
            # 40 tokens: the drafts' length grows with what they keep (``NgramPolicy``) past the 6 rows
            text, last = _run(eng.complete(COPY, replace(GREEDY, max_tokens=40), Cancel()))
            assert text == _run(eng.complete(COPY, replace(GREEDY, max_tokens=40, speculative=False), Cancel()))[0]
        finally:
            eng.unload()
        host = plan.estimate.host
        out = [a.output_bytes for a in report.allocations if a.output_bytes]
        assert out == [host.output_bytes] and report.draft_output_bytes == host.draft_bytes
        if planned:
            assert last.accepted_tokens > 0 and max(rows) == 1 + planned
        else:
            assert last.drafted_tokens == 0 and max(rows) == 1


@pytest.mark.slow
def test_a_step_asks_for_no_more_logits_rows_than_llama_cpp_reserved(engine: LlamaEngine,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """llama.cpp reserves one logits row per sequence at context creation (``output_reserve(n_seq_max)``, the
    output buffer the plan counts) and grows the buffer, unlogged, for a batch that asks for more: drafts fit in
    the rows of idle slots, so no step asks for more than ``slots`` rows, alone or beside another request."""
    import threading

    rows = _rows_per_decode(monkeypatch)
    _run(engine.complete(COPY, replace(GREEDY, max_tokens=24), Cancel()))
    assert max(rows) == engine.slots  # one sequence: its token and a draft in the 3 idle slots' rows
    rows.clear()
    t = threading.Thread(target=lambda: _run(engine.complete(COPY, replace(GREEDY, max_tokens=24), Cancel())))
    t.start()
    _run(engine.complete(TEXT, replace(GREEDY, max_tokens=24), Cancel()))
    t.join(600)
    assert 1 < max(rows) <= engine.slots


def test_a_draft_model_with_no_guess_counts_as_a_miss_and_pauses_too() -> None:
    p = DraftPolicy(draft_max=8)
    for i in range(PAUSE_AFTER_MISSES):
        assert p.budget(i) > 0
        p.declined(i)
    assert p.budget(PAUSE_AFTER_MISSES) == 0 and p.budget(PAUSE_AFTER_MISSES - 1 + PAUSE_TOKENS) > 0
    assert (p.drafted, p.accepted, p.length) == (0, 0, DRAFT_START)


def test_the_pool_drafts_a_scopes_earlier_answers_only() -> None:
    from service.engine.speculation import POOL_MIN_MATCH

    pool = NgramPool(answers=2)
    answer = list(range(100, 140))
    pool.add("alice", [1, 2, 3] + answer, 3)
    d = NgramDrafter(pool=pool, scope="alice")
    context = answer[:POOL_MIN_MATCH - 1]  # a new request writing the same answer again
    assert d.draft([7, 7] + context, answer[POOL_MIN_MATCH - 1], 5) == answer[POOL_MIN_MATCH:POOL_MIN_MATCH + 5]
    assert d.matched >= POOL_MIN_MATCH
    assert NgramDrafter(pool=pool, scope="bob").draft([7, 7] + context, answer[POOL_MIN_MATCH - 1], 5) == []
    assert d.draft([7, 100], 101, 5) == []  # a 2-gram: never from the pool
    own = [100, 101, 102, 103, 104, 105, 9, 9, 100, 101, 102, 103, 104]
    assert d.draft(own, 105, 3) == [9, 9, 100]  # the sequence's own tokens first
    for i in range(2):  # the oldest answer leaves once two newer ones are kept
        pool.add("alice", [50 + i] * 20, 0)
    assert NgramDrafter(pool=pool, scope="alice").draft([7, 7] + context, answer[POOL_MIN_MATCH - 1], 5) == []
    key = answer[:POOL_MIN_MATCH]
    assert pool.find("alice", POOL_MIN_MATCH, hash(tuple(key)), key)[0] == 0  # the newest two: 50s and 51s
    pool.add("alice", [1] + answer, 1)
    assert pool.find("alice", POOL_MIN_MATCH, hash(tuple(key)), key)[0] == POOL_MIN_MATCH
    pool.clear()
    assert pool.find("alice", POOL_MIN_MATCH, hash(tuple(key)), key)[0] == 0


def test_the_place_that_agrees_longest_is_copied_not_the_latest_short_key() -> None:
    """Few distinct tokens: ``3 4 5`` occurs in many places, the last tokens ``1 2 3 4 5`` in one. The draft follows
    the one (what ngram-simple's and the old 3-gram look-up missed: it drafted what followed the latest 3-gram)."""
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 3, 4, 5, 8, 8, 2, 3, 4, 5, 7, 7, 1, 2, 3, 4]
    d = NgramDrafter()
    assert d.draft(tokens, 5, 4) == [6, 7, 8, 9] and d.matched == 5
    assert d.draft(tokens + [5, 6], 7, 3) == [8, 9, 3] and d.matched == 7  # the copy goes on: it agrees longer


def test_a_loop_of_the_sequences_own_tokens_is_drafted_as_long_as_asked() -> None:
    """The place copied is 3 tokens back: the copy runs on into the tokens it drafts (ngram-mod's chained look-ups
    do the same), where the tokens that followed it ran out after 2."""
    tokens = [9, 8, 1, 2, 3, 1, 2, 3, 1, 2]
    d = NgramDrafter()
    assert d.draft(tokens, 3, 8) == [1, 2, 3, 1, 2, 3, 1, 2] and d.matched == 6


def test_the_pools_answer_is_copied_where_it_agrees_longer_than_the_sequences_own_tokens() -> None:
    """An answer asked for again: its own tokens agree with an earlier place on 13 tokens, the pool's answer on all
    it holds. The pool's is copied (on a small vocabulary the own place drafted a wrong word)."""
    rng = __import__("random").Random(5)
    words = [rng.randrange(2, 12) for _ in range(60)]
    prompt = [1] + words[:13] + [40, 41] + words
    answer = [rng.randrange(2, 12) for _ in range(40)]
    pool = NgramPool(answers=4)
    pool.add("", prompt + answer, len(prompt))
    d = NgramDrafter(pool=pool)
    assert d.draft(prompt[:-1], prompt[-1], 6) == answer[:6] and d.matched == MATCH_MAX
    own = NgramDrafter()
    assert own.draft(prompt[:-1], prompt[-1], 6) != answer[:6] and own.matched < 20


def test_an_answer_that_repeats_its_opening_is_drafted_from_its_opening() -> None:
    """An earlier answer that ends by repeating its opening agrees with a new request's start at both places; the
    one with the answer's tokens after it is copied (the latest had 3 left: a 3-token draft instead of 64)."""
    rng = __import__("random").Random(9)
    context = [rng.randrange(100, 200) for _ in range(MATCH_MAX)]
    body = [rng.randrange(200, 300) for _ in range(80)]
    answer = body + context + body[:3]  # it ends by writing the context and its opening again
    pool = NgramPool(answers=4)
    pool.add("", context + answer, len(context))
    d = NgramDrafter(pool=pool)
    assert d.draft(context[:-1], context[-1], 40) == body[:40] and d.pooled and d.matched == MATCH_MAX
    tail = NgramPool(answers=4)
    tail.add("", context + body[:5], len(context))  # an answer with less to copy than the request's own loop
    own = NgramDrafter(pool=tail)
    seq = context + body[:5] + context  # its own tokens agree as long and run on into themselves
    assert own.draft(seq[:-1], seq[-1], 12) == (body[:5] + context)[:12] and not own.pooled


def test_a_draft_expected_kept_whole_is_as_long_as_allowed_whatever_the_costs_measured() -> None:
    """Rows computed in other shapes round otherwise, and a step's time measured on shared cores is noisy: a class
    whose whole draft is expected kept (``WHOLE_DRAFT``) drafts the cap, the same shape each time, even where one
    slow long step made a shorter draft look best; below it the measured costs size the draft."""
    from service.engine.speculation import WHOLE_DRAFT, StepCosts, best_length

    noisy = StepCosts()
    for rows in (1, 2, 4, 8, 16, 32, 48, 64):
        noisy.record(rows, 0.0116 * rows ** 0.6)
    noisy.record(63, 0.0116 * 63)  # one step slowed by other work on the cores
    kept = WHOLE_DRAFT ** (1 / 62) + 1e-6
    assert best_length(kept, 62, noisy.relative(1)) == 62
    assert 0 < best_length(0.97, 62, noisy.relative(1)) < 62
    assert NgramPolicy(draft_max=62, costs=noisy).budget(0, MATCH_MAX) == 62  # 64 agreeing tokens: 0.998 a token


def test_short_agreements_draft_where_they_are_kept_and_stop_where_they_are_cut() -> None:
    """On the CPU a second row costs a step (``STEP_COST_PRIOR``): 2 to 7 agreeing tokens, which on a text of few
    words agree with many places, draft nothing untried; 8 to 15 draft a few, and stop once cut at once; places
    agreeing on 64 tokens draft the whole ``draft_max``."""
    p = NgramPolicy(draft_max=48)
    assert p.budget(0, 2) == 0 and p.budget(0, 5) == 0
    first = p.budget(0, 12)
    assert 0 < first < 12
    p.record(0, first, 0)
    assert p.budget(1, 12) == 0 and p.budget(1, 20) > 0  # one class learnt, not the others
    assert p.budget(1, MATCH_MAX) == 48 and p.budget(1, 0) == 0


def test_a_cut_pool_draft_leaves_the_sequences_own_copies_whole() -> None:
    """An answer asked again comes out otherwise from the first token another batch shape's rounding tips: its
    cut says nothing of the copies from the sequence's own text, whose class is kept apart (one class for both
    had shrunk the next own drafts of 64 agreeing tokens from 48 to 5 on the bench's prose)."""
    p = NgramPolicy(draft_max=48)
    n = p.budget(0, MATCH_MAX, pooled=True)
    assert n == 48
    p.record(0, n, 1)
    assert p.budget(2, MATCH_MAX, pooled=True) < 24 and p.budget(2, MATCH_MAX) == 48


def test_a_class_whose_drafts_are_kept_drafts_longer_and_one_cut_at_a_field_shorter() -> None:
    """Table rows agree with the row above on 12 to 20 tokens and part at the next number: drafts of that class
    shrink to what they keep, none where that is not worth a step's second row; a copy whose drafts of that class
    are kept whole grows them."""
    cut = NgramPolicy(draft_max=48)
    kept = NgramPolicy(draft_max=48)
    start = cut.budget(0, 12)
    for i in range(8):
        n = cut.budget(i, 12)
        cut.record(i, n, min(n, 2))
        m = kept.budget(i, 12)
        kept.record(i, m, m)
    assert cut.budget(9, 12) < start < kept.budget(9, 12) == 48
    assert cut.budget(9, 12) <= 2


def test_the_step_costs_measured_size_the_drafts() -> None:
    """Where a step's rows cost little (a GPU: 64 rows barely more than one) short agreements draft and a doubtful
    class drafts long; where a second row costs a step they do not. A row count not measured is read from the
    prior's shape between the measured ones."""
    from service.engine.speculation import STEP_COST_PRIOR, StepCosts, best_length

    cpu, gpu = StepCosts(), StepCosts()
    for rows in (1, 2, 8, 32, 64):
        cpu.record(rows, 0.0116 * dict(STEP_COST_PRIOR)[rows])
        gpu.record(rows, 0.010 + 0.0001 * rows)
    assert NgramPolicy(draft_max=48, costs=gpu).budget(0, 2) > 0
    assert NgramPolicy(draft_max=48, costs=cpu).budget(0, 2) == 0
    assert best_length(0.8, 48, gpu.relative(1)) > best_length(0.8, 48, cpu.relative(1)) > 0
    assert best_length(0.97, 48, gpu.relative(1)) == 48 > best_length(0.97, 48, cpu.relative(1))
    assert gpu.time(16) == pytest.approx(0.0116)  # between measured counts: on their line
    assert StepCosts().time(16) / StepCosts().time(1) == dict(STEP_COST_PRIOR)[16]  # none measured: the prior
    only = StepCosts()
    only.record(1, 0.02)
    assert only.time(48) == pytest.approx(0.02 * dict(STEP_COST_PRIOR)[48])  # beyond: the prior's shape, scaled
    gpu.record(2, 0.030)  # measured again: the running figure moves a quarter of the way
    assert gpu.time(2) == pytest.approx(0.0102 + 0.25 * (0.030 - 0.0102))
    # Another sequence in the step: the draft must pay for the time it adds to both.
    assert best_length(0.9, 48, cpu.relative(2), others=1) <= best_length(0.9, 48, cpu.relative(1))


def _replay(tokens: list[int], start: int, draft_max: int = 48) -> tuple[int, int, int, float]:
    """A known answer ``tokens[start:]`` decoded with the n-gram drafter and policy as the engine uses them
    (``Drafting.reserve``, a greedy verification keeping the drafted tokens that are the answer's): (steps, tokens
    drafted, tokens kept, its speed against one token a step at ``STEP_COST_PRIOR``'s costs)."""
    from service.engine.speculation import StepCosts

    d, p = NgramDrafter(), NgramPolicy(draft_max=draft_max)
    pos, steps, drafted, kept, time = start, 0, 0, 0, 0.0
    while pos < len(tokens) - 1:
        k = min(draft_max, len(tokens) - 1 - pos)
        guess = d.draft(tokens[:pos], tokens[pos], k) if k else []
        guess = guess[:p.budget(pos - start, d.matched)] if guess else []
        a = 0
        while a < len(guess) and guess[a] == tokens[pos + 1 + a]:
            a += 1
        if guess:
            p.record(pos - start, len(guess), a)
        time += StepCosts().time(1 + len(guess))
        steps, drafted, kept, pos = steps + 1, drafted + len(guess), kept + a, pos + 1 + a
    return steps, drafted, kept, (len(tokens) - 1 - start) / time


def test_a_copy_of_a_small_vocabulary_drafts_what_it_keeps() -> None:
    """350 words drawn from 24 (one token each), copied with a word left out every 40: most tokens come in drafts,
    few drafted rows are wasted, and the copy runs at twice one token a step at the CPU's step costs (the policy
    of a fixed row cost before them kept 293 of 340 drafted tokens here in 49 steps, 2.02x; sized by the costs
    alone 253 of 291 in 89, 1.98x: it drafts less at 2 to 7 agreeing tokens, which on the bench's real answers was
    faster; with whole drafts where 64 tokens agree, ``WHOLE_DRAFT``, 262 of 326 in 80, 1.95x)."""
    import random

    rng = random.Random(7)
    text = [rng.randrange(24) for _ in range(350)]
    answer = [t for i, t in enumerate(text) if i % 40 != 39]
    steps, drafted, kept, speed = _replay([100, *text, 101, *answer], len(text) + 2)
    assert kept >= 0.7 * len(answer) and kept >= 0.8 * drafted and speed >= 1.8 and steps < len(answer) / 3


@pytest.mark.parametrize("temperature,grammar", [(0.7, None), (0.0, "a grammar")])
def test_a_request_whose_rounding_matters_sizes_its_drafts_from_its_tokens_only(temperature: float,
                                                                                grammar: str | None) -> None:
    """A sampled request, or one with a grammar, drafts the same lengths however the load's measured step costs
    moved (a seeded tool call asked 8 times on a busy machine came out 2 ways while they did), and from its own
    tokens only; a greedy one follows the measured costs and drafts from the pool."""
    from service.engine.llama.drafting import Drafting
    from service.engine.llama.state import Sequence
    from service.engine.speculation import NgramPolicy, StepCosts

    def budgets(d: Drafting, greedy: bool) -> tuple[NgramDrafter, list[int]]:
        params = GenerationParams(temperature=0.0 if greedy else temperature, max_tokens=64)
        r = Sequence(tokens=[1, 2, 3], params=params, cancel=Cancel(), max_new_tokens=64,
                     grammar=None if greedy else grammar, greedy=greedy)
        d.assign([r], params, images=False)
        assert isinstance(r.drafter, NgramDrafter) and isinstance(r.policy, NgramPolicy)
        return r.drafter, [r.policy.budget(0, m) for m in (2, 4, 8, 16, 32)]

    calm, busy = Drafting(None, on=True, draft_max=64), Drafting(None, on=True, draft_max=64)
    for rows in range(1, 65):
        calm.costs.record(rows, 0.01 * StepCosts().time(rows))
        busy.costs.record(rows, 0.01 * StepCosts().time(rows) * (3.0 if rows % 2 else 1.0))  # odd row counts slowed
    drafter, calm_budgets = budgets(calm, greedy=False)
    assert drafter.pool is None
    assert budgets(busy, greedy=False)[1] == calm_budgets
    drafter, calm_greedy = budgets(calm, greedy=True)
    assert drafter.pool is calm.answers
    assert budgets(busy, greedy=True)[1] != calm_greedy  # the control: the measured costs do size a greedy draft


@pytest.mark.slow
def test_a_greedy_request_asked_again_takes_its_earlier_answer_within_the_rounding(engine: LlamaEngine) -> None:
    """The kept answer's token is taken where it trails the row's argmax by no more than the tolerance, and the
    argmax stands where it leads by more (``service.engine.replay``): a kept answer with the runner-up put at the
    first answer's closest place comes back with it; put where the argmax leads by 2 logits more, it does not, and
    the replay ends there: a runner-up put at a close place after it is not taken either."""
    prompt = "The history of the printing press begins"
    params = replace(GREEDY, max_tokens=24, ignore_eos=True, logprobs=2, cache_prompt=True)
    key = engine.prompt_tokens(prompt)
    raw = engine.engine  # the engine's own chunks: token ids and their scores
    chunks = [c for c in raw.generate(key, params, Cancel()) if c.tokens]
    tokens = [c.tokens[0] for c in chunks]
    gaps = [c.scores[0].top[0][1] - c.scores[0].top[1][1] for c in chunks]
    runner_up = [c.scores[0].top[1][0] for c in chunks]
    assert [c.scores[0].top[0][0] for c in chunks] == tokens
    close = min(range(1, len(tokens)), key=gaps.__getitem__)
    # A far place, and a close one after it: the argmax leads by 2 logits more there than at either close one.
    far, after = next((i, j) for i in range(1, len(tokens)) for j in range(i + 1, len(tokens))
                      if gaps[i] > max(gaps[close], gaps[j]) + 2.0)
    replays = raw._now().drafting.replays
    was = replays.tolerance
    replays.tolerance = max(gaps[close], gaps[after]) + 1.0
    try:
        for at, taken in ((close, True), (far, False)):
            kept = [*tokens[:at], runner_up[at], *tokens[at + 1:]]
            if not taken:
                kept[after] = runner_up[after]  # taken if the replay went on past the place the answer left it
            replays.add("", key, kept)
            again = [c.tokens[0] for c in raw.generate(key, params, Cancel()) if c.tokens]
            assert again[:at] == tokens[:at]
            assert again[at] == (runner_up[at] if taken else tokens[at]), (at, gaps[at], replays.tolerance)
        assert again == tokens, (far, after)  # the argmax stood, the replay ended, and the answer went on as the first
    finally:
        replays.tolerance = was
        replays.clear()


@pytest.mark.slow
def test_a_greedy_answer_cut_short_by_its_client_is_kept_for_the_same_prompt(engine: LlamaEngine) -> None:
    """A client that stops reading (a stop string seen on its side, a disconnect) cancels the answer: what was
    generated is still its start, kept for the same prompt again (``Replays``), the pool's whole answers apart."""
    import time

    raw = engine.engine
    key = engine.prompt_tokens("A list of rivers of Europe:")
    params = replace(GREEDY, max_tokens=32, ignore_eos=True, cache_scope="cut-short")
    replays = raw._now().drafting.replays
    whole = [c.tokens[0] for c in raw.generate(key, params, Cancel()) if c.tokens]
    replays.clear()
    it = raw.generate(key, params, Cancel())
    got = [c.tokens[0] for c, _ in zip((c for c in it if c.tokens), range(6))]
    it.close()  # the client goes: the engine cancels the sequence
    deadline = time.monotonic() + 10
    while (kept := replays.find("cut-short", key)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kept is not None and got == whole[:6] and len(kept) >= 6 and kept == whole[:len(kept)]
    assert len(raw._now().drafting.answers._scopes["cut-short"]) == 1  # the pool: the whole answer only


def test_the_draft_max_default_is_one_number_in_the_settings_the_engine_and_the_sizing_cli(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``GGUF_DRAFT_MAX``'s default, the engine's (``DRAFT_MAX``) and ``python -m sizing plan --draft-rows``'s are
    written apart (the sizing package does not import the service, nor the settings the engine): a plan that holds
    other logits rows than the service drafts into would be sized for another step."""
    import sizing.__main__ as cli
    from service.engine.speculation import DRAFT_MAX
    from service.settings import Settings

    seen: list[int] = []
    monkeypatch.setattr(cli, "_plan", lambda args: seen.append(args.draft_rows) or 0)
    assert cli.main(["plan", "model.gguf"]) == 0
    assert Settings.model_fields["draft_max"].default == DRAFT_MAX == seen[0]
