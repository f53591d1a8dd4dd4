"""MTP drafting (``service.engine.mtp``) on a real llama.cpp load of a GLM-4.5-shaped model whose NextN head guesses
what its trunk predicts (``write_mtp_fixture``): the head's guesses are verified like any draft, so answers with
it are the answers without it, and here nearly every guess is kept."""

from __future__ import annotations

from dataclasses import replace
from typing import Iterator

import pytest

from service.engine.base import Cancel, GenerationParams, LoadReport
from service.engine.calibrate import Calibrator
from service.engine.llama import LlamaEngine
from service.text.served import ServedModel
from service.engine.mtp import MtpRunner
from service.planning.planner import LoadOptions, Planner
from service.residency.views import allocation_rows
from service.settings import Settings
from sizing.plan.device import MIB, Device
from sizing.plan.make import Plan, PlanRequest, make_plan
from sizing.probe import probe_path
from sizing.probe.devices import host_memory
from sizing.testing.fixtures import write_mtp_fixture
from tests.service.engine.test_speculation import _both, _run

GREEDY = GenerationParams(max_tokens=40, temperature=0.0, cache_prompt=False, ignore_eos=True)
PROMPT = "The sea is wide and the"


def _plan(path: str, *, mtp: bool) -> Plan:
    """The service's plan (its planner, llama.cpp's dry runs of the MTP context), or without the head."""
    if not mtp:
        return make_plan(probe_path(path), [], host_memory(),
                         PlanRequest(n_ctx=512, n_seq_max=2, min_ctx=256, cpu_repack=False, draft_rows=16))
    cal = Calibrator()
    try:
        return Planner(Settings(parallel=2, cpu_repack="off"), lambda: ([], HOST), cal).plan(
            probe_path(path), LoadOptions(n_ctx=512), path=path)
    finally:
        cal.close()


HOST = Device(0, "host memory", 8 << 30, 64 << 30, "host")


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_mtp_fixture(tmp_path_factory.mktemp("mtp"))


@pytest.fixture(scope="module")
def planned(mtp_model: str) -> Plan:
    return _plan(mtp_model, mtp=True)


@pytest.fixture(scope="module")
def loaded(mtp_model: str, planned: Plan) -> Iterator[tuple[LlamaEngine, LoadReport]]:
    assert planned.cfg.mtp, planned.mtp_refusal
    eng = ServedModel.of(LlamaEngine())
    report = eng.load(mtp_model, planned)
    yield eng, report
    eng.unload()


def test_greedy_answers_with_the_mtp_head_are_the_answers_without(loaded: tuple[LlamaEngine, LoadReport]) -> None:
    eng = loaded[0]
    assert isinstance(eng.engine.loaded.runner, MtpRunner)
    (text_off, last_off), (text_on, last_on) = _both(eng, PROMPT, GREEDY)
    assert text_on == text_off and last_on.completion_tokens == last_off.completion_tokens == 40
    assert last_off.drafted_tokens == 0
    # The head computes the trunk's own function of the last token: its sure guesses are kept.
    assert last_on.drafted_tokens > 16 and last_on.accepted_tokens >= 0.9 * last_on.drafted_tokens


def test_a_head_that_guesses_wrong_changes_no_answer(loaded: tuple[LlamaEngine, LoadReport]) -> None:
    """Every guess made, however unlikely (``p_min`` 0), and the head's input rows spoiled: most guesses are
    rejected, and the answer is the one without drafts."""
    eng = loaded[0]
    runner = eng.engine.loaded.runner
    assert isinstance(runner, MtpRunner)
    off = _run(eng.complete("Another text, then", replace(GREEDY, speculative=False), Cancel()))
    keep, runner.p_min = runner.p_min, 0.0
    real_add = runner._add
    try:
        runner._add = lambda seq, tok, pos, h, *, output: real_add(seq, (tok * 7 + 3) % 512, pos, h, output=output)
        # Another cache scope: in this one the answer just given would be replayed, not guessed by the head.
        on = _run(eng.complete("Another text, then", replace(GREEDY, cache_scope="wrong-guesses"), Cancel()))
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
    plain = ServedModel.of(LlamaEngine())
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


