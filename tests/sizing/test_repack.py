"""Repacked weights in the plan (``sizing.memory.repack``): which weights llama.cpp's extra CPU buffer types copy, and
their bytes; checked against llama.cpp's own load and dry run on this host."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sizing.plan.device import MIB, Device
from sizing.probe import probe_path
from sizing.plan.make import PlanRequest, make_plan
from sizing.memory.repack import auto_repack, buffer_of, extra_buffer_bytes
from sizing.model.spec import TensorInfo

AVX2 = frozenset({"AVX", "AVX2", "FMA", "REPACK"})
AVX512 = AVX2 | {"AVX512"}
AMX = AVX512 | {"AVX512_VNNI", "AMX_INT8"}
NEON = frozenset({"NEON", "DOTPROD", "REPACK"})
HOST = Device(0, "host", 16 << 30, 24 << 30, "host")


def t(name: str, type_name: str, *shape: int, n_bytes: int = 1000) -> TensorInfo:
    return TensorInfo(name, shape, 0, type_name, n_bytes, 0)


def test_the_avx2_rules_of_ggml_repack() -> None:
    assert buffer_of(t("blk.0.ffn_up.weight", "Q4_K", 640, 2048, n_bytes=1000), AVX2) == ("CPU_REPACK", 1024)
    assert buffer_of(t("blk.0.attn_q.weight", "Q4_0", 640, 1024), AVX2) == ("CPU_REPACK", 1024)
    assert buffer_of(t("blk.0.attn_q.weight", "Q4_K", 640, 1020), AVX2) is None, "rows not a multiple of 8"
    for kind in ("Q6_K", "Q5_0", "Q8_0", "F16"):
        assert buffer_of(t("blk.0.ffn_down.weight", kind, 2048, 640), AVX2) is None, kind
    assert buffer_of(t("blk.0.ffn_down.weight", "Q2_K", 2048, 640), AVX2) is None
    assert buffer_of(t("blk.0.ffn_down.weight", "Q2_K", 2048, 640), AVX512) == ("CPU_REPACK", 1024)
    assert buffer_of(t("token_embd.weight", "Q4_0", 640, 4096), AVX2) is None, "read by GET_ROWS"
    assert buffer_of(t("blk.0.attn_norm.weight", "F32", 640), AVX2) is None
    assert buffer_of(t("blk.0.ffn_up_exps.weight", "Q4_K", 2048, 768, 128), AVX2) == ("CPU_REPACK", 1024)
    assert buffer_of(t("blk.0.ffn_up.weight", "Q4_K", 640, 2048), AVX2 - {"REPACK"}) is None, "a build without it"
    assert buffer_of(t("blk.0.ffn_down.weight", "Q6_K", 2048, 640), NEON) == ("CPU_REPACK", 1024)


def test_amx_comes_first_and_packs_rows_its_own_way() -> None:
    # Q4_K 2048 x 640: 8 blocks of 144 bytes and 4 more each, per row.
    assert buffer_of(t("blk.0.ffn_down.weight", "Q4_K", 2048, 640), AMX) == ("AMX", 640 * 8 * 148)
    # Q8_0 640 x 1024: 20 blocks of 34 bytes and an int32 each, per row.
    assert buffer_of(t("blk.0.attn_q.weight", "Q8_0", 640, 1024), AMX) == ("AMX", 1024 * 20 * 38)
    # out_features not a multiple of 32: not AMX's; repacked where CPU_REPACK takes it.
    assert buffer_of(t("blk.0.attn_q.weight", "Q4_K", 2048, 1000), AMX) == ("CPU_REPACK", 1024)
    assert buffer_of(t("blk.0.ffn_up_exps.weight", "Q4_K", 2048, 768, 128), AMX) == ("CPU_REPACK", 1024)


def test_auto_is_off_only_where_amx_is_reported() -> None:
    assert auto_repack(AVX2) and auto_repack(NEON) and not auto_repack(AMX)


def test_the_embedded_models_q4k_matrices_and_its_tied_head(embedded_model: str) -> None:
    spec = probe_path(embedded_model)
    # Measured on an AVX2 host: "CPU_REPACK model buffer size = 12.66 MiB" (the Q4_K attn_output and ffn_down).
    assert round(extra_buffer_bytes(spec, AVX2)["CPU_REPACK"] / MIB, 2) == 12.66
    amx = extra_buffer_bytes(spec, AMX)
    # The tied head is a second use of the Q8_0 embedding by MUL_MAT: AMX takes a copy (170 MiB of the 213.9
    # MiB the AMX host's issue report shows).
    embd = next(x for x in spec.tensors if x.name == "token_embd.weight")
    assert amx["AMX"] > embd.n_bytes
    assert extra_buffer_bytes(spec, frozenset({"AVX2"})) == {}


def test_the_plan_counts_them_in_host_memory_only_when_they_are_used(embedded_model: str) -> None:
    spec = probe_path(embedded_model)
    base = PlanRequest(n_ctx=4096, min_ctx=256, cpu_features=AVX2)
    on = make_plan(spec, [], HOST, replace(base, cpu_repack=True)).estimate
    off = make_plan(spec, [], HOST, replace(base, cpu_repack=False)).estimate
    auto_amx = make_plan(spec, [], HOST, replace(base, cpu_features=AMX)).estimate
    assert on is not None and off is not None and auto_amx is not None
    assert dict(on.host.extra_weights) == extra_buffer_bytes(spec, AVX2) and off.host.extra_weights == ()
    assert on.host.total_bytes - off.host.total_bytes == on.host.extra_weights_bytes
    assert on.host.weights_bytes == off.host.weights_bytes, "the mapped file is as large either way"
    assert auto_amx.host.extra_weights == (), "auto is off where AMX is reported"
    # Beside a GPU, host weights are not the extra buffers' (the GPU's host buffer type comes first).
    card = Device(0, "card", 8 << 30, 8 << 30)
    with_card = make_plan(spec, [card], HOST, replace(base, cpu_repack=True)).estimate
    assert with_card is not None and with_card.host.extra_weights == ()


@pytest.mark.slow
def test_predicted_equals_what_llama_cpp_allocates_and_its_dry_run_reports(embedded_model: str) -> None:
    """On this host, with its own features and its auto choice: every row of the load's allocation log (CPU, and
    CPU_REPACK or AMX where used) equals the plan's figure; the no_alloc dry run creates the same weight buffers."""
    from service.engine.calibrate import Calibrator
    from service.engine.cpu import host_repack
    from service.engine.llama import LlamaEngine
    from service.text.served import ServedModel
    from service.engine.params import plan_params
    from service.residency import allocation_rows

    choice = host_repack("auto")
    for on in sorted({choice.on, False}):
        req = PlanRequest(n_ctx=4096, min_ctx=256, n_seq_max=4, kv_unified=True, cpu_repack=on,
                          cpu_features=choice.features)
        plan = make_plan(probe_path(embedded_model), [], HOST, req)
        assert plan.estimate is not None
        predicted = {k: round(v / MIB, 2) for k, v in allocation_rows(plan.estimate).items()}
        eng = ServedModel.of(LlamaEngine())
        report = eng.load(embedded_model, plan)
        eng.unload()
        allocated = {a.device: round(a.total_bytes / MIB, 2) for a in report.allocations}
        assert set(allocated) == set(predicted), (allocated, predicted)
        for row, mib in allocated.items():
            assert mib == pytest.approx(predicted[row], abs=0.011), (row, allocated, predicted)
        cal = Calibrator(timeout_s=60)
        try:
            mp = plan_params(plan)[0]
            cal.measure(embedded_model, mp, [plan.cfg])
            measured = cal.model_buffers(embedded_model, mp)
        finally:
            cal.close()
        # The no_alloc dry run names the same weight buffers (it logs their sizes as 0: the load above sized them).
        assert set(measured) == {"CPU", *dict(plan.estimate.host.extra_weights)}
