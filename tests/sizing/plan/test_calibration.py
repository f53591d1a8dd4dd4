"""Measured figures as the pure planner takes them (``sizing.memory.measured``): reading, bounding, using, reporting."""

from __future__ import annotations

from typing import Callable

import pytest

from sizing.memory.context import ContextConfig
from sizing.plan.device import MIB, Device
from sizing.errors import ConfigError
from sizing.memory.kv import kv_cells, kv_split_bytes
from sizing.memory.measured import Calibrated, Calibration, ConfigKey, Sample, mib_to_bytes
from sizing.memory.estimate import estimate
from sizing.plan.make import PlanRequest, make_plan
from sizing.plan.request import context_config
from sizing.model.spec import ModelSpec

GIB = 1 << 30
HOST = Device(0, "host memory", 48 * GIB, 64 * GIB, "host")
KEY = ConfigKey("f16", "f16", True, 512, 1, False, False)


def _sample(full: int, compute_mib: float, swa: int = 0) -> Sample:
    return Sample(full, full, swa, full * 1024, swa * 512, 0, {"CPU": int(compute_mib * MIB)}, 1 * MIB)


def test_log_figures_round_up_to_the_top_of_their_interval() -> None:
    assert mib_to_bytes(0) == 0
    assert mib_to_bytes(1.0) == int(1.005 * MIB) + 1
    assert mib_to_bytes(100.25) >= 100.25 * MIB


def test_compute_between_samples_is_the_chord_and_bounds_a_convex_peak() -> None:
    cal = Calibrated(KEY, (_sample(4096, 100.0), _sample(16384, 200.0), _sample(8192, 120.0)))
    assert [s.full_cells for s in cal.samples] == [4096, 8192, 16384]  # sorted
    at = cal.compute_at("CPU", 12288, 0)
    assert at is not None and at.exact and at.bytes == pytest.approx(160 * MIB, abs=1)
    # a sampled point is the sample, below the first sample its figure bounds every shorter context
    assert cal.compute_at("CPU", 8192, 0).bytes == int(120 * MIB)  # type: ignore[union-attr]
    assert cal.compute_at("CPU", 256, 0).bytes == int(100 * MIB)  # type: ignore[union-attr]
    # past the last sample: the last chord, extrapolated and marked not exact
    past = cal.compute_at("CPU", 20480, 0)
    assert past is not None and not past.exact and past.bytes == pytest.approx(240 * MIB, abs=1)
    assert cal.compute_at("CUDA0", 4096, 0) is None


def test_kv_is_linear_in_cells_from_one_sample() -> None:
    cal = Calibrated(KEY, (_sample(4096, 100.0, swa=1536),))
    f = cal.figures(8192, 1536)
    assert f.kv_full_bytes == 8192 * 1024 and f.kv_swa_bytes == 1536 * 512 and f.output_bytes == MIB


def test_a_calibrated_plan_uses_llama_cpps_figures_and_says_so(model_spec: Callable[..., ModelSpec]) -> None:
    spec = model_spec("Qwen3-14B")
    req = PlanRequest(n_ctx=8192, cache_types=("f16",), cache_type="f16")
    cfg = context_config(req, "f16", 8192)
    simulated = estimate(spec, cfg)
    assert simulated.sources.compute == "simulated"
    full, _ = kv_split_bytes(spec, cfg, True)
    cells = kv_cells(spec, cfg)
    big = simulated.host.compute_bytes + 300 * MIB
    s = Sample(8192, cells.full, cells.swa, full, 0, 0, {"CPU": big}, simulated.host.output_bytes)
    key = ConfigKey.of(cfg, True)
    cal = Calibration("CPU").with_config(Calibrated(key, (s,)))
    plan = make_plan(spec, [], HOST, req, calibration=cal)
    assert plan.estimate is not None
    assert plan.estimate.host.compute_bytes == big
    assert plan.estimate.sources.compute == "measured" and plan.estimate.sources.kv == "measured"
    # the KV agreed to the log's resolution: the exact bytes stay
    assert plan.estimate.host.kv_bytes == full
    # a card gets the measured compute buffer too (a CPU calibration holds for any placement)
    card = Device(0, "RTX 4090", 40 * GIB, 48 * GIB)
    on_card = make_plan(spec, [card], HOST, req, calibration=cal)
    assert on_card.estimate is not None and on_card.estimate.gpus[0].compute_bytes >= big


