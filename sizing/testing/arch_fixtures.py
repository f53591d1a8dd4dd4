"""Header-only GGUFs of architectures beyond the mirrored seven: hybrids, recurrent models, MoE with sinks.

Each ``ArchFixture`` carries a model's public config.json values (the source is
named beside it) as the GGUF keys llama.cpp's converter writes, and a tensor
builder that mirrors the architecture's ``load_arch_tensors``
(``src/models/<arch>.cpp`` of the llama.cpp vendored by llama-cpp-python 0.3.36):
every required tensor with its shape, nothing the loader would not create
(``done_getting_tensors`` refuses extra tensors). ``sizing.testing.fixtures``
writes them like the others: header, then a hole to the full size.

Where a config value is not a plain GGUF key (layer-type lists, hybrid patterns)
the converter's mapping is applied here: per-layer ``head_count_kv`` (0 on
recurrent layers) and ``feed_forward_length`` arrays, ``attention.recurrent_layers``
or ``full_attention_interval``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal, Mapping

Tensor = tuple[str, tuple[int, ...], str]
"""(name, shape in ggml order, role): roles choose the quantization type (``fixtures._qtype``)."""


@dataclass(frozen=True)
class ArchFixture:
    """One model: its architecture, its GGUF keys (relative to ``{arch}.``) and its tensor builder."""

    arch: str
    n_embd: int
    n_layer: int
    n_vocab: int
    n_ctx_train: int
    keys: Mapping[str, object]
    builder: str
    source: str
    tokenizer: Literal["gpt2", "llama"] = "gpt2"
    tokenizer_pre: str = "default"
    tied: bool = False
    extra: Mapping[str, object] = field(default_factory=dict)
    """Builder parameters that are not GGUF keys (layer periods)."""
    special_tokens: tuple[str, ...] = ()
    """Tokens the vocabulary loader looks up by name for this model (``llama_vocab::impl::load``)."""

    def key(self, name: str, default: object = None) -> object:
        return self.keys.get(name, default)

    def int_key(self, name: str, default: int = 0) -> int:
        v = self.keys.get(name, default)
        assert isinstance(v, int)
        return v

    def int_extra(self, name: str) -> int:
        v = self.extra[name]
        assert isinstance(v, int)
        return v

    def per_layer(self, name: str, default: int = 0) -> list[int]:
        v = self.keys.get(name, default)
        if isinstance(v, list):
            return [int(x) for x in v]
        assert isinstance(v, int)
        return [v] * self.n_layer


# ---- tensor builders (one per load_arch_tensors) ------------------------------------------------------------


def _p(i: int) -> str:
    return f"blk.{i}."


def _head(fx: ArchFixture, out: list[Tensor], *, norm_bias: bool = False, output: bool | None = None,
          norm: str = "output_norm") -> None:
    e = fx.n_embd
    out.append(("token_embd.weight", (e, fx.n_vocab), "embd"))
    out.append((f"{norm}.weight", (e,), "norm"))
    if norm_bias:
        out.append((f"{norm}.bias", (e,), "norm"))
    if output if output is not None else not fx.tied:
        out.append(("output.weight", (e, fx.n_vocab), "output"))


def _attn(out: list[Tensor], p: str, e: int, q: int, k: int, v: int, *, o_in: int | None = None, bias: bool = False,
          fused: bool = False, o_bias: bool = False) -> None:
    if fused:
        out.append((p + "attn_qkv.weight", (e, q + k + v), "attn"))
        if bias:
            out.append((p + "attn_qkv.bias", (q + k + v,), "norm"))
    else:
        out += [(p + "attn_q.weight", (e, q), "attn"), (p + "attn_k.weight", (e, k), "attn"),
                (p + "attn_v.weight", (e, v), "attn_v")]
        if bias:
            out += [(p + "attn_q.bias", (q,), "norm"), (p + "attn_k.bias", (k,), "norm"), (p + "attn_v.bias", (v,), "norm")]
    out.append((p + "attn_output.weight", (o_in if o_in is not None else q, e), "attn"))
    if o_bias:
        out.append((p + "attn_output.bias", (e,), "norm"))


def _ffn(out: list[Tensor], p: str, e: int, f: int, *, gate: bool = True, bias: bool = False) -> None:
    if gate:
        out.append((p + "ffn_gate.weight", (e, f), "ffn"))
    out += [(p + "ffn_up.weight", (e, f), "ffn"), (p + "ffn_down.weight", (f, e), "ffn_down")]
    if bias:
        out += [(p + "ffn_up.bias", (f,), "norm"), (p + "ffn_down.bias", (e,), "norm")]


def _moe(out: list[Tensor], p: str, e: int, f: int, n: int, *, gate: bool = True) -> None:
    out.append((p + "ffn_gate_inp.weight", (e, n), "norm"))
    if gate:
        out.append((p + "ffn_gate_exps.weight", (e, f, n), "ffn"))
    out += [(p + "ffn_up_exps.weight", (e, f, n), "ffn"), (p + "ffn_down_exps.weight", (f, e, n), "ffn_down")]


def _norm(out: list[Tensor], name: str, n: int, bias: bool = False) -> None:
    out.append((name + ".weight", (n,), "norm"))
    if bias:
        out.append((name + ".bias", (n,), "norm"))


def _dims(fx: ArchFixture, il: int) -> tuple[int, int, int, int]:
    """(n_head, n_head_kv, head k size, head v size) of layer il."""
    n_head = fx.per_layer("attention.head_count")[il]
    n_kv = fx.per_layer("attention.head_count_kv", n_head)[il] if "attention.head_count_kv" in fx.keys else n_head
    head0 = fx.per_layer("attention.head_count")[0]
    hk = fx.int_key("attention.key_length", fx.n_embd // head0 if head0 else 0)
    hv = fx.int_key("attention.value_length", hk)
    return n_head, n_kv, hk, hv


def _mamba2_block(out: list[Tensor], p: str, fx: ArchFixture, *, d_in_proj: int, conv_bias: bool = True,
                  ssm_norm: bool = True) -> None:
    """The Mamba-2 mixer of src/models/mamba2.cpp, granite-hybrid.cpp, falcon-h1.cpp, nemotron-h.cpp."""
    e = fx.n_embd
    d_conv, d_inner = fx.int_key("ssm.conv_kernel"), fx.int_key("ssm.inner_size")
    d_state, n_group, n_head = fx.int_key("ssm.state_size"), fx.int_key("ssm.group_count"), fx.int_key("ssm.time_step_rank")
    conv_dim = d_inner + 2 * n_group * d_state
    out.append((p + "ssm_in.weight", (e, d_in_proj), "attn"))
    out.append((p + "ssm_conv1d.weight", (d_conv, conv_dim), "norm"))
    if conv_bias:
        out.append((p + "ssm_conv1d.bias", (conv_dim,), "norm"))
    out.append((p + "ssm_dt.bias", (n_head,), "norm"))
    out += [(p + "ssm_a", (1, n_head), "norm"), (p + "ssm_d", (1, n_head), "norm")]
    if ssm_norm:
        out.append((p + "ssm_norm.weight", (d_inner // n_group, n_group), "norm"))
    out.append((p + "ssm_out.weight", (d_inner, e), "attn"))


def _mamba1_block(out: list[Tensor], p: str, fx: ArchFixture, *, norms: bool = False) -> None:
    """The Mamba-1 mixer of src/models/mamba.cpp and jamba.cpp."""
    e = fx.n_embd
    d_conv, d_inner = fx.int_key("ssm.conv_kernel"), fx.int_key("ssm.inner_size")
    d_state, dt_rank = fx.int_key("ssm.state_size"), fx.int_key("ssm.time_step_rank")
    out.append((p + "ssm_in.weight", (e, 2 * d_inner), "attn"))
    out.append((p + "ssm_conv1d.weight", (d_conv, d_inner), "norm"))
    out.append((p + "ssm_conv1d.bias", (d_inner,), "norm"))
    out.append((p + "ssm_x.weight", (d_inner, dt_rank + 2 * d_state), "attn"))
    if norms:
        out.append((p + "ssm_dt_norm.weight", (dt_rank,), "norm"))
    out.append((p + "ssm_dt.weight", (dt_rank, d_inner), "attn"))
    out.append((p + "ssm_dt.bias", (d_inner,), "norm"))
    if norms:
        out += [(p + "ssm_b_norm.weight", (d_state,), "norm"), (p + "ssm_c_norm.weight", (d_state,), "norm")]
    out += [(p + "ssm_a", (d_state, d_inner), "norm"), (p + "ssm_d", (d_inner,), "norm")]
    out.append((p + "ssm_out.weight", (d_inner, e), "attn"))


def _mamba(fx: ArchFixture) -> list[Tensor]:
    out: list[Tensor] = []
    _head(fx, out)
    for i in range(fx.n_layer):
        _norm(out, _p(i) + "attn_norm", fx.n_embd)
        _mamba1_block(out, _p(i), fx)
    return out


def _mamba2(fx: ArchFixture) -> list[Tensor]:
    out: list[Tensor] = []
    _head(fx, out)
    d_inner, d_state = fx.int_key("ssm.inner_size"), fx.int_key("ssm.state_size")
    n_group, n_head = fx.int_key("ssm.group_count"), fx.int_key("ssm.time_step_rank")
    d_in_proj = d_inner + (d_inner + 2 * n_group * d_state) + n_head
    for i in range(fx.n_layer):
        _norm(out, _p(i) + "attn_norm", fx.n_embd)
        _mamba2_block(out, _p(i), fx, d_in_proj=d_in_proj)
    return out


def _jamba(fx: ArchFixture) -> list[Tensor]:
    out: list[Tensor] = []
    _head(fx, out)
    e, f = fx.n_embd, fx.int_key("feed_forward_length")
    n_expert = fx.int_key("expert_count")
    every, offset = fx.int_extra("expert_layer_period"), fx.int_extra("expert_layer_offset")
    for i in range(fx.n_layer):
        p = _p(i)
        _norm(out, p + "attn_norm", e)
        n_head, n_kv, hk, hv = _dims(fx, i)
        if n_kv == 0:
            _mamba1_block(out, p, fx, norms=True)
        else:
            _attn(out, p, e, e, n_kv * hk, n_kv * hv, o_in=e)
        _norm(out, p + "ffn_norm", e)
        if n_expert and i % every == offset:
            _moe(out, p, e, f, n_expert)
        else:
            _ffn(out, p, e, f)
    return out


def _falcon_h1(fx: ArchFixture) -> list[Tensor]:
    out: list[Tensor] = []
    _head(fx, out)
    e, f = fx.n_embd, fx.int_key("feed_forward_length")
    d_inner, d_state = fx.int_key("ssm.inner_size"), fx.int_key("ssm.state_size")
    n_group, n_head_ssm = fx.int_key("ssm.group_count"), fx.int_key("ssm.time_step_rank")
    d_in_proj = d_inner + (d_inner + 2 * n_group * d_state) + n_head_ssm
    for i in range(fx.n_layer):
        p = _p(i)
        _mamba2_block(out, p, fx, d_in_proj=d_in_proj)
        n_head, n_kv, hk, hv = _dims(fx, 0)
        _attn(out, p, e, hk * n_head, n_kv * hk, n_kv * hv)
        _norm(out, p + "attn_norm", e)
        out.append((p + "ffn_norm", (e,), "norm"))  # tn(LLM_TENSOR_FFN_NORM, i): no ".weight" suffix
        _ffn(out, p, e, f)
    return out


def _granite_hybrid(fx: ArchFixture) -> list[Tensor]:
    out: list[Tensor] = []
    _head(fx, out)
    e, f = fx.n_embd, fx.int_key("feed_forward_length")
    d_inner, d_state = fx.int_key("ssm.inner_size"), fx.int_key("ssm.state_size")
    n_group, n_head_ssm = fx.int_key("ssm.group_count"), fx.int_key("ssm.time_step_rank")
    d_in_proj = 2 * d_inner + 2 * n_group * d_state + n_head_ssm
    for i in range(fx.n_layer):
        p = _p(i)
        _norm(out, p + "attn_norm", e)
        n_head, n_kv, hk, hv = _dims(fx, i)
        if n_kv == 0:
            _mamba2_block(out, p, fx, d_in_proj=d_in_proj)
        else:
            _attn(out, p, e, hk * n_head, n_kv * hk, n_kv * hv)
        _norm(out, p + "ffn_norm", e)
        _ffn(out, p, e, f)
    return out


def _nemotron_h(fx: ArchFixture) -> list[Tensor]:
    out: list[Tensor] = []
    _head(fx, out)
    e = fx.n_embd
    d_inner, d_state = fx.int_key("ssm.inner_size"), fx.int_key("ssm.state_size")
    n_group, n_head_ssm = fx.int_key("ssm.group_count"), fx.int_key("ssm.time_step_rank")
    d_in_proj = 2 * d_inner + 2 * n_group * d_state + n_head_ssm
    n_ff = fx.per_layer("feed_forward_length")
    for i in range(fx.n_layer):
        p = _p(i)
        _norm(out, p + "attn_norm", e)
        n_head, n_kv, hk, hv = _dims(fx, i)
        if n_kv == 0 and n_ff[i] == 0:
            _mamba2_block(out, p, fx, d_in_proj=d_in_proj)
        elif n_ff[i] == 0:
            _attn(out, p, e, hk * n_head, n_kv * hk, n_kv * hv)
        else:
            _ffn(out, p, e, n_ff[i], gate=False)
    return out


def _lfm2(fx: ArchFixture) -> list[Tensor]:
    out: list[Tensor] = []
    e, f = fx.n_embd, fx.int_key("feed_forward_length")
    out.append(("token_embd.weight", (e, fx.n_vocab), "embd"))
    out.append(("token_embd_norm.weight", (e,), "norm"))  # LLM_TENSOR_OUTPUT_NORM_LFM2
    l_cache = fx.int_key("shortconv.l_cache")
    for i in range(fx.n_layer):
        p = _p(i)
        _norm(out, p + "ffn_norm", e)
        _ffn(out, p, e, f)
        _norm(out, p + "attn_norm", e)
        n_head, n_kv, hk, hv = _dims(fx, i)
        if n_kv:
            _norm(out, p + "attn_q_norm", hk)
            _norm(out, p + "attn_k_norm", hk)
            _attn(out, p, e, e, n_kv * hk, n_kv * hv, o_in=e)
        else:
            out.append((p + "shortconv.conv.weight", (l_cache, e), "norm"))
            out.append((p + "shortconv.in_proj.weight", (e, 3 * e), "attn"))
            out.append((p + "shortconv.out_proj.weight", (e, e), "attn"))
    return out


def _rwkv7(fx: ArchFixture) -> list[Tensor]:
    out: list[Tensor] = []
    e, f = fx.n_embd, fx.int_key("feed_forward_length")
    out.append(("token_embd.weight", (e, fx.n_vocab), "embd"))
    _norm(out, "token_embd_norm", e, bias=True)
    _norm(out, "output_norm", e, bias=True)
    out.append(("output.weight", (e, fx.n_vocab), "output"))
    decay, iclr = fx.int_key("attention.decay_lora_rank"), fx.int_key("attention.iclr_lora_rank")
    vmix, gate = fx.int_key("attention.value_residual_mix_lora_rank"), fx.int_key("attention.gate_lora_rank")
    for i in range(fx.n_layer):
        p = _p(i)
        _norm(out, p + "attn_norm", e, bias=True)
        _norm(out, p + "attn_norm_2", e, bias=True)
        out.append((p + "time_mix_w0.weight", (e,), "norm"))
        out += [(p + "time_mix_w1.weight", (e, decay), "norm"), (p + "time_mix_w2.weight", (decay, e), "norm")]
        out.append((p + "time_mix_a0.weight", (e,), "norm"))
        out += [(p + "time_mix_a1.weight", (e, iclr), "norm"), (p + "time_mix_a2.weight", (iclr, e), "norm")]
        vr = iclr if i == 0 else vmix
        out.append((p + "time_mix_v0.weight", (e,), "norm"))
        out += [(p + "time_mix_v1.weight", (e, vr), "norm"), (p + "time_mix_v2.weight", (vr, e), "norm")]
        out += [(p + "time_mix_g1.weight", (e, gate), "norm"), (p + "time_mix_g2.weight", (gate, e), "norm")]
        out.append((p + "time_mix_lerp_fused.weight", (e, 1, 1, 6), "norm"))
        out += [(p + f"time_mix_{n}.weight", (e,), "norm") for n in ("k_k", "k_a", "r_k")]
        out += [(p + f"time_mix_{n}.weight", (e, e), "attn") for n in ("key", "value", "receptance")]
        _norm(out, p + "time_mix_ln", e, bias=True)
        out.append((p + "time_mix_output.weight", (e, e), "attn"))
        out.append((p + "channel_mix_lerp_k.weight", (e, 1, 1), "norm"))
        out.append((p + "channel_mix_key.weight", (e, f), "ffn"))
        out.append((p + "channel_mix_value.weight", (f, e), "ffn_down"))
    return out


def _qwen3next(fx: ArchFixture) -> list[Tensor]:
    out: list[Tensor] = []
    _head(fx, out)
    e = fx.n_embd
    n_expert, f_exp = fx.int_key("expert_count"), fx.int_key("expert_feed_forward_length")
    f_sh = fx.int_key("expert_shared_feed_forward_length")
    hk_dim, n_k, n_v = fx.int_key("ssm.state_size"), fx.int_key("ssm.group_count"), fx.int_key("ssm.time_step_rank")
    key_dim, value_dim = hk_dim * n_k, hk_dim * n_v
    interval = fx.int_key("full_attention_interval", 4)
    for i in range(fx.n_layer):
        p = _p(i)
        _norm(out, p + "attn_norm", e)
        _norm(out, p + "post_attention_norm", e)
        if (i + 1) % interval == 0:
            n_head, n_kv, hk, hv = _dims(fx, i)
            _attn(out, p, e, hk * n_head * 2, n_kv * hk, n_kv * hv, o_in=hk * n_head)  # Q with its gate
            _norm(out, p + "attn_q_norm", hk)
            _norm(out, p + "attn_k_norm", hk)
        else:
            out.append((p + "ssm_in.weight", (e, key_dim * 2 + value_dim * 2), "attn"))
            out.append((p + "ssm_conv1d.weight", (fx.int_key("ssm.conv_kernel"), key_dim * 2 + value_dim), "norm"))
            out.append((p + "ssm_dt.bias", (n_v,), "norm"))
            out.append((p + "ssm_a", (n_v,), "norm"))
            out.append((p + "ssm_ba.weight", (e, 2 * n_v), "attn"))
            out.append((p + "ssm_norm.weight", (hk_dim,), "norm"))
            out.append((p + "ssm_out.weight", (value_dim, e), "attn"))
        _moe(out, p, e, f_exp, n_expert)
        out.append((p + "ffn_gate_inp_shexp.weight", (e,), "norm"))
        out += [(p + "ffn_gate_shexp.weight", (e, f_sh), "ffn"), (p + "ffn_up_shexp.weight", (e, f_sh), "ffn"),
                (p + "ffn_down_shexp.weight", (f_sh, e), "ffn_down")]
    return out


def _gpt_oss(fx: ArchFixture) -> list[Tensor]:
    out: list[Tensor] = []
    _head(fx, out, output=True)
    e, f = fx.n_embd, fx.int_key("expert_feed_forward_length")
    n_expert = fx.int_key("expert_count")
    for i in range(fx.n_layer):
        p = _p(i)
        n_head, n_kv, hk, hv = _dims(fx, i)
        _norm(out, p + "attn_norm", e)
        _norm(out, p + "post_attention_norm", e)
        _attn(out, p, e, n_head * hk, n_kv * hk, n_kv * hk, bias=True, o_bias=True)
        out.append((p + "attn_sinks.weight", (n_head,), "norm"))
        _moe(out, p, e, f, n_expert)
        out += [(p + "ffn_gate_inp.bias", (n_expert,), "norm"), (p + "ffn_gate_exps.bias", (f, n_expert), "norm"),
                (p + "ffn_down_exps.bias", (e, n_expert), "norm"), (p + "ffn_up_exps.bias", (f, n_expert), "norm")]
    return out


def _phi3(fx: ArchFixture) -> list[Tensor]:
    out: list[Tensor] = []
    _head(fx, out)
    e, f = fx.n_embd, fx.int_key("feed_forward_length")
    for i in range(fx.n_layer):
        p = _p(i)
        n_head, n_kv, hk, hv = _dims(fx, i)
        _norm(out, p + "attn_norm", e)
        _attn(out, p, e, e, n_kv * hk, n_kv * hv, fused=True)
        _norm(out, p + "ffn_norm", e)
        out += [(p + "ffn_down.weight", (f, e), "ffn_down"), (p + "ffn_up.weight", (e, 2 * f), "ffn")]
    return out


def _olmo2(fx: ArchFixture) -> list[Tensor]:
    out: list[Tensor] = []
    _head(fx, out, output=True)
    e, f = fx.n_embd, fx.int_key("feed_forward_length")
    for i in range(fx.n_layer):
        p = _p(i)
        n_head, n_kv, hk, hv = _dims(fx, i)
        _attn(out, p, e, e, n_kv * hk, n_kv * hv)
        _norm(out, p + "attn_q_norm", e)
        _norm(out, p + "attn_k_norm", n_kv * hk)
        _norm(out, p + "post_attention_norm", e)
        _ffn(out, p, e, f)
        _norm(out, p + "post_ffw_norm", e)
    return out


def _llama_like(fx: ArchFixture, *, qk_norm: int = 0, bias: bool = False) -> list[Tensor]:
    out: list[Tensor] = []
    _head(fx, out)
    e, f = fx.n_embd, fx.int_key("feed_forward_length")
    for i in range(fx.n_layer):
        p = _p(i)
        n_head, n_kv, hk, hv = _dims(fx, i)
        _norm(out, p + "attn_norm", e)
        _attn(out, p, e, hk * n_head, n_kv * hk, n_kv * hv, bias=bias)
        if qk_norm:
            _norm(out, p + "attn_q_norm", qk_norm)
            _norm(out, p + "attn_k_norm", qk_norm)
        _norm(out, p + "ffn_norm", e)
        _ffn(out, p, e, f)
    return out


def _gemma(fx: ArchFixture) -> list[Tensor]:
    return _llama_like(fx)


def _smollm3(fx: ArchFixture) -> list[Tensor]:
    return _llama_like(fx)


def _internlm2(fx: ArchFixture) -> list[Tensor]:
    return _llama_like(fx)


def _cohere2(fx: ArchFixture) -> list[Tensor]:
    out: list[Tensor] = []
    _head(fx, out, output=False)
    e, f = fx.n_embd, fx.int_key("feed_forward_length")
    for i in range(fx.n_layer):
        p = _p(i)
        n_head, n_kv, hk, hv = _dims(fx, i)
        _norm(out, p + "attn_norm", e)
        _attn(out, p, e, e, n_kv * hk, n_kv * hv)
        _ffn(out, p, e, f)
    return out


def _starcoder2(fx: ArchFixture) -> list[Tensor]:
    out: list[Tensor] = []
    _head(fx, out, norm_bias=True)
    e, f = fx.n_embd, fx.int_key("feed_forward_length")
    for i in range(fx.n_layer):
        p = _p(i)
        n_head, n_kv, hk, hv = _dims(fx, i)
        _norm(out, p + "attn_norm", e, bias=True)
        _attn(out, p, e, e, n_kv * hk, n_kv * hv, bias=True, o_bias=True)
        _norm(out, p + "ffn_norm", e, bias=True)
        _ffn(out, p, e, f, gate=False, bias=True)
    return out


def _exaone4(fx: ArchFixture) -> list[Tensor]:
    out: list[Tensor] = []
    _head(fx, out)
    e, f = fx.n_embd, fx.int_key("feed_forward_length")
    for i in range(fx.n_layer):
        p = _p(i)
        n_head, n_kv, hk, hv = _dims(fx, i)
        _attn(out, p, e, hk * n_head, n_kv * hk, n_kv * hv, o_in=e)
        _norm(out, p + "post_attention_norm", e)
        _norm(out, p + "attn_q_norm", hk)
        _norm(out, p + "attn_k_norm", hk)
        _ffn(out, p, e, f)
        _norm(out, p + "post_ffw_norm", e)
    return out


def _glm4(fx: ArchFixture) -> list[Tensor]:
    out: list[Tensor] = []
    _head(fx, out)
    e, f = fx.n_embd, fx.int_key("feed_forward_length")
    for i in range(fx.n_layer):
        p = _p(i)
        n_head, n_kv, hk, hv = _dims(fx, i)
        _norm(out, p + "attn_norm", e)
        _attn(out, p, e, hk * n_head, n_kv * hk, n_kv * hv, bias=True)
        _norm(out, p + "post_attention_norm", e)
        _norm(out, p + "ffn_norm", e)
        out += [(p + "ffn_down.weight", (f, e), "ffn_down"), (p + "ffn_up.weight", (e, 2 * f), "ffn")]
        _norm(out, p + "post_ffw_norm", e)
    return out


def _stablelm(fx: ArchFixture) -> list[Tensor]:
    out: list[Tensor] = []
    _head(fx, out, norm_bias=True, output=True)
    e, f = fx.n_embd, fx.int_key("feed_forward_length")
    for i in range(fx.n_layer):
        p = _p(i)
        n_head, n_kv, hk, hv = _dims(fx, i)
        _norm(out, p + "attn_norm", e, bias=True)
        _attn(out, p, e, e, n_kv * hk, n_kv * hv, bias=True)
        _norm(out, p + "ffn_norm", e, bias=True)
        _ffn(out, p, e, f)
    return out


def _olmoe(fx: ArchFixture) -> list[Tensor]:
    out: list[Tensor] = []
    _head(fx, out, output=True)
    e, f, n = fx.n_embd, fx.int_key("expert_feed_forward_length"), fx.int_key("expert_count")
    for i in range(fx.n_layer):
        p = _p(i)
        n_head, n_kv, hk, hv = _dims(fx, i)
        _norm(out, p + "attn_norm", e)
        _attn(out, p, e, e, n_kv * hk, n_kv * hv)
        _norm(out, p + "attn_q_norm", e)
        _norm(out, p + "attn_k_norm", e)
        _norm(out, p + "ffn_norm", e)
        _moe(out, p, e, f, n)
    return out


def _qwen2moe(fx: ArchFixture) -> list[Tensor]:
    out: list[Tensor] = []
    _head(fx, out, output=True)
    e, f, n = fx.n_embd, fx.int_key("expert_feed_forward_length"), fx.int_key("expert_count")
    f_sh = fx.int_key("expert_shared_feed_forward_length")
    for i in range(fx.n_layer):
        p = _p(i)
        n_head, n_kv, hk, hv = _dims(fx, i)
        _norm(out, p + "attn_norm", e)
        _attn(out, p, e, e, n_kv * hk, n_kv * hv, bias=True)
        _norm(out, p + "ffn_norm", e)
        _moe(out, p, e, f, n)
        out.append((p + "ffn_gate_inp_shexp.weight", (e,), "norm"))
        out += [(p + "ffn_gate_shexp.weight", (e, f_sh), "ffn"), (p + "ffn_down_shexp.weight", (f_sh, e), "ffn_down"),
                (p + "ffn_up_shexp.weight", (e, f_sh), "ffn")]
    return out


def _gptneox(fx: ArchFixture) -> list[Tensor]:
    out: list[Tensor] = []
    _head(fx, out, norm_bias=True, output=True)
    e, f = fx.n_embd, fx.int_key("feed_forward_length")
    for i in range(fx.n_layer):
        p = _p(i)
        _norm(out, p + "attn_norm", e, bias=True)
        _attn(out, p, e, e, e, e, fused=True, bias=True, o_bias=True)
        _norm(out, p + "ffn_norm", e, bias=True)
        out += [(p + "ffn_down.weight", (f, e), "ffn_down"), (p + "ffn_down.bias", (e,), "norm"),
                (p + "ffn_up.weight", (e, f), "ffn"), (p + "ffn_up.bias", (f,), "norm")]
    return out


def _glm4moe(fx: ArchFixture) -> list[Tensor]:
    """src/models/glm4-moe.cpp: a dense first block, MoE blocks with a shared expert, then the NextN (MTP) blocks
    (``nextn_predict_layers``, the last of ``block_count``), which llama.cpp skips unless it loads MTP layers."""
    out: list[Tensor] = []
    _head(fx, out)
    e, f, n = fx.n_embd, fx.int_key("feed_forward_length"), fx.int_key("expert_count")
    f_exp, n_shared = fx.int_key("expert_feed_forward_length"), fx.int_key("expert_shared_count")
    n_main = fx.n_layer - fx.int_key("nextn_predict_layers")
    for i in range(fx.n_layer):
        p = _p(i)
        n_head, n_kv, hk, hv = _dims(fx, i)
        _norm(out, p + "attn_norm", e)
        _attn(out, p, e, hk * n_head, n_kv * hk, n_kv * hv, o_in=hk * n_head, bias=True)
        _norm(out, p + "post_attention_norm", e)
        if i >= fx.int_key("leading_dense_block_count"):
            _moe(out, p, e, f_exp, n)
            out.append((p + "exp_probs_b.bias", (n,), "norm"))
            f_sh = f_exp * n_shared
            out += [(p + "ffn_gate_shexp.weight", (e, f_sh), "ffn"),
                    (p + "ffn_down_shexp.weight", (f_sh, e), "ffn_down"), (p + "ffn_up_shexp.weight", (e, f_sh), "ffn")]
        else:
            _ffn(out, p, e, f)
        if i >= n_main:
            out.append((p + "nextn.eh_proj.weight", (2 * e, e), "attn"))
            for t in ("enorm", "hnorm", "shared_head_norm"):
                _norm(out, p + f"nextn.{t}", e)
    return out


BUILDERS: dict[str, Callable[[ArchFixture], list[Tensor]]] = {
    "mamba": _mamba, "mamba2": _mamba2, "jamba": _jamba, "falcon-h1": _falcon_h1, "granitehybrid": _granite_hybrid,
    "nemotron_h": _nemotron_h, "lfm2": _lfm2, "rwkv7": _rwkv7, "qwen3next": _qwen3next, "gpt-oss": _gpt_oss,
    "phi3": _phi3, "olmo2": _olmo2, "gemma": _gemma, "smollm3": _smollm3, "internlm2": _internlm2,
    "cohere2": _cohere2, "starcoder2": _starcoder2, "exaone4": _exaone4, "glm4": _glm4, "stablelm": _stablelm,
    "olmoe": _olmoe, "qwen2moe": _qwen2moe, "gptneox": _gptneox, "glm4moe": _glm4moe,
}


# ---- the models (public config.json values, as the converter writes them) ----------------------------------

_EPS = {"attention.layer_norm_rms_epsilon": 1e-5, "attention.layer_norm_epsilon": 1e-5}


def _lfm2_kv() -> list[int]:
    # LiquidAI/LFM2-1.2B layer_types: attention at 2, 5, 8, 10, 12, 14 (full_attn_idxs), short conv elsewhere
    return [8 if i in (2, 5, 8, 10, 12, 14) else 0 for i in range(16)]


def _jamba_kv() -> list[int]:
    # ai21labs/AI21-Jamba-Mini-1.5: attn_layer_period 8, attn_layer_offset 4
    return [8 if i % 8 == 4 else 0 for i in range(32)]


def _granite_kv() -> list[int]:
    # ibm-granite/granite-4.0-h-micro layer_types: mostly "mamba", "attention" every ~10th layer (4 of 40)
    return [8 if i in (9, 19, 29, 39) else 0 for i in range(40)]


def _nemotron_h_layers() -> tuple[list[int], list[int]]:
    # nvidia/Nemotron-H-8B-Base-8K hybrid_override_pattern: M = Mamba-2, * = attention, - = MLP (52 blocks)
    pattern = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
    kv = [8 if c == "*" else 0 for c in pattern]
    ff = [21504 if c == "-" else 0 for c in pattern]
    return kv, ff


_NEMO_KV, _NEMO_FF = _nemotron_h_layers()

ARCH_FIXTURES: dict[str, ArchFixture] = {
    "Mamba-1.4B": ArchFixture(
        "mamba", 2048, 48, 50280, 1048576, builder="mamba", source="state-spaces/mamba-1.4b-hf config.json",
        keys={**_EPS, "ssm.conv_kernel": 4, "ssm.inner_size": 4096, "ssm.state_size": 16, "ssm.time_step_rank": 128},
        tied=True,
    ),
    "Mamba2-2.7B": ArchFixture(
        "mamba2", 2560, 64, 50288, 1048576, builder="mamba2", source="state-spaces/mamba2-2.7b config.json",
        keys={**_EPS, "ssm.conv_kernel": 4, "ssm.inner_size": 5120, "ssm.state_size": 128, "ssm.time_step_rank": 80,
              "ssm.group_count": 1},
        tied=True,
    ),
    "Jamba-Mini-1.5": ArchFixture(
        "jamba", 4096, 32, 65536, 262144, builder="jamba", source="ai21labs/AI21-Jamba-Mini-1.5 config.json",
        keys={**_EPS, "attention.head_count": 32, "attention.head_count_kv": _jamba_kv(), "feed_forward_length": 14336,
              "expert_count": 16, "expert_used_count": 2, "ssm.conv_kernel": 4, "ssm.inner_size": 8192,
              "ssm.state_size": 16, "ssm.time_step_rank": 256},
        tokenizer="llama", extra={"expert_layer_period": 2, "expert_layer_offset": 1},
    ),
    "Falcon-H1-0.5B": ArchFixture(
        "falcon-h1", 1024, 36, 32784, 16384, builder="falcon-h1", source="tiiuae/Falcon-H1-0.5B-Instruct config.json",
        keys={**_EPS, "attention.head_count": 8, "attention.head_count_kv": 2, "attention.key_length": 64,
              "attention.value_length": 64, "feed_forward_length": 2048, "ssm.conv_kernel": 4, "ssm.inner_size": 1536,
              "ssm.state_size": 128, "ssm.time_step_rank": 24, "ssm.group_count": 1},
    ),
    "granite-4.0-h-micro": ArchFixture(
        "granitehybrid", 2048, 40, 100352, 131072, builder="granitehybrid",
        source="ibm-granite/granite-4.0-h-micro config.json",
        keys={**_EPS, "attention.head_count": 32, "attention.head_count_kv": _granite_kv(), "feed_forward_length": 8192,
              "ssm.conv_kernel": 4, "ssm.inner_size": 4096, "ssm.state_size": 128, "ssm.time_step_rank": 64,
              "ssm.group_count": 1},
        tied=True,
    ),
    "Nemotron-H-8B": ArchFixture(
        "nemotron_h", 4096, 52, 131072, 8192, builder="nemotron_h", source="nvidia/Nemotron-H-8B-Base-8K config.json",
        keys={**_EPS, "attention.head_count": 32, "attention.head_count_kv": _NEMO_KV, "attention.key_length": 128,
              "attention.value_length": 128, "feed_forward_length": _NEMO_FF, "ssm.conv_kernel": 4,
              "ssm.inner_size": 8192, "ssm.state_size": 128, "ssm.time_step_rank": 128, "ssm.group_count": 8},
    ),
    "LFM2-1.2B": ArchFixture(
        "lfm2", 2048, 16, 65536, 128000, builder="lfm2", source="LiquidAI/LFM2-1.2B config.json",
        keys={**_EPS, "attention.head_count": 32, "attention.head_count_kv": _lfm2_kv(), "feed_forward_length": 8192,
              "shortconv.l_cache": 3},
        tied=True,
    ),
    "RWKV7-Goose-1.5B": ArchFixture(
        "rwkv7", 2048, 24, 65536, 1048576, builder="rwkv7", source="RWKV/RWKV7-Goose-World3-1.5B-HF config.json",
        keys={**_EPS, "feed_forward_length": 8192, "wkv.head_size": 64, "attention.decay_lora_rank": 96,
              "attention.iclr_lora_rank": 96, "attention.value_residual_mix_lora_rank": 64,
              "attention.gate_lora_rank": 256},
    ),
    "Qwen3-Next-80B-A3B": ArchFixture(
        "qwen3next", 2048, 48, 151936, 262144, builder="qwen3next", source="Qwen/Qwen3-Next-80B-A3B-Instruct config.json",
        keys={**_EPS, "attention.head_count": 16, "attention.head_count_kv": 2, "attention.key_length": 256,
              "attention.value_length": 256, "feed_forward_length": 5120, "expert_count": 512, "expert_used_count": 10,
              "expert_feed_forward_length": 512, "expert_shared_feed_forward_length": 512, "ssm.conv_kernel": 4,
              "ssm.inner_size": 4096, "ssm.state_size": 128, "ssm.time_step_rank": 32, "ssm.group_count": 16,
              "full_attention_interval": 4, "rope.dimension_count": 64},
        tokenizer_pre="qwen2",
    ),
    "gpt-oss-20b": ArchFixture(
        "gpt-oss", 2880, 24, 201088, 131072, builder="gpt-oss", source="openai/gpt-oss-20b config.json",
        keys={**_EPS, "attention.head_count": 64, "attention.head_count_kv": 8, "attention.key_length": 64,
              "attention.value_length": 64, "rope.dimension_count": 64, "feed_forward_length": 2880,
              "expert_count": 32, "expert_used_count": 4, "expert_feed_forward_length": 2880,
              "attention.sliding_window": 128},
        tokenizer_pre="gpt-4o",
    ),
    "Phi-3-mini-4k": ArchFixture(
        "phi3", 3072, 32, 32064, 4096, builder="phi3", source="microsoft/Phi-3-mini-4k-instruct config.json",
        keys={**_EPS, "attention.head_count": 32, "attention.head_count_kv": 32, "feed_forward_length": 8192,
              "rope.dimension_count": 96},
        tokenizer="llama", special_tokens=("<|endoftext|>",),
    ),
    "OLMo-2-7B": ArchFixture(
        "olmo2", 4096, 32, 100352, 4096, builder="olmo2", source="allenai/OLMo-2-1124-7B config.json",
        keys={**_EPS, "attention.head_count": 32, "attention.head_count_kv": 32, "feed_forward_length": 11008},
    ),
    "gemma-7b": ArchFixture(
        "gemma", 3072, 28, 256000, 8192, builder="gemma", source="google/gemma-7b config.json",
        keys={**_EPS, "attention.head_count": 16, "attention.head_count_kv": 16, "attention.key_length": 256,
              "attention.value_length": 256, "feed_forward_length": 24576},
        tokenizer="llama", tied=True,
    ),
    "command-r7b": ArchFixture(
        "cohere2", 4096, 32, 256000, 131072, builder="cohere2", source="CohereForAI/c4ai-command-r7b-12-2024 config.json",
        keys={**_EPS, "attention.head_count": 32, "attention.head_count_kv": 8, "feed_forward_length": 14336,
              "attention.sliding_window": 4096, "logit_scale": 0.25},
        tied=True,
    ),
    "starcoder2-7b": ArchFixture(
        "starcoder2", 4608, 32, 49152, 16384, builder="starcoder2", source="bigcode/starcoder2-7b config.json",
        keys={**_EPS, "attention.head_count": 36, "attention.head_count_kv": 4, "feed_forward_length": 18432},
    ),
    "EXAONE-4.0-32B": ArchFixture(
        "exaone4", 5120, 64, 102400, 131072, builder="exaone4", source="LGAI-EXAONE/EXAONE-4.0-32B config.json",
        keys={**_EPS, "attention.head_count": 40, "attention.head_count_kv": 8, "attention.key_length": 128,
              "attention.value_length": 128, "feed_forward_length": 27392, "attention.sliding_window": 4096},
    ),
    "SmolLM3-3B": ArchFixture(
        "smollm3", 2048, 36, 128256, 65536, builder="smollm3", source="HuggingFaceTB/SmolLM3-3B config.json",
        keys={**_EPS, "attention.head_count": 16, "attention.head_count_kv": 4, "feed_forward_length": 11008},
        tied=True,
    ),
    "GLM-4-9B-0414": ArchFixture(
        "glm4", 4096, 40, 151552, 32768, builder="glm4", source="THUDM/GLM-4-9B-0414 config.json",
        keys={**_EPS, "attention.head_count": 32, "attention.head_count_kv": 2, "attention.key_length": 128,
              "attention.value_length": 128, "feed_forward_length": 13696, "rope.dimension_count": 64},
    ),
    "internlm2-7b": ArchFixture(
        "internlm2", 4096, 32, 92544, 32768, builder="internlm2", source="internlm/internlm2-chat-7b config.json",
        keys={**_EPS, "attention.head_count": 32, "attention.head_count_kv": 8, "feed_forward_length": 14336},
        tokenizer="llama",
    ),
    "stablelm-2-1.6b": ArchFixture(
        "stablelm", 2048, 24, 100352, 4096, builder="stablelm", source="stabilityai/stablelm-2-1_6b config.json",
        keys={**_EPS, "attention.head_count": 32, "attention.head_count_kv": 32, "feed_forward_length": 5632,
              "rope.dimension_count": 16},
    ),
    "OLMoE-1B-7B": ArchFixture(
        "olmoe", 2048, 16, 50304, 4096, builder="olmoe", source="allenai/OLMoE-1B-7B-0924 config.json",
        keys={**_EPS, "attention.head_count": 16, "attention.head_count_kv": 16, "feed_forward_length": 1024,
              "expert_count": 64, "expert_used_count": 8, "expert_feed_forward_length": 1024},
    ),
    "Qwen1.5-MoE-A2.7B": ArchFixture(
        "qwen2moe", 2048, 24, 151936, 8192, builder="qwen2moe", source="Qwen/Qwen1.5-MoE-A2.7B config.json",
        keys={**_EPS, "attention.head_count": 16, "attention.head_count_kv": 16, "feed_forward_length": 5632,
              "expert_count": 60, "expert_used_count": 4, "expert_feed_forward_length": 1408,
              "expert_shared_feed_forward_length": 5632},
        tokenizer_pre="qwen2",
    ),
    "GLM-4.5-Air": ArchFixture(
        "glm4moe", 4096, 47, 151552, 131072, builder="glm4moe",
        source="zai-org/GLM-4.5-Air config.json (block_count: 46 layers + 1 NextN)",
        keys={**_EPS, "attention.head_count": 96, "attention.head_count_kv": 8, "attention.key_length": 128,
              "attention.value_length": 128, "rope.dimension_count": 64, "feed_forward_length": 10944,
              "expert_count": 128, "expert_used_count": 8, "expert_shared_count": 1,
              "expert_feed_forward_length": 1408, "leading_dense_block_count": 1, "expert_weights_scale": 1.0,
              "expert_weights_norm": True, "expert_gating_func": 2, "nextn_predict_layers": 1},
    ),
    "pythia-1.4b": ArchFixture(
        "gptneox", 2048, 24, 50304, 2048, builder="gptneox", source="EleutherAI/pythia-1.4b config.json",
        keys={**_EPS, "attention.head_count": 16, "feed_forward_length": 8192, "rope.dimension_count": 32,
              "use_parallel_residual": True},
    ),
}
