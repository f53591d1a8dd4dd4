"""A speculative-decoding draft model beside the main one: where it goes, its context, and what it holds.

The engine (``service.engine.draft``) loads the draft whole on one device: the card that holds the main model's
output layer, or host memory when the output layer is there (a CPU-only or mostly-host placement). Its context has
the main context's size, cache type, sequences and batch (every slot drafts in its own sequence), and neither an
embedding context nor drafted rows of its own. Its bytes are lines of the plan beside the main model's on that
device (``DeviceMemory.draft_model_bytes``, ``MemoryEstimate.draft``: a ``DraftMemory``, in ``estimate``), so the largest context is searched with
them counted.

Pure (values, no I/O).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from .context import ContextConfig
from .placement import Placement

if TYPE_CHECKING:
    from ..model.spec import ModelSpec
    from .measured import Calibration


@dataclass(frozen=True)
class DraftModel:
    """The draft model a plan sizes: its probed header and, where its graph is not mirrored here, llama.cpp's
    measured figures for it (a calibration of its own file)."""

    spec: "ModelSpec" = field(compare=False, repr=False)
    path: str = ""
    """The file the engine loads (shown in the plan; the pure code never opens it)."""
    calibration: "Calibration | None" = field(default=None, compare=False, repr=False)
    name: str = ""

    @property
    def label(self) -> str:
        return self.name or self.spec.name


def draft_placement(main: Placement, draft_layers: int, n_layer_all: int) -> tuple[Placement, int | None]:
    """The draft's placement for a main placement, and the main plan's GPU position it is on (None: the host).

    Whole on the card that holds the main model's output layer (the last slot, ``Placement.slots``): the draft's
    logits are compared there with the main model's anyway, and under a split it is the last card. With the
    output layer in host memory (no cards, or a partial offload that left it there), whole in host memory."""
    out = main.slots(n_layer_all)[n_layer_all]
    if out is None:
        return Placement(), None
    return Placement(gpus=(main.gpus[out],), n_gpu_layers=draft_layers + 1, tensor_split=(1.0,)), out


def draft_config(cfg: ContextConfig) -> ContextConfig:
    """The draft's context: the main one's size, cache type, flash attention, sequences and batch; no embedding
    context and no drafted rows (its steps output one row per sequence)."""
    return replace(cfg, embedding_tokens=0, embedding_gpu=False, draft_rows=0, embeddings=False)
