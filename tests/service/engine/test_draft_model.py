"""A draft model beside the main one (issue 26), on llama.cpp with the embedded model as the draft of itself: its
vocabulary is the model's, its guesses are the model's own greedy tokens, so greedy and seeded answers with its
drafts must be the answers without them, and most drafts are kept. Its memory, as llama.cpp's load log reports
it, is what the plan predicted for it; a draft of another vocabulary is refused at load with the difference."""

from __future__ import annotations

from dataclasses import replace
from typing import Iterator

import pytest

from service.engine.base import Cancel, Chunk
from service.engine.draft import VocabularyMismatch
from service.engine.llama import LlamaEngine
from service.text.served import ServedModel
from service.residency.views import allocation_rows
from sizing.memory.draft import DraftModel
from sizing.plan.device import MIB
from sizing.plan.make import Plan, PlanRequest, make_plan
from sizing.probe import probe_path
from sizing.probe.devices import host_memory
from sizing.testing.fixtures import TINY_LLAMA, write_fixture
from tests.service.engine.test_speculation import COPY, GREEDY, _both, _run

pytestmark = pytest.mark.slow


def _plan(path: str, draft: str, slots: int = 2) -> Plan:
    """Repacking off and a q8_0 cache, as for the n-gram drafts' test: rows decoded together round as rows decoded
    alone. (With an f16 cache they do not: CPU flash attention takes several query rows otherwise than one, and
    seeded samples with drafts of either kind were seen to part from those without at the fifth token.)"""
    return make_plan(probe_path(path), [], host_memory(),
                     PlanRequest(n_ctx=2048, n_seq_max=slots, kv_unified=True, cache_type="q8_0", min_ctx=256,
                                 cpu_repack=False, draft_rows=32, draft=DraftModel(probe_path(draft), path=draft)))


@pytest.fixture(scope="module")
def loaded(embedded_model: str) -> Iterator[tuple[LlamaEngine, Plan, object]]:
    plan = _plan(embedded_model, embedded_model)
    assert plan.draft is not None, plan.draft_refusal
    eng = ServedModel.of(LlamaEngine())
    report = eng.load(embedded_model, plan)
    yield eng, plan, report
    eng.unload()


def test_greedy_answers_with_the_draft_model_are_the_answers_without(loaded: tuple[LlamaEngine, Plan, object]) -> None:
    eng = loaded[0]
    (text_off, last_off), (text_on, last_on) = _both(eng, COPY, GREEDY)
    assert text_on == text_off and last_on.completion_tokens == last_off.completion_tokens == 64
    # The model drafting for itself: its confident guesses are its own tokens, nearly all kept.
    assert last_on.drafted_tokens > 16 and last_on.accepted_tokens >= 0.8 * last_on.drafted_tokens
    other = "The history of the printing press begins"
    (a, _), (b, lb) = _both(eng, other, replace(GREEDY, max_tokens=40))
    assert a == b and lb.drafted_tokens > 0


def test_seeded_samples_with_the_draft_model_are_the_samples_without(loaded: tuple[LlamaEngine, Plan, object]) -> None:
    """The draft is the draft model's argmax, a point mass: keeping it while it is the token sampled from the main
    model is speculative sampling's acceptance rule, one sampler draw per kept token, so the seed decides alike."""
    eng = loaded[0]
    params = replace(GREEDY, temperature=0.8, top_p=0.95, seed=11, max_tokens=48)
    (a, _), (b, lb) = _both(eng, COPY, params)
    assert a == b and lb.drafted_tokens > 0
    for n in (1, 3):
        (a, la), (b, lb) = _both(eng, COPY, replace(GREEDY, max_tokens=n))
        assert a == b and la.completion_tokens == lb.completion_tokens == n


def test_two_sequences_draft_together_and_each_gives_its_answer(loaded: tuple[LlamaEngine, Plan, object]) -> None:
    eng = loaded[0]
    params = replace(GREEDY, n=2, temperature=0.7, seed=5, max_tokens=32)

    def by_choice(chunks: Iterator[Chunk]) -> dict[int, str]:
        out: dict[int, str] = {}
        for c in chunks:
            out[c.index] = out.get(c.index, "") + c.text
        return out

    off = by_choice(eng.complete(COPY, replace(params, speculative=False), Cancel()))
    on = by_choice(eng.complete(COPY, params, Cancel()))
    assert on == off and len(on) == 2


def test_the_draft_models_memory_is_what_the_plan_predicted(loaded: tuple[LlamaEngine, Plan, object]) -> None:
    _, plan, report = loaded
    est = plan.estimate
    assert est is not None and est.draft is not None
    allocated = {a.device: a.total_bytes for a in report.draft_allocations}  # type: ignore[attr-defined]
    predicted = allocation_rows(est.draft.estimate)
    assert allocated and set(allocated) == {d for d, n in predicted.items() if n}
    for device, n in allocated.items():
        assert abs(n - predicted[device]) <= 0.02 * MIB, (device, n / MIB, predicted[device] / MIB)
    # The main model's own rows are its own: the draft's bytes are beside them (the host's total counts both).
    main = {a.device: a.total_bytes for a in report.allocations}  # type: ignore[attr-defined]
    rows = allocation_rows(est)
    assert abs(main["CPU"] - (rows["CPU"] - est.host.draft_bytes)) <= 0.02 * MIB
    assert est.host.draft_model_bytes == est.draft.estimate.host.total_bytes


def test_a_draft_of_another_vocabulary_is_refused_at_load(embedded_model: str, tmp_path: object) -> None:
    other = write_fixture("tiny-llama", str(tmp_path), shape=TINY_LLAMA)
    eng = ServedModel.of(LlamaEngine())
    with pytest.raises(VocabularyMismatch) as err:
        eng.load(embedded_model, _plan(embedded_model, other, slots=1))
    assert "does not share the model's vocabulary" in err.value.message and other in err.value.message
    assert err.value.param == "draft_model"
    assert "512 tokens against the model's 262144" in err.value.message
    # Nothing was kept: the engine loads the model alone afterwards.
    plan = _plan(embedded_model, embedded_model, slots=1)
    eng.load(embedded_model, replace(plan, request=replace(plan.request, draft=None)))
    try:
        assert _run(eng.complete("Hello", replace(GREEDY, max_tokens=4), Cancel()))[1].completion_tokens == 4
    finally:
        eng.unload()