def test_the_plan_sizes_the_head_and_the_load_allocates_what_it_predicted(
        mtp_model: str, planned: Plan, loaded: tuple[LlamaEngine, LoadReport]) -> None:
    """The service's planner, with llama.cpp's dry runs of the MTP context: the head is in the plan (its NextN
    weights in the model's rows, its context's KV, compute and output, the hidden rows), and the real load
    allocates what each row predicted."""
    spec = probe_path(mtp_model)
    est, report = planned.estimate, loaded[1]
    assert planned.mtp_refusal is None and est is not None and est.mtp is not None
    mm = est.mtp
    assert dict(mm.weights) == {"CPU": spec.nextn_weights_bytes}
    assert mm.rows_bytes == spec.n_embd * min(planned.cfg.n_batch, planned.cfg.n_ctx) * 4
    assert est.host.weights_bytes == spec.weights_bytes  # the NextN block's bytes counted in the model's
    rows = allocation_rows(est)
    main = {a.device: a.total_bytes for a in report.allocations}
    assert main and set(main) == {d for d, n in rows.items() if n}
    for device, n in main.items():
        want = rows[device] - (est.host.draft_bytes if device == "CPU" else 0)
        assert abs(n - want) <= 0.02 * MIB, (device, n / MIB, want / MIB)
    head = {a.device: a.total_bytes for a in report.mtp_allocations}
    assert head and report.mtp_rows_bytes == mm.rows_bytes
    for device, n in head.items():
        want = mm.logged_on(device)
        assert abs(n - want) <= 0.02 * MIB, (device, n / MIB, want / MIB)
    assert mm.kv_bytes > 0 and mm.compute_bytes > 0


def test_without_llama_cpps_figures_for_its_context_the_head_is_left_out(mtp_model: str) -> None:
    plan = make_plan(probe_path(mtp_model), [], host_memory(),
                     PlanRequest(n_ctx=512, n_seq_max=2, min_ctx=256, cpu_repack=False, draft_rows=16, mtp=True))
    assert plan.fits and not plan.cfg.mtp and plan.estimate is not None and plan.estimate.mtp is None
    assert plan.mtp_refusal is not None and "MTP_NOT_LOADED" in plan.mtp_refusal and "dry run" in plan.mtp_refusal


def test_on_a_card_the_head_is_planned_with_its_layer(mtp_model: str) -> None:
    """A declared card that holds the whole model: the NextN weights, the MTP context's KV and (a CPU build's
    figure: the whole graph runs there) its compute buffer on the card, with the bound on its own backend's CUDA
    pool; its output buffer and the hidden rows in host memory."""
    cal = Calibrator()
    try:
        plan = Planner(Settings(parallel=2), lambda: ([], HOST), cal).plan(
            probe_path(mtp_model), LoadOptions(n_ctx=512, gpus=({"name": "card", "free_mib": 4096},)),
            path=mtp_model)
    finally:
        cal.close()
    est = plan.estimate
    assert plan.cfg.mtp and est is not None and est.mtp is not None and len(est.gpus) == 1, plan.mtp_refusal
    mm, card = est.mtp, est.gpus[0]
    spec = probe_path(mtp_model)
    assert dict(mm.weights) == {card.device: spec.nextn_weights_bytes}
    assert dict(mm.pool)[card.device] > 0 and mm.logged_on(card.device) == mm.kv_bytes + mm.compute_bytes
    assert card.mtp_bytes == mm.context_on(card.device) and est.host.mtp_bytes == mm.output_bytes + mm.rows_bytes
    assert card.weights_bytes >= spec.weights_bytes - spec.token_embd_bytes  # the NextN block on the card
