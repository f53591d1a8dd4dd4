"""Partial offload (issue 6): models larger than the cards still run, on the fastest placement."""

from __future__ import annotations

from typing import Callable

from sizing.plan.device import Device
from sizing.plan.make import PlanRequest, make_plan
from sizing.model.spec import ModelSpec

GIB = 1 << 30
Spec = Callable[..., ModelSpec]

# The first source document's laptop: an 8 GB card (8.6 GB) with 2.2 GB used, 32 GB of host RAM.
LAPTOP_GPU = Device(0, "NVIDIA GeForce RTX 3080 Laptop GPU", int(8.6e9 - 2.2e9), int(8.6e9))
LAPTOP_HOST = Device(0, "host memory", int(32e9 * 0.85), int(32e9), "host")
SECONDS_PER_TOKEN_STREAMED = 27.0  # AirLLM on that laptop (first source document, Table 6)


def test_qwen3_14b_bf16_on_the_laptop_is_a_partial_offload(model_spec: Spec) -> None:
    spec = model_spec("Qwen3-14B")
    plan = make_plan(spec, [LAPTOP_GPU], LAPTOP_HOST, PlanRequest(cache_type="f16", n_ctx=4096))
    assert plan.verdict == "partial_offload"
    ngl = plan.placement.n_gpu_layers
    assert 0 < ngl < spec.n_layer_all + 1
    est = plan.estimate
    assert est is not None
    gpu = est.gpus[0]
    assert gpu.total_bytes <= LAPTOP_GPU.free_bytes
    # The most slots that fit: one more would not.
    from sizing.plan.offload import fits
    from sizing.plan.make import Sizer

    sz = Sizer(spec, [LAPTOP_GPU], LAPTOP_HOST, plan.request, "f16")
    from dataclasses import replace

    assert not fits(sz, replace(plan.placement, n_gpu_layers=ngl + 1), 4096)
    best = plan.candidates[0]
    assert best.placement == plan.placement
    # Faster than streaming every layer through the card per token, by a wide margin.
    assert best.decode_tokens_per_s > 10 / SECONDS_PER_TOKEN_STREAMED
    # The trade-off is listed: fewer layers, and all on the CPU, each slower.
    speeds = [c.decode_tokens_per_s for c in plan.candidates]
    assert speeds == sorted(speeds, reverse=True)
    assert any(c.placement.cpu_only for c in plan.candidates)


def test_moe_on_a_12gb_card_keeps_experts_in_host_memory(model_spec: Spec) -> None:
    spec = model_spec("Qwen3-30B-A3B", "q4_k_m")
    card = Device(0, "NVIDIA GeForce RTX 3060", 12 * GIB - 300 * (1 << 20), 12 * GIB)
    host = Device(0, "host memory", 28 * GIB, 32 * GIB, "host")
    plan = make_plan(spec, [card], host, PlanRequest(n_ctx=8192))
    assert plan.verdict == "partial_offload"
    # All attention on the GPU: every slot offloaded, only expert tensors stay on the host.
    assert plan.placement.n_gpu_layers == spec.n_layer_all + 1
    assert 0 < plan.placement.n_cpu_moe <= spec.n_layer_all
    assert plan.estimate is not None
    assert plan.estimate.gpus[0].layers == tuple(range(spec.n_layer_all))
    expert_host = sum(spec.layers[il].expert_bytes for il in range(plan.placement.n_cpu_moe))
    assert plan.estimate.host.weights_bytes >= expert_host
    whole_layers = [c for c in plan.candidates if c.placement.n_cpu_moe == 0 and not c.placement.cpu_only]
    assert whole_layers, "the whole-layer split is listed for comparison"
    assert plan.candidates[0].decode_tokens_per_s > max(c.decode_tokens_per_s for c in whole_layers)
    pattern = plan.placement.expert_override_pattern()
    assert pattern is not None
    import re

    assert re.search(pattern, "blk.0.ffn_up_exps.weight")
    assert not re.search(pattern, f"blk.{plan.placement.n_cpu_moe}.ffn_up_exps.weight")
    assert not re.search(pattern, "blk.0.attn_q.weight")


def test_offload_disallowed_refuses_with_figures(model_spec: Spec) -> None:
    spec = model_spec("Qwen3-14B")
    plan = make_plan(spec, [LAPTOP_GPU], LAPTOP_HOST, PlanRequest(cache_type="f16", allow_offload=False))
    assert plan.verdict == "refused" and plan.refusal == "INSUFFICIENT_MEMORY"
    assert plan.estimate is not None and plan.estimate.gpus[0].weights_bytes > LAPTOP_GPU.free_bytes


