"""A fast, defensive GGUF header reader.

Reads the key/value metadata and the tensor table of a GGUF file (v2, v3)
without touching tensor data and without materialising long arrays: the
262,144 token strings of a Gemma vocabulary are walked, not decoded.

Every byte sequence yields either a ``GGUFHeader`` or one ``ProbeError``
subclass naming what is wrong and at which offset. Counts are checked against
the bytes that remain before anything is allocated for them, so a hostile
header cannot make the reader allocate more than the file's size.

The layout mirrors ggml's own parser (``ggml/src/gguf.cpp``, ``gguf_init_from_file_impl``
in the llama.cpp vendored by llama-cpp-python 0.3.36).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Callable, Protocol

from ..errors import MalformedError, NotGGUFError, ProbeError, TruncatedError, UnsupportedVersionError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS

# GGUF value types (gguf.GGUFValueType), with their fixed sizes and struct codes.
T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32, T_FLOAT32, T_BOOL = range(8)
T_STRING, T_ARRAY, T_UINT64, T_INT64, T_FLOAT64 = 8, 9, 10, 11, 12
_SCALAR_FORMATS: dict[int, str] = {
    T_UINT8: "<B", T_INT8: "<b", T_UINT16: "<H", T_INT16: "<h",
    T_UINT32: "<I", T_INT32: "<i", T_FLOAT32: "<f", T_BOOL: "<?",
    T_UINT64: "<Q", T_INT64: "<q", T_FLOAT64: "<d",
}
_SCALAR_STRUCTS = {t: struct.Struct(f) for t, f in _SCALAR_FORMATS.items()}
_TYPE_NAMES = {
    T_UINT8: "uint8", T_INT8: "int8", T_UINT16: "uint16", T_INT16: "int16",
    T_UINT32: "uint32", T_INT32: "int32", T_FLOAT32: "float32", T_BOOL: "bool",
    T_STRING: "string", T_ARRAY: "array", T_UINT64: "uint64", T_INT64: "int64",
    T_FLOAT64: "float64",
}

# Arrays longer than this are summarised (type and count) instead of decoded.
MAX_DECODED_ARRAY = 4096
MAX_DECODED_STRING_ARRAY = 64
# A key or a tensor name longer than this is malformed (ggml has GGML_MAX_NAME = 64 for tensors).
MAX_KEY_BYTES = 65536
MAX_TENSOR_NAME_BYTES = 4096

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")


class ByteSource(Protocol):
    """Random access to a file's bytes; ``fetch`` returns at most ``size - offset`` bytes."""

    @property
    def name(self) -> str: ...

    @property
    def size(self) -> int: ...

    def fetch(self, offset: int, length: int) -> bytes | memoryview: ...


@dataclass(frozen=True)
class ArraySummary:
    """A long array kept as its element type and length only."""

    element_type: str
    count: int

    def to_json(self) -> dict[str, object]:
        return {"type": "array", "element_type": self.element_type, "count": self.count}


@dataclass(frozen=True)
class RawTensor:
    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int


@dataclass
class GGUFHeader:
    """The parsed header of one file (one shard)."""

    version: int
    metadata: dict[str, object]
    tensors: list[RawTensor]
    alignment: int
    data_offset: int
    """Absolute offset where tensor data begins (header size padded to the alignment)."""
    file_size: int
    source_name: str
    bytes_read: int = 0
    array_lengths: dict[str, int] = field(default_factory=dict)


