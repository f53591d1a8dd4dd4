"""The model spec: everything sizing needs from a GGUF header, as frozen values.

Produced by ``sizing.probe`` (the probe), consumed by the pure core. No
behaviour beyond derived properties.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Mapping


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: its name, shape (ggml order, ne0 first) and exact size."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    type_name: str
    n_bytes: int
    offset: int
    """Offset of the tensor's data, relative to its shard's data section."""
    shard: int = 0

    @property
    def layer(self) -> int | None:
        """The block index for ``blk.N.*`` tensors, else None."""
        if not self.name.startswith("blk."):
            return None
        head, _, _ = self.name[4:].partition(".")
        return int(head) if head.isdigit() else None


@dataclass(frozen=True)
class LayerSpec:
    """The attention / state shape of one block, as llama.cpp's hparams see it."""

    index: int
    n_head: int
    n_head_kv: int
    n_embd_head_k: int
    n_embd_head_v: int
    is_swa: bool = False
    is_recurrent: bool = False
    weights_bytes: int = 0
    """Exact bytes of the ``blk.{index}.*`` tensors."""
    expert_bytes: int = 0
    """Bytes of this block's MoE expert tensors (``ffn_*_exps``), part of weights_bytes."""
    n_ff: int = 0
    """``hparams.n_ff(il)`` (``feed_forward_length``, scalar or per layer)."""
    attention: bool | None = None
    """Whether ``create_memory``'s cache keeps K/V for this block (``sizing.model.arch.memory_layers``);
    None: not recurrent and with KV heads."""
    state: bool | None = None
    """Whether ``llama_memory_recurrent`` keeps r/s state for this block; None: ``is_recurrent``."""

    @property
    def has_kv(self) -> bool:
        """Whether this block keeps an attention KV cache."""
        if self.attention is not None:
            return self.attention
        return not self.is_recurrent and self.n_head_kv > 0

    @property
    def has_state(self) -> bool:
        """Whether this block keeps a recurrent (conv / SSM / WKV) state."""
        return self.is_recurrent if self.state is None else self.state


@dataclass(frozen=True)
class MlaSpec:
    """DeepSeek multi-head latent attention (``attention.kv_lora_rank`` and friends)."""

    kv_lora_rank: int
    n_embd_head_k_mla: int
    n_embd_head_v_mla: int
    n_rot: int


@dataclass(frozen=True)
class SsmSpec:
    """Recurrent (Mamba-style) state sizes from ``{arch}.ssm.*``."""

    d_conv: int
    d_inner: int
    d_state: int
    n_group: int
    dt_rank: int


@dataclass(frozen=True)
class StateSpec:
    """Per-sequence recurrent state of every state layer: F32 ``n_embd_r`` + ``n_embd_s`` elements
    (``llama_hparams::n_embd_r`` / ``n_embd_s``; ``sizing.model.arch.state_widths``)."""

    kind: str
    """``ssm`` (Mamba, Mamba-2, gated delta net), ``rwkv``, ``shortconv`` (LFM2), ``kda``, ``linear_attn``."""
    n_embd_r: int
    n_embd_s: int


@dataclass(frozen=True)
class ModelSource:
    """Where the spec was read from: a local path (and its shards) or a URL."""

    path: str | None = None
    shards: tuple[str, ...] = ()
    url: str | None = None

    @property
    def display(self) -> str:
        """A short human name for the source."""
        return self.url or self.path or "<memory>"


@dataclass(frozen=True)
class ModelSpec:
    """What a GGUF file declares, for sizing. Units are in the names."""

    architecture: str
    name: str
    n_ctx_train: int
    n_embd: int
    n_layer: int
    """Blocks in the main graph (``block_count`` less ``nextn_predict_layers``)."""
    n_layer_all: int
    """``block_count`` as written, NextN/MTP layers included."""
    n_vocab: int
    layers: tuple[LayerSpec, ...]
    tensors: tuple[TensorInfo, ...]
    file_size_bytes: int
    n_swa: int = 0
    n_expert: int = 0
    n_expert_used: int = 0
    mla: MlaSpec | None = None
    ssm: SsmSpec | None = None
    state: StateSpec | None = None
    arch_known: bool = True
    """Whether ``sizing.model.arch.ARCHS`` lists the architecture (else it is sized as a plain attention stack)."""
    file_type: int | None = None
    file_type_name: str | None = None
    alignment: int = 32
    data_offset: int = 0
    """Where tensor data starts in the first shard (the header's size, padded)."""
    version: int = 3
    source: ModelSource = field(default_factory=ModelSource)
    metadata: Mapping[str, object] = field(default_factory=dict, compare=False, repr=False)
    """Scalar metadata and short arrays, by key; long arrays are summarised."""

    @cached_property
    def weights_bytes(self) -> int:
        """Exact bytes of every tensor in the file."""
        return sum(t.n_bytes for t in self.tensors)

    @cached_property
    def nextn_weights_bytes(self) -> int:
        """Bytes of the NextN/MTP blocks (``blk.N.*`` for N >= ``n_layer``): every architecture that has them
        creates their tensors with ``TENSOR_SKIP`` unless the model is loaded with ``load_mtp``, and a skipped
        tensor is given no buffer (``llama_model_loader::create_tensor``). The engine does not load them."""
        return sum(layer.weights_bytes for layer in self.layers[self.n_layer:])

    @cached_property
    def loaded_weights_bytes(self) -> int:
        """What a load gives buffers: every tensor but the NextN/MTP blocks'."""
        return self.weights_bytes - self.nextn_weights_bytes

    @cached_property
    def n_params(self) -> int:
        """Parameters (elements) over every tensor."""
        n = 0
        for t in self.tensors:
            c = 1
            for d in t.shape:
                c *= d
            n += c
        return n

    @cached_property
    def token_embd_bytes(self) -> int:
        """Bytes of ``token_embd.weight`` (stays in host memory in llama.cpp)."""
        return sum(t.n_bytes for t in self.tensors if t.name.startswith("token_embd."))

    @cached_property
    def output_bytes(self) -> int:
        """Bytes of the output head (``output.weight``), 0 when tied to the embedding."""
        return sum(t.n_bytes for t in self.tensors if t.name == "output.weight")

    @cached_property
    def output_tied(self) -> bool:
        """True when the output head reuses ``token_embd`` (no ``output.weight``)."""
        return not any(t.name == "output.weight" for t in self.tensors)

    @cached_property
    def output_layer_bytes(self) -> int:
        """Bytes that llama.cpp's output slot holds: output norm and head (tied: a copy of token_embd)."""
        head = self.token_embd_bytes if self.output_tied else self.output_bytes
        norm = sum(t.n_bytes for t in self.tensors if t.name.startswith("output_norm."))
        return head + norm

    @cached_property
    def tensor_names(self) -> frozenset[str]:
        """Names of every tensor of the file (``blk.0.attn_q_norm.weight`` ...), for presence tests."""
        return frozenset(t.name for t in self.tensors)

    @cached_property
    def swa_layer_count(self) -> int:
        """How many main blocks use a sliding window."""
        return sum(1 for layer in self.layers[: self.n_layer] if layer.is_swa)

    @property
    def quantization(self) -> str:
        """The file's quantization name (``general.file_type``), or the dominant tensor type."""
        if self.file_type_name:
            return self.file_type_name
        by_type: dict[str, int] = {}
        for t in self.tensors:
            by_type[t.type_name] = by_type.get(t.type_name, 0) + t.n_bytes
        return max(by_type, key=by_type.__getitem__) if by_type else "unknown"
