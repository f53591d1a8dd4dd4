"""KV cache bytes, as llama.cpp allocates them.

Mirrors ``llama_kv_cache::llama_kv_cache`` (``src/llama-kv-cache.cpp``),
``llama_kv_cache_iswa::llama_kv_cache_iswa`` (``src/llama-kv-cache-iswa.cpp``)
and ``llama_memory_recurrent`` (``src/llama-memory-recurrent.cpp``) of the
llama.cpp vendored by llama-cpp-python 0.3.36:

- per layer with KV, one K tensor ``[n_embd_k_gqa(il), kv_size, n_stream]`` of
  type_k and one V tensor ``[n_embd_v_gqa, kv_size, n_stream]`` of type_v, each
  row ``ggml_row_size`` bytes;
- without flash attention V is stored transposed (``v_trans``) and every
  layer's V is as wide as the widest (``n_embd_v_gqa_max``);
- MLA (``hparams.is_mla()``) keeps K only (the compressed latent);
- the sliding-window cache of an iSWA model holds
  ``GGML_PAD(min(kv_size, n_swa * (unified ? n_seq_max : 1) + n_ubatch), 256)``
  cells unless ``swa_full``;
- recurrent layers keep a fixed F32 state per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from .context import ContextConfig, pad
from ..errors import ConfigError
from ..model.ggml import CacheType, cache_type
from ..model.spec import LayerSpec, ModelSpec

F32 = 4


@dataclass(frozen=True)
class KvCells:
    """Cells per stream of the full-attention cache and of the sliding-window cache (0: none)."""

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


def kv_layers(spec: ModelSpec) -> list[LayerSpec]:
    """Layers whose K/V ``llama_kv_cache`` allocates: it walks every block (``n_layer_all``) and keeps those
    with ``hparams.has_kv`` that ``create_memory``'s filter lets through (``LayerSpec.has_kv``, set by the
    probe from ``sizing.model.arch``; a spec built by hand counts its main layers with KV heads)."""
    return [l for l in spec.layers if l.has_kv and (l.attention is not None or l.index < spec.n_layer)]


def _v_width_max(spec: ModelSpec) -> int:
    """``hparams.n_embd_v_gqa_max()``: the widest V over every block, cached or not."""
    return max((l.n_embd_head_v * l.n_head_kv for l in spec.layers), default=0)


def layer_widths(spec: ModelSpec, layer: LayerSpec, flash: bool) -> tuple[int, int]:
    """Elements per cell of K and V for one layer (V is 0 for MLA)."""
    k = layer.n_embd_head_k * layer.n_head_kv
    if spec.mla is not None:
        # MLA caches the compressed latent (key_length = kv_lora_rank + rope dims, one KV head)
        # as K only; V is a view of it (has_v = !is_mla).
        return k, 0
    v = layer.n_embd_head_v * layer.n_head_kv
    if not flash:
        v = _v_width_max(spec)
    return k, v


def check_cache_types(spec: ModelSpec, cfg: ContextConfig, flash: bool = True) -> None:
    """Refuse what ``llama_init_from_model`` refuses about cache types (src/llama-context.cpp).

    With flash attention on, a quantized type's block size must divide every
    head size; MLA models need type_k == type_v.
    """
    tk, tv = cache_type(cfg.type_k), cache_type(cfg.type_v)
    if spec.mla is not None and tk.name != tv.name:
        raise ConfigError(
            f"model uses MLA and does not support different K ({tk.name}) and V ({tv.name}) cache types"
        )
    if not flash:
        return
    for layer in spec.layers[: spec.n_layer]:
        if tk.quantized and layer.n_embd_head_k and layer.n_embd_head_k % tk.block_size:
            raise ConfigError(
                f"K cache type {tk.name} with block size {tk.block_size} does not divide "
                f"n_embd_head_k={layer.n_embd_head_k} (layer {layer.index})"
            )
        if tv.quantized and layer.n_embd_head_v and layer.n_embd_head_v % tv.block_size:
            raise ConfigError(
                f"V cache type {tv.name} with block size {tv.block_size} does not divide "
                f"n_embd_head_v={layer.n_embd_head_v} (layer {layer.index})"
            )


def _row(t: CacheType, n: int) -> int:
    return t.row_bytes(n) if n else 0


def _cell_bytes(spec: ModelSpec, type_k: str, type_v: str, flash: bool) -> tuple[tuple[int, int, bool], ...]:
    """(layer index, bytes per cell and stream, sliding) of every cached layer; memoized on the spec (a value)."""
    memo: dict[tuple[str, str, bool], tuple[tuple[int, int, bool], ...]] = spec.__dict__.setdefault("_kv_cell_memo", {})
    key = (type_k, type_v, flash)
    got = memo.get(key)
    if got is None:
        tk, tv = cache_type(type_k), cache_type(type_v)
        out = []
        for layer in kv_layers(spec):
            k, v = layer_widths(spec, layer, flash)
            out.append((layer.index, _row(tk, k) + _row(tv, v), layer.is_swa))
        got = memo[key] = tuple(out)
    return got


def kv_bytes_per_cell(
    spec: ModelSpec, cfg: ContextConfig, flash: bool, layers: Iterable[int] | None = None
) -> tuple[int, int]:
    """Bytes per cell and stream of (full-attention layers, sliding layers), over ``layers`` (default: all)."""
    wanted = None if layers is None else set(layers)
    full = swa = 0
    for index, b, is_swa in _cell_bytes(spec, cfg.type_k, cfg.type_v, flash):
        if wanted is not None and index not in wanted:
            continue
        if is_swa:
            swa += b
        else:
            full += b
    return full, swa


def kv_split_bytes(
    spec: ModelSpec, cfg: ContextConfig, flash: bool, layers: Iterable[int] | None = None
) -> tuple[int, int]:
    """(full-attention cache, sliding-window cache) bytes, all streams."""
    cells = kv_cells(spec, cfg)
    full, swa = kv_bytes_per_cell(spec, cfg, flash, layers)
    return full * cells.full * cfg.n_stream, swa * cells.swa * cfg.n_stream


def state_layers(spec: ModelSpec, layers: Iterable[int] | None = None) -> list[LayerSpec]:
    """Blocks whose recurrent state ``llama_memory_recurrent`` allocates (it walks the ``n_layer`` main blocks)."""
    wanted = None if layers is None else set(layers)
    return [l for l in spec.layers[: spec.n_layer] if l.has_state and (wanted is None or l.index in wanted)]


def state_bytes_per_layer(spec: ModelSpec, cfg: ContextConfig) -> int:
    """F32 r + s rows of one state layer: ``mem_size * (1 + n_rs_seq)`` rows with ``mem_size = max(1, n_seq_max)``
    and ``n_rs_seq = 0`` (no rollback snapshots; ``llama_context_default_params``)."""
    if spec.state is None:
        return 0
    rows = max(cfg.n_seq_max, 1)
    return F32 * (spec.state.n_embd_r + spec.state.n_embd_s) * rows


def recurrent_state_bytes(spec: ModelSpec, cfg: ContextConfig, layers: Iterable[int] | None = None) -> int:
    """Recurrent state (``llama_memory_recurrent``, src/llama-memory-recurrent.cpp): per state layer
    ``ggml_new_tensor_2d(F32, n_embd_r, rows)`` and ``(F32, n_embd_s, rows)`` (``llama_hparams::n_embd_r`` /
    ``n_embd_s``: Mamba conv + SSM, RWKV token shift + WKV, LFM2 short conv, KDA). Independent of n_ctx."""
    return state_bytes_per_layer(spec, cfg) * len(state_layers(spec, layers))


def kv_bytes(spec: ModelSpec, cfg: ContextConfig, flash: bool, layers: Iterable[int] | None = None) -> int:
    """Total KV cache bytes (all streams) plus recurrent state, for ``layers`` (default: every layer)."""
    full, swa = kv_split_bytes(spec, cfg, flash, layers)
    return full + swa + recurrent_state_bytes(spec, cfg, layers)


def kv_bytes_per_token(spec: ModelSpec, type_k: str = "f16", type_v: str = "f16") -> int:
    """Bytes one more token of context costs over every full-attention layer (flash attention on)."""
    full, _ = kv_bytes_per_cell(spec, ContextConfig(n_ctx=256, type_k=type_k, type_v=type_v), flash=True)
    return full
