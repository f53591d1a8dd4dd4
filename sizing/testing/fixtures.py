"""Header-only GGUF files of real model shapes, for tests and capacity planning.

``write_fixture("Qwen3-14B", directory)`` writes a GGUF whose header is what
the real model's would be (public hyperparameters, every tensor llama.cpp's
loader requires for the architecture with its shape and a realistic type, a
full-length tokenizer vocabulary) and whose data section is a hole: the file
is extended to its full size with ``truncate`` and so is sparse. llama.cpp's
no_alloc dry run (``service.engine.dryrun``) accepts it without reading a
weight, and the probe sizes it like the real file.

Tensor lists mirror the ``load_arch_tensors`` functions of ``src/models/*.cpp``
(llama.cpp vendored by llama-cpp-python 0.3.36); tokenizer keys mirror
``llama_vocab::impl::load`` (``src/llama-vocab.cpp``): a gpt2-style BPE
vocabulary needs ``tokenizer.ggml.merges``; a sentencepiece (``llama``) one
needs scores and token types, with the 256 ``<0xNN>`` byte tokens.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import gguf
import numpy as np

from .arch_fixtures import ARCH_FIXTURES, BUILDERS, ArchFixture

Quant = Literal["bf16", "q8_0", "q4_k_m"]
QUANTS: tuple[Quant, ...] = ("bf16", "q8_0", "q4_k_m")
_T = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class FixtureShape:
    """A model's public hyperparameters, as its GGUF declares them."""

    arch: str
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    tokenizer: Literal["gpt2", "llama"] = "gpt2"
    tokenizer_pre: str = "default"
    tied: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False
    n_swa: int = 0
    special_tokens: tuple[str, ...] = ()
    """Control tokens after the byte tokens (``_vocab``), e.g. FIM markers."""
    token_ids: dict[str, str] = field(default_factory=dict)
    """``tokenizer.ggml.{key}_token_id`` -> the spelling of the token it names (``fim_pre``: ``<|fim_prefix|>``)."""
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_expert_shared: int = 0
    n_layer_dense_lead: int = 0
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    rope_dim: int = 0
    head_dim_v_mla: int = 0
    extra: dict[str, object] = field(default_factory=dict)
    """More ``{arch}.`` keys: numbers as float32, lists as arrays (Qwen2-VL's ``rope.dimension_sections``)."""


