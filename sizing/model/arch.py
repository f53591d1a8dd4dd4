"""Architecture facts, in one table: what each architecture's memory is made of.

Everything here is read from the llama.cpp vendored by llama-cpp-python 0.3.36:
``llama_model::create_memory`` (``src/llama-model.cpp``: which memory an
architecture gets and its layer filters), ``llm_arch_is_recurrent`` /
``llm_arch_is_hybrid`` (``src/llama-arch.cpp``), each model's
``load_arch_hparams`` (``src/models/*.cpp``: sliding-window patterns, which
layers are recurrent, ``n_layer_kv_from_start``), and ``llama_hparams``
(``src/llama-hparams.cpp``: ``n_embd_r`` / ``n_embd_s``, ``set_swa_pattern``).

An architecture that is not in ``ARCHS`` is sized as a plain attention stack
and marked unknown; plans for it (and for every ``special`` one, whose cache
this model does not mirror) are calibrated by llama.cpp's own dry run.

Traits that a file can tell by itself are read from its tensors instead of
listed here (as gguf-parser-go's estimate does): a MoE FFN (``ffn_gate_inp``),
Q/K norms, QKV biases, fused QKV, short-convolution layers
(``shortconv.conv``), the state kind by the hyperparameters it declares
(``wkv.head_size``, ``shortconv.l_cache``, ``kda.head_dim``).

Pure: no imports beyond the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping, Sequence

MemoryKind = Literal["kv", "recurrent", "hybrid", "none", "special"]
"""Which ``llama_memory_i`` ``create_memory`` builds: a KV cache (iSWA when the architecture slides), a
recurrent state only, both (``llama_memory_hybrid[_iswa]``), none (encoders, diffusion), or a cache this
model does not mirror (DSA/MSA indexers, DeepSeek-V4, draft and assistant models)."""

RecurrentRule = Literal["none", "all", "no_kv_heads", "no_kv_heads_no_ff", "interval", "every"]
"""How ``load_arch_hparams`` sets ``is_recr_impl``: never; every layer (``llm_arch_is_recurrent``); iff
``n_head_kv(il) == 0`` (jamba, granitehybrid, lfm2, plamo2, kimi-linear); iff ``n_head_kv == 0 and
n_ff == 0`` (nemotron_h); ``recurrent_layers`` array or every layer but each ``full_attention_interval``-th
(qwen3next, qwen35, minimax-01); every layer, as well as attention (falcon-h1)."""

HybridFilter = Literal["default", "all", "no_ff", "main"]
"""``create_memory``'s hybrid layer filters: attention on ``!is_recr``, state on ``is_recr`` (default);
both on every layer (falcon-h1); both only where ``n_ff == 0`` (nemotron_h: MLP-only layers keep nothing);
both only below ``n_layer`` (the NextN block keeps nothing: qwen3next, qwen35, minimax-01)."""

SwaWhen = Literal["always", "key_positive", "window_positive", "unless_key_zero", "n_layer_64"]
"""When ``load_arch_hparams`` turns sliding windows on: always; when the ``sliding_window`` key is present
and positive; when the window (the key, or its default) is positive; unless the key is present and zero
(llama4); only for the 64-layer model (exaone4)."""


@dataclass(frozen=True)
class SwaRule:
    """``load_swa_pattern(ml, period, dense_first)``, or the pattern array an architecture requires."""

    period: int | None
    """The default period (``set_swa_pattern``); None: ``sliding_window_pattern`` must be an array."""
    dense_first: bool = False
    when: SwaWhen = "always"
    window_default: int = 0
    """``n_swa`` before the key is read (gemma2 4096, exaone4 4096, exaone-moe 128)."""
    window_fixed: int = 0
    """``n_swa`` set after the key is read, whatever the file says (llama4 8192, smallthinker 4096)."""
    attention_layers: bool = False
    """lfm2: the attention (non-recurrent) layers slide, no period."""


@dataclass(frozen=True)
class ArchTraits:
    """What one architecture's memory is made of, as the pinned llama.cpp builds it."""

    memory: MemoryKind = "kv"
    recurrent: RecurrentRule = "none"
    hybrid_filter: HybridFilter = "default"
    swa: SwaRule | None = None
    kv_from_start: Literal["none", "fixed_20", "shared_kv_layers"] = "none"
    """``n_layer_kv_from_start``: gemma3n keeps KV for its first 20 layers, gemma4 for all but
    ``attention.shared_kv_layers``; the others reuse them (no bytes)."""
    mirrored: bool = False
    """The reserve graph is mirrored by ``sizing.memory.graph`` (compute simulated, proven on CPU)."""
    moe_graph: bool = False
    """Mirrored with the MoE builder (``build_moe_ffn``: src/models/qwen3moe.cpp, deepseek2.cpp)."""
    moe_norm_fixed: bool = False
    """The builder fixes the expert weights' normalisation (true) and gating (softmax) whatever the file says
    (src/models/qwen3moe.cpp); else they come from ``expert_weights_norm`` / ``expert_gating_func``."""
    mla_graph: bool = False
    """Mirrored with absorbed multi-head latent attention (src/models/deepseek2.cpp)."""
    gemma_graph: bool = False
    """Gemma's graph: the input embedding scaled by sqrt(n_embd), post-norms (src/models/gemma2.cpp, gemma3.cpp)."""
    attn_softcap: bool = False
    """Reads ``attn_logit_softcapping`` into the attention (src/models/gemma2.cpp)."""
    scaled_q: bool = False
    """Gemma's ``query_pre_attn_scalar`` keeps one more query-sized tensor (the phase model's input)."""
    no_flash_attn: bool = False
    """``llama_init_from_model`` forces flash attention off (grok), so a quantized V cache cannot be used."""
    note: str = ""


