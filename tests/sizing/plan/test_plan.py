"""Derived context and placement (issue 5): exact figures for real model shapes, and properties."""

from __future__ import annotations

from typing import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sizing.memory.context import ContextConfig
from sizing.plan.device import MIB, Device
from sizing.memory.kv import kv_bytes, kv_bytes_per_token
from sizing.memory.estimate import estimate
from sizing.memory.placement import Placement, assign_slots
from sizing.plan.make import PlanRequest, make_plan
from sizing.model.spec import ModelSpec

MB = 1000 * 1000
GIB = 1 << 30
HOST = Device(0, "host memory", 48 * GIB, 64 * GIB, "host")
RTX_3080_TI = Device(0, "RTX 3080 Ti", 11_500 * MB, 12 * GIB)
RTX_3090 = Device(1, "RTX 3090", 23_500 * MB, 24 * GIB)

Spec = Callable[..., ModelSpec]


def layer_bytes(spec: ModelSpec, layers: list[int] | tuple[int, ...]) -> int:
    """Weights of the given blocks, summed straight from the tensor table."""
    wanted = set(layers)
    return sum(t.n_bytes for t in spec.tensors if t.layer in wanted)


def test_qwen3_14b_f16_kv_is_163840_bytes_per_token(model_spec: Spec) -> None:
    spec = model_spec("Qwen3-14B")
    assert kv_bytes_per_token(spec, "f16", "f16") == 2 * 40 * 8 * 128 * 2 == 163_840


@pytest.mark.parametrize("n_ctx", [4096, 8192])
def test_qwen25_14b_bf16_splits_over_3080ti_and_3090(model_spec: Spec, n_ctx: int) -> None:
    spec = model_spec("Qwen2.5-14B")
    plan = make_plan(spec, [RTX_3080_TI, RTX_3090], HOST, PlanRequest(n_ctx=n_ctx, cache_type="f16", allow_offload=False))
    assert plan.verdict == "split"
    assert plan.cfg.n_ctx == n_ctx
    assert plan.placement.gpus == (0, 1)
    assert plan.placement.n_gpu_layers == 49  # 48 blocks + the output slot: full offload
    est = plan.estimate
    assert est is not None
    on_0, on_1 = est.gpus[0].layers, est.gpus[1].layers
    # Contiguous, all 48 blocks, the lower ones on the first card (llama.cpp's slot order).
    assert list(on_0) + list(on_1) == list(range(48))
    # Proportional to free memory less the allowance: 16 and 32 blocks (+ output on the 3090).
    assert (len(on_0), len(on_1)) == (16, 32)
    # Every figure is exact: weights of exactly those blocks (+ the output head on the last card),
    # KV of exactly those blocks at n_ctx.
    assert est.gpus[0].weights_bytes == layer_bytes(spec, on_0)
    assert est.gpus[1].weights_bytes == layer_bytes(spec, on_1) + spec.output_bytes + sum(
        t.n_bytes for t in spec.tensors if t.name.startswith("output_norm"))
    per_layer_token = 2 * 8 * 128 * 2
    assert est.gpus[0].kv_bytes == per_layer_token * 16 * n_ctx
    assert est.gpus[1].kv_bytes == per_layer_token * 32 * n_ctx
    for need, dev in zip(est.gpus, (RTX_3080_TI, RTX_3090)):
        assert need.total_bytes <= dev.free_bytes
        assert need.allowance_bytes == 500 * MB


def test_qwen25_14b_bf16_at_32k_is_refused_with_both_shortfalls(model_spec: Spec) -> None:
    spec = model_spec("Qwen2.5-14B")
    plan = make_plan(spec, [RTX_3080_TI, RTX_3090], HOST, PlanRequest(n_ctx=32768, cache_type="f16", allow_offload=False))
    assert plan.verdict == "refused"
    assert plan.refusal == "INSUFFICIENT_MEMORY"
    est = plan.estimate
    assert est is not None and len(est.gpus) == 2
    need = sum(g.total_bytes for g in est.gpus)
    free = RTX_3080_TI.free_bytes + RTX_3090.free_bytes
    # The weights, the 32k cache and two allowances alone exceed the 35,000 MB free, however divided.
    assert spec.weights_bytes - spec.token_embd_bytes + 196_608 * 32768 + 2 * 500 * MB > free
    assert need > free
    shortfalls = [g.total_bytes - d.free_bytes for g, d in zip(est.gpus, (RTX_3080_TI, RTX_3090))]
    assert all(s > 0 for s in shortfalls), shortfalls
    from sizing.plan.report import plan_json

    devices = {d["device"]: d for d in plan_json(plan)["estimate"]["devices"]}  # type: ignore[index]
    assert devices["CUDA0"]["missing_mib"] == round(shortfalls[0] / MIB, 2)
    assert devices["CUDA1"]["missing_mib"] == round(shortfalls[1] / MIB, 2)