FIXTURES: dict[str, FixtureShape] = {
    "Qwen3-14B": FixtureShape("qwen3", 5120, 40, 40, 8, 128, 17408, 151936, 40960, tokenizer_pre="qwen2", qk_norm=True),
    "Llama-3.1-8B": FixtureShape("llama", 4096, 32, 32, 8, 128, 14336, 128256, 131072, tokenizer_pre="llama-bpe"),
    "Qwen2.5-14B": FixtureShape("qwen2", 5120, 48, 40, 8, 128, 13824, 152064, 32768, tokenizer_pre="qwen2", qkv_bias=True),
    "gemma-2-9b": FixtureShape(
        "gemma2", 3584, 42, 16, 8, 256, 14336, 256000, 8192, tokenizer="llama", tied=True, post_norms=True, n_swa=4096,
        extra={"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    ),
    "gemma-3-27b": FixtureShape(
        "gemma3", 5376, 62, 32, 16, 128, 21504, 262208, 131072, tokenizer="llama", tied=True, post_norms=True,
        qk_norm=True, n_swa=1024,
    ),
    "Mistral-Nemo-12B": FixtureShape("llama", 5120, 40, 32, 8, 128, 14336, 131072, 1024000, tokenizer_pre="tekken"),
    "Qwen3-30B-A3B": FixtureShape(
        "qwen3moe", 2048, 48, 32, 4, 128, 6144, 151936, 40960, tokenizer_pre="qwen2", qk_norm=True,
        n_expert=128, n_expert_used=8, n_ff_exp=768,
    ),
    "DeepSeek-V2-Lite": FixtureShape(
        "deepseek2", 2048, 27, 16, 1, 576, 10944, 102400, 163840, tokenizer_pre="deepseek-llm",
        n_expert=64, n_expert_used=6, n_ff_exp=1408, n_expert_shared=2, n_layer_dense_lead=1,
        kv_lora_rank=512, rope_dim=64, head_dim_v_mla=128,
    ),
}


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte-level alphabet: the 256 strings a byte-level BPE vocabulary starts with."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def _vocab(shape: "FixtureShape | ArchFixture") -> tuple[list[str], list[float], list[int], list[str]]:
    """Tokens, scores, token types and merges of a synthetic vocabulary of ``n_vocab`` entries."""
    n = shape.n_vocab
    if shape.tokenizer == "llama":
        head = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
        types = [2, 3, 3] + [6] * 256
    else:
        head = _bytes_to_unicode()
        types = [1] * 256
    extra = list(getattr(shape, "special_tokens", ()))
    head = head + extra
    types = types + [3] * len(extra)
    tokens = head + [f"\u2581t{i}" for i in range(n - len(head))]
    types = types + [1] * (n - len(head))
    scores = [0.0] * n
    merges = [] if shape.tokenizer == "llama" else ["\u0120 t", "\u0120t h", "i n", "e r"]
    return tokens, scores, types, merges


def _qtype(quant: Quant, role: str, n_in: int) -> _T:
    """The type a tensor gets in a file of this quantization (llama.cpp's fallbacks when rows do not divide)."""
    if role == "norm":
        return _T.F32
    if quant == "bf16":
        return _T.BF16
    if quant == "q8_0":
        return _T.Q8_0 if n_in % 32 == 0 else _T.F16
    # A Q4_K_M-like mix: Q6_K for the output head and V/down projections, Q4_K elsewhere;
    # rows that 256 does not divide fall back to a 32-element type, as llama-quantize does.
    t = _T.Q6_K if role in ("output", "attn_v", "ffn_down") else _T.Q4_K
    if n_in % 256:
        t = _T.Q8_0 if t == _T.Q6_K else _T.Q5_0
        if n_in % 32:
            t = _T.F16
    return t


def _tensors(shape: FixtureShape) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape in ggml order ne0 first, role) of every tensor the loader requires."""
    s = shape
    e, hd = s.n_embd, s.head_dim
    out: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (e, s.n_vocab), "embd")]
    out.append(("output_norm.weight", (e,), "norm"))
    if not s.tied:
        out.append(("output.weight", (e, s.n_vocab), "output"))
    for i in range(s.n_layer):
        p = f"blk.{i}."
        out.append((p + "attn_norm.weight", (e,), "norm"))
        if s.kv_lora_rank:
            # DeepSeek-V2 MLA (src/models/deepseek2.cpp, is_mla): key_length_mla = nope + rope.
            nope = s.head_dim_v_mla  # qk_nope_head_dim equals v_head_dim in DeepSeek-V2
            k_mla = nope + s.rope_dim
            out.append((p + "attn_kv_a_norm.weight", (s.kv_lora_rank,), "norm"))
            out.append((p + "attn_q.weight", (e, s.n_head * k_mla), "attn"))
            out.append((p + "attn_kv_a_mqa.weight", (e, s.kv_lora_rank + s.rope_dim), "attn"))
            out.append((p + "attn_k_b.weight", (nope, s.kv_lora_rank, s.n_head), "attn"))
            out.append((p + "attn_v_b.weight", (s.kv_lora_rank, s.head_dim_v_mla, s.n_head), "attn_v"))
            out.append((p + "attn_output.weight", (s.n_head * s.head_dim_v_mla, e), "attn"))
        else:
            q, kv = s.n_head * hd, s.n_head_kv * hd
            out.append((p + "attn_q.weight", (e, q), "attn"))
            out.append((p + "attn_k.weight", (e, kv), "attn"))
            out.append((p + "attn_v.weight", (e, kv), "attn_v"))
            if s.qkv_bias:
                out += [(p + "attn_q.bias", (q,), "norm"), (p + "attn_k.bias", (kv,), "norm"), (p + "attn_v.bias", (kv,), "norm")]
            out.append((p + "attn_output.weight", (q, e), "attn"))
            if s.qk_norm:
                out += [(p + "attn_q_norm.weight", (hd,), "norm"), (p + "attn_k_norm.weight", (hd,), "norm")]
        if s.post_norms:
            out.append((p + "post_attention_norm.weight", (e,), "norm"))
            out.append((p + "post_ffw_norm.weight", (e,), "norm"))
        out.append((p + "ffn_norm.weight", (e,), "norm"))
        if s.n_expert and i >= s.n_layer_dense_lead:
            f = s.n_ff_exp
            out.append((p + "ffn_gate_inp.weight", (e, s.n_expert), "norm"))
            out.append((p + "ffn_gate_exps.weight", (e, f, s.n_expert), "ffn"))
            out.append((p + "ffn_up_exps.weight", (e, f, s.n_expert), "ffn"))
            out.append((p + "ffn_down_exps.weight", (f, e, s.n_expert), "ffn_down"))
            if s.n_expert_shared:
                fs = f * s.n_expert_shared
                out.append((p + "ffn_gate_shexp.weight", (e, fs), "ffn"))
                out.append((p + "ffn_up_shexp.weight", (e, fs), "ffn"))
                out.append((p + "ffn_down_shexp.weight", (fs, e), "ffn_down"))
        else:
            out.append((p + "ffn_gate.weight", (e, s.n_ff), "ffn"))
            out.append((p + "ffn_up.weight", (e, s.n_ff), "ffn"))
            out.append((p + "ffn_down.weight", (s.n_ff, e), "ffn_down"))
    return out


def _nbytes(ne: tuple[int, ...], t: _T) -> int:
    block, size = gguf.GGML_QUANT_SIZES[t]
    n = 1
    for d in ne[1:]:
        n *= d
    return ne[0] // block * size * n


def _metadata(w: gguf.GGUFWriter, name: str, shape: FixtureShape, quant: Quant) -> None:
    s, a = shape, shape.arch
    w.add_name(name)
    w.add_file_type({"bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                     "q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M}[quant])
    w.add_context_length(s.n_ctx_train)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1000000.0)
    if s.kv_lora_rank:
        w.add_key_length(s.kv_lora_rank + s.rope_dim)
        w.add_value_length(s.kv_lora_rank)
        w.add_uint32(f"{a}.attention.key_length_mla", s.head_dim_v_mla + s.rope_dim)
        w.add_uint32(f"{a}.attention.value_length_mla", s.head_dim_v_mla)
        w.add_kv_lora_rank(s.kv_lora_rank)
        w.add_rope_dimension_count(s.rope_dim)
        w.add_leading_dense_block_count(s.n_layer_dense_lead)
        w.add_expert_shared_count(s.n_expert_shared)
        w.add_expert_weights_scale(1.0)
    else:
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)
        w.add_rope_dimension_count(s.head_dim)
    if s.n_expert:
        w.add_expert_count(s.n_expert)
        w.add_expert_used_count(s.n_expert_used)
        w.add_expert_feed_forward_length(s.n_ff_exp)
    if s.n_swa:
        w.add_sliding_window(s.n_swa)
    for k, v in s.extra.items():
        add_key(w, f"{a}.{k}", float(v) if isinstance(v, int) and not isinstance(v, bool) else v)  # ints: floats
    _add_vocab(w, s)


def add_key(w: gguf.GGUFWriter, key: str, v: object) -> None:
    """One metadata key, typed by its Python value: bool, uint32, float32, string or array."""
    if isinstance(v, bool):
        w.add_bool(key, v)
    elif isinstance(v, int):
        w.add_uint32(key, v)
    elif isinstance(v, float):
        w.add_float32(key, v)
    elif isinstance(v, str):
        w.add_string(key, v)
    elif isinstance(v, list):
        w.add_array(key, v)
    else:  # pragma: no cover - a fixture typo
        raise TypeError(f"{key}: unsupported value {v!r}")


def _add_vocab(w: gguf.GGUFWriter, shape: "FixtureShape | ArchFixture") -> None:
    """The synthetic vocabulary (``_vocab``), its tokenizer and BOS/EOS ids."""
    tokens, scores, types, merges = _vocab(shape)
    w.add_tokenizer_model(shape.tokenizer)
    w.add_tokenizer_pre(shape.tokenizer_pre)
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    if merges:
        w.add_token_merges(merges)
    w.add_bos_token_id(1 if shape.tokenizer == "llama" else 0)
    w.add_eos_token_id(2 if shape.tokenizer == "llama" else 1)
    for key, spelling in getattr(shape, "token_ids", {}).items():
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", tokens.index(spelling))


def _arch_metadata(w: gguf.GGUFWriter, name: str, fx: ArchFixture, quant: Quant) -> None:
    a = fx.arch
    w.add_name(name)
    w.add_file_type({"bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                     "q4_k_m": gguf.LlamaFileType.MOSTLY_Q4_K_M}[quant])
    w.add_context_length(fx.n_ctx_train)
    w.add_embedding_length(fx.n_embd)
    w.add_block_count(fx.n_layer)
    for k, v in fx.keys.items():
        add_key(w, f"{a}.{k}", v)
    _add_vocab(w, fx)


ALL_FIXTURES: tuple[str, ...] = (*FIXTURES, *ARCH_FIXTURES)
"""Every fixture name: the mirrored architectures' shapes, then ``arch_fixtures``' models."""


def fixture_filename(name: str, quant: Quant = "bf16") -> str:
    """The file name ``write_fixture`` uses: ``{name}-{quant}.gguf``."""
    return f"{name}-{quant}.gguf"


TINY_QWEN2VL = FixtureShape("qwen2vl", 128, 2, 4, 4, 32, 256, 512, 2048, tokenizer="llama", qkv_bias=True,
                            extra={"rope.dimension_sections": [4, 6, 6, 0]})
"""A Qwen2-VL text model as small as ``TINY_LLAMA``: M-RoPE (its head's 16 rotary pairs in sections for time,
height and width), so that an image takes fewer positions than tokens; zeros, for the engine's positions."""

TINY_LLAMA = FixtureShape("llama", 128, 2, 4, 4, 32, 256, 512, 2048, tokenizer="llama")
"""A llama-shaped model small enough to load and run in a blink: 2 layers of 128 (heads of 32, so every KV cache type divides them), a 512-token sentencepiece
vocabulary (the 256 byte tokens among them). Written by ``write_fixture`` its weights are the file's hole, read as
zeros: llama.cpp loads it, evaluates prompts and samples tokens (meaningless ones), like any model."""


TINY_GLM4MOE = ArchFixture(
    "glm4moe", 128, 3, 512, 2048, builder="glm4moe", source="made up: GLM-4.5's layout at TINY_LLAMA's size",
    keys={"attention.layer_norm_rms_epsilon": 1e-5, "attention.head_count": 4, "attention.head_count_kv": 2,
          "attention.key_length": 32, "attention.value_length": 32, "rope.dimension_count": 16,
          "feed_forward_length": 256, "expert_count": 4, "expert_used_count": 2, "expert_shared_count": 1,
          "expert_feed_forward_length": 64, "leading_dense_block_count": 1, "expert_weights_scale": 1.0,
          "expert_weights_norm": True, "expert_gating_func": 2, "nextn_predict_layers": 1},
    tokenizer="llama")
"""GLM-4.5's layout as small as ``TINY_LLAMA``: a dense block, a MoE block, and a NextN (MTP) block last, which
llama.cpp allocates only when it loads MTP layers; zeros, so that a real load shows what it allocates."""

FIM_TOKENS = {"fim_pre": "<|fim_prefix|>", "fim_suf": "<|fim_suffix|>", "fim_mid": "<|fim_middle|>",
              "fim_pad": "<|fim_pad|>", "fim_rep": "<|repo_name|>", "fim_sep": "<|file_sep|>"}
"""Qwen2.5-Coder's FIM markers, by the GGUF key that names each (``llama_vocab::impl::load`` reads the ids)."""

TINY_LLAMA_FIM = FixtureShape("llama", 128, 2, 4, 4, 32, 256, 512, 2048, tokenizer="llama",
                              special_tokens=tuple(FIM_TOKENS.values()), token_ids=dict(FIM_TOKENS))
"""``TINY_LLAMA`` with FIM tokens in its vocabulary, their ids in the header: llama.cpp infills with it."""


def write_fixture(name: str, directory: str | os.PathLike[str], quant: Quant = "bf16",
                  shape: FixtureShape | ArchFixture | None = None) -> str:
    """Write (or reuse) the sparse header-only GGUF of model ``name`` in ``directory``; return its path.

    ``shape``: a shape of one's own (``TINY_LLAMA``, ``TINY_GLM4MOE``, or a made-up size), written under ``name``."""
    if shape is None and name not in FIXTURES and name not in ARCH_FIXTURES:
        raise KeyError(f"unknown fixture {name!r}; one of {', '.join(ALL_FIXTURES)}")
    if quant not in QUANTS:
        raise KeyError(f"unknown quantization {quant!r}; one of {', '.join(QUANTS)}")
    path = Path(directory) / fixture_filename(name, quant)
    if path.exists() and path.stat().st_size > 0:
        return str(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".gguf.part")
    if isinstance(shape, FixtureShape) or (shape is None and name in FIXTURES):
        shape = shape or FIXTURES[name]
        w = gguf.GGUFWriter(str(tmp), shape.arch)
        _metadata(w, name, shape, quant)
        tensors = _tensors(shape)
    else:
        fx = shape or ARCH_FIXTURES[name]
        w = gguf.GGUFWriter(str(tmp), fx.arch)
        _arch_metadata(w, name, fx, quant)
        tensors = BUILDERS[fx.builder](fx)
    data_bytes = 0
    align = gguf.GGUF_DEFAULT_ALIGNMENT
    for tname, ne, role in tensors:
        t = _T.F32 if role == "norm" else _qtype(quant, role, ne[0])
        if role == "embd" and quant == "q4_k_m":
            t = _T.Q4_K if ne[0] % 256 == 0 else _T.Q8_0
        nb = _nbytes(ne, t)
        # GGUFWriter takes numpy order (it reverses the shape); the dtype only matters for unquantized types.
        w.add_tensor_info(tname, tuple(reversed(ne)), np.dtype(np.float32), nb, raw_dtype=t)
        data_bytes += (nb + align - 1) // align * align
    return finish_sparse(w, tmp, path, data_bytes)


def finish_sparse(w: gguf.GGUFWriter, tmp: Path, path: Path, data_bytes: int) -> str:
    """Write ``w``'s header, keys and tensor infos to ``tmp``, extend it by ``data_bytes`` of tensor data after
    the aligned header, and move it to ``path``. The data section is a hole: the loader's bounds checks pass, a
    no_alloc load reads nothing and a real one reads zeros."""
    align = gguf.GGUF_DEFAULT_ALIGNMENT
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    assert w.fout is not None
    f = w.fout[0]
    f.flush()
    header_end = f.tell()
    w.close()
    os.truncate(tmp, (header_end + align - 1) // align * align + data_bytes)
    os.replace(tmp, path)
    return str(path)


def write_mtp_fixture(directory: str | os.PathLike[str]) -> str:
    """``TINY_GLM4MOE`` with weights that make its NextN head guess exactly what its trunk predicts, for MTP
    drafting's tests: random token embeddings and output head (scaled so that a guess is sure), unit norms where
    the signal passes, the head's ``eh_proj`` the identity on the token half, every other weight zero. The trunk's
    blocks then add nothing, so the model's next token is a function of its last token alone (its embedding,
    normalised, through the output head), and the head computes the same function of the token it is given:
    every confident guess is the model's own choice. Meaningless text, a few MiB."""
    import numpy as np

    path = write_fixture("tiny-glm4moe-mtp", directory, "bf16", shape=TINY_GLM4MOE)
    reader = gguf.GGUFReader(path, "r+")
    tensors = {t.name: t for t in reader.tensors}
    if not np.any(tensors["blk.2.nextn.eh_proj.weight"].data):  # a file written before: already set
        n_embd, n_vocab = TINY_GLM4MOE.n_embd, TINY_GLM4MOE.n_vocab
        rng = np.random.default_rng(0)
        nextn = f"blk.{TINY_GLM4MOE.n_layer - 1}.nextn"
        eh = np.zeros((n_embd, 2 * n_embd))
        eh[np.arange(n_embd), np.arange(n_embd)] = 1.0
        for name, value in (("token_embd.weight", rng.standard_normal((n_vocab, n_embd))),
                            ("output.weight", 3.0 * rng.standard_normal((n_vocab, n_embd))),
                            ("output_norm.weight", np.ones(n_embd)), (f"{nextn}.enorm.weight", np.ones(n_embd)),
                            (f"{nextn}.shared_head_norm.weight", np.ones(n_embd)), (f"{nextn}.eh_proj.weight", eh)):
            t = tensors[name]
            if t.tensor_type == _T.BF16:  # the upper half of each F32
                bits = (value.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
                t.data[...] = bits.view(np.uint8).reshape(t.data.shape)
            else:
                t.data[...] = value.astype(np.float32).reshape(t.data.shape)
        reader.data.flush()
    return path