_KV = ArchTraits()
_NONE = ArchTraits(memory="none")


def _special(note: str) -> ArchTraits:
    return ArchTraits(memory="special", note=note)


def _pattern(period: int, dense_first: bool = False, when: SwaWhen = "always", window_default: int = 0,
             window_fixed: int = 0) -> SwaRule:
    return SwaRule(period, dense_first, when, window_default, window_fixed)


_ARRAY = SwaRule(None)
_SSM_HYBRID = ArchTraits(memory="hybrid", recurrent="no_kv_heads")

ARCHS: Mapping[str, ArchTraits] = {
    # mirrored graphs (sizing/memory/graph.py)
    "llama": ArchTraits(mirrored=True),
    "qwen2": ArchTraits(mirrored=True),
    "qwen3": ArchTraits(mirrored=True),
    "qwen3moe": ArchTraits(mirrored=True, moe_graph=True, moe_norm_fixed=True),
    "deepseek2": ArchTraits(mirrored=True, moe_graph=True, mla_graph=True),
    "gemma2": ArchTraits(swa=_pattern(2, window_default=4096), mirrored=True, scaled_q=True, gemma_graph=True,
                         attn_softcap=True),
    "gemma3": ArchTraits(swa=_pattern(6, when="key_positive"), mirrored=True, scaled_q=True, gemma_graph=True),
    # no memory at all (create_memory returns nullptr)
    **{a: _NONE for a in ("bert", "jina-bert-v2", "jina-bert-v3", "nomic-bert", "nomic-bert-moe", "neo-bert",
                          "eurobert", "wavtokenizer-dec", "modern-bert", "gemma-embedding", "dream", "llada",
                          "llada-moe", "rnd1", "clip")},
    # recurrent only (llm_arch_is_recurrent): every layer keeps r and s, no KV
    **{a: ArchTraits(memory="recurrent", recurrent="all") for a in ("mamba", "mamba2", "rwkv6", "rwkv6qwen2",
                                                                      "rwkv7", "arwkv7")},
    # hybrids (llm_arch_is_hybrid) with the filters create_memory gives them
    "jamba": _SSM_HYBRID,
    "plamo2": _SSM_HYBRID,
    "granitehybrid": _SSM_HYBRID,
    "lfm2": ArchTraits(memory="hybrid", recurrent="no_kv_heads",
                       swa=SwaRule(None, when="window_positive", attention_layers=True)),
    "lfm2moe": _SSM_HYBRID,
    "kimi-linear": ArchTraits(memory="hybrid", recurrent="no_kv_heads", note="KDA state; MLA attention (K only)"),
    "falcon-h1": ArchTraits(memory="hybrid", recurrent="every", hybrid_filter="all"),
    "nemotron_h": ArchTraits(memory="hybrid", recurrent="no_kv_heads_no_ff", hybrid_filter="no_ff"),
    "nemotron_h_moe": ArchTraits(memory="hybrid", recurrent="no_kv_heads_no_ff", hybrid_filter="no_ff"),
    "qwen3next": ArchTraits(memory="hybrid", recurrent="interval", hybrid_filter="main"),
    "qwen35": ArchTraits(memory="hybrid", recurrent="interval", hybrid_filter="main"),
    "qwen35moe": ArchTraits(memory="hybrid", recurrent="interval", hybrid_filter="main"),
    "minimax-01": ArchTraits(memory="hybrid", recurrent="interval", hybrid_filter="main",
                             note="linear-attention state (n_embd_head_la)"),
    "bailingmoe3": ArchTraits(memory="hybrid", recurrent="no_kv_heads", note="KDA state; MLA attention (K only)"),
    "kimi-k3": ArchTraits(memory="hybrid", recurrent="no_kv_heads", note="KDA state; MLA attention (K only)"),
    # caches this model does not mirror: measured
    "glm5-next": _special("llama_memory_hybrid_idx: KDA state, MLA cache and an indexer key cache"),
    "qwen4exp": _special("llama_memory_hybrid_idx with a QSA indexer and a PLE conv state"),
    "deepseek4": _special("llama_kv_cache_dsv4: compressed caches and an indexer"),
    "minimax-m3": _special("llama_kv_cache_msa: an indexer key cache on the sparse layers"),
    "glm-dsa": _special("llama_kv_cache_dsa: MLA cache and a lightning-indexer key cache"),
    "deepseek32": _special("llama_kv_cache_dsa: MLA cache and a lightning-indexer key cache"),
    "hy_v4": _special("llama_kv_cache_dsa when the checkpoint has an indexer"),
    "dots3note": _special("llama_kv_cache_dsa_iswa: MLA + SWA with an indexer"),
    "dflash": _special("a draft model sized against its target"),
    "eagle3": _special("a draft model sized against its target"),
    "gemma4-assistant": _special("shares the target model's KV cache"),
    "graniteswitch": _special("a router KV layer in the NextN slot"),
    "nanbeige": _special("looped layers: the KV cache covers n_layer x num_loops"),
    "hrm_text": _special("looped H/L stacks"),
    # sliding windows (load_swa_pattern and friends)
    "gemma3n": ArchTraits(swa=_pattern(5), kv_from_start="fixed_20", scaled_q=True),
    "gemma4": ArchTraits(swa=_ARRAY, kv_from_start="shared_kv_layers"),
    "cohere2": ArchTraits(swa=_pattern(4)),
    "cohere2moe": ArchTraits(swa=_pattern(4, dense_first=True)),
    "exaone4": ArchTraits(swa=_pattern(4, when="n_layer_64", window_default=4096)),
    "exaone-moe": ArchTraits(swa=_pattern(4, window_default=128)),
    "llama4": ArchTraits(swa=_pattern(4, when="unless_key_zero", window_fixed=8192), note="chunked attention"),
    "olmo2": ArchTraits(swa=_pattern(4, when="key_positive")),
    "gpt-oss": ArchTraits(swa=_pattern(2), note="attention sinks"),
    "afmoe": ArchTraits(swa=_pattern(4, when="window_positive")),
    "smallthinker": ArchTraits(swa=_pattern(4, dense_first=True, when="key_positive", window_fixed=4096)),
    "plamo3": ArchTraits(swa=_pattern(8, when="key_positive")),
    "mellum": ArchTraits(swa=_pattern(4, when="window_positive")),
    "muse-glimmer": ArchTraits(swa=_pattern(4)),
    "laguna": ArchTraits(swa=_pattern(4, dense_first=True, when="window_positive")),
    "maple": ArchTraits(swa=_ARRAY),
    "mimo2": ArchTraits(swa=_ARRAY),
    "spark2_5": ArchTraits(swa=_ARRAY),
    "step35": ArchTraits(swa=_ARRAY),
    "granite_swa": ArchTraits(swa=_ARRAY),
    "grok": ArchTraits(no_flash_attn=True, note="flash attention forced off (llama_init_from_model)"),
    "phi3": ArchTraits(note="sliding_window in the file is ignored (SWA disabled, src/models/phi3.cpp)"),
    # every other architecture llama.cpp loads: a plain KV cache on every main layer
    **{a: _KV for a in (
        "deci", "falcon", "gpt2", "gptj", "gptneox", "mpt", "baichuan", "starcoder",
        "refact", "bloom", "stablelm", "qwen", "qwen2moe", "qwen2vl", "qwen3vl", "qwen3vlmoe", "phi2", "phimoe",
        "plamo", "codeshell", "orion", "internlm2", "minicpm", "minicpm3", "gemma", "starcoder2", "xverse",
        "command-r", "dbrx", "olmo", "olmoe", "openelm", "arctic", "deepseek", "deepseek2-ocr", "chatglm", "glm4",
        "glm4moe", "bitnet", "t5", "t5encoder", "jais", "jais2", "nemotron", "exaone", "granite", "granitemoe",
        "chameleon", "plm", "bailingmoe", "bailingmoe2", "dots1", "arcee", "ernie4_5", "ernie4_5-moe",
        "hunyuan-moe", "hunyuan-dense", "hunyuan_vl", "hy_v3", "smollm3", "seed_oss", "grovemoe", "apertus",
        "minimax-m2", "cogvlm", "pangu-embedded", "mistral3", "mistral4", "paddleocr", "llama-embed", "maincoder",
        "talkie", "qwen3tts", "pockettts",
    )},
}

