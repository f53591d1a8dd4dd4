"""ggml type sizes needed by the pure core (KV cache types).

Mirrors ``ggml_type_traits`` (``ggml/src/ggml.c``): ``ggml_row_size(type, n)
= type_size * n / block_size``. The GGUF reader uses the ``gguf`` package's
full table for tensors; this small table keeps the core free of imports.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class CacheType:
    """A KV cache element type: name, block size (elements) and bytes per block."""

    name: str
    block_size: int
    type_size: int

    @property
    def quantized(self) -> bool:
        """True for block-quantized types, which need flash attention for V."""
        return self.block_size > 1

    def row_bytes(self, n_elements: int) -> int:
        """``ggml_row_size``: bytes of a row of ``n_elements`` (a multiple of the block size)."""
        return self.type_size * n_elements // self.block_size


CACHE_TYPES: dict[str, CacheType] = {
    t.name: t
    for t in (
        CacheType("f32", 1, 4),
        CacheType("f16", 1, 2),
        CacheType("bf16", 1, 2),
        CacheType("q8_0", 32, 34),
        CacheType("q5_1", 32, 24),
        CacheType("q5_0", 32, 22),
        CacheType("q4_1", 32, 20),
        CacheType("q4_0", 32, 18),
        CacheType("iq4_nl", 32, 18),
    )
}

# llama.cpp's ggml_type enum values for the cache types (ggml.h), as llama_context_params wants them.
GGML_TYPE_IDS: dict[str, int] = {
    "f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "iq4_nl": 20, "bf16": 30,
}


def cache_type(name: str) -> CacheType:
    """Look up a cache type by llama.cpp's name (``f16``, ``q8_0``, ...); a ``ConfigError`` names the choices."""
    try:
        return CACHE_TYPES[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown KV cache type {name!r}; one of {', '.join(CACHE_TYPES)}") from None