@pytest.mark.parametrize("n_ctx", [None, 4096, 8192, 32768])
def test_qwen25_14b_bf16_on_one_24gb_card_without_offload_is_refused(model_spec: Spec, n_ctx: int | None) -> None:
    spec = model_spec("Qwen2.5-14B")
    card = Device(0, "RTX 3090", 24 * GIB, 24 * GIB)
    plan = make_plan(spec, [card], HOST, PlanRequest(n_ctx=n_ctx, cache_type="f16", allow_offload=False))
    assert plan.verdict == "refused"
    assert plan.refusal == "INSUFFICIENT_MEMORY"
    assert all(o.n_ctx == 0 for o in plan.options)
    est = plan.estimate
    assert est is not None
    g = est.gpus[0]
    assert g.weights_bytes > card.free_bytes
    assert g.kv_bytes > 0 and g.compute_bytes > 0 and g.allowance_bytes > 0


def test_all_on_a_node_whose_second_card_has_300mb_is_split_not_honoured(model_spec: Spec) -> None:
    spec = model_spec("Qwen2.5-14B")
    cards = [Device(0, "RTX 3090", 24 * GIB, 24 * GIB), Device(1, "RTX 3090", 300 * MB, 24 * GIB)]
    plan = make_plan(spec, cards, HOST, PlanRequest(gpu="all", cache_type="f16", allow_offload=False))
    assert plan.verdict == "refused"
    assert plan.refusal == "SPLIT_NOT_HONOURED"
    assert "CUDA1 0 layers" in (plan.options[-1].error or "") or any("CUDA1 0 layers" in r for r in plan.reasons)


def test_all_is_honoured_when_each_card_gets_layers(model_spec: Spec) -> None:
    spec = model_spec("Llama-3.1-8B", "q8_0")
    cards = [Device(0, "RTX 4090", 24 * GIB, 24 * GIB), Device(1, "RTX 4090", 24 * GIB, 24 * GIB)]
    auto = make_plan(spec, cards, HOST, PlanRequest(n_ctx=8192))
    assert auto.verdict == "one_card"  # a model that fits one card is never split unless asked
    both = make_plan(spec, cards, HOST, PlanRequest(n_ctx=8192, gpu="all"))
    assert both.verdict == "split"
    assert both.estimate is not None
    assert all(len(g.layers) > 0 for g in both.estimate.gpus)


def test_named_card_is_honoured_or_refused_never_swapped(model_spec: Spec) -> None:
    spec = model_spec("Llama-3.1-8B", "q8_0")
    cards = [Device(0, "small", 4 * GIB, 8 * GIB), Device(1, "big", 20 * GIB, 24 * GIB)]
    on_big = make_plan(spec, cards, HOST, PlanRequest(gpu=1, n_ctx=4096, allow_offload=False))
    assert on_big.verdict == "one_card" and on_big.placement.gpus == (1,)
    on_small = make_plan(spec, cards, HOST, PlanRequest(gpu=0, n_ctx=4096, allow_offload=False))
    assert on_small.verdict == "refused"
    assert on_small.placement.gpus == (0,)


def test_auto_takes_the_card_with_most_free_memory(model_spec: Spec) -> None:
    spec = model_spec("Llama-3.1-8B", "q4_k_m")
    cards = [Device(0, "A", 10 * GIB, 24 * GIB), Device(1, "B", 20 * GIB, 24 * GIB), Device(2, "C", 12 * GIB, 24 * GIB)]
    plan = make_plan(spec, cards, HOST, PlanRequest())
    assert plan.verdict == "one_card"
    assert plan.placement.gpus == (1,)


def test_split_takes_only_as_many_cards_as_needed(model_spec: Spec) -> None:
    spec = model_spec("Qwen2.5-14B")
    cards = [Device(i, f"RTX 3090 #{i}", 20 * GIB, 24 * GIB) for i in range(4)]
    plan = make_plan(spec, cards, HOST, PlanRequest(n_ctx=8192, cache_type="f16"))
    assert plan.verdict == "split"
    assert len(plan.placement.gpus) == 2


def test_context_is_capped_by_n_ctx_train_and_ceiling(model_spec: Spec) -> None:
    spec = model_spec("Llama-3.1-8B", "q4_k_m")
    h200 = [Device(0, "H200", 140 * GIB, 141 * GIB)]
    plan = make_plan(spec, h200, HOST, PlanRequest())
    assert all(o.n_ctx == spec.n_ctx_train == 131072 for o in plan.options)
    capped = make_plan(spec, h200, HOST, PlanRequest(context_length=20000))
    assert all(o.n_ctx == 20000 for o in capped.options)
    assert any("ceiling" in r for r in capped.reasons)


def test_declared_262k_model_gets_what_the_card_holds_not_what_it_declares(model_spec: Spec) -> None:
    spec = model_spec("Mistral-Nemo-12B", "q4_k_m")  # declares 1,024,000 tokens
    card = [Device(0, "RTX 4090", 23 * GIB, 24 * GIB)]
    plan = make_plan(spec, card, HOST, PlanRequest(cache_type="f16"))
    assert plan.verdict == "one_card"
    n = plan.cfg.n_ctx
    assert 4096 <= n < spec.n_ctx_train
    assert n % 256 == 0
    # The largest: 256 more tokens would not fit.
    cfg = ContextConfig(n_ctx=n + 256, type_k="f16", type_v="f16")
    over = estimate(spec, cfg, plan.placement, gpu_labels=["CUDA0"])
    assert over.gpus[0].total_bytes > card[0].free_bytes
    assert plan.estimate is not None and plan.estimate.gpus[0].total_bytes <= card[0].free_bytes


