"""A vision projector in the plan (issue 27): its weights and compute buffer as mtmd allocates them, on the device it
goes to, and the largest context searched with them counted.

The figures compared with are mtmd's own, measured here: each projector fixture loaded by ``mtmd_init_from_file``
with its warmup (``sizing.probe.mtmd``, a child process), flash attention on and off."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

import pytest

from sizing.probe.mtmd import ProjectorFigures, measure_projector
from sizing.errors import UnsupportedModelError
from sizing.memory import Projector, compute_bound_bytes, mib_to_bytes
from sizing.model.spec import ModelSpec
from sizing.plan.device import Device
from sizing.plan.make import PlanRequest, make_plan
from sizing.plan.report import plan_json, plan_table
from sizing.probe.projector import probe_projector
from sizing.testing.projector_fixtures import PROJECTORS, TINY, ProjectorShape, write_projector
from sizing.units import mib

GIB = 1 << 30
MB = 1000 * 1000
HOST = Device(0, "host memory", 48 * GIB, 64 * GIB, "host")
SHAPES: dict[str, ProjectorShape] = {"tiny": TINY, **PROJECTORS}


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[bool, ProjectorFigures]]]:
    d = tmp_path_factory.mktemp("mmproj")
    out = {}
    for name, shape in SHAPES.items():
        path = write_projector(d / f"mmproj-{name}.gguf", shape)
        out[name] = (path, {fa: measure_projector(str(path), fa) for fa in (True, False)})
    return out


def _projector(path: Path, figures: dict[bool, ProjectorFigures], **kw: object) -> Projector:
    return Projector(probe_projector(str(path)),
                     figures={("CPU", fa): mib_to_bytes(f.compute_mib["CPU"]) for fa, f in figures.items()}, **kw)


@pytest.mark.parametrize("name", list(SHAPES))
def test_probe_and_bound_against_mtmd(measured: dict[str, tuple[Path, dict[bool, ProjectorFigures]]],
                                      name: str) -> None:
    path, figs = measured[name]
    spec = probe_projector(str(path))
    shape = SHAPES[name]
    assert spec.projector_type == shape.projector_type and spec.n_embd_text == shape.n_embd_text
    for fa, f in figs.items():
        assert f.flash_attn is fa
        # The weights: every tensor's ggml_nbytes, what mtmd logs as its model size.
        assert mib(spec.weights_bytes) == f.weights_mib
        if spec.fixed_size:
            # Every image is the one square: its tokens known from the header, the warmup the largest image, and
            # where no figure is measured the bound is above mtmd's.
            assert spec.tokens_per_image == (shape.image_size // shape.patch_size // 4) ** 2
            assert f.image_max_tokens is None
            assert compute_bound_bytes(spec, fa) >= mib_to_bytes(f.compute_mib["CPU"])
        else:
            # Dynamic resolution: the tokens come from each image; the figures hold for images within the warmup's
            # (capped where the projector's own largest image is larger: Pixtral's 512 px against a 256 px warmup).
            assert spec.tokens_per_image is None
            assert 0 < f.max_pixels <= f.warmup_pixels, f
            assert compute_bound_bytes(spec, fa) >= mib_to_bytes(f.compute_mib["CPU"])
            if f.image_max_tokens is not None:
                assert f.image_max_tokens == f.warmup_pixels // spec.token_pixels
    if name in ("gemma3-4b", "gemma3-27b", "qwen2.5vl-7b"):  # thousands of patches (Pixtral's warmup: 256)
        # Flash attention moves the tower's compute buffer (SigLIP at 896 px: by a factor of 9; Qwen2.5-VL's
        # 1288 px warmup: 4872 against 705 MiB, the figures gguf-parser-go#44 reports from llama.cpp).
        assert figs[False].compute_mib["CPU"] > 5 * figs[True].compute_mib["CPU"]


def test_plan_on_the_host_counts_mtmd_figures(model_spec: Callable[..., ModelSpec],
                                             measured: dict[str, tuple[Path, dict[bool, ProjectorFigures]]]) -> None:
    main = model_spec("gemma-3-27b", "q4_k_m")
    path, figs = measured["gemma3-27b"]
    proj = _projector(path, figs)
    for fa in ("on", "off"):
        req = PlanRequest(n_ctx=8192, cache_type="f16", flash_attn=fa, projector=proj)
        plan, alone = make_plan(main, [], HOST, req), make_plan(main, [], HOST, replace(req, projector=None))
        est, base = plan.estimate, alone.estimate
        assert plan.fits and est is not None and base is not None and est.projector is not None
        pm = est.projector
        assert pm.device == "CPU" and pm.flash_attn is (fa == "on") and pm.compute_source == "measured"
        f = figs[fa == "on"]
        assert mib(pm.weights_bytes) == f.weights_mib
        assert pm.compute_bytes == mib_to_bytes(f.compute_mib["CPU"])
        assert est.host.projector_bytes == pm.total_bytes
        assert est.host.total_bytes == base.host.total_bytes + pm.total_bytes
        assert plan_json(plan)["projector"]["compute_mib"] == mib(pm.compute_bytes)
        assert "vision projector gemma3" in plan_table(plan) and "256 tokens an image" in plan_table(plan)


def test_largest_context_is_searched_with_the_projector(
        model_spec: Callable[..., ModelSpec], measured: dict[str, tuple[Path, dict[bool, ProjectorFigures]]]) -> None:
    main = model_spec("gemma-3-27b", "q4_k_m")
    path, figs = measured["gemma3-27b"]
    proj = _projector(path, figs)
    alone = make_plan(main, [], HOST, PlanRequest(cache_type="f16", flash_attn="off"))
    assert alone.fits and alone.estimate is not None
    # A host that holds the model's largest context with 0.5 GiB to spare: the projector (weights 0.8 GiB, compute
    # 1.1 GiB without flash attention) must cost context, and what is chosen fits with it.
    tight = Device(0, "host memory", alone.estimate.total_bytes + GIB // 2, 64 * GIB, "host")
    plain = make_plan(main, [], tight, PlanRequest(cache_type="f16", flash_attn="off"))
    plan = make_plan(main, [], tight, PlanRequest(cache_type="f16", flash_attn="off", projector=proj))
    assert plain.fits and plan.fits and plan.estimate is not None and plan.estimate.projector is not None
    assert plan.cfg.n_ctx < plain.cfg.n_ctx
    assert plan.estimate.total_bytes <= tight.free_bytes
    more = make_plan(main, [], tight, PlanRequest(cache_type="f16", flash_attn="off", projector=proj,
                                                  n_ctx=plan.cfg.n_ctx + 256))
    assert more.estimate is not None and more.estimate.total_bytes > tight.free_bytes


def test_projector_goes_on_the_card_of_the_output_layer(
        model_spec: Callable[..., ModelSpec], measured: dict[str, tuple[Path, dict[bool, ProjectorFigures]]]) -> None:
    main = model_spec("gemma-3-27b", "q4_k_m")
    path, figs = measured["gemma3-27b"]
    cards = [Device(0, "A", 24_000 * MB, 24 * GIB), Device(1, "B", 24_000 * MB, 24 * GIB)]
    proj = _projector(path, figs)
    req = PlanRequest(n_ctx=8192, cache_type="f16", gpu="all", projector=proj)
    plan = make_plan(main, cards, HOST, req)
    est = plan.estimate
    assert plan.verdict == "split" and est is not None and est.projector is not None
    last = plan.placement.slots(main.n_layer_all)[main.n_layer_all]
    assert est.projector.device == est.gpus[last].device
    # A GPU backend's compute buffer is not measured here: the bound stands in for it.
    assert est.projector.compute_source == "bound"
    assert est.gpus[last].projector_bytes == est.projector.total_bytes
    assert all(g.projector_bytes == 0 for i, g in enumerate(est.gpus) if i != last) and est.host.projector_bytes == 0
    for g, dev in zip(est.gpus, (cards[i] for i in plan.placement.gpus)):
        assert g.total_bytes <= dev.free_bytes
    # Offload off (llama-server's --no-mmproj-offload): host memory, with the CPU backend's measured figure.
    host = make_plan(main, cards, HOST, replace(req, projector=replace(proj, offload=False))).estimate
    assert host is not None and host.projector is not None
    assert host.projector.device == "CPU" and host.host.projector_bytes == host.projector.total_bytes
    assert host.projector.compute_source == "measured"


def test_probe_refuses_what_mtmd_refuses(tmp_path: Path, embedded_model: str) -> None:
    with pytest.raises(UnsupportedModelError, match="not a projector"):
        probe_projector(embedded_model)
    with pytest.raises(UnsupportedModelError, match="not found"):
        probe_projector(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="no projector fixture"):
        write_projector(tmp_path / "x.gguf", replace(TINY, projector_type="llama4"))
