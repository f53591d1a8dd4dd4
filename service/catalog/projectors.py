"""Vision projectors (``mmproj``) for the models that take images: which file, and llama.cpp's figures for it.

A model's projector is named by ``mmproj`` (``GGUF_MMPROJ``, the models file, a load's body): a path (relative
to the models directory, or absolute where the settings or the models file name it), ``auto`` (the default) or
``""``/``none``. ``auto`` takes the ``*mmproj*.gguf`` files beside the model whose text width (``clip.vision.
projection_dim``: the width of the embeddings it hands the model) is the model's ``n_embd``; where several are,
the one whose name shares the longest prefix with the model's. A file named but unreadable, not a projector, or
of another width is a 400 naming ``mmproj``; ``auto`` skips what it cannot use, with a log line.

Its compute buffer is mtmd's own figure where it can be had (``sizing.probe.mtmd``: a child process loads the
projector as the engine will, warmup included, once per file and flash-attention setting, kept while the file is
unchanged), else the plan's bound (``sizing.memory.projector``). Measured on the CPU backend, and where this
machine has cards on the GPU backend too (``use_gpu``: mtmd's buffers on the first card, ``CUDA0``), which is the
figure a projector on a card is planned with; a CPU build answers with CPU buffers only, and the bound stands in.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Callable

from sizing.errors import ProbeError, UnsupportedModelError
from sizing.memory import Projector, mib_to_bytes
from sizing.model import ModelSpec, ProjectorSpec
from sizing.probe import ProjectorFigures, measure_projector, probe_projector

from ..errors import BadRequest

log = logging.getLogger(__name__)

NONE = ("", "none", "off")
AUTO = "auto"


def is_projector_file(name: str) -> bool:
    """A ``.gguf`` file named as a projector (``mmproj-*.gguf``, ``*-mmproj-f16.gguf``): never a model of the
    registry."""
    low = name.lower()
    return low.endswith(".gguf") and "mmproj" in low


def _common_prefix(a: str, b: str) -> int:
    return len(os.path.commonprefix([a.lower(), b.lower()]))


Measure = Callable[[str, bool, bool], ProjectorFigures]
"""(path, flash attention, use_gpu) -> mtmd's figures."""


