"""A vision projector beside the model (``mmproj``): its weights and its compute buffer, and where they go.

mtmd (``tools/mtmd``) loads the projector as a CLIP model of its own (``clip_init``): every tensor the loader takes
in one weights buffer on its backend (``clip_model_loader::load_tensors``: ``ggml_nbytes`` each, counted in
``clip_ctx::mem_usage``), and one compute buffer, reserved at load for the largest image the tower takes
(``warmup``: the ``warmup_image_size`` square; ``reserve_compute_meta``'s ``compute buffer size`` line). llama.cpp's
own fit counts the same two (``mtmd_get_memory_usage``: ``mem_usage`` + ``mem_compute``).

The compute buffer follows the tower's graph through ggml's allocator and moves with flash attention by an order of
magnitude (SigLIP at 896 px, 16 heads: 121.25 MiB with it, 1132.00 MiB without, measured on the CPU backend), so it
is llama.cpp's figure, measured by mtmd's warmup on the backend the projector runs on (``figures``). Without one the
plan carries a bound: the attention scores of every head (without flash attention) and eight activations of the
widest layer for every patch, f32; above every measured figure of a fixed-size projector
(``tests/sizing/plan/test_projector_plan.py``). A dynamic-resolution projector's warmup image is not its ``image_size``
(Qwen2.5-VL warms up at 1288 px): its bound is for the largest image such types take by default
(``DYNAMIC_MAX_TOKENS``), several times what is measured; its figure is measured where it can be, with images
capped to the warmup's (``image_max_tokens``).

Where: the card of the model's output layer (as the draft model, ``sizing.memory.draft``), or host memory when the
model has no card there or ``offload`` is off (llama-server's ``--no-mmproj-offload``).

Pure (values, no I/O).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Mapping

from ..model.projector import ProjectorSpec
from ..units import mib


@dataclass(frozen=True)
class Projector:
    """The projector a plan sizes: its probed header and llama.cpp's measured compute buffers for it."""

    spec: ProjectorSpec = field(repr=False)
    offload: bool = True
    """On the model's card (False: host memory, whatever the model's placement)."""
    figures: Mapping[tuple[str, bool], int] = field(default_factory=dict, compare=False, repr=False)
    """(backend kind, flash attention) -> compute buffer bytes mtmd reserved (``CPU`` or ``CUDA``)."""
    image_max_tokens: int | None = None
    """The cap on an image's tokens the figures were measured with (``sizing.probe.mtmd.warmup_cap``: a dynamic-
    resolution projector whose largest image is beyond its warmup's), which the engine loads with."""

    @property
    def path(self) -> str:
        return self.spec.path


DYNAMIC_MAX_TOKENS = 4096
"""The tokens of the largest image a dynamic-resolution type takes by default, the largest of those measured here
(Qwen2.5-VL's ``image_max_pixels`` 3,211,264 over 28 x 28 pixels a token; Pixtral's is 1,024)."""


def compute_bound_bytes(spec: ProjectorSpec, flash_attn: bool) -> int:
    """An upper bound on the tower's compute buffer for its largest image, where none is measured: the
    ``image_size`` square for a fixed-size type; ``DYNAMIC_MAX_TOKENS`` tokens' patches for the others (whose
    warmup is not their ``image_size``: Qwen2.5-VL's 560 against a 1288 px warmup)."""
    n = max(spec.n_patches if spec.fixed_size else max(spec.n_patches, DYNAMIC_MAX_TOKENS * spec.n_merge ** 2), 1)
    widest = max(spec.n_ff, 3 * spec.n_embd, spec.n_embd_text)
    scores = 0 if flash_attn else n * n * max(spec.n_head, 1) * 4
    return scores + 8 * n * widest * 4


@dataclass(frozen=True)
class ProjectorMemory:
    """The projector's lines of a plan: on one device, its weights and its compute buffer."""

    path: str
    device: str
    """``CPU`` or the card's label (``CUDA0``)."""
    flash_attn: bool
    weights_bytes: int
    compute_bytes: int
    compute_source: Literal["measured", "bound"]
    tokens_per_image: int | None
    projector_type: str = ""
    image_max_tokens: int | None = None
    """mtmd's ``image_max_tokens`` the engine loads with (None: the projector's own limit)."""

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.compute_bytes

    @property
    def use_gpu(self) -> bool:
        return self.device != "CPU"

    def to_json(self) -> dict[str, object]:
        return {"path": self.path, "projector_type": self.projector_type, "device": self.device,
                "flash_attn": self.flash_attn, "weights_mib": mib(self.weights_bytes),
                "compute_mib": mib(self.compute_bytes), "compute_source": self.compute_source,
                "tokens_per_image": self.tokens_per_image, "image_max_tokens": self.image_max_tokens,
                "total_mib": mib(self.total_bytes)}


def projector_memory(projector: Projector, device: str, flash_attn: bool) -> ProjectorMemory:
    """The projector's buffers on ``device`` (its label) with flash attention on or off."""
    kind = "CPU" if device == "CPU" else "".join(c for c in device if not c.isdigit())
    measured = projector.figures.get((kind, flash_attn))
    spec = projector.spec
    return ProjectorMemory(
        path=spec.path, device=device, flash_attn=flash_attn, weights_bytes=spec.weights_bytes,
        compute_bytes=measured if measured is not None else compute_bound_bytes(spec, flash_attn),
        compute_source="measured" if measured is not None else "bound", tokens_per_image=spec.tokens_per_image,
        projector_type=spec.projector_type, image_max_tokens=projector.image_max_tokens)
