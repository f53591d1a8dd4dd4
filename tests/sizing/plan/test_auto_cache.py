"""``cache_type = "auto"`` (``sizing.plan.auto_cache``): the most precise KV cache type that reaches the ceiling.

The scenarios are real model shapes on declared cards and host memory; each asserts its premise from the plan's
own per-type rows (f16 falls short, q8_0 reaches, ...) before it asserts the choice, so a change of the memory
model that moves a scenario fails loudly instead of testing something else.
"""

from __future__ import annotations

from typing import Callable

import pytest

from sizing.memory.context import ContextConfig
from sizing.memory.estimate import estimate
from sizing.memory.placement import Placement
from sizing.plan import AUTO_CACHE_TYPES, choose_cache_type, plan_json, plan_table
from sizing.plan.device import Device
from sizing.plan.make import CacheTypeOption, Plan, PlanRequest, make_plan
from sizing.model.spec import ModelSpec

GIB = 1 << 30
Spec = Callable[..., ModelSpec]
HOST = Device(0, "host memory", 48 * GIB, 64 * GIB, "host")
H200 = Device(0, "H200", 140 * GIB, 141 * GIB)
CARD_16 = Device(0, "RTX 4080", 15 * GIB, 16 * GIB)
CARD_12 = Device(0, "RTX 3080 Ti", 11 * GIB, 12 * GIB)


def rows(plan: Plan) -> dict[str, CacheTypeOption]:
    return {o.cache_type: o for o in plan.options}


def llama(model_spec: Spec) -> ModelSpec:
    spec = model_spec("Llama-3.1-8B", "q4_k_m")
    assert spec.n_ctx_train == 131072
    return spec


def test_the_default_is_auto_and_auto_takes_f16_when_f16_reaches_the_ceiling(model_spec: Spec) -> None:
    spec = llama(model_spec)
    plan = make_plan(spec, [H200], HOST, PlanRequest())
    assert PlanRequest().cache_type == "auto"
    assert rows(plan)["f16"].n_ctx == plan.ctx_cap == 131072, "premise: f16 reaches n_ctx_train"
    assert (plan.cfg.type_k, plan.cfg.type_v, plan.cfg.n_ctx) == ("f16", "f16", 131072)
    assert plan.cache_type_reason == "cache type auto: f16 reaches the ceiling 131072"
    assert plan.cache_type_reason in plan.reasons


def test_auto_takes_f16_under_a_configured_ceiling_that_q8_0_alone_reached_without_it(model_spec: Spec) -> None:
    """The ceiling is the configured one (context_length), not n_ctx_train: below it f16 suffices."""
    spec = llama(model_spec)
    full = make_plan(spec, [CARD_12], HOST, PlanRequest(allow_offload=False))
    f16 = rows(full)["f16"].n_ctx
    assert 4096 < f16 < 131072, "premise: f16 falls short of n_ctx_train on this card"
    capped = make_plan(spec, [CARD_12], HOST, PlanRequest(allow_offload=False, context_length=f16))
    assert capped.cfg.type_k == "f16" and capped.cfg.n_ctx == f16
    asked = make_plan(spec, [CARD_12], HOST, PlanRequest(allow_offload=False, n_ctx=f16 + 256))
    assert asked.cfg.type_k != "f16" and asked.cfg.n_ctx == f16 + 256, "an explicit n_ctx is the ceiling too"


def test_auto_takes_q8_0_when_only_q8_0_reaches_the_ceiling(model_spec: Spec) -> None:
    spec = llama(model_spec)
    plan = make_plan(spec, [CARD_16], HOST, PlanRequest(allow_offload=False))
    r = rows(plan)
    assert r["f16"].n_ctx < 131072 == r["q8_0"].n_ctx == r["q4_0"].n_ctx, "premise: q8_0 and q4_0 reach it"
    assert plan.cfg.type_k == plan.cfg.type_v == "q8_0", "q4_0 buys no context over q8_0 here"
    assert plan.cfg.n_ctx == 131072 and plan.verdict == "one_card"
    assert plan.cache_type_reason == (f"cache type auto: q8_0 reaches the ceiling 131072 "
                                      f"(f16 reaches only {r['f16'].n_ctx} of 131072)")


