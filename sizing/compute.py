"""Compute buffer bytes: a model of what llama.cpp's ``sched_reserve`` measures.

llama.cpp never computes the compute buffer in closed form:
``llama_context::sched_reserve`` (``src/llama-context.cpp``) builds the
worst-case graph (``n_tokens = min(n_ctx, n_ubatch)``, every token an output,
the whole KV view) and ``ggml_gallocr`` (``ggml/src/ggml-alloc.c``) measures
the peak of a best-fit allocator that frees each tensor after its last use.
The peak is the largest set of tensors alive together (plus fragmentation),
so this module models the graph's phases and takes the largest:

- **output**: the logits ``[n_vocab, n_ubatch]`` F32 (``llm_graph_context::build_inp_out_ids``
  keeps every token in the reserve graph) with the final norm's input and output;
- **attention without flash attention** (``llm_graph_context::build_attn_mha``):
  ``kq = mul_mat(k, q)`` F32 ``[n_kv, n_ubatch, n_head]`` (softmax in place), the
  F32 masks ``[n_kv, n_ubatch]`` (``build_attn_inp_kv``; an iSWA model keeps one per
  cache, both alive), plus Q/K/V and the residual stream;
- **attention with flash attention**: F16 masks and Q/K/V only (no n_kv x n_head term);
- **MoE**: the routed FFN intermediates ``[n_ff_exp, n_expert_used, n_ubatch]``.

The per-token coefficients (3 x n_embd + 2 x q + 2 x kv for the attention block;
one q fewer when K is quantized; one more q for Gemma's scaled query) were read
off CPU dry runs of eight model shapes (``tests/sizing/test_memory_vs_llama.py``).
What the allocator's layout adds on top (a live tensor below the logits) is covered
by three terms read off the measurements (iSWA + swa_full + quantized cache; attention
narrower than n_embd; MLA without FA) so that no case of the test matrix is
under-predicted by more than 5%; see ``docs/memory.md``.

CUDA-only terms, **unverifiable on a CPU build** and therefore separate
functions, not part of ``compute_bytes``: the F16 copies of a quantized K/V
that the CUDA flash-attention kernels make, the ``op_offload`` weight copies
under partial offload, and pipeline parallelism's extra input copies.
"""

from __future__ import annotations

from .config import ContextConfig
from .ggml import cache_type
from .kv import kv_cells, kv_layers
from .spec import ModelSpec

F32 = 4
F16 = 2

# Architectures whose attention block keeps one more query-sized tensor (Gemma's
# query_pre_attn_scalar scaling of Q, src/models/gemma2.cpp and gemma3.cpp).
_SCALED_Q_ARCHS = frozenset({"gemma2", "gemma3", "gemma3n", "gemma-embedding"})

PIPELINE_PARALLEL_COPIES = 4
"""``GGML_SCHED_MAX_COPIES``: input copies the scheduler keeps with pipeline parallelism."""


def _n_ff(spec: ModelSpec) -> int:
    v = spec.metadata.get(f"{spec.architecture}.feed_forward_length")
    if isinstance(v, list):
        v = max((int(x) for x in v if isinstance(x, int)), default=0)
    return v if isinstance(v, int) and not isinstance(v, bool) else 4 * spec.n_embd


def _n_ff_exp(spec: ModelSpec) -> int:
    v = spec.metadata.get(f"{spec.architecture}.expert_feed_forward_length")
    if isinstance(v, list):
        v = max((int(x) for x in v if isinstance(x, int)), default=0)
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def logits_bytes(spec: ModelSpec, cfg: ContextConfig) -> int:
    """The output projection of the reserve graph: every token of the ubatch gets F32 logits."""
    return F32 * spec.n_vocab * cfg.n_ubatch_effective


def mask_bytes(spec: ModelSpec, cfg: ContextConfig, flash: bool) -> int:
    """The KQ masks (``build_attn_inp_kv``): ``[n_kv, n_ubatch]`` per cache, F16 with flash attention, else F32.

    Graph inputs are allocated first (``ggml_gallocr_alloc_graph_impl``), at the
    bottom of the buffer, so everything allocated later sits above them.
    """
    layers = kv_layers(spec)
    if not layers:
        return 0
    cells = kv_cells(spec, cfg)
    n = 0
    if any(not l.is_swa for l in layers):
        n += cells.full
    if any(l.is_swa for l in layers):
        n += cells.swa
    return (F16 if flash else F32) * n * cfg.n_ubatch_effective


