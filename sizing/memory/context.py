"""The context configuration a plan chooses and llama.cpp receives."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

FlashAttn = Literal["on", "off", "auto"]

EMBEDDING_SEQS = 8
"""Inputs one /v1/embeddings batch evaluates together (sequences of the embedding context)."""

N_CTX_PAD = 256
"""llama.cpp pads n_ctx up to a multiple of 256 (``llama_context`` constructor)."""


def pad(n: int, to: int = N_CTX_PAD) -> int:
    """``GGML_PAD``: round ``n`` up to a multiple of ``to``."""
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class ContextConfig:
    """llama.cpp context parameters that decide memory. Defaults are this service's, not llama.cpp's."""

    n_ctx: int
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: FlashAttn = "auto"
    n_ubatch: int = 512
    n_batch: int = 512
    n_seq_max: int = 1
    kv_unified: bool = False
    swa_full: bool = False
    offload_kqv: bool = True
    embeddings: bool = False
    """This is an embedding context (llama.cpp ``embeddings``): every token of a batch is an output."""
    embedding_tokens: int = 0
    """Beside this context, an embedding context for /v1/embeddings holding this many tokens per batch
    (its KV, compute and output buffers; ``embedding_config``). 0: none."""
    embedding_gpu: bool = False
    """The embedding context also when layers run on GPUs (its buffers then take card memory); off: only
    CPU-only plans get one (``applies_embedding``)."""
    draft_rows: int = 0
    """Logits rows beyond one per sequence, for the tokens self-speculation drafts into a step
    (``service.engine.speculation``): llama.cpp's output buffer grows to ``n_seq_max + draft_rows`` rows with the
    first batch that asks for them, which the engine sends at load (``output_buffer_bytes``)."""
    mtp: bool = False
    """The model's MTP head is loaded beside this context (``sizing.memory.mtp``): the NextN block's weights, an
    MTP context, the hidden rows it reads."""
    mtp_context: bool = False
    """This is an MTP context (``mtp_config``: llama.cpp's ``LLAMA_CONTEXT_TYPE_MTP``)."""

    def applies_embedding(self, cpu_only: bool) -> bool:
        """Whether a placement (CPU-only or not) gets the embedding context."""
        return self.embedding_tokens > 0 and (cpu_only or self.embedding_gpu)

    def embedding_config(self) -> "ContextConfig | None":
        """The embedding context: its cache holds one batch (n_ctx = n_batch = n_ubatch = ``embedding_tokens``),
        f16, one stream shared by ``EMBEDDING_SEQS`` inputs; cleared before every batch."""
        n = self.embedding_tokens
        if n <= 0:
            return None
        return ContextConfig(n_ctx=n, type_k="f16", type_v="f16", flash_attn=self.flash_attn, n_ubatch=n, n_batch=n,
                             n_seq_max=min(EMBEDDING_SEQS, n), kv_unified=True, offload_kqv=self.offload_kqv,
                             embeddings=True)

    @property
    def n_ctx_padded(self) -> int:
        """n_ctx as llama.cpp allocates it: padded to 256, and to n_seq_max streams of padded cells."""
        n = pad(max(self.n_ctx, 1))
        if self.kv_unified or self.n_seq_max <= 1:
            return n
        return self.n_ctx_seq * self.n_seq_max

    @property
    def n_ctx_seq(self) -> int:
        """Cells per sequence stream (``cparams.n_ctx_seq``)."""
        n = pad(max(self.n_ctx, 1))
        if self.kv_unified or self.n_seq_max <= 1:
            return n
        return pad(n // self.n_seq_max)

    @property
    def n_stream(self) -> int:
        """KV streams: 1 when unified, else one per sequence."""
        return 1 if self.kv_unified else max(self.n_seq_max, 1)

    @property
    def n_batch_effective(self) -> int:
        """``cparams.n_batch``: clamped to n_ctx (the requested one, before padding) for causal models."""
        return min(self.n_batch, max(self.n_ctx, 1))

    @property
    def n_ubatch_effective(self) -> int:
        """``cparams.n_ubatch``: n_ubatch clamped to the effective n_batch (``llama_context`` constructor)."""
        return min(self.n_ubatch or self.n_batch, self.n_batch_effective)

    def with_ctx(self, n_ctx: int) -> "ContextConfig":
        return replace(self, n_ctx=n_ctx)