def test_auto_takes_q8_0_on_a_cpu_host_whose_memory_f16_cannot_fill(model_spec: Spec) -> None:
    spec = llama(model_spec)
    host = Device(0, "host memory", spec.weights_bytes + 11 * GIB, 64 * GIB, "host")
    plan = make_plan(spec, [], host, PlanRequest())
    r = rows(plan)
    assert r["f16"].verdict == "cpu" and r["f16"].n_ctx < 131072 == r["q8_0"].n_ctx, "premise"
    assert plan.cfg.type_k == "q8_0" and plan.verdict == "cpu"


def test_auto_takes_q4_0_only_when_it_buys_context_over_q8_0(model_spec: Spec) -> None:
    spec = llama(model_spec)
    plan = make_plan(spec, [CARD_12], HOST, PlanRequest(allow_offload=False))
    r = rows(plan)
    assert r["f16"].n_ctx < r["q8_0"].n_ctx < r["q4_0"].n_ctx, "premise: each smaller type buys context"
    assert r["q8_0"].n_ctx < plan.ctx_cap, "premise: q8_0 does not reach the ceiling"
    assert plan.cfg.type_k == "q4_0" and plan.cfg.n_ctx == r["q4_0"].n_ctx
    assert plan.cache_type_reason.startswith("cache type auto: q4_0 ")
    assert f"f16 reaches only {r['f16'].n_ctx} of {plan.ctx_cap}" in plan.cache_type_reason
    assert f"q8_0 reaches only {r['q8_0'].n_ctx} of {plan.ctx_cap}" in plan.cache_type_reason
    # On a card where q4_0 falls short of the ceiling too, it is still the largest context.
    small = make_plan(spec, [Device(0, "RTX 3070", int(7.5 * GIB), 8 * GIB)], HOST, PlanRequest(allow_offload=False))
    r = rows(small)
    assert 0 < r["f16"].n_ctx < r["q8_0"].n_ctx < r["q4_0"].n_ctx < small.ctx_cap, "premise"
    assert small.cfg.type_k == "q4_0" and small.cfg.n_ctx == r["q4_0"].n_ctx
    assert small.cache_type_reason.startswith(f"cache type auto: q4_0 gives the largest context, {r['q4_0'].n_ctx} "
                                              f"of {small.ctx_cap}")


def test_auto_never_takes_a_quantized_type_with_flash_attention_off(model_spec: Spec) -> None:
    spec = llama(model_spec)
    plan = make_plan(spec, [CARD_12], HOST, PlanRequest(allow_offload=False, flash_attn="off"))
    r = rows(plan)
    assert r["q8_0"].refusal == r["q4_0"].refusal == "INVALID_CONFIG", "premise: quantized types refused"
    assert 0 < r["f16"].n_ctx < plan.ctx_cap
    assert plan.fits and plan.cfg.type_k == plan.cfg.type_v == "f16" and plan.cfg.flash_attn == "off"
    assert "q8_0 refused" in plan.cache_type_reason and "q4_0 refused" in plan.cache_type_reason