class _Cursor:
    """Bounds-checked reads over a source that may grow (remote) or is whole (local)."""

    def __init__(self, source: ByteSource, initial: int) -> None:
        self.source = source
        self.size = source.size
        first = source.fetch(0, min(initial, self.size))
        self.buf: bytes | memoryview = first
        self.avail = len(first)
        self.off = 0

    def grow(self, end: int) -> None:
        """Make bytes up to ``end`` available, or raise TruncatedError."""
        if end <= self.avail:
            return
        if end > self.size:
            raise TruncatedError(
                f"header needs {end} bytes but the file has {self.size}",
                offset=self.off, source=self.source.name,
            )
        # Growing windows: at least double, so a remote header costs O(log n) requests.
        want = min(self.size, max(end, 2 * self.avail))
        more = self.source.fetch(self.avail, want - self.avail)
        if len(more) != want - self.avail:
            raise TruncatedError("short read", offset=self.avail, source=self.source.name)
        self.buf = bytes(self.buf) + bytes(more)
        self.avail = want

    def take(self, n: int) -> bytes:
        end = self.off + n
        if end > self.avail:
            self.grow(end)
        b = bytes(self.buf[self.off:end])
        self.off = end
        return b

    def unpack(self, st: struct.Struct) -> tuple:  # type: ignore[type-arg]
        end = self.off + st.size
        if end > self.avail:
            self.grow(end)
        v = st.unpack_from(self.buf, self.off)
        self.off = end
        return v

    def u32(self) -> int:
        return int(self.unpack(_U32)[0])

    def u64(self) -> int:
        return int(self.unpack(_U64)[0])

    def remaining(self) -> int:
        return self.size - self.off

    def string(self, what: str, limit: int | None = None) -> str:
        start = self.off
        n = self.u64()
        if n > self.remaining():
            raise TruncatedError(f"{what} length {n} runs past the end of the file", offset=start, source=self.source.name)
        if limit is not None and n > limit:
            raise MalformedError(f"{what} length {n} exceeds {limit}", offset=start, source=self.source.name)
        raw = self.take(n)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise MalformedError(f"{what} is not valid UTF-8", offset=start, source=self.source.name) from exc

    def skip_strings(self, count: int) -> None:
        """Walk ``count`` length-prefixed strings without decoding them."""
        unpack = _U64.unpack_from
        off = self.off
        i = 0
        while i < count:
            if off + 8 > self.avail:
                self.grow(off + 8)
            buf = self.buf
            limit = self.avail - 8
            # The hot loop of the probe: 262,144 iterations for a Gemma vocabulary.
            while i < count and off <= limit:
                off += 8 + unpack(buf, off)[0]
                i += 1
        if off > self.avail:
            self.grow(off)
        self.off = off


def parse_header(
    source: ByteSource,
    *,
    initial_bytes: int = 1 << 20,
    keep_array: Callable[[str], bool] | None = None,
) -> GGUFHeader:
    """Parse the header of one GGUF file.

    ``keep_array(key)`` may force a long array to be decoded in full (used
    for per-layer arrays, which are short anyway).
    """
    name = source.name
    try:
        return _parse(source, name, initial_bytes, keep_array)
    except ProbeError:
        raise
    except (struct.error, ValueError, OverflowError, MemoryError) as exc:  # pragma: no cover - defensive
        raise MalformedError(f"unreadable header ({type(exc).__name__}: {exc})", source=name) from exc


