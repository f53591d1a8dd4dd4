"""The host's safe CPU default: llama.cpp's extra buffer types (AMX, CPU_REPACK) off where its AMX kernel crashes,
on elsewhere, overridden by GGUF_CPU_REPACK; the plan carries the choice to the engine and the dry run."""

from __future__ import annotations

from dataclasses import replace

import pytest

from service.engine.cpu import choose_repack, system_features
from sizing.probe import parse_system_info
from service.engine.params import plan_params, repack_of
from service.planning.planner import LoadOptions, plan_request
from service.settings import Settings
from sizing.plan.device import Device
from sizing.probe import probe_path
from sizing.plan.make import PlanRequest, make_plan

# llama_print_system_info of two hosts (the first: the Sapphire Rapids host of the AMX crash).
AMX_HOST = ("CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | "
            "AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 | OPENMP = 1 | "
            "REPACK = 1 | ")
AVX2_HOST = "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | "


def test_system_info_features_are_parsed() -> None:
    assert {"AVX2", "AVX512", "AMX_INT8", "REPACK"} <= parse_system_info(AMX_HOST)
    assert "AMX_INT8" not in parse_system_info(AVX2_HOST)
    assert parse_system_info("CPU : AVX2 = 0 | ") == frozenset()


def test_auto_turns_repacking_off_where_llama_cpp_reports_amx() -> None:
    amx = choose_repack("auto", parse_system_info(AMX_HOST))
    assert not amx.on and "AMX_INT8" in amx.reason and "20824" in amx.reason
    avx2 = choose_repack("auto", parse_system_info(AVX2_HOST))
    assert avx2.on


@pytest.mark.parametrize("setting,on", [("on", True), ("off", False)])
def test_the_setting_overrides_the_host(setting: str, on: bool) -> None:
    for info in (AMX_HOST, AVX2_HOST):
        choice = choose_repack(setting, parse_system_info(info))  # type: ignore[arg-type]
        assert choice.on is on and "GGUF_CPU_REPACK" in choice.reason


def test_this_hosts_features_come_from_llama_cpp() -> None:
    assert "AVX" in system_features() or "NEON" in system_features() or system_features()


def _plan(path: str, req: PlanRequest):  # type: ignore[no-untyped-def]
    host = Device(0, "host", 16 << 30, 24 << 30, "host")
    return make_plan(probe_path(path), [], host, replace(req, n_ctx=4096, min_ctx=256))


def test_the_plan_carries_the_choice_to_llama_cpps_parameters(embedded_model: str) -> None:
    for setting in ("on", "off"):
        settings = Settings(cpu_repack=setting)  # type: ignore[arg-type]
        req = plan_request(settings, LoadOptions(), repack=choose_repack(settings.cpu_repack, system_features()))
        mp, _ = plan_params(_plan(embedded_model, req))
        assert mp.use_extra_bufts is (setting == "on")
    # A plan that leaves it open (tests, benches building their own) gets this host's auto choice.
    mp, _ = plan_params(_plan(embedded_model, PlanRequest()))
    assert mp.use_extra_bufts is choose_repack("auto", system_features()).on
    # The engine's batch-invariant mode turns them off whatever the plan says.
    assert plan_params(_plan(embedded_model, PlanRequest(cpu_repack=True)), use_extra_bufts=False)[0].use_extra_bufts is False


def test_an_open_plan_on_an_amx_host_is_loaded_without_extra_buffers(embedded_model: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import service.engine.cpu as cpu

    monkeypatch.setattr(cpu, "system_features", lambda: parse_system_info(AMX_HOST))
    plan = _plan(embedded_model, PlanRequest())
    assert repack_of(plan).on is False and plan_params(plan)[0].use_extra_bufts is False


@pytest.mark.slow
def test_a_load_on_this_host_uses_no_amx_buffer_by_default(embedded_model: str) -> None:
    """Where llama.cpp reports AMX_INT8 the default load has no AMX buffer (the crashing kernel is never used), and it
    decodes; elsewhere the same assertions hold trivially for AMX and the load decodes with its repacked weights."""
    from service.engine.base import Cancel, GenerationParams
    from service.engine.llama import LlamaEngine
    from service.text.served import ServedModel

    eng = ServedModel.of(LlamaEngine())
    report = eng.load(embedded_model, _plan(embedded_model, PlanRequest(n_seq_max=2, kv_unified=True)))
    try:
        assert not any(a.device == "AMX" for a in report.allocations)
        text = "".join(c.text for c in eng.complete("Write about the sea.", GenerationParams(max_tokens=24, temperature=0),
                                                    Cancel()))
        assert text
    finally:
        eng.unload()
