"""Vision projector files (``mmproj-*.gguf``) for tests: real shapes, written with ``gguf``.

``write_projector(path, PROJECTORS["gemma3-4b"])`` writes the header llama.cpp's converter writes for a model's
vision tower and projector (``clip.*`` keys, every tensor ``clip_model_loader::load_tensors`` requires for the
projector type, its shape and type) with the data section a hole (a sparse file): mtmd loads it, reading zeros.
``TINY`` is a tower for the embedded model (gemma-3-270m, 640-wide embeddings): two layers over 224-pixel
images, 16 tokens an image, small enough to encode in milliseconds; with ``values="random"`` its weights are
random numbers, so that different images give different embeddings (the answers mean nothing; the memory and the
plumbing are real).

Keys and tensor names mirror ``tools/mtmd/clip-impl.h`` and ``clip.cpp`` (llama.cpp vendored by llama-cpp-python
0.3.36); shapes are those of the public ``config.json`` of each model's vision tower: Gemma 3's SigLIP (fixed
896 px), Qwen2.5-VL's and Pixtral's (dynamic resolution).
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
    spatial_merge: int = 0
    """``clip.vision.spatial_merge_size`` (Qwen2.5-VL's 2x2 merger, Mistral Small 3.1's patch merger; 0: none)."""
    n_wa_pattern: int = 0
    """``clip.vision.n_wa_pattern``: Qwen2.5-VL's full-attention layer every n (window attention between)."""


PROJECTORS: dict[str, ProjectorShape] = {
    # google/gemma-3-4b-it vision_config (SigLIP so400m at 896 px) and text hidden_size 2560
    "gemma3-4b": ProjectorShape("gemma3", n_embd=1152, n_ff=4304, n_layer=27, n_head=16, image_size=896,
                                patch_size=14, n_embd_text=2560),
    # google/gemma-3-27b-it: the same tower, text hidden_size 5376
    "gemma3-27b": ProjectorShape("gemma3", n_embd=1152, n_ff=4304, n_layer=27, n_head=16, image_size=896,
                                 patch_size=14, n_embd_text=5376),
    # Qwen/Qwen2.5-VL-7B-Instruct vision_config: depth 32, hidden 1280, intermediate 3420, 16 heads, patch 14,
    # spatial_merge_size 2, fullatt_block_indexes every 8th, out_hidden_size 3584 (image_size as the converter's 560)
    "qwen2.5vl-7b": ProjectorShape("qwen2.5vl_merger", n_embd=1280, n_ff=3420, n_layer=32, n_head=16, image_size=560,
                                   patch_size=14, n_embd_text=3584, spatial_merge=2, n_wa_pattern=8),
    # mistral-community/pixtral-12b vision_config: 24 layers, hidden 1024, intermediate 4096, 16 heads, patch 16,
    # image_size 1024; text hidden_size 5120
    "pixtral-12b": ProjectorShape("pixtral", n_embd=1024, n_ff=4096, n_layer=24, n_head=16, image_size=1024,
                                  patch_size=16, n_embd_text=5120, eps=1e-5),
}

TINY = ProjectorShape("gemma3", n_embd=64, n_ff=128, n_layer=2, n_head=2, image_size=224, patch_size=14,
                      n_embd_text=640, weight_type="f32")
"""For the embedded model: 16x16 patches pooled 4x4 into 16 tokens an image."""

TINY_QWEN25VL = ProjectorShape("qwen2.5vl_merger", n_embd=64, n_ff=128, n_layer=2, n_head=2, image_size=224,
                               patch_size=14, n_embd_text=128, spatial_merge=2, n_wa_pattern=2, weight_type="f32")
"""A Qwen2.5-VL tower for ``sizing.testing.fixtures.TINY_QWEN2VL`` (128 wide): M-RoPE image positions."""

TINY_PIXTRAL = ProjectorShape("pixtral", n_embd=64, n_ff=128, n_layer=2, n_head=2, image_size=1024, patch_size=16,
                              n_embd_text=640, eps=1e-5, weight_type="f32")
"""A dynamic-resolution tower for the embedded model: one token per 16x16 patch, a ``[IMG_BREAK]`` after each row
but the last; mtmd's own limit 512x512 pixels, its warmup 256x256 (so the plan caps images there)."""


