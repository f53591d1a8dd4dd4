"""A multimodal projector (``mmproj-*.gguf``): the vision tower and projector llama.cpp's mtmd loads beside a model.

The value a probe of the file's header gives (``sizing.probe.projector``): its projector type, the tower's shape,
the images it takes and the tokens one image becomes, and its weights' bytes. Keys mirror ``tools/mtmd/clip.cpp``
``clip_model_loader::load_hparams`` (llama.cpp vendored by llama-cpp-python 0.3.36).

Pure (values, no I/O).
"""

from __future__ import annotations

from dataclasses import dataclass

FIXED_SIZE_TYPES = {"gemma3": 4}
"""Projector types whose every image is resized to one ``image_size`` square (``mtmd_image_preprocessor_fixed_size``),
with their default ``n_merge`` (``load_hparams``: gemma3 pools 4x4 patches into one token)."""


@dataclass(frozen=True)
class ProjectorSpec:
    """A projector file's header, as mtmd reads it."""

    path: str
    projector_type: str
    n_embd: int
    n_ff: int
    n_layer: int
    n_head: int
    image_size: int
    patch_size: int
    n_merge: int
    n_embd_text: int
    """The language model's input embedding width it projects to (``clip.vision.projection_dim``); mtmd refuses a
    model of another width (``mtmd_context``: "mismatch between text model (n_embd = ...)")."""
    weights_bytes: int
    """Every tensor's ``ggml_nbytes`` (what ``clip_model_loader`` logs as ``model size`` and counts in its memory)."""
    file_size: int = 0

    @property
    def fixed_size(self) -> bool:
        return self.projector_type in FIXED_SIZE_TYPES

    @property
    def n_patches(self) -> int:
        """Patches of the largest image the tower encodes in one pass (the warmup's ``image_size`` square)."""
        side = self.image_size // self.patch_size if self.patch_size else 0
        return side * side

    @property
    def token_pixels(self) -> int:
        """The pixels one image token covers: a patch, merged ``n_merge`` x ``n_merge``."""
        return (self.patch_size * max(self.n_merge, 1)) ** 2

    @property
    def tokens_per_image(self) -> int | None:
        """Context tokens one image takes (without the begin/end-of-image text tokens mtmd wraps it in); None for
        a dynamic-resolution type, whose count depends on the image (mtmd's tokenizer gives it)."""
        if not self.fixed_size or not self.patch_size or not self.n_merge:
            return None
        side = self.image_size // self.patch_size // self.n_merge
        return side * side

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    def to_json(self) -> dict[str, object]:
        return {"path": self.path, "projector_type": self.projector_type, "image_size": self.image_size,
                "patch_size": self.patch_size, "n_merge": self.n_merge, "n_layer": self.n_layer,
                "n_embd": self.n_embd, "n_head": self.n_head, "n_embd_text": self.n_embd_text,
                "tokens_per_image": self.tokens_per_image, "weights_bytes": self.weights_bytes}