MIRRORED: frozenset[str] = frozenset(a for a, t in ARCHS.items() if t.mirrored)
"""Architectures whose reserve graph ``sizing.memory.graph`` mirrors (compute simulated)."""

UNKNOWN = ArchTraits(note="not in the table: sized as a plain attention stack, calibrated by llama.cpp")


def traits(arch: str) -> ArchTraits:
    """The table's entry, or ``UNKNOWN`` for an architecture the table does not list."""
    return ARCHS.get(arch, UNKNOWN)


def known(arch: str) -> bool:
    return arch in ARCHS


# ---- per-layer kinds (pure functions of the header's values) --------------------------------------------


def swa_window(t: ArchTraits, key_value: int | None) -> int:
    """``n_swa`` after ``load_arch_hparams``: the key (or the default), unless the architecture fixes it."""
    if t.swa is None:
        return 0
    if t.swa.window_fixed:
        return t.swa.window_fixed
    return key_value if key_value is not None else t.swa.window_default


def swa_layers(t: ArchTraits, n_layer: int, n_layer_all: int, window_key: int | None, pattern: object,
               recurrent: Sequence[bool]) -> list[bool]:
    """``is_swa_impl`` per layer: ``load_swa_pattern`` / ``set_swa_pattern`` (src/llama-hparams.cpp) under the
    architecture's condition. ``pattern`` is the ``sliding_window_pattern`` value (bools, a period, or None)."""
    off = [False] * n_layer_all
    rule = t.swa
    if rule is None:
        return off
    window = swa_window(t, window_key)
    if rule.when == "key_positive" and not (window_key is not None and window_key > 0):
        return off
    if rule.when == "window_positive" and window <= 0:
        return off
    if rule.when == "unless_key_zero" and window_key is not None and window_key == 0:
        return off
    if rule.when == "n_layer_64" and n_layer != 64:
        return off
    if rule.attention_layers:
        return [il < n_layer and not recurrent[il] for il in range(n_layer_all)]
    if isinstance(pattern, list):
        return [bool(x) for x in pattern] + [False] * (n_layer_all - len(pattern))
    if rule.period is None:
        return off  # the array is required; the probe reports its absence
    period = pattern if isinstance(pattern, int) and not isinstance(pattern, bool) else rule.period
    out = []
    for il in range(n_layer_all):
        if il >= n_layer:
            out.append(False)
        elif rule.dense_first:
            out.append(period == 0 or il % period != 0)
        else:
            out.append(period == 0 or il % period < period - 1)
    return out