def _tensors(s: ProjectorShape) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, numpy shape, is a matrix) for every tensor of the projector (``load_tensors``)."""
    if s.projector_type == "qwen2.5vl_merger":
        return _qwen25vl(s)
    if s.projector_type == "pixtral":
        return _pixtral(s)
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


def _layers(s: ProjectorShape, *, bias: bool, norm_bias: bool) -> list[tuple[str, tuple[int, ...], bool]]:
    """Pre-norm blocks with a gated FFN (SwiGLU: Qwen2.5-VL's and Pixtral's), RMS norms where ``norm_bias`` is off."""
    e, f = s.n_embd, s.n_ff
    out: list[tuple[str, tuple[int, ...], bool]] = []
    for il in range(s.n_layer):
        p = f"v.blk.{il}"
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            out.append((f"{p}.{name}.weight", (e, e), True))
            if bias:
                out.append((f"{p}.{name}.bias", (e,), False))
        for name in ("ln1", "ln2"):
            out.append((f"{p}.{name}.weight", (e,), False))
            if norm_bias:
                out.append((f"{p}.{name}.bias", (e,), False))
        for name, shp in (("ffn_gate", (f, e)), ("ffn_up", (f, e)), ("ffn_down", (e, f))):
            out.append((f"{p}.{name}.weight", shp, True))
            if bias:
                out.append((f"{p}.{name}.bias", (shp[0],), False))
    return out


def _qwen25vl(s: ProjectorShape) -> list[tuple[str, tuple[int, ...], bool]]:
    """Qwen2.5-VL's tower: the 3D patch convolution as two 2D kernels, no position embedding (M-RoPE), RMS norms,
    the merger's norm (``post_ln``) and its MLP over 2x2-merged patches (``mm.0``, ``mm.2``)."""
    e, m = s.n_embd, s.n_embd * max(s.spatial_merge, 1) ** 2
    return [("v.patch_embd.weight", (e, 3, s.patch_size, s.patch_size), True),
            ("v.patch_embd.weight.1", (e, 3, s.patch_size, s.patch_size), True),
            *_layers(s, bias=True, norm_bias=False),
            ("v.post_ln.weight", (e,), False), ("mm.0.weight", (m, m), True), ("mm.0.bias", (m,), False),
            ("mm.2.weight", (s.n_embd_text, m), True), ("mm.2.bias", (s.n_embd_text,), False)]


def _pixtral(s: ProjectorShape) -> list[tuple[str, tuple[int, ...], bool]]:
    """Pixtral's tower: a patch convolution without bias, a pre-norm, 2D RoPE (no position embedding), RMS norms,
    the two-layer projector (``mm.1``, ``mm.2``) and the ``[IMG_BREAK]`` embedding."""
    e, t = s.n_embd, s.n_embd_text
    return [("v.patch_embd.weight", (e, 3, s.patch_size, s.patch_size), True), ("v.pre_ln.weight", (e,), False),
            *_layers(s, bias=False, norm_bias=False),
            ("mm.1.weight", (t, e), True), ("mm.1.bias", (t,), False), ("mm.2.weight", (t, t), True),
            ("mm.2.bias", (t,), False), ("v.token_embd.img_break", (t,), False)]


def write_projector(path: str | os.PathLike[str], shape: ProjectorShape, *,
                    values: Literal["zeros", "random"] = "zeros", seed: int = 0) -> Path:
    """Write ``shape``'s mmproj GGUF at ``path``. ``zeros``: a header and a hole (sparse, any size);
    ``random``: every weight written, normal with a small deviation (norm weights 1)."""
    path = Path(path)
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_name(f"fixture {shape.projector_type} projector")
    w.add_string("clip.projector_type", shape.projector_type)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.use_gelu", shape.projector_type not in ("qwen2.5vl_merger", "pixtral"))
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
    if shape.spatial_merge:
        w.add_uint32("clip.vision.spatial_merge_size", shape.spatial_merge)
    if shape.n_wa_pattern:
        w.add_uint32("clip.vision.n_wa_pattern", shape.n_wa_pattern)
    if shape.projector_type in ("qwen2.5vl_merger", "pixtral"):
        w.add_bool("clip.use_silu", True)
    rng = np.random.default_rng(seed)
    tensors = _tensors(shape)
    for name, shp, matrix in tensors:
        dtype = np.float16 if (matrix and shape.weight_type == "f16") else np.float32
        if values == "random":
            arr = (np.ones(shp) if name.endswith(("ln1.weight", "ln2.weight", "post_ln.weight", "pre_ln.weight"))
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
