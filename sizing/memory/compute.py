"""Compute buffer bytes: what llama.cpp's ``sched_reserve`` measures, simulated or modelled.

llama.cpp never computes the compute buffer in closed form:
``llama_context::sched_reserve`` (``src/llama-context.cpp``) builds the
worst-case graph and ``ggml_gallocr`` (``ggml/src/ggml-alloc.c``) measures its
peak. ``compute_bytes`` asks the mirrored graph first (``sizing.memory.graph``, exact
for ``sizing.model.arch.MIRRORED`` on the CPU backend); every other architecture
gets this module's phase model, an estimate (plans for those architectures are
calibrated by llama.cpp's own dry run, ``service.planning.planner``), the largest of:

- **output**: the logits ``[n_vocab, n_ubatch]`` F32 with the final norm's input and output;
- **attention without flash attention**: ``kq`` F32 ``[n_kv, n_ubatch, n_head]`` (softmax
  in place), the masks, Q/K/V and the residual stream;
- **attention with flash attention**: F16 masks and Q/K/V only;
- **MoE**: the routed FFN intermediates ``[n_ff_exp, n_expert_used, n_ubatch]``.

GPU-only terms the CPU dry run cannot show, and the bound every GPU plan carries
for the CUDA pool, are in ``sizing.memory.gpu``.
"""

from __future__ import annotations

from ..model import arch as archs
from .context import ContextConfig
from ..model.ggml import cache_type
from .kv import kv_cells, kv_layers
from .graph import n_ff, n_ff_exp, simulated_compute_bytes
from ..model.spec import ModelSpec

F32 = 4
F16 = 2


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
            extra = F32 * cfg.n_ubatch_effective * (n_ff(spec) + spec.n_embd) + mask_bytes(spec, cfg, flash)
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
        if archs.traits(spec.architecture).scaled_q:
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
    f = n_ff_exp(spec) or n_ff(spec)
    return F32 * n_ub * (3 * f * spec.n_expert_used + 2 * spec.n_expert + 3 * spec.n_embd)


def ffn_phase_bytes(spec: ModelSpec, cfg: ContextConfig) -> int:
    """A dense FFN block: gate, up and their product, with the residual stream."""
    return F32 * cfg.n_ubatch_effective * (3 * n_ff(spec) + 2 * spec.n_embd)


def compute_bytes(spec: ModelSpec, cfg: ContextConfig, flash: bool) -> int:
    """Predicted compute buffer of the device that runs the whole graph (CPU: what ``sched_reserve`` logs)."""
    sim = simulated_compute_bytes(spec, cfg, flash)
    if sim is not None:
        return sim
    return max(
        output_phase_bytes(spec, cfg, flash),
        attention_phase_bytes(spec, cfg, flash),
        moe_phase_bytes(spec, cfg),
        ffn_phase_bytes(spec, cfg),
    )


def layers_compute_bytes(spec: ModelSpec, cfg: ContextConfig, flash: bool) -> int:
    """The phase model without the output phase: a first figure for a device that runs only repeating layers (a
    worker's device without the output layer), before llama.cpp's dry run measures it (``service.planning``)."""
    return max(attention_phase_bytes(spec, cfg, flash), moe_phase_bytes(spec, cfg), ffn_phase_bytes(spec, cfg))


def host_compute_bytes(spec: ModelSpec, cfg: ContextConfig) -> int:
    """The host's compute buffer when the graph runs on a GPU: token embeddings for the ubatch."""
    return F32 * spec.n_embd * cfg.n_ubatch_effective


def compute_mirrored(spec: ModelSpec) -> bool:
    """Whether the compute buffer is simulated from a mirrored graph (``sizing.memory.graph``), not the phase model."""
    from .graph import graph_shape

    return graph_shape(spec) is not None