def _parse(source: ByteSource, name: str, initial: int, keep_array: Callable[[str], bool] | None) -> GGUFHeader:
    if source.size < 4:
        raise TruncatedError("file is shorter than the GGUF magic", offset=0, source=name)
    cur = _Cursor(source, initial)
    magic = cur.take(4)
    if magic != GGUF_MAGIC:
        raise NotGGUFError(f"bad magic {magic!r}, expected b'GGUF'", offset=0, source=name)
    version = cur.u32()
    if version == 1:
        raise UnsupportedVersionError("GGUF version 1 is not supported", offset=4, source=name)
    if version not in (2, 3):
        raise UnsupportedVersionError(f"unsupported GGUF version {version}", offset=4, source=name)
    off_counts = cur.off
    n_tensors = int(cur.unpack(_I64)[0])
    n_kv = int(cur.unpack(_I64)[0])
    # Each KV needs at least 8 (key length) + 4 (type) + 1 bytes; each tensor info at least 8+4+8+4+8.
    if n_tensors < 0 or n_tensors * 32 > cur.remaining():
        raise MalformedError(f"tensor count {n_tensors} cannot fit in the file", offset=off_counts, source=name)
    if n_kv < 0 or n_kv * 13 > cur.remaining():
        raise MalformedError(f"key/value count {n_kv} cannot fit in the file", offset=off_counts + 8, source=name)

    metadata: dict[str, object] = {}
    array_lengths: dict[str, int] = {}
    for _ in range(n_kv):
        key_off = cur.off
        key = cur.string("key", MAX_KEY_BYTES)
        if key in metadata:
            raise MalformedError(f"duplicate key {key!r}", offset=key_off, source=name)
        vtype_off = cur.off
        vtype = cur.u32()
        if vtype == T_ARRAY:
            etype_off = cur.off
            etype = cur.u32()
            count_off = cur.off
            count = int(cur.unpack(_I64)[0])
            if etype == T_ARRAY:
                raise MalformedError(f"nested array in key {key!r}", offset=etype_off, source=name)
            if etype not in _TYPE_NAMES:
                raise MalformedError(f"unknown array element type {etype} in key {key!r}", offset=etype_off, source=name)
            elem_min = 8 if etype == T_STRING else _SCALAR_STRUCTS[etype].size
            if count < 0 or count * elem_min > cur.remaining():
                raise MalformedError(
                    f"array {key!r} of {count} elements cannot fit in the file", offset=count_off, source=name
                )
            array_lengths[key] = count
            force = keep_array is not None and keep_array(key)
            if etype == T_STRING:
                if count <= MAX_DECODED_STRING_ARRAY or force:
                    metadata[key] = [cur.string(f"element of {key!r}") for _ in range(count)]
                else:
                    cur.skip_strings(count)
                    metadata[key] = ArraySummary("string", count)
            else:
                st = _SCALAR_STRUCTS[etype]
                nbytes = count * st.size
                if count <= MAX_DECODED_ARRAY or force:
                    raw = cur.take(nbytes)
                    values = list(struct.unpack(f"<{count}{_SCALAR_FORMATS[etype][1]}", raw))
                    metadata[key] = values
                else:
                    cur.grow(cur.off + nbytes)
                    cur.off += nbytes
                    metadata[key] = ArraySummary(_TYPE_NAMES[etype], count)
        elif vtype == T_STRING:
            metadata[key] = cur.string(f"value of {key!r}")
        elif vtype in _SCALAR_STRUCTS:
            metadata[key] = cur.unpack(_SCALAR_STRUCTS[vtype])[0]
        else:
            raise MalformedError(f"unknown value type {vtype} for key {key!r}", offset=vtype_off, source=name)

    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in metadata:
        a = metadata["general.alignment"]
        if not isinstance(a, int) or isinstance(a, bool) or a <= 0 or a & (a - 1):
            raise MalformedError(f"general.alignment {a!r} is not a power of two", source=name)
        alignment = a

    tensors: list[RawTensor] = []
    seen: set[str] = set()
    for _ in range(n_tensors):
        t_off = cur.off
        tname = cur.string("tensor name", MAX_TENSOR_NAME_BYTES)
        if tname in seen:
            raise MalformedError(f"duplicate tensor {tname!r}", offset=t_off, source=name)
        seen.add(tname)
        dims_off = cur.off
        n_dims = cur.u32()
        if n_dims == 0 or n_dims > MAX_DIMS:
            raise MalformedError(f"tensor {tname!r} has {n_dims} dimensions (1..{MAX_DIMS})", offset=dims_off, source=name)
        shape = struct.unpack(f"<{n_dims}q", cur.take(8 * n_dims))
        if any(d < 0 for d in shape):
            raise MalformedError(f"tensor {tname!r} has a negative dimension {shape}", offset=dims_off, source=name)
        type_off = cur.off
        ggml_type = cur.u32()
        offset = cur.u64()
        if offset % alignment:
            raise MalformedError(
                f"tensor {tname!r} data offset {offset} is not a multiple of the alignment {alignment}",
                offset=type_off + 4, source=name,
            )
        tensors.append(RawTensor(tname, tuple(shape), ggml_type, offset))

    header_end = cur.off
    data_offset = (header_end + alignment - 1) // alignment * alignment
    return GGUFHeader(
        version=version,
        metadata=metadata,
        tensors=tensors,
        alignment=alignment,
        data_offset=data_offset,
        file_size=source.size,
        source_name=name,
        bytes_read=cur.avail,
        array_lengths=array_lengths,
    )
