"""Property: any byte sequence gives a spec or one typed error, never a crash or a hang.

Bounded for CI: a few hundred examples per property, no per-example deadline.
"""

from __future__ import annotations

import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sizing.errors import ProbeError, SizingError
from sizing.probe import probe_bytes
from sizing.model.spec import ModelSpec
from sizing.testing.raw_gguf import minimal_llama

# 100 tokens: long enough to go through the unchecked skip_strings walk.
VALID = bytes(minimal_llama(2, n_vocab=100))
HEADER_LEN = len(minimal_llama(2, n_vocab=100).header())
FUZZ = settings(max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def _outcome(data: bytes) -> ModelSpec | SizingError:
    try:
        return probe_bytes(data)
    except SizingError as exc:  # anything else (struct.error, IndexError, ...) fails the test
        if isinstance(exc, ProbeError) and exc.offset is not None:
            assert 0 <= exc.offset <= max(len(data), HEADER_LEN), exc
        return exc


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes(data: bytes) -> None:
    out = _outcome(data)
    assert isinstance(out, (ModelSpec, SizingError))


@FUZZ
@given(st.binary(max_size=256))
def test_random_bytes_after_a_valid_prefix(tail: bytes) -> None:
    out = _outcome(b"GGUF" + struct.pack("<I", 3) + tail)
    assert isinstance(out, (ModelSpec, SizingError))


@FUZZ
@given(
    st.lists(
        st.tuples(st.integers(0, HEADER_LEN - 1), st.integers(0, 255)), min_size=1, max_size=8
    ),
    st.integers(0, len(VALID)),
)
def test_mutated_valid_header(edits: list[tuple[int, int]], cut: int) -> None:
    data = bytearray(VALID)
    for pos, value in edits:
        data[pos] = value
    out = _outcome(bytes(data[: max(cut, HEADER_LEN // 2)]))
    assert isinstance(out, (ModelSpec, SizingError))
    if isinstance(out, ModelSpec):
        # Whatever was accepted is self-consistent: tensors fit in the file.
        assert out.data_offset + max((t.offset + t.n_bytes for t in out.tensors), default=0) <= out.file_size_bytes


@FUZZ
@given(st.integers(0, HEADER_LEN - 8), st.sampled_from([1 << 63, (1 << 64) - 1, 1 << 32, 1 << 62, 0xFFFFFFFF]))
def test_large_integers_anywhere(pos: int, value: int) -> None:
    data = bytearray(VALID)
    struct.pack_into("<Q", data, pos, value)
    out = _outcome(bytes(data))
    assert isinstance(out, (ModelSpec, SizingError))


def test_unmutated_is_accepted() -> None:
    out = _outcome(VALID)
    assert isinstance(out, ModelSpec) and out.n_vocab == 100
