"""A tiny BERT-shaped reranker, sparse and zero-weight, that llama.cpp loads and ranks with (meaninglessly).

``write_tiny_reranker(directory)`` writes a GGUF of architecture ``bert`` whose ``bert.pooling_type`` is 4
(``LLAMA_POOLING_TYPE_RANK``) with every tensor ``llama_model_bert::load_arch_tensors`` reads for it (llama.cpp
vendored by llama-cpp-python 0.3.36): token, token-type and position embeddings, the embedding norm, per layer
separate Q/K/V with biases, the attention output and its norm, the GELU feed-forward with biases and the layer
output norm, and the classification head rank pooling needs (``cls``, ``cls.output``: ``build_pooling``'s RANK
branch, one output, the score). Its tokenizer is WordPiece (``tokenizer.ggml.model = bert``: llama.cpp's WPM):
``[PAD] [UNK] [CLS] [SEP] [MASK]``, then every lower-case letter and digit as a word start (``▁a``, as the
converter writes BERT vocabularies) and as a continuation (``a``), and a few words. The weights are the file's
hole, zeros: every score is the classifier's bias, 0, and finite. With a ``seed`` they are written instead,
seeded random values (norms' weights 1): scores then differ from document to document, meaningless but
deterministic, and a ranking has an order to check.
"""

from __future__ import annotations

import os
import string
from pathlib import Path

import gguf
import numpy as np

from .fixtures import finish_sparse

RERANKER_NAME = "tiny-bert-reranker"
N_EMBD = 64
N_LAYER = 2
N_HEAD = 4
N_FF = 128
N_CTX_TRAIN = 512
WORDS = ("the", "sea", "light", "house", "keeper", "stairs", "dusk", "ship", "storm", "lamp")
SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def _vocab() -> tuple[list[str], list[int]]:
    chars = string.ascii_lowercase + string.digits + string.punctuation
    tokens = list(SPECIALS) + [f"\u2581{c}" for c in chars] + list(chars) + [f"\u2581{w}" for w in WORDS]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types


def _tensors(n_vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape in ggml order) of every tensor the bert loader reads for a ranking model."""
    e, f = N_EMBD, N_FF
    out: list[tuple[str, tuple[int, ...]]] = [
        ("token_embd.weight", (e, n_vocab)), ("token_types.weight", (e, 2)), ("position_embd.weight", (e, N_CTX_TRAIN)),
        ("token_embd_norm.weight", (e,)), ("token_embd_norm.bias", (e,)),
        ("cls.weight", (e, e)), ("cls.bias", (e,)), ("cls.output.weight", (e, 1)), ("cls.output.bias", (1,)),
    ]
    for i in range(N_LAYER):
        p = f"blk.{i}."
        for t in ("attn_q", "attn_k", "attn_v", "attn_output"):
            out += [(p + t + ".weight", (e, e)), (p + t + ".bias", (e,))]
        out += [(p + "attn_output_norm.weight", (e,)), (p + "attn_output_norm.bias", (e,)),
                (p + "ffn_up.weight", (e, f)), (p + "ffn_up.bias", (f,)),
                (p + "ffn_down.weight", (f, e)), (p + "ffn_down.bias", (e,)),
                (p + "layer_output_norm.weight", (e,)), (p + "layer_output_norm.bias", (e,))]
    return out


def _values(name: str, ne: tuple[int, ...], rng: "np.random.Generator") -> "np.ndarray":
    """A tensor's seeded values in numpy order: norms' weights 1 (their biases 0), the rest small normals."""
    shape = tuple(reversed(ne))
    if name.endswith("norm.weight"):
        return np.ones(shape, dtype=np.float32)
    if name.endswith("norm.bias"):
        return np.zeros(shape, dtype=np.float32)
    return (rng.standard_normal(shape) * 0.2).astype(np.float32)


def write_tiny_reranker(directory: str | os.PathLike[str], name: str = RERANKER_NAME, *, seed: int | None = None,
                        rerank_template: str | None = None) -> str:
    """Write (or reuse) ``{name}.gguf`` in ``directory``, f32; return its path. ``seed``: write seeded weights
    instead of the hole of zeros; ``rerank_template``: a ``tokenizer.chat_template.rerank`` (``{query}``,
    ``{document}``), which llama-server formats pairs with instead of ``[CLS] query [SEP] document``."""
    path = Path(directory) / f"{name}.gguf"
    if path.exists() and path.stat().st_size > 0:
        return str(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".gguf.part")
    tokens, types = _vocab()
    w = gguf.GGUFWriter(str(tmp), "bert")
    w.add_name(name)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_context_length(N_CTX_TRAIN)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_layer_norm_eps(1e-12)
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType.RANK)
    w.add_tokenizer_model("bert")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_type_count(2)
    w.add_pad_token_id(0)
    w.add_unk_token_id(1)
    w.add_bos_token_id(2)  # [CLS]
    w.add_sep_token_id(3)  # [SEP]
    w.add_mask_token_id(4)
    w.add_add_bos_token(True)
    w.add_add_sep_token(True)
    if rerank_template is not None:
        w.add_string("tokenizer.chat_template.rerank", rerank_template)
    if seed is not None:
        rng = np.random.default_rng(seed)
        for tname, ne in _tensors(len(tokens)):
            w.add_tensor(tname, _values(tname, ne, rng))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)
        return str(path)
    align = gguf.GGUF_DEFAULT_ALIGNMENT
    data_bytes = 0
    for tname, ne in _tensors(len(tokens)):
        nb = int(np.prod(ne)) * 4
        w.add_tensor_info(tname, tuple(reversed(ne)), np.dtype(np.float32), nb, raw_dtype=gguf.GGMLQuantizationType.F32)
        data_bytes += (nb + align - 1) // align * align
    return finish_sparse(w, tmp, path, data_bytes)  # the data section a hole, read as zeros


__all__ = ["RERANKER_NAME", "write_tiny_reranker"]
