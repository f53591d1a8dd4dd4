"""Sealed disk prompt-cache entries (issue 54): a file is served only as its install wrote it. Each test writes real
entries with ``PromptCache.put``, tampers with the bytes on disk as someone who can write the folder but has not
the key would (every unkeyed field made consistent again: token count, state length, the state's sha256), opens a
new ``PromptCache`` on the folder and checks that ``best``/``take`` give nothing of the tampered file, that
``rejected`` counts it, once, and that the untouched entry beside it is still served."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
import struct
import subprocess
import sys
from array import array
from pathlib import Path
from typing import Any

import pytest

from service.engine.prompt_cache import (FORMAT, KEY_FILE, MAGIC, SEAL_BYTES, SUFFIX, Entry, KeyFileRefused,
                                         PromptCache, binding_of, install_key, scope_of)

FIELDS = {"model": "a" * 32, "type_k": 1, "type_v": 1, "flash_attn": 1, "n_ctx_seq": 2048}
SCOPE = scope_of("tenant-one", None)
OTHER_SCOPE = scope_of("tenant-two", None)
T_A = list(range(1000, 1322))  # the round re-paired 322 tokens
T_B = list(range(5000, 5200))
S_A = hashlib.sha256(b"a").digest() * 200
S_B = hashlib.sha256(b"b").digest() * 300


def _write(root: Path, fields: dict[str, Any] = FIELDS, state_a: bytes = S_A) -> dict[str, Path]:
    """A and B written by a cache on ``root`` (its install's key), as the engine writes them: ``put``, then the
    writer thread; their files by name."""
    pc = PromptCache(1 << 20)
    pc.open_disk(root, fields, 1 << 30)
    try:
        assert pc.put(T_A, bytearray(state_a), scope=SCOPE, pos_min=0, n_canon=300)
        assert pc.put(T_B, bytearray(S_B), scope=SCOPE, pos_min=0, n_canon=180)
        pc.flush()
        by_tokens = {len(e.tokens): e.path for e in pc.entries}
    finally:
        pc.close()
    a, b = by_tokens[len(T_A)], by_tokens[len(T_B)]
    assert a is not None and b is not None
    return {"A": a, "B": b}


def _usable(e: Entry, tokens: list[int]) -> int:
    return len(e.tokens) if tokens[:len(e.tokens)] == e.tokens else 0


def _served(pc: PromptCache, tokens: list[int], scope: str) -> bytes | None:
    """What a request for ``tokens`` and a few more in ``scope`` would restore."""
    e, _ = pc.best(tokens + [7, 8, 9], scope, _usable, 0)
    state = None if e is None else pc.take(e)
    return None if state is None else bytes(state)


def _parts(path: Path) -> tuple[bytes, dict[str, Any], list[int], bytes]:
    """A file's seal, header, tokens and state."""
    raw = path.read_bytes()
    at = len(MAGIC)
    seal = raw[at:at + SEAL_BYTES]
    at += SEAL_BYTES
    (n,) = struct.unpack("<I", raw[at:at + 4])
    head = json.loads(raw[at + 4:at + 4 + n])
    at += 4 + n
    tokens = array("i")
    tokens.frombytes(raw[at:at + 4 * head["n_tokens"]])
    return seal, head, tokens.tolist(), raw[at + 4 * head["n_tokens"]:]


def _rewrite(path: Path, seal: bytes, head: dict[str, Any], tokens: list[int], state: bytes) -> None:
    """A file made consistent again but for its seal: what anyone without the key can do."""
    head = {**head, "n_tokens": len(tokens), "state_bytes": len(state),
            "state_sha256": hashlib.sha256(state).hexdigest()}
    text = json.dumps(head, sort_keys=True).encode()
    path.write_bytes(MAGIC + seal + struct.pack("<I", len(text)) + text + array("i", tokens).tobytes() + state)


def _edit(path: Path, *, head: dict[str, Any] | None = None, tokens: list[int] | None = None,
          state: bytes | None = None) -> None:
    seal, h, t, s = _parts(path)
    _rewrite(path, seal, {**h, **(head or {})}, t if tokens is None else tokens, s if state is None else state)


def _flipped(state: bytes) -> bytes:
    out = bytearray(state)
    out[len(out) // 2] ^= 0x01
    return bytes(out)


TAMPERS = {
    "tokens": lambda f: _edit(f["A"], tokens=T_A[:-5] + [1, 2, 3, 4, 5]),  # A's KV for another prompt
    "scope": lambda f: _edit(f["A"], head={"scope": OTHER_SCOPE}),  # A's KV for another key
    "n_canon": lambda f: _edit(f["A"], head={"n_canon": len(T_A)}),
    "pos_min": lambda f: _edit(f["A"], head={"pos_min": 17}),
    "state_bytes": lambda f: _edit(f["A"], state=S_A[:-64]),  # the header's length follows the state's
    "state": lambda f: _edit(f["A"], state=_flipped(S_A)),  # its sha256 recomputed
}


def _transplant(f: dict[str, Path]) -> None:
    """The round's re-pairing: A's tokens put in front of B's state and B's checksum, in A's place."""
    seal_b, head_b, _, state_b = _parts(f["B"])
    _rewrite(f["A"], seal_b, head_b, T_A, state_b)


TAMPERS["transplant"] = _transplant


def _check_rejected(root: Path, tampered_tokens: list[int], tampered_scope: str, caplog: pytest.LogCaptureFixture,
                    fields: dict[str, Any] = FIELDS) -> None:
    """A new cache on ``root``: nothing of A's file served (as A or as what it was made to say), rejected counted
    once and logged once without the file's content, B still served as written."""
    for budget in (0, 1 << 20):  # on disk only (read when a request takes it), and read back at open
        caplog.clear()
        pc = PromptCache(budget)
        with caplog.at_level(logging.WARNING, logger="service.engine.prompt_cache"):
            pc.open_disk(root, fields, 1 << 30)
            try:
                assert _served(pc, tampered_tokens, tampered_scope) is None
                assert _served(pc, T_A, SCOPE) is None
                assert _served(pc, T_B, SCOPE) == S_B  # the untouched file beside it
                assert pc.stats.rejected == 1
            finally:
                pc.close()
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1, warnings
        assert "ignored" in warnings[0] and tampered_scope not in warnings[0] and "1000" not in warnings[0]


@pytest.mark.parametrize("tamper", sorted(TAMPERS))
def test_a_tampered_file_is_never_served(tmp_path: Path, tamper: str, caplog: pytest.LogCaptureFixture) -> None:
    files = _write(tmp_path)
    TAMPERS[tamper](files)
    _, head, tokens, _ = _parts(files["A"])
    assert (tokens, head["scope"]) != (T_A, SCOPE) or tamper not in ("tokens", "scope")
    _check_rejected(tmp_path, tokens, head["scope"], caplog)


@pytest.mark.parametrize("other", [{"model": "b" * 32}, {"type_k": 8, "type_v": 8}],
                         ids=["another-model-file", "another-cache-type"])
def test_a_file_moved_from_another_bindings_folder_is_never_served(tmp_path: Path, other: dict[str, Any],
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A file of this install for another model (or cache type), moved into this binding's folder in place of
    A's with its header rewritten to this binding: the folder's name is no proof, the seal is."""
    theirs = _write(tmp_path, {**FIELDS, **other}, state_a=bytes(len(S_A)))
    ours = _write(tmp_path)
    assert theirs["A"].name == ours["A"].name and theirs["A"].parent != ours["A"].parent
    shutil.copy(theirs["A"], ours["A"])
    _edit(ours["A"], head={"binding": {"format": FORMAT, **FIELDS}})
    _check_rejected(tmp_path, T_A, SCOPE, caplog)


def test_a_file_written_under_another_installs_key_is_never_served(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Another install (another key) with the same model and parameters: its file, copied over ours byte for byte,
    is as good as any other there, but not here."""
    files = _write(tmp_path / "ours")
    theirs = _write(tmp_path / "theirs")
    assert install_key(tmp_path / "ours") != install_key(tmp_path / "theirs")
    assert theirs["A"].name == files["A"].name and theirs["A"].parent.name == files["A"].parent.name
    shutil.copy(theirs["A"], files["A"])
    _check_rejected(tmp_path / "ours", T_A, SCOPE, caplog)


def test_an_untouched_file_is_served_as_written(tmp_path: Path) -> None:
    """The control for the tests above: the same files, untouched, come back as written, in their scope only."""
    _write(tmp_path)
    pc = PromptCache(0)
    pc.open_disk(tmp_path, FIELDS, 1 << 30)
    try:
        assert _served(pc, T_A, OTHER_SCOPE) is None
        assert _served(pc, T_A, SCOPE) == S_A and _served(pc, T_B, SCOPE) == S_B
        assert pc.stats.rejected == 0
    finally:
        pc.close()


def test_a_file_of_the_previous_format_is_never_read(tmp_path: Path) -> None:
    """Format 1 (an unsealed sha256) lived in folders of its own (the format is part of the binding): a format-2
    cache opens another folder and leaves them alone. One copied into the new folder is rejected."""
    old_folder = tmp_path / binding_of({**FIELDS, "format": 1})
    old_folder.mkdir()
    (old_folder / ("0" * 32 + SUFFIX)).write_bytes(b"GGUFKV1\n" + bytes(100))
    files = _write(tmp_path)
    assert files["A"].parent != old_folder and binding_of(FIELDS) == files["A"].parent.name
    shutil.copy(old_folder / ("0" * 32 + SUFFIX), files["A"].parent / ("1" * 32 + SUFFIX))
    pc = PromptCache(0)
    pc.open_disk(tmp_path, FIELDS, 1 << 30)
    try:
        assert pc.stats.rejected == 1 and pc.disk_entries == 2
    finally:
        pc.close()
    assert (old_folder / ("0" * 32 + SUFFIX)).exists()


# -- the install's key ------------------------------------------------------------------------------------------


def test_the_key_file_is_made_private_and_kept(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    old = os.umask(0o022)  # a usual umask: the key must be 0600 regardless
    try:
        key = install_key(root)
    finally:
        os.umask(old)
    st = (root / KEY_FILE).stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == len(key) == 32
    assert install_key(root) == key  # kept: the files it sealed stay readable after a restart
    assert sorted(p.name for p in root.iterdir()) == [KEY_FILE]  # no temporary file left


@pytest.mark.parametrize("damage", ["group-readable", "world-readable", "short", "empty", "long"])
def test_a_key_file_that_cannot_be_trusted_keeps_the_disk_tier_off(tmp_path: Path, damage: str) -> None:
    """Refused, not replaced: the operator sees why (the message names the file and what to do); the cache
    stays in memory (the engine catches the ``OSError``); the files it sealed are neither read nor removed."""
    files = _write(tmp_path)
    key_file = tmp_path / KEY_FILE
    if damage == "group-readable":
        key_file.chmod(0o640)
    elif damage == "world-readable":
        key_file.chmod(0o644)
    else:
        key = key_file.read_bytes()
        key_file.write_bytes({"short": key[:31], "empty": b"", "long": key + b"\n"}[damage])
    pc = PromptCache(1 << 20)
    with pytest.raises(KeyFileRefused) as refused:
        pc.open_disk(tmp_path, FIELDS, 1 << 30)
    assert isinstance(refused.value, OSError) and str(key_file) in str(refused.value)
    assert ("0600" in str(refused.value)) == damage.endswith("readable")
    assert pc.directory is None and pc.entries == [] and not pc.takes(len(S_A) + (1 << 20))
    assert files["A"].exists() and files["B"].exists()


RACER = """
import os, sys
from pathlib import Path
from service.engine.prompt_cache import install_key
go = Path(sys.argv[2])
print("ready", flush=True)
while not go.exists():
    pass
print(install_key(Path(sys.argv[1])).hex(), flush=True)
"""


def test_processes_starting_at_once_end_with_one_key(tmp_path: Path) -> None:
    """Eight processes asking for a new install's key at the same moment (each spinning until a file appears)
    all get the same one, and one file holds it."""
    root, go = tmp_path / "kv", tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(root), str(go)], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).parents[3]) for _ in range(8)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == "ready\n"
        go.touch()
        keys = [p.communicate(timeout=60)[0].strip() for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert all(p.returncode == 0 for p in procs)
    assert len(set(keys)) == 1 and len(bytes.fromhex(keys[0])) == 32
    assert (root / KEY_FILE).read_bytes().hex() == keys[0]
    assert sorted(p.name for p in root.iterdir()) == [KEY_FILE]
