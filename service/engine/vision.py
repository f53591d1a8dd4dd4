"""Images into a loaded model: llama.cpp's mtmd context beside it, and the tokens an image takes in a prompt.

mtmd (``tools/mtmd``, what llama-server serves images with) loads the projector (``mmproj``) against the text
model, preprocesses a bitmap into an image chunk (``mtmd_tokenize_from_parts``: resized and normalised as the
projector asks, with the text the model expects around it, Gemma 3's ``<start_of_image>`` ... ``<end_of_image>``),
and evaluates that chunk into a sequence at a position (``mtmd_helper_eval_chunk_single``: the vision tower's
graph, then the embeddings decoded into the KV, non-causally where the model asks for it).

In a prompt an image is a run of negative ids, one per token it takes, derived from the image's digest and
the place within it (``image_run``): the same image gives the same ids, another image other ids, so the slots'
prefix reuse and the prompt cache beyond them (which compare token lists) reuse an image's KV exactly where the
image is the same, and never where it is not. No id of the vocabulary is negative: the engine evaluates a run
with ``evaluate`` (never as tokens), and drafts stop before one.

With M-RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) an image takes fewer positions than tokens (``ImageChunk.n_pos``:
its grid's longer side): the engine maps a token's index in the sequence to its position past each image
(``LlamaEngine._pos``).

The chunks live here between the tokenization of a prompt and its evaluation (``Images``: the most recent
``KEEP`` images); a request holds the ones it needs from its admission on.
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import BadRequest, EngineFailure
from .base import ImageInput

log = logging.getLogger(__name__)

KEEP = 8
"""Image chunks kept after their tokenization (each holds its preprocessed pixels: 9.2 MiB at Gemma 3's 896 px,
host memory the plan does not count: a few). A request carries its images (``GenerationParams.images``), so one
whose chunk was dropped meanwhile is prepared again, not refused."""


def image_run(digest: str, n: int) -> list[int]:
    """The ids of an image's ``n`` positions: negative, 31 bits each, from the digest and the position."""
    seed = bytes.fromhex(digest)
    out = []
    for j in range(n):
        h = hashlib.blake2b(seed + j.to_bytes(4, "little"), digest_size=4).digest()
        out.append(-1 - int.from_bytes(h, "little") % (2**31 - 1))
    return out


@dataclass(eq=False)
class ImageChunk:
    """One image as mtmd prepared it: its ids in a prompt and the chunk that evaluates it."""

    digest: str
    run: tuple[int, ...]
    chunk: Any = field(repr=False)
    """``mtmd_input_chunk *`` (owned: freed with this object)."""
    n_pos: int = 0
    """Positions the image takes in the sequence: its tokens, or with M-RoPE (Qwen2-VL and later) the larger of its
    grid's sides (``mtmd_image_tokens_get_n_pos``), the text after it going on from there."""
    _free: Callable[[Any], None] | None = field(default=None, repr=False)

    def __del__(self) -> None:
        if self._free is not None and self.chunk:
            self._free(self.chunk)
            self.chunk = None