class ProjectorSource:
    """Finds a load's projector and measures it (one per service: its figures are cached by file)."""

    def __init__(self, models_dir: str | None, *, calibrate: bool = True, measure: Measure | None = None,
                 has_gpus: Callable[[], bool] = lambda: False) -> None:
        self.models_dir = models_dir
        self.calibrate = calibrate
        self._measure = measure or (lambda path, fa, gpu: measure_projector(path, fa, use_gpu=gpu))
        self._has_gpus = has_gpus
        self._lock = threading.Lock()
        self._figures: dict[tuple[str, int, int, bool, str], tuple[int | None, int | None] | None] = {}
        self._specs: dict[tuple[str, int, int], ProjectorSpec | None] = {}

    def resolve(self, value: str | None, model_path: str | None, spec: ModelSpec) -> str | None:
        """The projector file ``value`` names for the model at ``model_path`` (None: no projector)."""
        if value is None or value.strip().lower() == AUTO:
            return self._beside(model_path, spec) if model_path else None
        if value.strip().lower() in NONE:
            return None
        path = Path(value)
        if not path.is_absolute() and self.models_dir:
            path = Path(self.models_dir) / path
        return str(path)

    def inside_models_dir(self, value: str | None) -> None:
        """A load's or dry run's ``mmproj`` (a client's value): ``auto``, none, or a file of the models directory
        (as model names: never another path of this machine); ``BadRequest`` otherwise."""
        if value is None or value.strip().lower() in (AUTO, *NONE):
            return
        base = Path(self.models_dir or ".").resolve()
        real = (base / value).resolve()
        if base not in real.parents or real.suffix.lower() != ".gguf":
            raise BadRequest("mmproj: a .gguf file of the models directory (GGUF_MODELS_DIR), auto, or \"\" for none",
                             param="mmproj")

    def projector(self, value: str | None, model_path: str | None, spec: ModelSpec, *,
                  offload: bool = True) -> Projector | None:
        """The plan's projector for this model: probed, checked against the model, its compute buffers measured."""
        path = self.resolve(value, model_path, spec)
        if path is None:
            return None
        try:
            pspec = probe_projector(path)
        except (UnsupportedModelError, ProbeError, OSError) as exc:
            raise BadRequest(f"mmproj: {exc}", param="mmproj") from exc
        if pspec.n_embd_text and pspec.n_embd_text != spec.n_embd:
            raise BadRequest(f"mmproj: {path} hands the model embeddings {pspec.n_embd_text} wide; "
                             f"{spec.name} takes {spec.n_embd}", param="mmproj")
        figures, cap = self._measured(pspec)
        return Projector(pspec, offload=offload, figures=figures, image_max_tokens=cap)

    def _beside(self, model_path: str, spec: ModelSpec) -> str | None:
        folder = Path(model_path).parent
        try:
            names = sorted(n for n in os.listdir(folder) if is_projector_file(n))
        except OSError:
            return None
        fits = []
        for n in names:
            p = folder / n
            s = self._spec(str(p))
            if s is not None and s.n_embd_text == spec.n_embd:
                fits.append(n)
        if not fits:
            return None
        stem = Path(model_path).name
        best = max(fits, key=lambda n: (_common_prefix(n, stem), -fits.index(n)))
        return str(folder / best)

    def _spec(self, path: str) -> ProjectorSpec | None:
        """A projector beside a model, probed once while unchanged; None for a file ``auto`` cannot use."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        key = (path, st.st_size, st.st_mtime_ns)
        with self._lock:
            if key in self._specs:
                return self._specs[key]
        try:
            spec: ProjectorSpec | None = probe_projector(path)
        except (UnsupportedModelError, ProbeError, OSError) as exc:
            log.info("mmproj auto: %s skipped: %s", path, exc)
            spec = None
        with self._lock:
            self._specs[key] = spec
        return spec

    def _measured(self, pspec: ProjectorSpec) -> tuple[dict[tuple[str, bool], int], int | None]:
        """mtmd's compute buffer on the CPU backend, flash attention on and off (``{}`` without calibration), and the
        cap on an image's tokens they hold for (``sizing.probe.mtmd.warmup_cap``)."""
        if not self.calibrate:
            return {}, None
        try:
            st = os.stat(pspec.path)
        except OSError:
            return {}, None
        out: dict[tuple[str, bool], int] = {}
        cap = None
        try:
            kinds = ("CPU", "CUDA") if self._has_gpus() else ("CPU",)
        except Exception:  # the inventory unreadable: the plan says so elsewhere; the CPU figure still holds
            kinds = ("CPU",)
        for kind in kinds:
            for fa in (True, False):
                key = (pspec.path, st.st_size, st.st_mtime_ns, fa, kind)
                with self._lock:
                    known = key in self._figures
                    value = self._figures.get(key)
                if not known:
                    try:
                        figures = self._measure(pspec.path, fa, kind != "CPU")
                        # A card's buffer is the one of its kind (CUDA0); a CPU build answers with CPU buffers only.
                        mib = sum(v for b, v in figures.compute_mib.items() if b.rstrip("0123456789") == kind)
                        value = (mib_to_bytes(mib) or None, figures.image_max_tokens)
                    except Exception as exc:  # the bound stands in; the plan says which
                        log.warning("mtmd could not measure %s (%s, flash attention %s): %s", pspec.path, kind,
                                    "on" if fa else "off", exc)
                        value = None
                    with self._lock:
                        self._figures[key] = value
                if value is not None and value[0] is not None:
                    out[(kind, fa)] = value[0]
                    cap = value[1] if kind == "CPU" else cap
        return out, cap
