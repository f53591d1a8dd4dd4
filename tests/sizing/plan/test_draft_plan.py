"""A draft model in the plan (issue 26): its weights, KV cache and compute buffer are lines beside the main model's
on the device it goes to, the largest context is searched with them counted, and a draft that would cost the main
model context or placement is left out with the figures."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import pytest

from sizing.memory.draft import DraftModel, draft_config
from sizing.memory.estimate import estimate
from sizing.memory.placement import Placement
from sizing.model.spec import ModelSpec
from sizing.plan.device import MIB, Device
from sizing.plan.make import DRAFT_REFUSAL, PlanRequest, make_plan

GIB = 1 << 30
MB = 1000 * 1000
HOST = Device(0, "host memory", 48 * GIB, 64 * GIB, "host")
Spec = Callable[..., ModelSpec]


@pytest.fixture()
def pair(model_spec: Spec) -> tuple[ModelSpec, DraftModel]:
    return model_spec("Qwen3-14B", "q4_k_m"), DraftModel(model_spec("Llama-3.1-8B", "q4_k_m"), path="/m/draft.gguf")


def test_draft_on_the_host_adds_its_own_estimate_there(pair: tuple[ModelSpec, DraftModel]) -> None:
    main, draft = pair
    req = PlanRequest(n_ctx=8192, cache_type="f16", n_seq_max=4, draft=draft)
    plan = make_plan(main, [], HOST, req)
    alone = make_plan(main, [], HOST, replace(req, draft=None))
    assert plan.fits and plan.draft is draft and plan.draft_refusal is None
    est, base = plan.estimate, alone.estimate
    assert est is not None and base is not None and est.draft is not None
    own = estimate(draft.spec, draft_config(plan.cfg), Placement())
    assert est.host.draft_model_bytes == own.host.total_bytes == est.draft.total_bytes
    assert est.host.total_bytes == base.host.total_bytes + own.host.total_bytes
    assert est.draft.estimate.cfg.n_seq_max == 4 and est.draft.estimate.cfg.n_ctx == 8192
    assert est.draft.estimate.cfg.draft_rows == 0 and est.draft.estimate.cfg.embedding_tokens == 0
    assert est.draft.estimate.kv_bytes > 0 and est.draft.device == "CPU"


def test_draft_goes_on_the_card_of_the_output_layer(pair: tuple[ModelSpec, DraftModel]) -> None:
    main, draft = pair
    cards = [Device(0, "A", 12_000 * MB, 12 * GIB), Device(1, "B", 12_000 * MB, 12 * GIB)]
    plan = make_plan(main, cards, HOST, PlanRequest(n_ctx=8192, cache_type="f16", gpu="all", draft=draft,
                                                    draft_squeeze=True))
    assert plan.verdict == "split" and plan.draft is draft
    est = plan.estimate
    assert est is not None and est.draft is not None
    last = plan.placement.slots(main.n_layer_all)[main.n_layer_all]
    on = est.gpus[last]
    assert est.draft.device == on.device
    assert on.draft_model_bytes == est.draft.estimate.gpus[0].total_bytes > 0
    assert all(g.draft_model_bytes == 0 for i, g in enumerate(est.gpus) if i != last)
    # The token embedding and the host's share of the compute stay in host memory, as for any model.
    assert est.host.draft_model_bytes == est.draft.estimate.host.total_bytes > 0
    for g, dev in zip(est.gpus, (cards[i] for i in plan.placement.gpus)):
        assert g.total_bytes <= dev.free_bytes


def test_largest_context_is_searched_with_the_draft_counted(pair: tuple[ModelSpec, DraftModel]) -> None:
    main, draft = pair
    host = Device(0, "host memory", 20 * GIB, 24 * GIB, "host")
    req = PlanRequest(cache_type="f16", draft=draft)
    alone = make_plan(main, [], host, replace(req, draft=None))
    refused = make_plan(main, [], host, req)
    squeezed = make_plan(main, [], host, replace(req, draft_squeeze=True))
    assert alone.fits and squeezed.fits and squeezed.draft is draft
    assert squeezed.cfg.n_ctx < alone.cfg.n_ctx <= alone.ctx_cap
    est = squeezed.estimate
    assert est is not None and est.total_bytes <= host.free_bytes
    # 256 tokens more would not have fitted beside the draft (asked for, they are planned with weights read from
    # the file past the host's free memory).
    more = make_plan(main, [], host, replace(req, draft_squeeze=True, n_ctx=squeezed.cfg.n_ctx + 256))
    assert more.estimate is not None and more.estimate.total_bytes > host.free_bytes
    # Without draft_squeeze the draft is left out, with both contexts and its size said.
    assert refused.draft is None and refused.cfg.n_ctx == alone.cfg.n_ctx
    assert refused.draft_refusal is not None and refused.draft_refusal.startswith(DRAFT_REFUSAL)
    assert str(squeezed.cfg.n_ctx) in refused.draft_refusal and str(alone.cfg.n_ctx) in refused.draft_refusal
    assert f"{est.draft.total_bytes / MIB:.0f} MiB" in refused.draft_refusal  # type: ignore[union-attr]
    assert refused.draft_refusal in refused.warnings


def test_a_draft_that_keeps_the_context_at_the_ceiling_is_kept(pair: tuple[ModelSpec, DraftModel]) -> None:
    main, draft = pair
    plan = make_plan(main, [], HOST, PlanRequest(cache_type="f16", context_length=16384, draft=draft))
    assert plan.draft is draft and plan.cfg.n_ctx == 16384 and plan.draft_refusal is None


def test_no_draft_where_the_main_model_keeps_a_recurrent_state(model_spec: Spec, pair: tuple[ModelSpec, DraftModel]
                                                              ) -> None:
    mamba = model_spec("Mamba-1.4B")
    plan = make_plan(mamba, [], HOST, PlanRequest(draft=pair[1]))
    assert plan.fits and plan.draft is None
    assert plan.draft_refusal is not None and "recurrent state" in plan.draft_refusal