class Images:
    """A loaded model's projector: tokenizes images (any thread) and evaluates them (the scheduler's)."""

    def __init__(self, mtmd: Any, ctx: Any, *, n_ubatch: int) -> None:
        self._mtmd = mtmd
        self._ctx = ctx
        self._lock = threading.Lock()
        self._chunks: "collections.OrderedDict[int, ImageChunk]" = collections.OrderedDict()
        self.n_ubatch = n_ubatch

    @staticmethod
    def load(path: str, model: Any, *, use_gpu: bool, flash_attn: bool, n_threads: int, n_ubatch: int,
             image_max_tokens: int | None = None) -> "Images":
        """mtmd's context for the projector at ``path`` against ``model`` (``llama_model *``), warmed up as
        llama-server's (its compute buffer reserved now: what the plan counts), with the plan's cap on an image's
        tokens (``image_max_tokens``: images resized within the warmup's, so none grows the buffer past the
        plan); ``EngineFailure`` if it cannot."""
        from llama_cpp import mtmd_cpp as mtmd

        params = mtmd.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.n_threads = n_threads
        params.print_timings = False
        params.warmup = True
        params.flash_attn_type = 1 if flash_attn else 0
        if image_max_tokens is not None:
            params.image_max_tokens = image_max_tokens
        ctx = mtmd.mtmd_init_from_file(path.encode(), model, params)
        if not ctx:
            raise EngineFailure(f"mtmd could not load the projector {path} (its log says why)")
        if not mtmd.mtmd_support_vision(ctx):
            mtmd.mtmd_free(ctx)
            raise EngineFailure(f"{path}: this projector takes no images")
        return Images(mtmd, ctx, n_ubatch=n_ubatch)

    def close(self) -> None:
        with self._lock:
            self._chunks.clear()
            if self._ctx:
                self._mtmd.mtmd_free(self._ctx)
                self._ctx = None

    def tokens(self, image: ImageInput, param: str) -> tuple[list[int], ImageChunk, list[int]]:
        """The text before the image (token ids), the image, the text after it: what mtmd makes of one image."""
        mtmd = self._mtmd
        with self._lock:
            if not self._ctx:
                raise EngineFailure("the projector was unloaded")
            data = (ctypes.c_uint8 * len(image.rgb)).from_buffer_copy(image.rgb)
            bitmap = mtmd.mtmd_bitmap_init(image.width, image.height, data)
            if not bitmap:
                raise BadRequest(f"{param}: mtmd could not take a {image.width}x{image.height} image", param=param)
            chunks = mtmd.mtmd_input_chunks_init()
            try:
                mtmd.mtmd_bitmap_set_id(bitmap, image.digest.encode())
                part = mtmd.mtmd_input_part(text=None, bitmap=bitmap)
                parts = (ctypes.POINTER(mtmd.mtmd_input_part) * 1)(ctypes.pointer(part))
                ret = int(mtmd.mtmd_tokenize_from_parts(self._ctx, chunks, parts, 1, False))
                if ret != 0:
                    raise BadRequest(f"{param}: mtmd could not preprocess the image (code {ret})", param=param)
                before: list[int] = []
                after: list[int] = []
                image_chunk: ImageChunk | None = None
                for i in range(int(mtmd.mtmd_input_chunks_size(chunks))):
                    c = mtmd.mtmd_input_chunks_get(chunks, i)
                    kind = int(mtmd.mtmd_input_chunk_get_type(c))
                    if kind == mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT:
                        n = ctypes.c_size_t(0)
                        ptr = mtmd.mtmd_input_chunk_get_tokens_text(c, ctypes.byref(n))
                        (after if image_chunk is not None else before).extend(ptr[j] for j in range(n.value))
                    elif kind == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE and image_chunk is None:
                        n_tok = int(mtmd.mtmd_input_chunk_get_n_tokens(c))
                        if mtmd.mtmd_decode_use_non_causal(self._ctx, c) and n_tok > self.n_ubatch:
                            raise BadRequest(f"{param}: the image takes {n_tok} tokens, evaluated in one batch; this "
                                             f"load's is {self.n_ubatch} (GGUF_N_UBATCH)", param=param)
                        image_chunk = ImageChunk(image.digest, tuple(image_run(image.digest, n_tok)),
                                                 mtmd.mtmd_input_chunk_copy(c), int(mtmd.mtmd_input_chunk_get_n_pos(c)),
                                                 mtmd.mtmd_input_chunk_free)
                    else:
                        raise BadRequest(f"{param}: mtmd made a chunk of a kind this server does not evaluate "
                                         f"({kind})", param=param)
                if image_chunk is None:
                    raise BadRequest(f"{param}: mtmd made no image of it", param=param)
            finally:
                mtmd.mtmd_input_chunks_free(chunks)
                mtmd.mtmd_bitmap_free(bitmap)
            self._chunks[image_chunk.run[0]] = image_chunk
            self._chunks.move_to_end(image_chunk.run[0])
            while len(self._chunks) > KEEP:
                self._chunks.popitem(last=False)
        return before, image_chunk, after

    def find(self, tokens: list[int], images: tuple[ImageInput, ...] = ()) -> list[tuple[int, ImageChunk]]:
        """The images of a prompt, by where each begins, each prepared again from ``images`` if its chunk was
        dropped since; ``BadRequest`` for ids of no image held here or given."""
        given = {image_run(im.digest, 1)[0]: im for im in images}
        out: list[tuple[int, ImageChunk]] = []
        i, n = 0, len(tokens)
        while i < n:
            if tokens[i] >= 0:
                i += 1
                continue
            with self._lock:
                c = self._chunks.get(tokens[i])
            if c is None and tokens[i] in given:
                _, c, _ = self.tokens(given[tokens[i]], "messages")
            if c is None or tuple(tokens[i:i + len(c.run)]) != c.run:
                raise BadRequest("the prompt holds an image this model does not have (send the image with the "
                                 "request)", param="messages")
            out.append((i, c))
            i += len(c.run)
        return out

    def evaluate(self, lctx: Any, image: ImageChunk, n_past: int, seq_id: int, n_batch: int) -> int:
        """Encode the image and decode its embeddings into ``seq_id`` from position ``n_past`` (the scheduler's
        thread); 0, or mtmd's error code."""
        import llama_cpp

        mtmd = self._mtmd
        new_n_past = llama_cpp.llama_pos(0)
        with self._lock:
            if not self._ctx:
                return -1
            return int(mtmd.mtmd_helper_eval_chunk_single(self._ctx, lctx, image.chunk, n_past, seq_id, n_batch,
                                                          False, ctypes.byref(new_n_past)))