def recurrent_layers(t: ArchTraits, n_layer: int, n_layer_all: int, n_head_kv: Sequence[int], n_ff: Sequence[int],
                     recurrent_key: object, interval_key: int | None) -> list[bool]:
    """``is_recr_impl`` per layer, as the architecture's ``load_arch_hparams`` sets it."""
    rule = t.recurrent
    if rule == "all":
        return [True] * n_layer_all  # std::fill over the whole array (llm_arch_is_recurrent)
    if rule == "every":
        return [True] * n_layer_all
    if rule == "no_kv_heads":
        return [il < n_layer and n_head_kv[il] == 0 for il in range(n_layer_all)]
    if rule == "no_kv_heads_no_ff":
        return [il < n_layer and n_head_kv[il] == 0 and n_ff[il] == 0 for il in range(n_layer_all)]
    if rule == "interval":
        if isinstance(recurrent_key, list):
            return [bool(x) for x in recurrent_key] + [False] * (n_layer_all - len(recurrent_key))
        if isinstance(recurrent_key, int) and not isinstance(recurrent_key, bool):
            return [bool(recurrent_key)] * n_layer_all
        every = interval_key if interval_key else 4
        return [il < n_layer and (il + 1) % every != 0 for il in range(n_layer_all)]
    return [False] * n_layer_all


