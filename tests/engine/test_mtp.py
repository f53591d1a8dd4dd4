"""MTP drafting (``service.engine.mtp``) on a real llama.cpp load of a GLM-4.5-shaped model whose NextN head guesses
what its trunk predicts (``write_mtp_fixture``): the head's guesses are verified like any draft, so answers with
it are the answers without it, and here nearly every guess is kept."""

from __future__ import annotations

from dataclasses import replace
from typing import Iterator

import pytest

from service.engine.base import Cancel, GenerationParams, LoadReport
from service.engine.llama import LlamaEngine
from service.engine.mtp import MtpRunner
from sizing.plan.planner import Plan, PlanRequest, make_plan
from sizing.probe import probe_path
from sizing.probe.devices import host_memory
from sizing.testing.fixtures import write_mtp_fixture
from tests.engine.test_speculation import _both, _run

GREEDY = GenerationParams(max_tokens=40, temperature=0.0, cache_prompt=False, ignore_eos=True)
PROMPT = "The sea is wide and the"


def _plan(path: str, *, mtp: bool) -> Plan:
    return make_plan(probe_path(path), [], host_memory(),
                     PlanRequest(n_ctx=512, n_seq_max=2, kv_unified=True, cache_type="f16", min_ctx=256,
                                 cpu_repack=False, draft_rows=16, mtp=mtp))


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_mtp_fixture(tmp_path_factory.mktemp("mtp"))


@pytest.fixture(scope="module")
def loaded(mtp_model: str) -> Iterator[tuple[LlamaEngine, LoadReport]]:
    eng = LlamaEngine()
    report = eng.load(mtp_model, _plan(mtp_model, mtp=True))
    yield eng, report
    eng.unload()


def test_greedy_answers_with_the_mtp_head_are_the_answers_without(loaded: tuple[LlamaEngine, LoadReport]) -> None:
    eng = loaded[0]
    assert isinstance(eng._draft_runner, MtpRunner)
    (text_off, last_off), (text_on, last_on) = _both(eng, PROMPT, GREEDY)
    assert text_on == text_off and last_on.completion_tokens == last_off.completion_tokens == 40
    assert last_off.drafted_tokens == 0
    # The head computes the trunk's own function of the last token: its sure guesses are kept.
    assert last_on.drafted_tokens > 16 and last_on.accepted_tokens >= 0.9 * last_on.drafted_tokens


def test_a_head_that_guesses_wrong_changes_no_answer(loaded: tuple[LlamaEngine, LoadReport]) -> None:
    """Every guess made, however unlikely (``p_min`` 0), and the head's input rows spoiled: most guesses are
    rejected, and the answer is the one without drafts."""
    eng = loaded[0]
    runner = eng._draft_runner
    assert isinstance(runner, MtpRunner)
    off = _run(eng.complete("Another text, then", replace(GREEDY, speculative=False), Cancel()))
    keep, runner.p_min = runner.p_min, 0.0
    real_add = runner._add
    try:
        runner._add = lambda seq, tok, pos, h, *, output: real_add(seq, (tok * 7 + 3) % 512, pos, h, output=output)
        on = _run(eng.complete("Another text, then", GREEDY, Cancel()))
    finally:
        runner._add = real_add  # type: ignore[method-assign]
        runner.p_min = keep
    assert on[0] == off[0] and on[1].completion_tokens == 40
    assert on[1].drafted_tokens > 0 and on[1].accepted_tokens < on[1].drafted_tokens


def test_a_prompt_that_reuses_a_slots_prefix_keeps_drafting(loaded: tuple[LlamaEngine, LoadReport]) -> None:
    """The second request evaluates only past the prefix its slot holds; the head's sequence is cut there too."""
    eng = loaded[0]
    params = replace(GREEDY, cache_prompt=True, max_tokens=24)
    first = _run(eng.complete(PROMPT + " long", params, Cancel()))
    second = _run(eng.complete(PROMPT + " long", params, Cancel()))
    off = _run(eng.complete(PROMPT + " long", replace(params, speculative=False, cache_prompt=False), Cancel()))
    assert first[0] == second[0] == off[0]
    assert second[1].drafted_tokens > 8 and second[1].accepted_tokens >= 0.9 * second[1].drafted_tokens


def test_two_sequences_draft_together(loaded: tuple[LlamaEngine, LoadReport]) -> None:
    eng = loaded[0]
    params = replace(GREEDY, n=2, max_tokens=24)
    texts: dict[int, str] = {}
    for c in eng.complete(PROMPT, params, Cancel()):
        texts[c.index] = texts.get(c.index, "") + c.text
    alone = _run(eng.complete(PROMPT, replace(params, n=1, speculative=False), Cancel()))[0]
    assert texts == {0: alone, 1: alone}


def test_the_nextn_block_and_the_mtp_context_are_allocated(mtp_model: str, loaded: tuple[LlamaEngine, LoadReport]) -> None:
    """The model's buffer holds the NextN block's bytes beside the trunk's (what a plan line for the head would
    count), and the MTP context has a KV cache of the NextN layer alone: half the main context's per layer."""
    spec = probe_path(mtp_model)
    report = loaded[1]
    plain = LlamaEngine()
    try:
        without = plain.load(mtp_model, _plan(mtp_model, mtp=False))
    finally:
        plain.unload()
    w_on = sum(a.weights_bytes for a in report.allocations)
    w_off = sum(a.weights_bytes for a in without.allocations)
    assert abs((w_on - w_off) - spec.nextn_weights_bytes) <= 0.01 * 2**20
    assert not without.mtp_allocations and without.mtp_rows_bytes == 0
    kv_main = sum(a.kv_bytes for a in report.allocations)
    kv_mtp = sum(a.kv_bytes for a in report.mtp_allocations)
    n_main = spec.n_layer  # the trunk's attention layers (the NextN one is the head's)
    assert kv_mtp > 0 and abs(kv_mtp * n_main - kv_main) <= n_main * 0.01 * 2**20
    assert sum(a.compute_bytes for a in report.mtp_allocations) > 0
    assert report.mtp_rows_bytes == spec.n_embd * 512 * 4