def output_phase_bytes(spec: ModelSpec, cfg: ContextConfig, flash: bool = True) -> int:
    """Logits plus the final norm's input and output (``result_norm``).

    For MLA the last layer's latent attention output (n_head x (kv_lora_rank +
    key_length_mla) + 2 x key_length per token) is still placed below the logits.
    """
    per_token = 2 * spec.n_embd
    layers = kv_layers(spec)
    if spec.mla is not None and layers:
        n_head = max(l.n_head for l in layers)
        k_len = max(l.n_embd_head_k for l in layers)
        per_token += n_head * (spec.mla.kv_lora_rank + spec.mla.n_embd_head_k_mla) + 2 * k_len
    extra = 0
    quantized = cache_type(cfg.type_k).quantized or cache_type(cfg.type_v).quantized
    if spec.swa_layer_count and cfg.swa_full and quantized:
        # Both masks cover n_ctx; with a quantized cache (the Hadamard rotation inputs and
        # copies change the layout) they sit below the logits (gemma-3-27b, 50000 tokens: +96.6 MiB).
        extra = mask_bytes(spec, cfg, flash)
    elif layers and not spec.swa_layer_count and spec.mla is None and not spec.n_expert and not cache_type(cfg.type_v).quantized:
        _, q, _ = _attn_dims(spec)
        if q != spec.n_embd:
            # Attention narrower than the residual stream (Mistral-Nemo: 32 x 128 = 4096 < 5120):
            # the n_embd-wide tensors of the last layer do not fit the freed attention holes and
            # the last FFN intermediate, one residual and the mask end up below the logits. Measured
            # on Mistral-Nemo only; a quantized V (its Hadamard rotation changes the layout) does not show it.
            extra = F32 * cfg.n_ubatch_effective * (_n_ff(spec) + spec.n_embd) + mask_bytes(spec, cfg, flash)
    return logits_bytes(spec, cfg) + F32 * cfg.n_ubatch_effective * per_token + extra


def _attn_dims(spec: ModelSpec) -> tuple[int, int, int]:
    """(max n_head, max q width, max k/v width) over layers with KV."""
    layers = kv_layers(spec)
    n_head = max((l.n_head for l in layers), default=0)
    q = max((l.n_head * l.n_embd_head_k for l in layers), default=0)
    kv = max((l.n_head_kv * l.n_embd_head_k for l in layers), default=0)
    return n_head, q, kv


def attention_phase_bytes(spec: ModelSpec, cfg: ContextConfig, flash: bool) -> int:
    """Peak of one attention block of the reserve graph (the largest layer kind)."""
    layers = kv_layers(spec)
    if not layers:
        return 0
    n_ub = cfg.n_ubatch_effective
    cells = kv_cells(spec, cfg)
    # Per stream, each attention op sees its stream's cells; kq has n_ub/n_stream rows per stream.
    n_kv_full, n_kv_swa = cells.full, cells.swa
    has_full = any(not l.is_swa for l in layers)
    has_swa = any(l.is_swa for l in layers)
    mask_elems = n_ub * ((n_kv_full if has_full else 0) + (n_kv_swa if has_swa else 0))
    if spec.mla is not None:
        # MLA (src/models/deepseek2.cpp, absorbed): the query is projected into the latent
        # (n_head x key_length), the output comes back as n_head x kv_lora_rank.
        n_head = max(l.n_head for l in layers)
        k_len = max(l.n_embd_head_k for l in layers)
        per_token = n_head * (2 * k_len + spec.mla.kv_lora_rank + spec.mla.n_embd_head_k_mla)
    else:
        n_head, q, kv = _attn_dims(spec)
        q_copies = 2 if not cache_type(cfg.type_k).quantized else 1
        if spec.architecture in _SCALED_Q_ARCHS:
            q_copies += 1
        per_token = 3 * spec.n_embd + q_copies * q + 2 * kv
    if flash:
        return F16 * mask_elems + F32 * n_ub * per_token
    n_kv = max((n_kv_swa if l.is_swa else n_kv_full) for l in layers)
    kq = F32 * n_kv * n_ub * n_head
    masks = F32 * mask_elems
    if spec.mla is not None:
        # DeepSeek-V2-Lite without FA at 50000 tokens, 4 streams: a second mask-sized block
        # sits below kq (523.77 MiB measured against 474.50 without it).
        masks *= 2
    return kq + masks + F32 * n_ub * per_token


