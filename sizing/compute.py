"""Compute buffer bytes: a model of what llama.cpp's ``sched_reserve`` measures.

llama.cpp never computes the compute buffer in closed form: it builds the
worst-case graph (n_ubatch tokens against the full KV view) and lets
``ggml_gallocr`` measure the peak. The allocator reuses memory, so the peak is
the largest set of tensors alive together, not their sum. The two that
dominate are the logits (``4 * n_vocab * n_ubatch``, alive at the end of the
graph) and, without flash attention, the attention scores of one layer
(``4 * n_kv * n_ubatch * n_head`` plus the mask). See
``../shared/reference/llama-cpp-memory.md`` section 6.
"""

from __future__ import annotations

from .config import ContextConfig
from .kv import kv_cells
from .spec import ModelSpec

F32 = 4
F16 = 2


def _layer_n_kv(spec: ModelSpec, cfg: ContextConfig) -> tuple[int, int]:
    """KV cells an attention op sees in the reserve graph: (full layers, sliding layers)."""
    cells = kv_cells(spec, cfg)
    n_seq = cfg.n_seq_max if cfg.kv_unified else 1
    return cells.full * n_seq if cfg.kv_unified else cells.full, cells.swa


def logits_bytes(spec: ModelSpec, cfg: ContextConfig) -> int:
    """The output projection of the reserve graph: every token of the ubatch gets logits."""
    return F32 * spec.n_vocab * cfg.n_ubatch_effective


def attention_bytes(spec: ModelSpec, cfg: ContextConfig, flash: bool) -> int:
    """Peak of one attention block in the reserve graph."""
    n_ub = cfg.n_ubatch_effective
    full_kv, swa_kv = _layer_n_kv(spec, cfg)
    peak = 0
    for layer in spec.layers[: spec.n_layer]:
        if not layer.has_kv:
            continue
        n_kv = swa_kv if layer.is_swa else full_kv
        mask = F16 * n_kv * n_ub if flash else F32 * n_kv * n_ub
        if flash:
            scores = F32 * layer.n_embd_head_v * layer.n_head * n_ub
        else:
            scores = F32 * n_kv * n_ub * layer.n_head
        peak = max(peak, scores + mask)
    return peak


def activation_bytes(spec: ModelSpec, cfg: ContextConfig) -> int:
    """Hidden-state activations alive across a block (residual, norm, FFN intermediates)."""
    n_ub = cfg.n_ubatch_effective
    n_ff = int(spec.metadata.get(f"{spec.architecture}.feed_forward_length", 4 * spec.n_embd) or 0) \
        if isinstance(spec.metadata.get(f"{spec.architecture}.feed_forward_length", 0), int) else 4 * spec.n_embd
    return F32 * n_ub * (3 * spec.n_embd + 2 * n_ff)


def compute_bytes(spec: ModelSpec, cfg: ContextConfig, flash: bool) -> int:
    """Predicted compute buffer of the device that runs the graph's output."""
    return max(logits_bytes(spec, cfg), attention_bytes(spec, cfg, flash)) + activation_bytes(spec, cfg)


def host_compute_bytes(spec: ModelSpec, cfg: ContextConfig) -> int:
    """The host's compute buffer when the graph runs on a GPU: token embeddings for the ubatch."""
    return F32 * spec.n_embd * cfg.n_ubatch_effective