def test_auto_keeps_the_model_whole_on_the_card_before_it_keeps_f16(model_spec: Spec) -> None:
    """A card that holds the model at the minimum context with q8_0 but not with f16: f16 would put layers
    in host memory (read at host bandwidth each token), so auto quantizes."""
    spec = llama(model_spec)
    one = Placement(gpus=(0,), n_gpu_layers=spec.n_layer_all + 1, tensor_split=(1.0,))

    def need(t: str) -> int:
        return estimate(spec, ContextConfig(n_ctx=4096, type_k=t, type_v=t, flash_attn="on"), one,
                        gpu_labels=["CUDA0"]).gpus[0].total_bytes

    card = Device(0, "card", (need("f16") + need("q8_0")) // 2, 16 * GIB)
    plan = make_plan(spec, [card], HOST, PlanRequest())
    r = rows(plan)
    assert r["f16"].verdict == "partial_offload" and r["q8_0"].verdict == "one_card", "premise"
    assert plan.verdict == "one_card" and plan.cfg.type_k in ("q8_0", "q4_0")
    assert "f16 only with layers in host memory" in plan.cache_type_reason
    # Without the card's room for q8_0 too, the partial offload is what there is, and it is f16's.
    small = Device(0, "card", need("q4_0") // 2, 16 * GIB)
    off = make_plan(spec, [small], HOST, PlanRequest())
    assert all(o.verdict == "partial_offload" for o in off.options), "premise"
    assert off.fits and off.verdict == "partial_offload"


@pytest.mark.parametrize("explicit, card", [("q4_0", H200), ("f16", CARD_12), ("q8_0", CARD_12)])
def test_an_explicit_type_wins(model_spec: Spec, explicit: str, card: Device) -> None:
    spec = llama(model_spec)
    plan = make_plan(spec, [card], HOST, PlanRequest(cache_type=explicit, allow_offload=False))
    assert plan.cfg.type_k == plan.cfg.type_v == explicit and plan.cfg.n_ctx == rows(plan)[explicit].n_ctx
    assert plan.cache_type_reason == f"cache type {explicit}: as asked (not auto)"
    assert not any(r.startswith("cache type auto") for r in plan.reasons)


@pytest.mark.parametrize("card", [H200, CARD_16, CARD_12])
def test_auto_is_the_explicit_plan_of_the_type_it_picks(model_spec: Spec, card: Device) -> None:
    spec = llama(model_spec)
    auto = make_plan(spec, [card], HOST, PlanRequest(allow_offload=False))
    same = make_plan(spec, [card], HOST, PlanRequest(allow_offload=False, cache_type=auto.cfg.type_k))
    assert auto.cfg.type_k in AUTO_CACHE_TYPES
    assert (auto.cfg, auto.placement, auto.estimate, auto.verdict) == (same.cfg, same.placement, same.estimate,
                                                                        same.verdict)


def test_a_refusal_under_auto_shows_the_least_demanding_types_figures(model_spec: Spec) -> None:
    spec = llama(model_spec)
    tiny = Device(0, "tiny", 2 * GIB, 4 * GIB)
    plan = make_plan(spec, [tiny], HOST, PlanRequest(allow_offload=False))
    assert not plan.fits and all(o.refusal == "INSUFFICIENT_MEMORY" for o in plan.options), "premise"
    assert plan.cfg.type_k == "q4_0" and plan.refusal == "INSUFFICIENT_MEMORY"
    assert plan.cache_type_reason == ("cache type auto: no type fits (f16, q8_0, q4_0 tried); "
                                      "the figures shown are q4_0's")
    off = make_plan(spec, [tiny], HOST, PlanRequest(allow_offload=False, flash_attn="off"))
    assert off.cfg.type_k == "f16" and off.refusal == "INSUFFICIENT_MEMORY", "never a type refused outright"
    bad = make_plan(spec, [tiny], HOST, PlanRequest(gpu=3))
    assert bad.refusal == "INVALID_CONFIG" and "gpu 3 does not exist" in "; ".join(bad.reasons)
    assert bad.cache_type_reason == "cache type auto: every type refused (f16, q8_0, q4_0); f16's error shown"


def test_auto_sizes_its_candidates_whatever_the_reported_types(model_spec: Spec) -> None:
    spec = llama(model_spec)
    plan = make_plan(spec, [CARD_12], HOST, PlanRequest(allow_offload=False, cache_types=("q8_0", "auto")))
    assert [o.cache_type for o in plan.options] == ["q8_0", "f16", "q4_0"]
    assert plan.cfg.type_k == "q4_0"


def test_the_reason_is_in_the_json_and_the_table(model_spec: Spec) -> None:
    spec = llama(model_spec)
    plan = make_plan(spec, [CARD_16], HOST, PlanRequest(allow_offload=False))
    body = plan_json(plan)
    assert body["chosen"]["cache_type"] == "q8_0"  # type: ignore[index]
    assert body["chosen"]["cache_type_reason"] == plan.cache_type_reason  # type: ignore[index]
    assert plan.cache_type_reason in body["reasons"]  # type: ignore[operator]
    assert f"note: {plan.cache_type_reason}" in plan_table(plan).splitlines()


def _row(t: str, n_ctx: int, verdict: str = "one_card", refusal: str | None = None) -> CacheTypeOption:
    return CacheTypeOption(t, n_ctx, verdict, Placement(), None, refusal=refusal)  # type: ignore[arg-type]


def test_a_tie_below_the_ceiling_goes_to_the_more_precise_type() -> None:
    chosen, why = choose_cache_type([_row("f16", 8192), _row("q8_0", 16384), _row("q4_0", 16384)], 32768, True)
    assert chosen.cache_type == "q8_0"
    assert why == ("cache type auto: q8_0 gives the largest context, 16384 of 32768 "
                   "(f16 reaches only 8192 of 32768, q4_0 reaches only 16384 of 32768)")
    chosen, _ = choose_cache_type([_row("f16", 16384), _row("q8_0", 16384), _row("q4_0", 16384)], 32768, True)
    assert chosen.cache_type == "f16"


def test_partial_offload_counts_only_when_no_type_is_whole() -> None:
    offloaded = [_row("f16", 32768, "partial_offload"), _row("q8_0", 32768, "partial_offload"),
                 _row("q4_0", 32768, "partial_offload")]
    assert choose_cache_type(offloaded, 32768, True)[0].cache_type == "f16"
    cpu_on_a_gpu_host = [_row("f16", 32768, "cpu"), _row("q8_0", 8192, "one_card"), _row("q4_0", 0, "refused")]
    assert choose_cache_type(cpu_on_a_gpu_host, 32768, True)[0].cache_type == "q8_0"
    assert choose_cache_type(cpu_on_a_gpu_host[:1], 32768, False)[0].cache_type == "f16"
    with pytest.raises(ValueError):
        choose_cache_type([], 32768, True)


def test_batch_invariant_outputs_get_a_quantized_cache_where_attention_runs_on_the_cpu(model_spec: Spec) -> None:
    """``quantized_cpu_cache`` (``GGUF_BATCH_INVARIANT``): on a machine without cards auto passes f16 over, whose CPU
    flash attention tiles and splits by cell index; with a card it chooses as always (the card's kernels are not
    made batch-invariant by a quantized cache, which would only cost precision there)."""
    spec = llama(model_spec)
    cpu = make_plan(spec, [], HOST, PlanRequest(quantized_cpu_cache=True, context_length=8192))
    assert rows(cpu)["f16"].n_ctx == 8192, "premise: f16 reaches the ceiling"
    assert cpu.cfg.type_k == cpu.cfg.type_v == "q8_0"
    assert cpu.cache_type_reason == ("cache type auto: q8_0 reaches the ceiling 8192 (f16 left out: batch-invariant "
                                     "outputs need CPU attention over a quantized cache)")
    assert make_plan(spec, [], HOST, PlanRequest(context_length=8192)).cfg.type_k == "f16"
    assert make_plan(spec, [H200], HOST, PlanRequest(quantized_cpu_cache=True)).cfg.type_k == "f16"
    asked = make_plan(spec, [], HOST, PlanRequest(quantized_cpu_cache=True, cache_type="f16", context_length=8192))
    assert asked.cfg.type_k == "f16", "an explicit type wins"
