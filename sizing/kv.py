"""KV cache bytes, as llama.cpp allocates them.

Mirrors ``llama_kv_cache`` (``src/llama-kv-cache.cpp``) and
``llama_kv_cache_iswa`` (``src/llama-kv-cache-iswa.cpp``), llama.cpp vendored
by llama-cpp-python 0.3.36: per layer, K = row(type_k, n_embd_head_k *
n_head_kv) and V = row(type_v, n_embd_head_v * n_head_kv) per cell, times
cells, times streams.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from .config import ContextConfig, pad
from .errors import ConfigError
from .ggml import cache_type
from .spec import LayerSpec, ModelSpec


@dataclass(frozen=True)
class KvCells:
    """Cells per stream of the full-attention cache and of the sliding-window cache."""

    full: int
    swa: int


def kv_cells(spec: ModelSpec, cfg: ContextConfig) -> KvCells:
    """Cells per stream: n_ctx_seq for full layers; the SWA window (+ n_ubatch) for sliding ones."""
    full = cfg.n_ctx_seq
    swa = 0
    if spec.swa_layer_count:
        if cfg.swa_full:
            swa = full
        else:
            n_seq = cfg.n_seq_max if cfg.kv_unified else 1
            swa = pad(min(full, spec.n_swa * n_seq + cfg.n_ubatch_effective))
    return KvCells(full=full, swa=swa)


def _kv_layers(spec: ModelSpec) -> list[LayerSpec]:
    return [layer for layer in spec.layers[: spec.n_layer] if layer.has_kv]


def _layer_widths(spec: ModelSpec, layer: LayerSpec, flash: bool) -> tuple[int, int]:
    """Elements per cell of K and V for one layer."""
    if spec.mla is not None:
        # MLA caches the compressed latent (key_length = kv_lora_rank + rope dims, one KV head)
        # as K only; V is a view of it (llama_kv_cache with is_mla).
        return layer.n_embd_head_k * layer.n_head_kv, 0
    k = layer.n_embd_head_k * layer.n_head_kv
    v = layer.n_embd_head_v * layer.n_head_kv
    if not flash:
        # Without flash attention V is stored transposed and padded to the widest layer.
        v = max(l.n_embd_head_v * l.n_head_kv for l in _kv_layers(spec))
    return k, v


def check_cache_types(spec: ModelSpec, cfg: ContextConfig) -> None:
    """Refuse cache types whose block size does not divide a head size (llama.cpp refuses them too)."""
    tk, tv = cache_type(cfg.type_k), cache_type(cfg.type_v)
    for layer in _kv_layers(spec):
        if layer.n_embd_head_k % tk.block_size:
            raise ConfigError(
                f"K cache type {tk.name} with block size {tk.block_size} does not divide "
                f"n_embd_head_k={layer.n_embd_head_k} (layer {layer.index})"
            )
        if layer.n_embd_head_v % tv.block_size:
            raise ConfigError(
                f"V cache type {tv.name} with block size {tv.block_size} does not divide "
                f"n_embd_head_v={layer.n_embd_head_v} (layer {layer.index})"
            )


def kv_bytes_per_cell(spec: ModelSpec, cfg: ContextConfig, flash: bool, layers: Iterable[int] | None = None) -> tuple[int, int]:
    """Bytes per cell of (full-attention layers, sliding layers), over ``layers`` (default: all)."""
    tk, tv = cache_type(cfg.type_k), cache_type(cfg.type_v)
    wanted = None if layers is None else set(layers)
    full = swa = 0
    for layer in _kv_layers(spec):
        if wanted is not None and layer.index not in wanted:
            continue
        k, v = _layer_widths(spec, layer, flash)
        b = tk.row_bytes(k) + (tv.row_bytes(v) if v else 0)
        if layer.is_swa:
            swa += b
        else:
            full += b
    return full, swa


def kv_bytes(spec: ModelSpec, cfg: ContextConfig, flash: bool, layers: Iterable[int] | None = None) -> int:
    """Total KV cache bytes (all streams) for ``layers`` (default: every layer with KV)."""
    cells = kv_cells(spec, cfg)
    full, swa = kv_bytes_per_cell(spec, cfg, flash, layers)
    return (full * cells.full + swa * cells.swa) * cfg.n_stream


def kv_bytes_per_token(spec: ModelSpec, type_k: str = "f16", type_v: str = "f16") -> int:
    """Bytes one more token of context costs over every full-attention layer (Eq. 4 of the first source)."""
    full, _ = kv_bytes_per_cell(spec, ContextConfig(n_ctx=256, type_k=type_k, type_v=type_v), flash=True)
    return full
