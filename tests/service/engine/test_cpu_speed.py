"""The host's decode speed for the planner's speed model, measured with llama.cpp's own kernels once per machine
(``service.engine.cpu_speed``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.engine import cpu_speed


def _predicted_step_s(path: str, threads: int, flops_per_core: float | None) -> float:
    from sizing.memory import Placement
    from sizing.plan import PlanRequest
    from sizing.plan.offload import speed
    from sizing.plan.sizer import Sizer
    from sizing.plan.speed import Tiers
    from sizing.probe import host_memory, probe_path

    req = PlanRequest(n_ctx=512, cpu_cores=threads, host_bandwidth_bytes_per_s=1e18, disk_bandwidth_bytes_per_s=1e18,
                      cpu_flops_per_core=flops_per_core)
    sz = Sizer(probe_path(path), [], host_memory(), req, "f16")
    return 1.0 / speed(sz, Placement(), sz.estimate(Placement(), 512), 512, Tiers.for_request(req))[0]


def test_the_flops_solved_for_a_step_make_the_speed_model_predict_that_step(embedded_model: str) -> None:
    for step in (0.0116, 0.021, 0.05):
        flops = cpu_speed.flops_for_step(embedded_model, step, 2)
        assert _predicted_step_s(embedded_model, 2, flops) == pytest.approx(step, rel=1e-6)
    assert cpu_speed.flops_for_step(embedded_model, 0.0116, 2) > cpu_speed.flops_for_step(embedded_model, 0.021, 2)
    assert _predicted_step_s(embedded_model, 2, None) == _predicted_step_s(  # None: the constant
        embedded_model, 2, __import__("sizing.plan.speed", fromlist=["x"]).CPU_FLOPS_PER_CORE)


def test_the_speed_is_measured_once_and_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            embedded_model: str) -> None:
    cache = tmp_path / "cpu-speed.json"
    monkeypatch.setattr(cpu_speed, "CACHE", cache)
    flops = cpu_speed.decode_flops_per_core(2, False)
    assert flops is not None and 1e9 < flops < 1e12
    kept = json.loads(cache.read_text())
    (key,) = kept
    assert "threads=2" in key and "repack=False" in key and kept[key] == flops
    # The measured figure predicts a step of the embedded model near the one the engine takes (a loose bound: the
    # cores are shared with the rest of the suite).
    step = _predicted_step_s(embedded_model, 2, flops)
    assert 0.002 < step < 0.2
    kept[key] = 1.5e10  # kept: read back, not measured again
    cache.write_text(json.dumps(kept))
    assert cpu_speed.decode_flops_per_core(2, False) == 1.5e10
    cache.write_text("not json")  # a broken file is measured over
    assert cpu_speed.decode_flops_per_core(2, False) not in (None, 1.5e10)


def test_the_service_plans_with_the_measured_speed_unless_one_is_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                      embedded_model: str) -> None:
    """The model manager measures (or reads) the figure at start and its plans carry it; GGUF_CPU_GFLOPS_PER_CORE
    wins where set, and nothing is measured then."""
    from service.catalog.models import Registry
    from service.engine.cpu import host_repack
    from service.options import LoadOptions
    from service.planning.planner import plan_request
    from service.residency.manager import ModelManager
    from service.settings import Settings
    from service.testing.fake import FakeEngine

    cache = tmp_path / "cpu-speed.json"
    monkeypatch.setattr(cpu_speed, "CACHE", cache)
    settings = Settings(models_dir=str(tmp_path), n_threads=2, calibrate=False, host_bandwidth_gbps=20)
    cache.write_text(json.dumps({cpu_speed._key(2, host_repack("auto").on): 2.5e10}))
    manager = ModelManager(settings, Registry(settings), lambda s: FakeEngine())
    assert manager.planner.cpu_flops_per_core == 2.5e10
    req = plan_request(settings, LoadOptions(), cpu_flops_per_core=manager.planner.cpu_flops_per_core)
    assert req.cpu_flops_per_core == 2.5e10
    cache.unlink()
    fixed = Settings(models_dir=str(tmp_path), n_threads=2, calibrate=False, host_bandwidth_gbps=20,
                     cpu_gflops_per_core=7)
    manager = ModelManager(fixed, Registry(fixed), lambda s: FakeEngine())
    assert manager.planner.cpu_flops_per_core is None and not cache.exists()  # nothing measured
    assert plan_request(fixed, LoadOptions(), cpu_flops_per_core=2.5e10).cpu_flops_per_core == 7e9


def test_a_measurement_that_crashes_leaves_the_constant_and_keeps_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The measuring process killed by a signal (SIGSEGV, as a broken llama.cpp build would): the caller gets None
    (the planner's constant), a warning says why, nothing is kept, and the next start measures again."""
    import sys

    cache = tmp_path / "cpu-speed.json"
    monkeypatch.setattr(cpu_speed, "CACHE", cache)
    crash = tmp_path / "crash"
    crash.write_text("#!/bin/sh\nkill -SEGV $$\n")
    crash.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(crash))
    with caplog.at_level("WARNING", logger="service.engine.cpu_speed"):
        assert cpu_speed.decode_flops_per_core(2, False) is None
    assert "could not be measured (exit -11" in caplog.text and not cache.exists()
