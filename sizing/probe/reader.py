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

Two kinds of source are read the same way: a whole buffer (a local file's
mmap, bytes in memory: ``source.view()``) or a source fetched in growing
windows (HTTP range requests), where every window is sized from a lower
bound of the bytes still needed, so a remote probe fetches little more than
the header.
"""

from __future__ import annotations

import functools
import re
import struct
from dataclasses import dataclass, field
from itertools import repeat
from typing import Callable, Protocol

from ..errors import MalformedError, NotGGUFError, ProbeError, TruncatedError, UnsupportedVersionError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
INT64_MAX = (1 << 63) - 1

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
# A per-layer array has at most LLAMA_MAX_LAYERS = 512 entries, well below it.
MAX_DECODED_ARRAY = 4096
MAX_DECODED_STRING_ARRAY = 64
# A key or a tensor name longer than this is malformed (ggml has GGML_MAX_NAME = 64 for tensors).
MAX_KEY_BYTES = 65536
MAX_TENSOR_NAME_BYTES = 4096
# Smallest window fetched from a windowed source, and the growth floor (1/16 of what
# is held), which bounds a remote probe's overshoot to about 6 % of the header.
MIN_WINDOW_BYTES = 64 * 1024

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")

# The C-speed path of the string walk: a block of strings shorter than 256 bytes
# (length prefix ``L 0 0 0 0 0 0 0``, then L bytes) matched by one regex. Every
# branch starts with a distinct literal byte (sre skips a non-matching branch on
# it), the repeat is possessive (no backtracking state), and the count is exact,
# so a match is exactly _RX_BLOCK well-formed strings inside the buffer.
_RX_BLOCK = 1024


@functools.lru_cache(maxsize=1)
def _short_strings_rx() -> re.Pattern[bytes]:
    # Compiled on first use (about 10 ms), so small headers never pay for it.
    branches = (re.escape(bytes([n])) + rb"\x00{7}" + (b".{%d}" % n if n else b"") for n in range(256))
    return re.compile(b"(?:" + b"|".join(branches) + b"){%d}+" % _RX_BLOCK, re.DOTALL)


_KV_MIN_BYTES = 8 + 4 + 1  # key length, value type, smallest value
_TENSOR_MIN_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset


class ByteSource(Protocol):
    """Random access to a file's bytes; ``fetch`` returns at most ``size - offset`` bytes.

    A source may also offer ``view()``: the whole file as one buffer (bytes or
    mmap), which the reader then walks without copying.
    """

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
    """Offset of the data, relative to the data section."""
    info_offset: int = 0
    """Absolute offset of this tensor's entry in the tensor table (for error messages)."""


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
    """Bytes the reader obtained from its source (a windowed source: bytes fetched)."""
    array_lengths: dict[str, int] = field(default_factory=dict)
    key_offsets: dict[str, int] = field(default_factory=dict)
    """Absolute offset of each key's entry, so later checks can say where."""
    header_bytes: int = 0
    """Bytes of the header proper (before the alignment padding)."""


