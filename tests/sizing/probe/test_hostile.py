"""Hostile headers, built byte by byte: each gives one typed error naming what and where."""

from __future__ import annotations

import struct
import tracemalloc

import pytest

from sizing.errors import (
    LayerArrayError,
    MalformedError,
    NotGGUFError,
    ProbeError,
    SizingError,
    TruncatedError,
    UnsupportedVersionError,
)
from sizing.probe import probe_bytes
from sizing.probe.reader import parse_header
from sizing.probe.sources import BytesSource
from sizing.testing.raw_gguf import RawGGUF, gstr, kv_arr_u32, kv_str, kv_u32, minimal_llama, tensor_info

HUGE = (1 << 63) - 1


def _err(data: bytes) -> ProbeError:
    with pytest.raises(ProbeError) as ei:
        probe_bytes(data)
    return ei.value


def test_minimal_is_valid() -> None:
    spec = probe_bytes(bytes(minimal_llama(2, n_vocab=100)))
    assert spec.n_vocab == 100
    assert spec.n_layer == 2
    assert [t.name for t in spec.tensors] == ["blk.0.attn_norm.weight", "blk.1.attn_norm.weight", "token_embd.weight"]


@pytest.mark.parametrize("data", [b"", b"GG", b"GGU"])
def test_shorter_than_magic(data: bytes) -> None:
    e = _err(data)
    assert isinstance(e, TruncatedError) and e.offset == 0


def test_bad_magic() -> None:
    e = _err(b"GGML" + bytes(100))
    assert isinstance(e, NotGGUFError) and e.offset == 0 and "magic" in str(e)


@pytest.mark.parametrize("version", [0, 1, 4, 0xFFFFFFFF])
def test_unsupported_version(version: int) -> None:
    raw = minimal_llama()
    raw.version = version
    e = _err(bytes(raw))
    assert isinstance(e, UnsupportedVersionError) and e.offset == 4


def test_version_2_is_read() -> None:
    raw = minimal_llama()
    raw.version = 2
    assert probe_bytes(bytes(raw)).version == 2


@pytest.mark.parametrize("n_vocab", [3, 100])  # decoded strings, and the skip_strings walk
def test_truncation_at_every_offset(n_vocab: int) -> None:
    data = bytes(minimal_llama(2, n_vocab=n_vocab))
    header_len = len(minimal_llama(2, n_vocab=n_vocab).header())
    for cut in range(len(data)):
        with pytest.raises(ProbeError) as ei:
            probe_bytes(data[:cut])
        e = ei.value
        assert isinstance(e, (TruncatedError, MalformedError)), (cut, e)
        assert e.offset is not None and 0 <= e.offset <= max(cut, header_len), (cut, e)


@pytest.mark.parametrize("n_tensors,n_kv,what", [
    (HUGE, 1, "tensor count"), (1 << 62, 1, "tensor count"), (-1, 1, "tensor count"),
    (0, HUGE, "key/value count"), (0, 1 << 60, "key/value count"), (0, -5, "key/value count"),
])
def test_counts_that_overflow(n_tensors: int, n_kv: int, what: str) -> None:
    data = b"GGUF" + struct.pack("<Iqq", 3, n_tensors, n_kv) + bytes(64)
    e = _err(data)
    assert isinstance(e, MalformedError) and what in str(e)
    assert e.offset == (8 if what == "tensor count" else 16)


