"""Split GGUF files (``name-00001-of-00003.gguf``): all shards, one model."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest

from sizing.errors import ProbeError, ShardError
from sizing.probe import probe_path, shard_paths
from tests.sizing.probe.conftest import write_model


@pytest.fixture
def shards(tmp_path: Path) -> list[Path]:
    files = write_model(tmp_path / "m.gguf", n_layer=3, split_max_tensors=4)
    assert [f.name for f in files] == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    return files


def test_shard_paths() -> None:
    assert shard_paths("/x/m-00002-of-00003.gguf") == [f"/x/m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert shard_paths("/x/model.gguf") == ["/x/model.gguf"]
    with pytest.raises(ShardError):
        shard_paths("/x/m-00004-of-00003.gguf")


@pytest.mark.parametrize("which", [0, 1, 2])
def test_any_shard_names_the_whole_model(shards: list[Path], tmp_path: Path, which: int) -> None:
    whole = probe_path(str(write_model(tmp_path / "whole.gguf", n_layer=3)[0]))
    spec = probe_path(str(shards[which]))
    assert spec.source.shards == tuple(str(s) for s in shards)
    assert spec.source.path == str(shards[0])
    assert len(spec.tensors) == len(whole.tensors) == 1 + 3 * 3 + 2
    assert {t.name: t.n_bytes for t in spec.tensors} == {t.name: t.n_bytes for t in whole.tensors}
    assert [t.shard for t in spec.tensors] == sorted(t.shard for t in spec.tensors)
    assert {t.shard for t in spec.tensors} == {0, 1, 2}
    assert spec.weights_bytes == whole.weights_bytes
    assert [layer.weights_bytes for layer in spec.layers] == [layer.weights_bytes for layer in whole.layers]
    assert spec.file_size_bytes == sum(s.stat().st_size for s in shards)
    assert spec.n_vocab == whole.n_vocab and spec.n_layer == 3


def test_missing_shard(shards: list[Path]) -> None:
    shards[1].unlink()
    with pytest.raises(ShardError, match="00002-of-00003.gguf is missing"):
        probe_path(str(shards[0]))


def test_shard_count_disagrees_with_split_count(shards: list[Path], tmp_path: Path) -> None:
    # The same first shard presented as one of two: split.count says 3.
    d = tmp_path / "two"
    d.mkdir()
    shutil.copy(shards[0], d / "m-00001-of-00002.gguf")
    shutil.copy(shards[1], d / "m-00002-of-00002.gguf")
    with pytest.raises(ShardError, match="split.count is 3") as ei:
        probe_path(str(d / "m-00001-of-00002.gguf"))
    assert ei.value.offset is not None


def test_shards_in_the_wrong_order(shards: list[Path], tmp_path: Path) -> None:
    d = tmp_path / "swapped"
    d.mkdir()
    for i, j in ((0, 1), (1, 0), (2, 2)):
        shutil.copy(shards[i], d / f"m-0000{j + 1}-of-00003.gguf")
    with pytest.raises(ShardError, match="split.no"):
        probe_path(str(d / "m-00001-of-00003.gguf"))


def test_corrupt_shard_names_itself(shards: list[Path]) -> None:
    data = bytearray(shards[2].read_bytes())
    struct.pack_into("<I", data, 4, 99)
    shards[2].write_bytes(bytes(data))
    with pytest.raises(ProbeError) as ei:
        probe_path(str(shards[0]))
    assert ei.value.source == str(shards[2]) and ei.value.offset == 4
