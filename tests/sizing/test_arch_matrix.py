"""Every architecture of ``sizing.testing.arch_fixtures`` against llama.cpp's own dry run (issue 19's acceptance).

Per architecture, one dry-run worker (the model loaded once) answers everything:

- 8 configurations (cache types, flash attention on/off, n_ubatch, 1 and 4 sequences): the KV caches and
  the recurrent state equal llama.cpp's ``llama_kv_cache`` / ``llama_memory_recurrent`` lines to the log's
  0.01 MiB; the compute buffer, where the graph is not mirrored, is llama.cpp's own once calibrated;
- plans for every cache type with 1 and 4 sequences (and 8 in ``make soak``), on the host alone and on one card, calibrated; each
  row that says it fits is dry-run at its chosen context and llama.cpp's figures must fit the device too.
"""

from __future__ import annotations

import itertools
import os
from typing import Callable

import pytest

from service.engine.calibrate import Calibrator, sample_of
from service.engine.params import ModelParams
from service.planning.planner import LoadOptions, Planner
from service.settings import Settings
from sizing.memory.context import ContextConfig
from sizing.plan.device import MIB, Device
from sizing.probe import probe_path
from sizing.testing.arch_fixtures import ARCH_FIXTURES
from sizing.memory.kv import kv_split_bytes, recurrent_state_bytes
from sizing.memory.measured import Calibrated, ConfigKey
from sizing.memory.estimate import output_buffer_bytes, resolve_flash_attn
from sizing.plan.request import context_config
from sizing.model.spec import ModelSpec

from tests.figures import accuracy

GIB = 1 << 30
PARALLEL = (1, 4, 8) if os.environ.get("GGUF_SOAK") == "1" else (1, 4)
"""Slots the plans are made for: 8 too in ``make soak`` (a third more dry runs, ~150 s of ``make test``; 4 and 8
take the same code paths, multi-sequence KV and output)."""
HYBRID_OR_RECURRENT = {"mamba", "mamba2", "jamba", "falcon-h1", "granitehybrid", "nemotron_h", "lfm2", "rwkv7",
                       "qwen3next"}


def test_the_matrix_covers_what_the_issue_asks() -> None:
    archs = {fx.arch for fx in ARCH_FIXTURES.values()}
    mirrored = {"llama", "qwen2", "qwen3", "gemma2", "gemma3", "qwen3moe", "deepseek2"}
    assert len(archs - mirrored) >= 15
    assert len(archs & HYBRID_OR_RECURRENT) >= 4
    # a MoE with attention sinks and sliding windows
    assert "gpt-oss" in archs


def _configs() -> list[ContextConfig]:
    out = []
    for (tk, tv, fa), n_ub, par in itertools.product(
        [("f16", "f16", "on"), ("f16", "f16", "off"), ("q8_0", "q8_0", "on"), ("q4_0", "q4_0", "on")], [512, 1024], [1, 4]
    ):
        out.append(ContextConfig(12000, tk, tv, fa, n_ub, max(n_ub, 512), par))  # type: ignore[arg-type]
    return out[::2] + [ContextConfig(5000, "q8_0", "f16", "on", 512, 512, 4), ContextConfig(30000, "f16", "f16", "off", 1024, 1024, 1)]


def _check_memory(spec: ModelSpec, cal: Calibrator, path: str, name: str) -> None:
    cfgs = _configs()
    results = cal.measure(path, ModelParams(), cfgs)
    checked = 0
    for cfg, r in zip(cfgs, results):
        case = f"{name} n_ctx={cfg.n_ctx} {cfg.type_k}/{cfg.type_v} fa={cfg.flash_attn} ub={cfg.n_ubatch} par={cfg.n_seq_max}"
        assert r.ok, f"{case}: {r.failure}"
        checked += 1
        flash = resolve_flash_attn(cfg, spec)
        full, swa = kv_split_bytes(spec, cfg, flash)
        by_kind = {c.swa: c.size_mib for c in r.kv_caches}
        for is_swa, predicted in ((False, full), (True, swa)):
            logged = by_kind.get(is_swa, 0.0)
            assert abs(round(predicted / MIB, 2) - logged) < 0.005, f"{case}: KV {is_swa=} {predicted / MIB:.2f} vs {logged}"
        state = recurrent_state_bytes(spec, cfg)
        assert abs(round(state / MIB, 2) - r.state_mib) < 0.005, f"{case}: state {state / MIB:.2f} vs {r.state_mib}"
        assert abs(round(output_buffer_bytes(spec, cfg) / MIB, 2) - r.output_mib) < 0.005, case
        # the calibrated compute figure at a measured point is llama.cpp's own
        s = sample_of(r, spec)
        assert s is not None
        fig = Calibrated(ConfigKey.of(cfg, flash), (s,)).figures(s.full_cells, s.swa_cells)
        assert abs(fig.compute_bytes["CPU"] / MIB - r.compute_mib["CPU"]) <= 0.011, case
        accuracy(f"kv+state exact: {name}", 0.0, f"{checked} configurations")
    assert checked >= 6


