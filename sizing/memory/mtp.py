"""An MTP head beside the model: the NextN block a GGUF carries, drafting for speculative decoding
(``service.engine.mtp``), and what it holds.

Loaded, it costs four things beside the model's usual buffers:

- the NextN block's weights, which a load without ``load_mtp`` skips (``ModelSpec.nextn_weights_bytes``), in the
  buffers of the device its layer slot is on (``Placement.slots``; repacked on a CPU as any block's);
- a second context of type ``LLAMA_CONTEXT_TYPE_MTP`` on the same model, at the main context's size, sequences and
  batch (``mtp_config``): a KV cache of the NextN layer alone, its compute buffer (a graph of its own, not
  mirrored here: llama.cpp's dry run of that context measures it, ``Calibration`` under its own key) and its
  output buffer (logits and a hidden row per output, llama.cpp's formula at creation);
- the main context's output buffer grown by one F32 hidden row of ``n_embd`` per batch token, which the head
  reads (``llama_set_embeddings_nextn`` unmasked: ``llama_context::output_reserve``), host memory.

Pure (values, no I/O).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ..units import mib
from .context import ContextConfig

if TYPE_CHECKING:
    from ..model.spec import ModelSpec

MTP_ARCHITECTURES = frozenset({"glm4moe", "deepseek2", "mimo2", "hy_v3", "bailingmoe3", "cohere2moe"})
"""Architectures whose NextN block the vendored llama.cpp builds as an MTP graph (``LLM_GRAPH_TYPE_DECODER_MTP``
in src/models/) with a KV cache of its own, one head, no recurrent state: what the engine drives. Left out: the
hybrid ones (qwen3next, qwen35, nemotron-h-moe: nothing is drafted where a recurrent state cannot take back a
rejected token), step35's chained heads, gemma-4's assistant (it shares the target's cache) and the sparse-
attention caches (deepseek32, deepseek4, glm-dsa, glm5-next), none of which run here to be tested."""


def mtp_supported(spec: "ModelSpec") -> bool:
    """Whether the file carries an MTP head the engine drafts with: one NextN block of an architecture of
    ``MTP_ARCHITECTURES``, no recurrent state."""
    return (spec.architecture in MTP_ARCHITECTURES and spec.n_layer_all - spec.n_layer == 1
            and not any(layer.has_state for layer in spec.layers))


def mtp_config(cfg: ContextConfig) -> ContextConfig:
    """The MTP context of a main context: its size, cache type, flash attention, sequences and batch; no
    embedding context, no drafted rows of its own (its drafts output one row per sequence)."""
    return replace(cfg, mtp=False, mtp_context=True, embeddings=False, embedding_tokens=0, embedding_gpu=False,
                   draft_rows=0)


def hidden_rows_bytes(spec: "ModelSpec", cfg: ContextConfig) -> int:
    """What the main context's output buffer grows by for the head's input: an F32 row of ``n_embd`` for every
    token of a batch (``n_batch`` as the context has it)."""
    return spec.n_embd * cfg.n_batch_effective * 4


@dataclass(frozen=True)
class MtpMemory:
    """The head's buffers per device (``CPU`` or a card's label), beside the model's."""

    weights: tuple[tuple[str, int], ...]
    """The NextN block's weights per buffer row (``CPU``, ``CPU_REPACK``, ``AMX``, ``CUDA0``...): in the model's
    buffers, so in the model's rows of llama.cpp's log."""
    context: tuple[tuple[str, int], ...]
    """The MTP context's KV, compute and output buffers per device (llama.cpp's dry run of it)."""
    kv_bytes: int
    compute_bytes: int
    output_bytes: int
    rows_bytes: int
    """The main context's hidden rows (host)."""
    pool: tuple[tuple[str, int], ...] = ()
    """Per card: the bound on the CUDA pool and cuBLAS workspace of the MTP context's own backend
    (``sizing.memory.gpu.cuda_pool_bound_bytes``), which llama.cpp's log does not show."""

    @property
    def weights_bytes(self) -> int:
        return sum(n for _, n in self.weights)

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + sum(n for _, n in self.context) + self.rows_bytes + sum(n for _, n in self.pool)

    def logged_on(self, device: str) -> int:
        """The MTP context's buffers on ``device`` as llama.cpp logs them at its creation."""
        return sum(n for d, n in self.context if d == device)

    def context_on(self, device: str) -> int:
        """What the head holds on ``device`` beside the model's buffers: its context's buffers, the CUDA pool
        bound on a card, the hidden rows on the host."""
        return (self.logged_on(device) + sum(n for d, n in self.pool if d == device)
                + (self.rows_bytes if device == "CPU" else 0))

    def to_json(self) -> dict[str, object]:
        return {"weights_mib": {b: mib(n) for b, n in self.weights}, "kv_mib": mib(self.kv_bytes),
                "compute_mib": mib(self.compute_bytes), "output_mib": mib(self.output_bytes),
                "hidden_rows_mib": mib(self.rows_bytes),
                "context_mib": {d: mib(n) for d, n in self.context},
                **({"gpu_pool_mib": {d: mib(n) for d, n in self.pool}} if self.pool else {}),
                "total_mib": mib(self.total_bytes)}


__all__ = ["MTP_ARCHITECTURES", "MtpMemory", "hidden_rows_bytes", "mtp_config", "mtp_supported"]