def test_weights_beyond_host_memory_come_from_disk_with_a_warning(model_spec: Spec) -> None:
    spec = model_spec("Qwen2.5-14B")
    small_host = Device(0, "host memory", 16 * GIB, 16 * GIB, "host")
    plan = make_plan(spec, [LAPTOP_GPU], small_host, PlanRequest(cache_type="q8_0", n_ctx=4096))
    assert plan.verdict == "partial_offload"
    assert plan.candidates[0].disk_weights_bytes > 0
    assert any("disk" in w for w in plan.warnings)


def test_no_gpu_and_too_little_ram_still_runs_from_the_file(model_spec: Spec) -> None:
    spec = model_spec("Qwen3-14B")
    host = Device(0, "host memory", 12 * GIB, 16 * GIB, "host")
    plan = make_plan(spec, [], host, PlanRequest(cache_type="q8_0", n_ctx=4096))
    assert plan.verdict == "cpu"
    assert plan.placement.cpu_only
    assert any("disk" in w for w in plan.warnings)


def test_card_with_no_room_runs_everything_on_the_cpu(model_spec: Spec) -> None:
    spec = model_spec("Qwen3-14B")
    full_card = Device(0, "RTX 3060", 200 * (1 << 20), 12 * GIB)
    plan = make_plan(spec, [full_card], Device(0, "host memory", 60 * GIB, 64 * GIB, "host"), PlanRequest(n_ctx=4096))
    assert plan.verdict == "cpu"
    assert plan.placement.n_gpu_layers == 0


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(free_gib=st.floats(min_value=3.0, max_value=40.0), extra_gib=st.floats(min_value=0.25, max_value=16.0),
       model=st.sampled_from([("Qwen3-14B", "bf16"), ("Qwen3-30B-A3B", "q4_k_m")]))
def test_more_free_memory_never_slows_a_row_nor_drops_it_below_the_minimum(
        model_spec: Spec, free_gib: float, extra_gib: float, model: tuple[str, str]) -> None:
    """Issue 19, item 6: each row is the fastest placement that holds the minimum context; with more free
    memory the same placement is still there, so a row can only get faster, and its context never falls
    below the minimum (it may be smaller than before: a faster placement leaves less room for KV)."""
    spec = model_spec(*model)
    host = Device(0, "host memory", 60 * GIB, 64 * GIB, "host")
    req = PlanRequest()
    small = make_plan(spec, [Device(0, "RTX 4090", int(free_gib * GIB), 48 * GIB)], host, req)
    big = make_plan(spec, [Device(0, "RTX 4090", int((free_gib + extra_gib) * GIB), 48 * GIB)], host, req)
    for a, b in zip(small.options, big.options):
        assert a.cache_type == b.cache_type
        if a.verdict == "refused":
            continue
        assert b.verdict != "refused"
        assert a.decode_tokens_per_s is not None and b.decode_tokens_per_s is not None
        assert b.decode_tokens_per_s >= a.decode_tokens_per_s * (1 - 1e-9), (a, b)
        assert b.n_ctx >= min(req.min_ctx, big.ctx_cap)
        # "largest" is the largest over the placements considered
        assert b.largest_n_ctx >= b.n_ctx and b.largest_n_ctx >= max((c.n_ctx for c in b.candidates), default=0)


def test_every_row_has_its_placement_and_speed_in_json_and_table(model_spec: Spec) -> None:
    from sizing.plan.report import plan_json, plan_table

    spec = model_spec("Qwen3-14B")
    plan = make_plan(spec, [LAPTOP_GPU], LAPTOP_HOST, PlanRequest())
    rows = plan_json(plan)["cache_types"]
    assert isinstance(rows, list)
    for row, opt in zip(rows, plan.options):
        assert row["placement"]["n_gpu_layers"] == opt.placement.n_gpu_layers
        assert row["decode_tokens_per_s"] == round(opt.decode_tokens_per_s or 0, 2) > 0
        assert row["largest_n_ctx"] >= row["n_ctx"]
        assert row["sources"] == {"kv": "simulated", "state": "simulated", "compute": "simulated", "output": "simulated"}
    table = plan_table(plan)
    assert "decode t/s" in table and f"{plan.options[0].placement.n_gpu_layers}/{spec.n_layer_all + 1} layers" in table