class _Cursor:
    """Reads over a whole buffer (local) or a buffer that grows on demand (remote)."""

    def __init__(self, source: ByteSource, initial: int) -> None:
        self.source = source
        self.name = source.name
        self.size = source.size
        view = getattr(source, "view", None)
        whole = view() if view is not None else None
        if whole is not None:
            self.buf: bytes | bytearray | memoryview = whole
            self.avail = self.size
        else:
            first = bytes(source.fetch(0, min(max(initial, 1), self.size)))
            self.buf = bytearray(first)
            self.avail = len(first)
        self.off = 0

    def grow(self, end: int, ahead: int = 0) -> None:
        """Make bytes up to ``end`` available, or raise TruncatedError.

        ``ahead`` is a lower bound of the bytes the caller will need past
        ``end``; fetching them now saves round trips and wastes nothing.
        """
        if end <= self.avail:
            return
        if end > self.size:
            raise TruncatedError(
                f"header needs {end} bytes but the file has {self.size}", offset=self.off, source=self.name
            )
        want = min(self.size, max(end + ahead, self.avail + MIN_WINDOW_BYTES, self.avail + self.avail // 16))
        more = self.source.fetch(self.avail, want - self.avail)
        if len(more) != want - self.avail:
            raise TruncatedError("short read", offset=self.avail, source=self.name)
        assert isinstance(self.buf, bytearray)
        self.buf += more
        self.avail = want

    def take(self, n: int) -> bytes:
        end = self.off + n
        if end > self.avail:
            self.grow(end)
        b = bytes(self.buf[self.off : end])
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
            raise TruncatedError(f"{what} length {n} runs past the end of the file", offset=start, source=self.name)
        if limit is not None and n > limit:
            raise MalformedError(f"{what} length {n} exceeds {limit}", offset=start, source=self.name)
        raw = self.take(n)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise MalformedError(f"{what} is not valid UTF-8", offset=start, source=self.name) from exc

    def skip(self, n: int) -> None:
        """Skip ``n`` bytes the caller has checked fit in the file."""
        self.grow(self.off + n)
        self.off += n

    def skip_strings(self, count: int, what: str) -> None:
        """Walk ``count`` length-prefixed strings without decoding them.

        The hot loop of the probe: 262,144 iterations for a Gemma vocabulary.
        Three tiers: blocks of 1024 short strings matched by one regex (C
        speed); where a block holds a long string or crosses the buffer's end,
        Python walks it eight strings per iteration with no bounds check at
        all (``unpack_from`` raises past the buffer's end, a huge length
        overflows); the eight that raised are walked again with checks, which
        also grows a windowed buffer and locates a bad length exactly.
        """
        unpack = _U64.unpack_from
        rx = _short_strings_rx().match if count >= _RX_BLOCK else None
        size = self.size
        off = self.off
        left = count
        while left:
            buf = self.buf
            while rx is not None and left >= _RX_BLOCK:
                m = rx(buf, off)
                if m is None:
                    break
                off = m.end()
                left -= _RX_BLOCK
            if not left:
                break
            blocks = min(left, _RX_BLOCK) >> 3
            k = 0
            try:
                for k in range(blocks):  # noqa: B007 - k is read after an exception
                    o = off
                    o += 8 + unpack(buf, o)[0]
                    o += 8 + unpack(buf, o)[0]
                    o += 8 + unpack(buf, o)[0]
                    o += 8 + unpack(buf, o)[0]
                    o += 8 + unpack(buf, o)[0]
                    o += 8 + unpack(buf, o)[0]
                    o += 8 + unpack(buf, o)[0]
                    o += 8 + unpack(buf, o)[0]
                    if o > size:
                        break  # a length runs past the end: find which, with checks
                    off = o
                else:
                    k = blocks
            except (struct.error, OverflowError):
                pass
            left -= 8 * k
            # Checked steps: the block that raised, or the last < 8 strings.
            for _ in repeat(None, min(left, 8)):
                start = off
                if off + 8 > self.avail:
                    self.off = off
                    self.grow(off + 8, ahead=8 * (left - 1))
                off += 8 + unpack(self.buf, off)[0]
                if off > size:
                    raise TruncatedError(
                        f"element {count - left} of {what}: string runs past the end of the file",
                        offset=start, source=self.name,
                    )
                left -= 1
        if off > self.avail:
            self.off = off
            self.grow(off)
        self.off = off


def parse_header(
    source: ByteSource,
    *,
    initial_bytes: int = MIN_WINDOW_BYTES,
    keep_array: Callable[[str], bool] | None = None,
) -> GGUFHeader:
    """Parse the header of one GGUF file.

    ``keep_array(key)`` may force a string array of up to ``MAX_DECODED_ARRAY``
    entries to be decoded (scalar arrays that short always are).
    ``initial_bytes`` is the first window of a windowed source.
    """
    name = source.name
    try:
        return _parse(source, name, initial_bytes, keep_array)
    except ProbeError:
        raise
    except (struct.error, ValueError, OverflowError, MemoryError, IndexError) as exc:  # pragma: no cover - defensive
        raise MalformedError(f"unreadable header ({type(exc).__name__}: {exc})", source=name) from exc


def _parse(source: ByteSource, name: str, initial: int, keep_array: Callable[[str], bool] | None) -> GGUFHeader:
    if source.size < 4:
        raise TruncatedError(f"file of {source.size} bytes is shorter than the GGUF magic", offset=0, source=name)
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
    if n_tensors < 0 or n_tensors * _TENSOR_MIN_BYTES > cur.remaining():
        raise MalformedError(f"tensor count {n_tensors} cannot fit in the file", offset=off_counts, source=name)
    if n_kv < 0 or n_kv * _KV_MIN_BYTES + n_tensors * _TENSOR_MIN_BYTES > cur.remaining():
        raise MalformedError(f"key/value count {n_kv} cannot fit in the file", offset=off_counts + 8, source=name)

    metadata: dict[str, object] = {}
    array_lengths: dict[str, int] = {}
    key_offsets: dict[str, int] = {}
    for _ in range(n_kv):
        key_off = cur.off
        key = cur.string("key", MAX_KEY_BYTES)
        if key in metadata:
            raise MalformedError(f"duplicate key {key!r}", offset=key_off, source=name)
        key_offsets[key] = key_off
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
            if etype == T_STRING:
                force = count <= MAX_DECODED_ARRAY and keep_array is not None and keep_array(key)
                if count <= MAX_DECODED_STRING_ARRAY or force:
                    metadata[key] = [cur.string(f"element {i} of {key!r}") for i in range(count)]
                else:
                    cur.skip_strings(count, repr(key))
                    metadata[key] = ArraySummary("string", count)
            else:
                st = _SCALAR_STRUCTS[etype]
                nbytes = count * st.size
                if count <= MAX_DECODED_ARRAY:
                    raw = cur.take(nbytes)
                    metadata[key] = list(struct.unpack(f"<{count}{_SCALAR_FORMATS[etype][1]}", raw))
                else:
                    cur.skip(nbytes)
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
            raise MalformedError(
                f"general.alignment {a!r} is not a power of two", offset=key_offsets["general.alignment"], source=name
            )
        alignment = a

    tensors: list[RawTensor] = []
    seen: set[str] = set()
    for i in range(n_tensors):
        t_off = cur.off
        # Every remaining entry needs at least _TENSOR_MIN_BYTES: fetch them in one window.
        cur.grow(t_off + _TENSOR_MIN_BYTES, ahead=(n_tensors - i - 1) * _TENSOR_MIN_BYTES)
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
        n_elements = 1
        for d in shape:
            n_elements *= d
        if n_elements > INT64_MAX:
            # ggml: "total number of elements in tensor ... would overflow int64_t"
            raise MalformedError(f"tensor {tname!r} shape {shape} overflows int64", offset=dims_off, source=name)
        type_off = cur.off
        ggml_type = cur.u32()
        offset = cur.u64()
        if offset % alignment:
            raise MalformedError(
                f"tensor {tname!r} data offset {offset} is not a multiple of the alignment {alignment}",
                offset=type_off + 4, source=name,
            )
        tensors.append(RawTensor(tname, tuple(shape), ggml_type, offset, t_off))

    header_end = cur.off
    data_offset = (header_end + alignment - 1) // alignment * alignment
    if data_offset > source.size and tensors:
        raise TruncatedError(
            f"data section starts at {data_offset}, past the file's {source.size} bytes", offset=header_end, source=name
        )
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
        key_offsets=key_offsets,
        header_bytes=header_end,
    )