def _check_plans(spec: ModelSpec, cal: Calibrator, path: str, name: str) -> int:
    """Plan on a host that limits the context, and on one card; dry-run every row that fits at its context."""
    settings = Settings(min_context=1024)
    host, card = devices_that_limit(spec, settings)
    planned = limited = 0
    for par in PARALLEL:
        for gpus in ([], [card]):
            planner = Planner(settings, lambda gpus=gpus: (list(gpus), host), cal)
            plan = planner.plan(spec, LoadOptions(n_seq_max=par), path=path)
            for opt in plan.options:
                if opt.verdict == "refused" or opt.estimate is None:
                    continue
                planned += 1
                limited += opt.n_ctx < plan.ctx_cap
                cfg = context_config(plan.request, opt.cache_type, opt.n_ctx)
                r = cal.measure(path, ModelParams(), [cfg])[0]
                case = f"{name} {opt.cache_type} par={par} {'card' if gpus else 'host'} n_ctx={opt.n_ctx}"
                assert r.ok, f"{case}: {r.failure}"
                est = opt.estimate
                assert est.sources.compute == "measured" or not plan.calibration, case
                # llama.cpp's figures at the chosen point never exceed the plan's
                assert r.kv_mib <= round(est.kv_bytes / MIB, 2) + 0.02, f"{case}: KV {r.kv_mib} > {est.kv_bytes / MIB:.2f}"
                assert r.state_mib <= round(est.state_bytes / MIB, 2) + 0.01, case
                graph_dev = est.host if not est.gpus else est.gpus[0]
                assert r.compute_mib["CPU"] <= graph_dev.compute_bytes / MIB + 0.011, (
                    f"{case}: compute {r.compute_mib['CPU']} > {graph_dev.compute_bytes / MIB:.2f}")
                assert r.output_mib <= round(est.host.output_bytes / MIB, 2) + 0.01, case
                # ...so llama.cpp's own need fits where the plan puts it (each measured term within the plan's)
                if not est.gpus:
                    need = (est.host.total_bytes - est.host.kv_bytes - est.host.state_bytes - est.host.compute_bytes
                            - est.host.output_bytes + (r.kv_mib + r.state_mib + r.compute_mib["CPU"] + r.output_mib) * MIB)
                    spill = est.host.weights_bytes if opt.verdict != "cpu" or opt.candidates else 0
                    assert need - spill <= host.free_bytes + 0.05 * MIB, (
                        f"{case}: llama.cpp needs {need / MIB:.1f} MiB of {host.free_bytes / MIB:.1f}")
    accuracy(f"fits confirmed: {name}", 0.0, f"{planned} rows, {limited} limited by memory")
    return planned


def devices_that_limit(spec: ModelSpec, settings: Settings) -> tuple[Device, Device]:
    """A host and a card with room for about half the trained context at f16 (simulated): the rows are
    limited by memory wherever the context costs memory."""
    from sizing.memory.placement import Placement
    from sizing.plan.sizer import Sizer

    req = Planner(settings, lambda: ([], Device(0, "h", 0, 0, "host"))).request(LoadOptions())
    big_host = Device(0, "host memory", spec.weights_bytes + 256 * GIB, spec.weights_bytes + 256 * GIB, "host")
    big_card = Device(0, "RTX 6000", spec.weights_bytes + 256 * GIB, spec.weights_bytes + 256 * GIB)
    half = max(spec.n_ctx_train // 2, 2048)
    on_host = Sizer(spec, [], big_host, req, "f16").estimate(Placement(), half).host.total_bytes
    full = Placement(gpus=(0,), n_gpu_layers=spec.n_layer_all + 1, tensor_split=(1.0,))
    on_card = Sizer(spec, [big_card], big_host, req, "f16").estimate(full, half).gpus[0].total_bytes
    return (Device(0, "host memory", on_host, on_host + 64 * GIB, "host"),
            Device(0, "RTX 6000", on_card, on_card + 8 * GIB))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ARCH_FIXTURES))
def test_architecture_against_llama_cpp(name: str, fixture_path: Callable[..., str]) -> None:
    path = fixture_path(name)
    spec = probe_path(path)
    assert spec.arch_known, spec.architecture
    cal = Calibrator(timeout_s=120)
    try:
        _check_memory(spec, cal, path, name)
        assert _check_plans(spec, cal, path, name) > 0
        assert cal.dry_runs > 0
    finally:
        cal.close()


def test_models_with_a_recurrent_state_get_no_draft_rows(fixture_path: Callable[..., str]) -> None:
    """Self-speculation's logits rows (``ContextConfig.draft_rows``) only where the engine drafts: a recurrent
    state cannot take back a rejected draft's tokens, so hybrid and recurrent models plan none."""
    from sizing.plan.make import PlanRequest, make_plan

    host = Device(0, "host memory", 96 * GIB, 128 * GIB, "host")
    for name, fx in ARCH_FIXTURES.items():
        spec = probe_path(fixture_path(name))
        plan = make_plan(spec, [], host, PlanRequest(min_ctx=256, context_length=4096, draft_rows=32))
        want = 0 if fx.arch in HYBRID_OR_RECURRENT else 32
        assert plan.estimate is not None, name
        assert (plan.cfg.draft_rows, plan.estimate.host.draft_bytes) == (want, want * spec.n_vocab * 4), name
