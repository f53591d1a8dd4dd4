"""GGUF files assembled byte by byte: valid ones (``minimal_llama``) and the hostile variants the probe's tests and
its fuzzer (``bench/fuzz_probe.py``) derive from them by hand, where ``gguf.GGUFWriter`` would refuse."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Sequence


def gstr(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def kv_u32(key: str, v: int) -> bytes:
    return gstr(key) + struct.pack("<II", 4, v)


def kv_str(key: str, v: str) -> bytes:
    return gstr(key) + struct.pack("<I", 8) + gstr(v)


def kv_arr_u32(key: str, vs: Sequence[int]) -> bytes:
    return gstr(key) + struct.pack("<IIQ", 9, 4, len(vs)) + b"".join(struct.pack("<I", v) for v in vs)


def kv_arr_str(key: str, vs: Sequence[str]) -> bytes:
    return gstr(key) + struct.pack("<IIQ", 9, 8, len(vs)) + b"".join(gstr(v) for v in vs)


def tensor_info(name: str, shape: Sequence[int], ggml_type: int, offset: int) -> bytes:
    return gstr(name) + struct.pack("<I", len(shape)) + struct.pack(f"<{len(shape)}q", *shape) + struct.pack(
        "<IQ", ggml_type, offset
    )


@dataclass
class RawGGUF:
    """A GGUF assembled from parts; ``bytes()`` pads the header and appends the data."""

    kvs: list[bytes] = field(default_factory=list)
    tensors: list[bytes] = field(default_factory=list)
    data: bytes = b""
    version: int = 3
    n_kv: int | None = None
    n_tensors: int | None = None
    alignment: int = 32

    def header(self) -> bytes:
        n_kv = len(self.kvs) if self.n_kv is None else self.n_kv
        n_t = len(self.tensors) if self.n_tensors is None else self.n_tensors
        return b"GGUF" + struct.pack("<Iqq", self.version, n_t, n_kv) + b"".join(self.kvs) + b"".join(self.tensors)

    def __bytes__(self) -> bytes:
        h = self.header()
        pad = (-len(h)) % self.alignment
        return h + b"\0" * pad + self.data


def minimal_llama(n_layer: int = 2, *, extra_kvs: Sequence[bytes] = (), n_vocab: int = 3) -> RawGGUF:
    """A valid one-tensor-per-layer llama header with F32 data, built by hand."""
    kvs = [
        kv_str("general.architecture", "llama"),
        kv_u32("llama.context_length", 128),
        kv_u32("llama.embedding_length", 8),
        kv_u32("llama.block_count", n_layer),
        kv_u32("llama.attention.head_count", 2),
        kv_arr_str("tokenizer.ggml.tokens", [f"t{i}" for i in range(n_vocab)]),
        *extra_kvs,
    ]
    tensors = []
    off = 0
    for il in range(n_layer):
        tensors.append(tensor_info(f"blk.{il}.attn_norm.weight", [8], 0, off))
        off += 32
    tensors.append(tensor_info("token_embd.weight", [8, n_vocab], 0, off))
    off += 8 * n_vocab * 4
    return RawGGUF(kvs=kvs, tensors=tensors, data=b"\0" * off)