def moe_phase_bytes(spec: ModelSpec, cfg: ContextConfig) -> int:
    """Routed experts (``llm_graph_context::build_moe_ffn``): gate/up/act intermediates per used expert."""
    if not spec.n_expert or not spec.n_expert_used:
        return 0
    n_ub = cfg.n_ubatch_effective
    f = _n_ff_exp(spec) or _n_ff(spec)
    return F32 * n_ub * (3 * f * spec.n_expert_used + 2 * spec.n_expert + 3 * spec.n_embd)


def ffn_phase_bytes(spec: ModelSpec, cfg: ContextConfig) -> int:
    """A dense FFN block: gate, up and their product, with the residual stream."""
    return F32 * cfg.n_ubatch_effective * (3 * _n_ff(spec) + 2 * spec.n_embd)


def compute_bytes(spec: ModelSpec, cfg: ContextConfig, flash: bool) -> int:
    """Predicted compute buffer of the device that runs the whole graph (CPU: what ``sched_reserve`` logs)."""
    return max(
        output_phase_bytes(spec, cfg, flash),
        attention_phase_bytes(spec, cfg, flash),
        moe_phase_bytes(spec, cfg),
        ffn_phase_bytes(spec, cfg),
    )


def host_compute_bytes(spec: ModelSpec, cfg: ContextConfig) -> int:
    """The host's compute buffer when the graph runs on a GPU: token embeddings for the ubatch."""
    return F32 * spec.n_embd * cfg.n_ubatch_effective


# ---- CUDA-specific terms (documented; a CPU build cannot measure them) -------------------------


def cuda_fa_dequant_bytes(spec: ModelSpec, cfg: ContextConfig, flash: bool) -> int:
    """F16 copies of a quantized K and V that CUDA's flash-attention path makes for one layer.

    ``ggml_cuda_flash_attn_ext`` converts a quantized K/V view to F16 in the pool
    for kernels that lack a native quantized path: ``n_kv x n_embd_k_gqa`` (and V) F16.
    Unverifiable on CPU; an upper bound for the pool allocation.
    """
    if not flash:
        return 0
    tk, tv = cache_type(cfg.type_k), cache_type(cfg.type_v)
    if not (tk.quantized or tv.quantized):
        return 0
    cells = kv_cells(spec, cfg)
    n_kv = max(cells.full, cells.swa)
    _, _, kv = _attn_dims(spec)
    return F16 * n_kv * kv * ((1 if tk.quantized else 0) + (1 if tv.quantized else 0))


def op_offload_bytes(spec: ModelSpec, cfg: ContextConfig, host_layers: int) -> int:
    """Under partial offload with ``op_offload``, batches of 32+ tokens copy a host layer's weights to the GPU.

    The scheduler copies the largest host-resident layer's weights into the GPU
    compute buffer (``ggml_backend_sched`` offload of ops on host weights).
    Unverifiable on CPU.
    """
    if host_layers <= 0 or cfg.n_ubatch_effective < 32:
        return 0
    return max((l.weights_bytes for l in spec.layers[: spec.n_layer]), default=0)


def pipeline_parallel_bytes(spec: ModelSpec, cfg: ContextConfig) -> int:
    """Extra input copies with pipeline parallelism (multi-GPU layer split, all offloaded). Unverifiable on CPU."""
    return (PIPELINE_PARALLEL_COPIES - 1) * F32 * spec.n_embd * cfg.n_ubatch_effective
