"""Vision projector files (``mmproj-*.gguf``) for tests: real shapes, written with ``gguf``.

``write_projector(path, PROJECTORS["gemma3-4b"])`` writes the header llama.cpp's converter writes for a model's
vision tower and projector (``clip.*`` keys, every tensor ``clip_model_loader::load_tensors`` requires for the
projector type, its shape and type) with the data section a hole (a sparse file): mtmd loads it, reading zeros.
``TINY`` is a tower for the embedded model (gemma-3-270m, 640-wide embeddings): two layers over 224-pixel
images, 16 tokens an image, small enough to encode in milliseconds; with ``values="random"`` its weights are
random numbers, so that different images give different embeddings (the answers mean nothing; the memory and the
plumbing are real).

Keys and tensor names mirror ``tools/mtmd/clip-impl.h`` and ``clip.cpp`` (llama.cpp vendored by llama-cpp-python
0.3.36); shapes are those of the public ``config.json`` of each model's vision tower.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import gguf
import numpy as np

_T = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class ProjectorShape:
    """A vision tower and its projector, as a mmproj GGUF declares them."""

    projector_type: str
    n_embd: int
    n_ff: int
    n_layer: int
    n_head: int
    image_size: int
    patch_size: int
    n_embd_text: int
    """The language model's embedding width (``clip.vision.projection_dim``)."""
    scale_factor: int = 0
    """``clip.vision.projector.scale_factor`` (gemma3's pooling; 0: not written, llama.cpp's default)."""
    eps: float = 1e-6
    weight_type: Literal["f16", "f32"] = "f16"


PROJECTORS: dict[str, ProjectorShape] = {
    # google/gemma-3-4b-it vision_config (SigLIP so400m at 896 px) and text hidden_size 2560
    "gemma3-4b": ProjectorShape("gemma3", n_embd=1152, n_ff=4304, n_layer=27, n_head=16, image_size=896,
                                patch_size=14, n_embd_text=2560),
    # google/gemma-3-27b-it: the same tower, text hidden_size 5376
    "gemma3-27b": ProjectorShape("gemma3", n_embd=1152, n_ff=4304, n_layer=27, n_head=16, image_size=896,
                                 patch_size=14, n_embd_text=5376),
}

TINY = ProjectorShape("gemma3", n_embd=64, n_ff=128, n_layer=2, n_head=2, image_size=224, patch_size=14,
                      n_embd_text=640, weight_type="f32")
"""For the embedded model: 16x16 patches pooled 4x4 into 16 tokens an image."""


def _tensors(s: ProjectorShape) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, numpy shape, is a matrix) for every tensor of a gemma3 projector (``load_tensors``)."""
    if s.projector_type != "gemma3":
        raise ValueError(f"no projector fixture for type {s.projector_type!r}")
    e, f, n_patch = s.n_embd, s.n_ff, (s.image_size // s.patch_size) ** 2
    out: list[tuple[str, tuple[int, ...], bool]] = [
        ("v.patch_embd.weight", (e, 3, s.patch_size, s.patch_size), True),
        ("v.patch_embd.bias", (e,), False),
        ("v.position_embd.weight", (n_patch, e), True),
    ]
    for il in range(s.n_layer):
        p = f"v.blk.{il}"
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            out += [(f"{p}.{name}.weight", (e, e), True), (f"{p}.{name}.bias", (e,), False)]
        for name in ("ln1", "ln2"):
            out += [(f"{p}.{name}.weight", (e,), False), (f"{p}.{name}.bias", (e,), False)]
        out += [(f"{p}.ffn_up.weight", (f, e), True), (f"{p}.ffn_up.bias", (f,), False),
                (f"{p}.ffn_down.weight", (e, f), True), (f"{p}.ffn_down.bias", (e,), False)]
    out += [("v.post_ln.weight", (e,), False), ("v.post_ln.bias", (e,), False),
            ("mm.input_projection.weight", (e, s.n_embd_text), True), ("mm.soft_emb_norm.weight", (e,), False)]
    return out


def write_projector(path: str | os.PathLike[str], shape: ProjectorShape, *,
                    values: Literal["zeros", "random"] = "zeros", seed: int = 0) -> Path:
    """Write ``shape``'s mmproj GGUF at ``path``. ``zeros``: a header and a hole (sparse, any size);
    ``random``: every weight written, normal with a small deviation (norm weights 1)."""
    path = Path(path)
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_name(f"fixture {shape.projector_type} projector")
    w.add_string("clip.projector_type", shape.projector_type)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.use_gelu", True)
    w.add_uint32("clip.vision.embedding_length", shape.n_embd)
    w.add_uint32("clip.vision.feed_forward_length", shape.n_ff)
    w.add_uint32("clip.vision.block_count", shape.n_layer)
    w.add_uint32("clip.vision.projection_dim", shape.n_embd_text)
    w.add_uint32("clip.vision.attention.head_count", shape.n_head)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", shape.eps)
    w.add_uint32("clip.vision.image_size", shape.image_size)
    w.add_uint32("clip.vision.patch_size", shape.patch_size)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    if shape.scale_factor:
        w.add_uint32("clip.vision.projector.scale_factor", shape.scale_factor)
    rng = np.random.default_rng(seed)
    tensors = _tensors(shape)
    for name, shp, matrix in tensors:
        dtype = np.float16 if (matrix and shape.weight_type == "f16") else np.float32
        if values == "random":
            arr = (np.ones(shp) if name.endswith(("ln1.weight", "ln2.weight", "post_ln.weight"))
                   else rng.normal(0.0, 0.05, shp)).astype(dtype)
            w.add_tensor(name, arr)
        else:
            nbytes = int(np.prod(shp)) * np.dtype(dtype).itemsize
            w.add_tensor_info(name, shp, np.dtype(dtype), nbytes, raw_dtype=_T.F16 if dtype == np.float16 else _T.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    if values == "random":
        w.write_tensors_to_file()
        w.close()
        return path
    w.write_ti_data_to_file()
    w.close()
    # the data section: aligned tensors after the header, left as a hole
    align = 32
    size = path.stat().st_size
    start = -(-size // align) * align
    end = start
    for name, shp, matrix in tensors:
        itemsize = 2 if (matrix and shape.weight_type == "f16") else 4
        end += -(-(int(np.prod(shp)) * itemsize) // align) * align
    os.truncate(path, end)
    return path