@pytest.mark.parametrize("count", [HUGE, 1 << 61, (1 << 64) - 1])
@pytest.mark.parametrize("etype", [0, 4, 8, 12])
def test_array_length_near_2_63(count: int, etype: int) -> None:
    key = gstr("a.b") + struct.pack("<II", 9, etype) + struct.pack("<Q", count)
    data = bytes(RawGGUF(kvs=[key], data=bytes(100)))
    tracemalloc.start()
    try:
        e = _err(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(e, MalformedError)
    assert e.offset == 24 + 8 + 3 + 8  # header, key length + key, value type + element type
    assert peak < 64 * 1024


def test_string_length_past_end() -> None:
    data = bytes(RawGGUF(kvs=[gstr("k") + struct.pack("<I", 8) + struct.pack("<Q", 1 << 40) + b"abc"]))
    e = _err(data)
    assert isinstance(e, TruncatedError) and e.offset == 24 + 9 + 4 and "length" in str(e)


def test_key_length_past_end() -> None:
    data = bytes(RawGGUF(kvs=[struct.pack("<Q", HUGE) + b"xyz" * 10]))
    e = _err(data)
    assert isinstance(e, TruncatedError) and e.offset == 24


def test_skipped_token_length_past_end_names_the_element() -> None:
    toks = [f"t{i}" for i in range(100)]
    body = b"".join(gstr(t) for t in toks[:70]) + struct.pack("<Q", 1 << 50) + b"".join(gstr(t) for t in toks[71:])
    kv = gstr("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 100) + body
    data = bytes(RawGGUF(kvs=[kv]))
    e = _err(data)
    assert isinstance(e, TruncatedError)
    assert "element 70" in str(e)
    assert e.offset == 24 + 8 + len("tokenizer.ggml.tokens") + 16 + sum(8 + len(t) for t in toks[:70])


@pytest.mark.parametrize("vtype", [13, 255, 0xFFFFFFFF])
def test_unknown_value_type(vtype: int) -> None:
    e = _err(bytes(RawGGUF(kvs=[gstr("k") + struct.pack("<I", vtype) + bytes(8)])))
    assert isinstance(e, MalformedError) and e.offset == 24 + 9 and str(vtype) in str(e)


def test_unknown_array_element_type() -> None:
    e = _err(bytes(RawGGUF(kvs=[gstr("k") + struct.pack("<IIQ", 9, 77, 1) + bytes(8)])))
    assert isinstance(e, MalformedError) and e.offset == 24 + 9 + 4


def test_nested_array() -> None:
    e = _err(bytes(RawGGUF(kvs=[gstr("k") + struct.pack("<IIQ", 9, 9, 1) + struct.pack("<IQ", 4, 0)])))
    assert isinstance(e, MalformedError) and "nested" in str(e) and e.offset == 24 + 9 + 4


def test_duplicate_key() -> None:
    second = 24 + len(kv_u32("a.k", 1))
    e = _err(bytes(RawGGUF(kvs=[kv_u32("a.k", 1), kv_u32("a.k", 2)])))
    assert isinstance(e, MalformedError) and "duplicate key" in str(e) and e.offset == second


def test_key_not_utf8() -> None:
    e = _err(bytes(RawGGUF(kvs=[gstr(b"\xff\xfe") + struct.pack("<II", 4, 1)])))
    assert isinstance(e, MalformedError) and "UTF-8" in str(e) and e.offset == 24


def _with_tensor(info: bytes, *, alignment_kv: bytes | None = None, data: bytes = bytes(64)) -> tuple[bytes, int]:
    raw = minimal_llama(2)
    if alignment_kv is not None:
        raw.kvs.append(alignment_kv)
    raw.tensors.append(info)
    raw.data += data
    where = len(raw.header()) - len(info)
    return bytes(raw), where


def test_tensor_offset_past_end() -> None:
    data, where = _with_tensor(tensor_info("extra.weight", [8], 0, 1 << 40))
    e = _err(data)
    assert isinstance(e, TruncatedError) and "extra.weight" in str(e) and e.offset == where


def test_tensor_size_past_end() -> None:
    data, where = _with_tensor(tensor_info("extra.weight", [1 << 30, 1 << 20], 0, 32 * 2 + 12 * 8 + 0))
    e = _err(data)
    assert isinstance(e, (TruncatedError, MalformedError)) and e.offset == where


def test_unknown_tensor_type() -> None:
    data, where = _with_tensor(tensor_info("extra.weight", [8], 4242, 160))
    e = _err(data)
    assert isinstance(e, MalformedError) and "4242" in str(e) and e.offset == where


def test_removed_tensor_type() -> None:
    data, where = _with_tensor(tensor_info("extra.weight", [32], 4, 160))  # Q4_2, removed from ggml
    e = _err(data)
    assert isinstance(e, MalformedError) and e.offset == where


def test_misaligned_tensor_offset() -> None:
    data, where = _with_tensor(tensor_info("extra.weight", [8], 0, 161))
    e = _err(data)
    assert isinstance(e, MalformedError) and "alignment" in str(e)
    assert e.offset == where + 8 + len("extra.weight") + 4 + 8 + 4


def test_overlapping_tensors() -> None:
    data, where = _with_tensor(tensor_info("extra.weight", [16], 0, 0))
    e = _err(data)
    assert isinstance(e, MalformedError) and "overlaps" in str(e)


def test_row_not_multiple_of_block() -> None:
    data, where = _with_tensor(tensor_info("extra.weight", [33], 8, 160))  # Q8_0 blocks of 32
    e = _err(data)
    assert isinstance(e, MalformedError) and "block size" in str(e) and e.offset == where


@pytest.mark.parametrize("n_dims", [0, 5, 0xFFFFFFFF])
def test_bad_dimension_count(n_dims: int) -> None:
    info = gstr("extra.weight") + struct.pack("<I", n_dims) + bytes(64)
    raw = minimal_llama(2)
    raw.tensors.insert(0, info)
    e = _err(bytes(raw))
    assert isinstance(e, MalformedError) and "dimensions" in str(e)


def test_shape_overflowing_int64() -> None:
    raw = minimal_llama(2)
    raw.tensors.insert(0, tensor_info("big", [1 << 40, 1 << 40], 0, 0))
    e = _err(bytes(raw))
    assert isinstance(e, MalformedError) and "overflows" in str(e)


def test_negative_dimension() -> None:
    raw = minimal_llama(2)
    raw.tensors.insert(0, tensor_info("neg", [-8], 0, 0))
    assert isinstance(_err(bytes(raw)), MalformedError)


def test_duplicate_tensor() -> None:
    raw = minimal_llama(2)
    raw.tensors.append(tensor_info("token_embd.weight", [8], 0, 0))
    e = _err(bytes(raw))
    assert isinstance(e, MalformedError) and "duplicate tensor" in str(e)


@pytest.mark.parametrize("alignment", [0, 3, 48])
def test_alignment_not_power_of_two(alignment: int) -> None:
    raw = minimal_llama(2, extra_kvs=[kv_u32("general.alignment", alignment)])
    e = _err(bytes(raw))
    assert isinstance(e, MalformedError) and "alignment" in str(e)


def test_custom_alignment_is_honoured() -> None:
    raw = minimal_llama(1, extra_kvs=[kv_u32("general.alignment", 64)])
    raw.alignment = 64
    raw.tensors = [tensor_info("blk.0.attn_norm.weight", [8], 0, 0), tensor_info("token_embd.weight", [8, 3], 0, 64)]
    raw.data = bytes(64 + 96)
    spec = probe_bytes(bytes(raw))
    assert spec.alignment == 64 and spec.data_offset % 64 == 0


@pytest.mark.parametrize("key", ["llama.attention.head_count_kv", "llama.attention.head_count"])
def test_per_layer_array_wrong_length(key: str) -> None:
    raw = minimal_llama(2)
    raw.kvs = [kv for kv in raw.kvs if not kv.startswith(gstr("llama.attention.head_count"))]
    raw.kvs.append(kv_arr_u32(key, [1, 1, 1, 1]))
    data = bytes(raw)
    e = _err(data)
    assert isinstance(e, LayerArrayError) and key in str(e)
    assert e.offset is not None and data[e.offset + 8 : e.offset + 8 + len(key)] == key.encode()


def test_missing_architecture_is_a_typed_error() -> None:
    raw = minimal_llama(2)
    raw.kvs = raw.kvs[1:]
    with pytest.raises(SizingError, match="architecture"):
        probe_bytes(bytes(raw))


def test_tensor_names_a_block_past_block_count() -> None:
    raw = minimal_llama(2)
    raw.tensors.append(tensor_info("blk.7.attn_norm.weight", [8], 0, 160))
    raw.data += bytes(32)
    with pytest.raises(MalformedError, match="block 7"):
        probe_bytes(bytes(raw))


def test_windowed_source_gives_the_same_errors() -> None:
    """A source read in windows (as over HTTP) fails the same way as a whole buffer."""

    class Windowed(BytesSource):
        view = None  # type: ignore[assignment]

    toks = [f"t{i}" for i in range(5000)]
    raw = RawGGUF(kvs=[kv_str("general.architecture", "x"), gstr("tokenizer.ggml.tokens")
                       + struct.pack("<IIQ", 9, 8, len(toks)) + b"".join(gstr(t) for t in toks)])
    good = bytes(raw)
    h = parse_header(Windowed(good), initial_bytes=100)
    assert h.array_lengths["tokenizer.ggml.tokens"] == 5000
    assert h.header_bytes == len(raw.header())
    assert h.bytes_read <= len(good)
    for cut in (10, 30, 1000, len(good) // 2, len(good) - 40):
        with pytest.raises((TruncatedError, MalformedError)):  # a short file cannot hold its counts
            parse_header(Windowed(good[:cut]), initial_bytes=100)


def _token_kv(body: bytes, count: int) -> bytes:
    return gstr("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, count) + body


TOKENS_AT = 24 + 8 + len("tokenizer.ggml.tokens") + 16


@pytest.mark.parametrize("windowed", [False, True])
def test_long_tokens_among_short_ones(windowed: bool) -> None:
    """Strings of 256 bytes and more leave the regex path; the walk still ends exactly."""
    toks = [b"x" * (300 if i % 700 == 5 else 70_000 if i == 2222 else i % 40) for i in range(5000)]
    raw = RawGGUF(kvs=[_token_kv(b"".join(gstr(t) for t in toks), len(toks)), kv_u32("after", 7)])
    src = BytesSource(bytes(raw))
    if windowed:
        src.view = None  # type: ignore[method-assign, assignment]
    h = parse_header(src, initial_bytes=1000)
    assert h.array_lengths["tokenizer.ggml.tokens"] == 5000
    assert h.metadata["after"] == 7
    assert h.header_bytes == len(raw.header())


@pytest.mark.parametrize("bad", [0, 7, 1500, 2047, 4999])
def test_bad_length_in_a_long_array_is_located_exactly(bad: int) -> None:
    toks = [b"t%d" % i for i in range(5000)]
    body = b"".join(gstr(t) if i != bad else struct.pack("<Q", 1 << 62) + t for i, t in enumerate(toks))
    with pytest.raises(TruncatedError) as ei:
        parse_header(BytesSource(bytes(RawGGUF(kvs=[_token_kv(body, len(toks))]))))
    assert f"element {bad} of" in str(ei.value)
    assert ei.value.offset == TOKENS_AT + sum(8 + len(t) for t in toks[:bad])
