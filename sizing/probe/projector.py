"""From a ``mmproj-*.gguf`` header to a ``ProjectorSpec`` (no weight read).

Mirrors ``clip_model_loader`` (``tools/mtmd/clip.cpp`` of the llama.cpp vendored by llama-cpp-python 0.3.36): the
required keys and their defaults, and the same refusals (an audio-only file, an unknown projector type, the
sanity checks on sizes).
"""

from __future__ import annotations

import os

from ..errors import UnsupportedModelError
from ..model.projector import FIXED_SIZE_TYPES, ProjectorSpec
from .gguf import read_header, tensor_nbytes
from .reader import GGUFHeader
from .sources import FileSource

PROJECTOR_TYPES = frozenset({
    "mlp", "ldp", "ldpv2", "resampler", "adapter", "qwen2vl_merger", "qwen2.5vl_merger", "qwen3vl_merger", "ling3vl",
    "step3vl", "gemma3", "gemma3nv", "gemma4v", "gemma4uv", "phi4", "idefics3", "pixtral", "internvl", "llama4",
    "qwen2.5o", "lfm2", "kimivl", "paddleocr", "lightonocr", "cogvlm", "janus_pro", "dots_ocr", "dots3note_v",
    "deepseekocr", "deepseekocr2", "deepseek4v", "glm4v", "glm5v", "youtuvl", "kimik25", "nemotron_v2_vl",
    "exaone4_5", "hunyuanvl", "minicpmv4_6", "mimovl", "minimax_m3", "granite4_vision"})
"""Vision projector types mtmd knows (``clip-impl.h`` ``PROJECTOR_TYPE_NAMES``, the vision ones)."""


def _u32(md: dict[str, object], key: str, src: str, default: int | None = None) -> int:
    v = md.get(key, default)
    if v is None:
        raise UnsupportedModelError(f"{src}: projector has no {key}")
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise UnsupportedModelError(f"{src}: projector key {key} is {v!r}, not a count")
    return v


def projector_spec(header: GGUFHeader, path: str) -> ProjectorSpec:
    """The projector a header declares; ``UnsupportedModelError`` where mtmd would refuse the file."""
    md = header.metadata
    src = path
    if md.get("general.architecture") != "clip":
        raise UnsupportedModelError(f"{src}: not a projector: general.architecture is {md.get('general.architecture')!r}, "
                                    "not 'clip'")
    if md.get("clip.has_vision_encoder") is not True:
        raise UnsupportedModelError(f"{src}: projector has no vision encoder (clip.has_vision_encoder)")
    ptype = md.get("clip.projector_type") or md.get("clip.vision.projector_type")
    if not isinstance(ptype, str) or ptype not in PROJECTOR_TYPES:
        raise UnsupportedModelError(f"{src}: unknown vision projector type {ptype!r}")
    image_size = _u32(md, "clip.vision.image_size", src)
    patch_size = _u32(md, "clip.vision.patch_size", src)
    if image_size > 8192 or not 0 < patch_size < 65536:
        raise UnsupportedModelError(f"{src}: projector image_size {image_size} / patch_size {patch_size} out of range")
    n_merge = _u32(md, "clip.vision.projector.scale_factor", src, FIXED_SIZE_TYPES.get(ptype, 1))
    if ptype not in FIXED_SIZE_TYPES:
        n_merge = _u32(md, "clip.vision.spatial_merge_size", src, n_merge)
    weights = sum(tensor_nbytes(t.name, t.shape, t.ggml_type) for t in header.tensors)
    return ProjectorSpec(
        path=path, projector_type=ptype, n_embd=_u32(md, "clip.vision.embedding_length", src),
        n_ff=_u32(md, "clip.vision.feed_forward_length", src), n_layer=_u32(md, "clip.vision.block_count", src),
        n_head=_u32(md, "clip.vision.attention.head_count", src), image_size=image_size, patch_size=patch_size,
        n_merge=max(n_merge, 1), n_embd_text=_u32(md, "clip.vision.projection_dim", src), weights_bytes=weights,
        file_size=header.file_size)


def probe_projector(path: str) -> ProjectorSpec:
    """Probe a local projector file."""
    if not os.path.isfile(path):
        raise UnsupportedModelError(f"{path}: projector file not found")
    with FileSource(path) as source:
        return projector_spec(read_header(source, whole=True), path)
