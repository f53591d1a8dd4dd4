"""Which projector a model loads with (service/catalog/projectors.py), and the planner's request carrying it.

What can break: ``auto`` taking a projector of another width, or the wrong one of several; ``none``; an explicit
file that does not fit the model (a 400 naming ``mmproj``); a client naming a path outside the models directory;
the measured figures (once per file, the bound when mtmd cannot run); the plan counting the projector."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from service.errors import BadRequest
from service.planning.planner import LoadOptions, Planner
from service.catalog.projectors import ProjectorSource, is_projector_file
from service.settings import Settings
from sizing.probe import ProjectorFigures, probe_path
from sizing.probe.devices import host_memory
from sizing.testing.fixtures import TINY_LLAMA, write_fixture
from sizing.testing.projector_fixtures import TINY, write_projector


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    write_fixture("chat", tmp_path, shape=TINY_LLAMA)  # n_embd 64 (chat-bf16.gguf)
    return tmp_path


def _fits(shape_width: int) -> object:
    return replace(TINY, n_embd_text=shape_width)


def test_auto_takes_the_projector_of_the_models_width_sharing_its_name(folder: Path) -> None:
    spec = probe_path(str(folder / "chat-bf16.gguf"))
    src = ProjectorSource(str(folder), calibrate=False)
    model = str(folder / "chat-bf16.gguf")
    assert src.resolve("auto", model, spec) is None  # none there
    write_projector(folder / "mmproj-other-f16.gguf", _fits(spec.n_embd * 2))  # type: ignore[arg-type]
    assert src.resolve("auto", model, spec) is None  # another width: another model's
    write_projector(folder / "mmproj-a-f16.gguf", _fits(spec.n_embd))  # type: ignore[arg-type]
    write_projector(folder / "chat-bf16-mmproj-f16.gguf", _fits(spec.n_embd))  # type: ignore[arg-type]
    assert src.resolve("auto", model, spec) == str(folder / "chat-bf16-mmproj-f16.gguf")
    assert src.resolve(None, model, spec) == str(folder / "chat-bf16-mmproj-f16.gguf")
    for none in ("", "none", "off"):
        assert src.resolve(none, model, spec) is None
    assert src.resolve("mmproj-a-f16.gguf", model, spec) == str(folder / "mmproj-a-f16.gguf")
    assert is_projector_file("Gemma-3-4B-MMPROJ-F16.gguf") and not is_projector_file("gemma-3-4b.gguf")


def test_a_named_projector_is_probed_checked_and_measured_once(folder: Path) -> None:
    spec = probe_path(str(folder / "chat-bf16.gguf"))
    write_projector(folder / "mmproj-wide.gguf", _fits(spec.n_embd * 2))  # type: ignore[arg-type]
    write_projector(folder / "mmproj-fits.gguf", _fits(spec.n_embd))  # type: ignore[arg-type]
    (folder / "mmproj-bad.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    calls: list[tuple[str, bool]] = []

    def measure(path: str, fa: bool, gpu: bool) -> ProjectorFigures:
        assert not gpu
        calls.append((path, fa))
        return ProjectorFigures(0.5, {"CPU": 2.0 if fa else 3.0}, fa)

    src = ProjectorSource(str(folder), measure=measure)
    with pytest.raises(BadRequest, match=f"embeddings {spec.n_embd * 2} wide") as info:
        src.projector("mmproj-wide.gguf", None, spec)
    assert info.value.param == "mmproj"
    with pytest.raises(BadRequest) as info:
        src.projector("mmproj-bad.gguf", None, spec)
    assert info.value.param == "mmproj"
    with pytest.raises(BadRequest):
        src.projector("mmproj-missing.gguf", None, spec)
    p = src.projector("mmproj-fits.gguf", None, spec, offload=False)
    assert p is not None and not p.offload and p.figures[("CPU", True)] == int((2.0 + 0.005) * (1 << 20)) + 1
    again = src.projector("mmproj-fits.gguf", None, spec)
    assert again is not None and dict(again.figures) == dict(p.figures)
    assert sorted(calls) == [(str(folder / "mmproj-fits.gguf"), False), (str(folder / "mmproj-fits.gguf"), True)]

    def broken(path: str, fa: bool, gpu: bool) -> ProjectorFigures:
        raise RuntimeError("mtmd could not load it")

    bound = ProjectorSource(str(folder), measure=broken).projector("mmproj-fits.gguf", None, spec)
    assert bound is not None and not bound.figures  # the plan's bound stands in


def test_a_client_names_only_files_of_the_models_directory(folder: Path) -> None:
    src = ProjectorSource(str(folder))
    for ok in (None, "auto", "", "none", "mmproj-x.gguf"):
        src.inside_models_dir(ok)
    for bad in ("/etc/passwd", "../mmproj.gguf", "mmproj.txt", str(folder.parent / "mmproj.gguf")):
        with pytest.raises(BadRequest) as info:
            src.inside_models_dir(bad)
        assert info.value.param == "mmproj"


def test_the_planner_counts_the_projector_its_options_find(folder: Path) -> None:
    spec = probe_path(str(folder / "chat-bf16.gguf"))
    write_projector(folder / "mmproj-chat.gguf", _fits(spec.n_embd))  # type: ignore[arg-type]
    planner = Planner(Settings(models_dir=str(folder), calibrate=False), lambda: ([], host_memory()), live=True)
    model = str(folder / "chat-bf16.gguf")
    with_it = planner.plan(spec, LoadOptions(n_ctx=512), path=model)
    pm = with_it.estimate.projector  # type: ignore[union-attr]
    assert pm is not None and pm.path == str(folder / "mmproj-chat.gguf") and pm.compute_source == "bound"
    without = planner.plan(spec, LoadOptions(n_ctx=512, mmproj=""), path=model)
    assert without.estimate.projector is None  # type: ignore[union-attr]
    assert with_it.estimate.host.total_bytes - without.estimate.host.total_bytes == pm.total_bytes  # type: ignore[union-attr]
    host = planner.plan(spec, LoadOptions(n_ctx=512, mmproj_offload=False), path=model)
    assert host.estimate.projector.device == "CPU"  # type: ignore[union-attr]


def test_a_pull_takes_the_repos_most_precise_half_width_projector() -> None:
    from service.catalog.downloads import pick_projector

    assert pick_projector(["model-Q4_K_M.gguf", "README.md"]) is None
    assert pick_projector(["model-Q4_K_M.gguf", "mmproj-model.gguf"]) == "mmproj-model.gguf"
    assert pick_projector(["mmproj-model-f32.gguf", "mmproj-model-bf16.gguf", "mmproj-model-f16.gguf",
                           "model-Q4_K_M.gguf"]) == "mmproj-model-f16.gguf"
    assert pick_projector(["mmproj-F32.gguf", "mmproj-BF16.gguf"]) == "mmproj-BF16.gguf"
    assert pick_projector(["model-mmproj-q8_0.gguf", "model-mmproj-x.gguf"]) == "model-mmproj-q8_0.gguf"


def test_with_cards_the_projector_is_measured_on_the_gpu_backend_too(folder: Path) -> None:
    """Where the machine has cards, mtmd is asked with use_gpu: a card's buffer (CUDA0) is the figure a projector
    on a card is planned with; a CPU build's answer (CPU buffers only) gives none, and the bound stands in."""
    from sizing.memory import projector_memory

    spec = probe_path(str(folder / "chat-bf16.gguf"))
    write_projector(folder / "mmproj-fits.gguf", _fits(spec.n_embd))  # type: ignore[arg-type]

    def cuda(path: str, fa: bool, gpu: bool) -> ProjectorFigures:
        return ProjectorFigures(0.5, {"CUDA0": 7.0, "CPU": 0.25} if gpu else {"CPU": 2.0}, fa)

    p = ProjectorSource(str(folder), measure=cuda, has_gpus=lambda: True).projector("mmproj-fits.gguf", None, spec)
    assert p is not None and p.figures[("CUDA", True)] == int((7.0 + 0.005) * (1 << 20)) + 1
    card = projector_memory(p, "CUDA0", True)
    assert card.compute_source == "measured" and card.compute_bytes == p.figures[("CUDA", True)]

    def cpu_build(path: str, fa: bool, gpu: bool) -> ProjectorFigures:
        return ProjectorFigures(0.5, {"CPU": 2.0}, fa)

    q = ProjectorSource(str(folder), measure=cpu_build, has_gpus=lambda: True).projector("mmproj-fits.gguf", None, spec)
    assert q is not None and ("CUDA", True) not in q.figures
    assert projector_memory(q, "CUDA0", True).compute_source == "bound"