def memory_layers(t: ArchTraits, n_layer: int, n_layer_all: int, recurrent: Sequence[bool], n_ff: Sequence[int],
                  kv_from_start: int | None) -> tuple[list[bool], list[bool]]:
    """(keeps attention KV, keeps recurrent state) per layer, from ``create_memory``'s filters.

    KV: ``llama_kv_cache`` walks ``n_layer_all`` layers, skips those without ``hparams.has_kv`` (layers from
    ``n_layer_kv_from_start`` on) and those the filter drops (NextN layers for a plain cache; the hybrid
    filters). State: ``llama_memory_recurrent`` walks ``n_layer`` layers through its filter.
    """
    main = [il < n_layer for il in range(n_layer_all)]
    has_kv = [kv_from_start is None or il < kv_from_start for il in range(n_layer_all)]
    if t.memory == "none":
        return [False] * n_layer_all, [False] * n_layer_all
    if t.memory == "recurrent":
        return [False] * n_layer_all, main
    if t.memory == "hybrid":
        if t.hybrid_filter == "all":
            attn, recr = [True] * n_layer_all, [True] * n_layer_all
        elif t.hybrid_filter == "no_ff":
            attn = [not recurrent[il] and n_ff[il] == 0 for il in range(n_layer_all)]
            recr = [recurrent[il] and n_ff[il] == 0 for il in range(n_layer_all)]
        elif t.hybrid_filter == "main":
            attn = [main[il] and not recurrent[il] for il in range(n_layer_all)]
            recr = [main[il] and recurrent[il] for il in range(n_layer_all)]
        else:
            attn = [not r for r in recurrent]
            recr = list(recurrent)
        return ([a and k for a, k in zip(attn, has_kv)], [r and m for r, m in zip(recr, main)])
    # a plain (or iSWA) cache: NextN layers are filtered out when there is a trunk (create_memory)
    return [m and k for m, k in zip(main, has_kv)], [False] * n_layer_all


@dataclass(frozen=True)
class StateWidths:
    """F32 elements per cell of the recurrent state: ``n_embd_r`` (conv / token shift) and ``n_embd_s``."""

    kind: Literal["ssm", "rwkv", "shortconv", "kda", "linear_attn"]
    n_embd_r: int
    n_embd_s: int


def state_widths(n_embd: int, n_head: int, n_embd_head_k: int, *, wkv_head_size: int = 0, token_shift_count: int = 2,
                 shortconv_l_cache: int = 0, kda_head_dim: int = 0, linear_attn: bool = False, d_conv: int = 0,
                 d_inner: int = 0, d_state: int = 0, n_group: int = 0) -> StateWidths:
    """``llama_hparams::n_embd_r`` and ``n_embd_s`` (src/llama-hparams.cpp), checked in that order."""
    if wkv_head_size:
        r = token_shift_count * n_embd
    elif shortconv_l_cache:
        r = n_embd * (shortconv_l_cache - 1)
    elif kda_head_dim:
        r = 3 * (d_conv - 1 if d_conv > 0 else 3) * n_head * kda_head_dim
    else:
        r = (d_conv - 1 if d_conv > 0 else 0) * (d_inner + 2 * n_group * d_state)
    head_la = n_embd_head_k if linear_attn else 0
    if wkv_head_size:
        s, kind = n_embd * wkv_head_size, "rwkv"
    elif kda_head_dim:
        s, kind = kda_head_dim * kda_head_dim * n_head, "kda"
    elif head_la:
        s, kind = head_la * head_la * n_head, "linear_attn"
    else:
        s, kind = d_state * d_inner, "shortconv" if shortconv_l_cache else "ssm"
    return StateWidths(kind, r, s)  # type: ignore[arg-type]