def test_quantized_cache_with_flash_attention_off_is_refused_with_the_setting_named(model_spec: Spec) -> None:
    spec = model_spec("Llama-3.1-8B", "q4_k_m")
    plan = make_plan(spec, [Device(0, "RTX 4090", 23 * GIB, 24 * GIB)], HOST, PlanRequest(flash_attn="off"))
    q8 = next(o for o in plan.options if o.cache_type == "q8_0")
    assert q8.verdict == "refused" and q8.refusal == "INVALID_CONFIG"
    assert "flash" in (q8.error or "").lower() and "q8_0" in (q8.error or "")
    f16 = next(o for o in plan.options if o.cache_type == "f16")
    assert f16.n_ctx > 0


def test_layer_map_follows_llamas_rule() -> None:
    # 48 blocks + output, split proportional to 11,500 and 23,500: cumulative shares 0.3286, 1.0.
    slots = assign_slots(48, 49, [11_500.0, 23_500.0])
    # Slot il goes to the first device whose cumulative share exceeds il/49.
    expected = [0 if il / 49 < 11_500 / 35_000 else 1 for il in range(49)]
    assert list(slots) == expected
    assert slots.count(0) == 17
    # Counts as proportions give exactly those counts.
    slots = assign_slots(48, 49, [16.0, 33.0])
    assert slots.count(0) == 16 and slots.count(1) == 33
    # Partial offload: ngl = 10 offloads the output and the top 9 blocks.
    slots = assign_slots(48, 10, [1.0])
    assert [il for il, d in enumerate(slots) if d is not None] == list(range(39, 49))
    # A zero share gets nothing.
    slots = assign_slots(48, 49, [1.0, 0.0, 1.0])
    assert slots.count(1) == 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(free_gib=st.floats(min_value=4, max_value=60), extra_gib=st.floats(min_value=0.1, max_value=20))
def test_more_free_memory_never_gives_a_smaller_context(model_spec: Spec, free_gib: float, extra_gib: float) -> None:
    spec = model_spec("Llama-3.1-8B", "q4_k_m")
    small = make_plan(spec, [Device(0, "g", int(free_gib * GIB), 80 * GIB)], HOST, PlanRequest(allow_offload=False))
    big = make_plan(spec, [Device(0, "g", int((free_gib + extra_gib) * GIB), 80 * GIB)], HOST, PlanRequest(allow_offload=False))
    for a, b in zip(small.options, big.options):
        assert b.n_ctx >= a.n_ctx


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(free_gib=st.floats(min_value=4, max_value=40), name=st.sampled_from(["Llama-3.1-8B", "gemma-2-9b", "Qwen3-14B"]))
def test_smaller_cache_types_never_give_a_smaller_context(model_spec: Spec, free_gib: float, name: str) -> None:
    spec = model_spec(name, "q4_k_m")
    plan = make_plan(spec, [Device(0, "g", int(free_gib * GIB), 80 * GIB)], HOST, PlanRequest(allow_offload=False))
    ctx = {o.cache_type: o.n_ctx for o in plan.options}
    assert ctx["f16"] <= ctx["q8_0"] <= ctx["q4_0"]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n_ctx=st.integers(min_value=1, max_value=131072), ubatch=st.sampled_from([512, 2048]),
       name=st.sampled_from(["Llama-3.1-8B", "gemma-2-9b", "gemma-3-27b", "Qwen3-14B"]))
def test_flash_attention_never_costs_more(model_spec: Spec, n_ctx: int, ubatch: int, name: str) -> None:
    spec = model_spec(name, "q4_k_m")
    on = estimate(spec, ContextConfig(n_ctx=n_ctx, flash_attn="on", n_ubatch=ubatch, n_batch=ubatch))
    off = estimate(spec, ContextConfig(n_ctx=n_ctx, flash_attn="off", n_ubatch=ubatch, n_batch=ubatch))
    assert on.total_bytes <= off.total_bytes


def test_kv_of_a_split_adds_up_to_the_whole(model_spec: Spec) -> None:
    spec = model_spec("gemma-3-27b", "q4_k_m")
    cfg = ContextConfig(n_ctx=32768, type_k="q8_0", type_v="q8_0")
    pl = Placement(gpus=(0, 1, 2), n_gpu_layers=spec.n_layer_all + 1, tensor_split=(1.0, 2.0, 1.0))
    est = estimate(spec, cfg, pl, gpu_labels=["CUDA0", "CUDA1", "CUDA2"])
    assert sum(g.kv_bytes for g in est.gpus) == kv_bytes(spec, cfg, True)