def test_a_configuration_llama_cpp_refused_is_refused(model_spec: Callable[..., ModelSpec]) -> None:
    spec = model_spec("Qwen3-14B")
    req = PlanRequest(cache_types=("q8_0",), cache_type="q8_0")
    key = ConfigKey.of(context_config(req, "q8_0", 4096), True)
    cal = Calibration("CPU").with_refusal(key, None, "K cache type q8_0 ... does not divide")
    plan = make_plan(spec, [], HOST, req, calibration=cal)
    assert plan.verdict == "refused" and plan.refusal == "INVALID_CONFIG"
    assert "llama.cpp refuses" in (plan.options[0].error or "")


def test_unknown_cache_type_is_a_config_error() -> None:
    from sizing.model.ggml import cache_type

    with pytest.raises(ConfigError, match="unknown KV cache type"):
        cache_type("q3_k")


def test_a_gpu_plan_carries_the_cuda_pool_bound(model_spec: Callable[..., ModelSpec]) -> None:
    from sizing.memory.gpu import CUBLAS_WORKSPACE_BYTES, cuda_pool_bound_bytes

    spec = model_spec("Qwen3-30B-A3B")
    card = Device(0, "H100", 75 * GIB, 80 * GIB)
    plan = make_plan(spec, [card], HOST, PlanRequest(n_ctx=8192, cache_type="q8_0"))  # the quantized cache this checks
    assert plan.estimate is not None
    g = plan.estimate.gpus[0]
    cfg = ContextConfig(8192, "q8_0", "q8_0", "on")
    assert g.pool_bytes == cuda_pool_bound_bytes(spec, cfg, True) > CUBLAS_WORKSPACE_BYTES
    assert plan.estimate.host.pool_bytes == 0
    # FA with a quantized cache: the CUDA buffer holds F16 copies of K and V the CPU graph does not
    assert g.compute_bytes > estimate(spec, cfg).host.compute_bytes


def test_strict_calibration_chooses_only_measured_contexts(model_spec: Callable[..., ModelSpec]) -> None:
    """llama.cpp's compute peak is not monotone in the context, so when the search does not settle the plan
    may only take a context llama.cpp measured."""
    from dataclasses import replace

    spec = model_spec("Qwen3-14B")
    req = PlanRequest(cache_types=("f16",), cache_type="f16", min_ctx=4096)
    samples = []
    for n in (4096, 9984, 40960):
        cfg = context_config(req, "f16", n)
        est = estimate(spec, cfg)
        cells = kv_cells(spec, cfg)
        full, _ = kv_split_bytes(spec, cfg, True)
        samples.append(Sample(n, cells.full, cells.swa, full, 0, 0, {"CPU": est.host.compute_bytes}, est.host.output_bytes))
    key = ConfigKey.of(context_config(req, "f16", 4096), True)
    cal = Calibration("CPU").with_config(Calibrated(key, tuple(samples)))
    host = Device(0, "host memory", spec.weights_bytes + 4 * GIB, 64 * GIB, "host")
    loose = make_plan(spec, [], host, req, calibration=cal)
    strict = make_plan(spec, [], host, req, calibration=replace(cal, strict=True))
    assert loose.cfg.n_ctx not in (4096, 9984, 40960)  # the search lands between samples
    assert strict.cfg.n_ctx in (4096, 9984) and strict.cfg.n_ctx <= loose.cfg.n_ctx
    assert strict.estimate is not None and strict.estimate.host.total_bytes <= host.free_bytes
