"""mtmd's own figures for a vision projector: its weights and the compute buffer its warmup reserves.

``measure_projector(path, flash_attn)`` runs ``python -m sizing.probe.mtmd`` (a child: an abort in
mtmd kills only it, and its memory is given back when it ends), which loads the projector as llama-server does
(``mtmd_init_from_file`` with ``warmup`` on, no text model) and reads its log: ``model size`` (every tensor's
``ggml_nbytes``) and each buffer type's ``compute buffer size`` (``reserve_compute_meta``), the two terms of
llama.cpp's own ``mtmd_get_memory_usage``. A sparse header-only file (``sizing.testing.projector_fixtures``) is
enough: mtmd reads zeros.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])

_MODEL_SIZE = re.compile(r"model size:\s+([0-9.]+) MiB")
_COMPUTE = re.compile(r"(\S+) compute buffer size =\s+([0-9.]+) MiB")
_FLASH = re.compile(r"flash attention is (enabled|disabled)")
_WARMUP = re.compile(r"warmup with image size = (\d+) x (\d+)")
_MAX_PIXELS = re.compile(r"image_max_pixels:\s+(\d+)")


@dataclass(frozen=True)
class ProjectorFigures:
    """What mtmd logged loading a projector (MiB, as printed: 0.01 MiB resolution)."""

    weights_mib: float
    compute_mib: dict[str, float]
    """Buffer type (``CPU``, ``CUDA0``) -> its compute buffer."""
    flash_attn: bool
    image_max_tokens: int | None = None
    """The cap on an image's tokens the figures hold for (mtmd's ``image_max_tokens``), where the projector's own
    largest image is larger than its warmup's: mtmd reserves the compute buffer for the warmup image only
    (``get_dummy_batch``), and a larger image would grow it at run time, past what was counted. Capped, mtmd
    resizes every image to at most the warmup's pixels (``image_max_pixels``). None: no cap needed (fixed-size
    types, or a warmup at the largest image)."""
    warmup_pixels: int = 0
    max_pixels: int = 0
    """The warmup image's pixels and the largest image mtmd accepts (0: not logged, fixed-size types)."""


def parse_mtmd_log(lines: list[str]) -> ProjectorFigures | None:
    """The figures of one projector load's log (each buffer type's last reserve: an ``auto`` flash attention that
    falls back reserves twice)."""
    weights = flash = None
    compute: dict[str, float] = {}
    warmup = max_pixels = 0
    for line in lines:
        if m := _MODEL_SIZE.search(line):
            weights = float(m.group(1))
        elif m := _COMPUTE.search(line):
            compute[m.group(1)] = float(m.group(2))
        elif m := _FLASH.search(line):
            flash = m.group(1) == "enabled"
        elif m := _WARMUP.search(line):
            warmup = int(m.group(1)) * int(m.group(2))
        elif m := _MAX_PIXELS.search(line):
            max_pixels = int(m.group(1))
    if weights is None or not compute or flash is None:
        return None
    return ProjectorFigures(weights, compute, flash, warmup_pixels=warmup, max_pixels=max_pixels)


def warmup_cap(figures: ProjectorFigures, token_pixels: int) -> int | None:
    """The ``image_max_tokens`` that keeps every image within the warmup's pixels (``token_pixels``: the pixels one
    token covers, ``(patch_size * n_merge)^2``); None where the largest image already is."""
    if not figures.warmup_pixels or not figures.max_pixels or figures.max_pixels <= figures.warmup_pixels:
        return None
    return max(1, figures.warmup_pixels // max(token_pixels, 1))


def measure_projector(path: str, flash_attn: bool, *, use_gpu: bool = False, timeout_s: float = 120) -> ProjectorFigures:
    """Load ``path`` in a child and return mtmd's figures; ``RuntimeError`` with its last lines if it failed.

    Where the projector's largest image is larger than mtmd's warmup image (dynamic-resolution types: Pixtral's
    warmup is 256 px for images up to 512 px), the child loads it again with ``image_max_tokens`` capped to the
    warmup's (``warmup_cap``): the figures are those of that load, and ``image_max_tokens`` says the cap the engine
    loads with, so that no image grows the buffer past them."""
    cmd = [sys.executable, "-m", "sizing.probe.mtmd", path, "1" if flash_attn else "0",
           "1" if use_gpu else "0"]
    env = dict(os.environ)
    env["PYTHONPATH"] = _ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    out = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not out:
        raise RuntimeError(f"mtmd could not load {path} (exit {proc.returncode}): {proc.stderr.strip()[-600:]}")
    obj = json.loads(out[-1])
    return ProjectorFigures(obj["weights_mib"], obj["compute_mib"], obj["flash_attn"], obj.get("image_max_tokens"),
                            obj.get("warmup_pixels", 0), obj.get("max_pixels", 0))


def _main(argv: list[str]) -> int:  # pragma: no cover - runs in the child
    import ctypes

    import llama_cpp
    from llama_cpp import mtmd_cpp

    path, flash, gpu = argv[0], argv[1] == "1", argv[2] == "1"
    lines: list[str] = []

    @ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)  # type: ignore[untyped-decorator]
    def on_log(_level: int, text: bytes, _data: ctypes.c_void_p) -> None:
        lines.append(text.decode(errors="replace"))

    llama_cpp.llama_log_set(on_log, None)
    mtmd_cpp.mtmd_log_set(on_log, None)
    llama_cpp.llama_backend_init()
    from .projector import probe_projector

    spec = probe_projector(path)

    def load(max_tokens: int | None) -> ProjectorFigures | None:
        del lines[:]
        params = mtmd_cpp.mtmd_context_params_default()
        params.use_gpu = gpu
        params.warmup = True
        params.print_timings = False
        params.flash_attn_type = 1 if flash else 0  # LLAMA_FLASH_ATTN_TYPE_ENABLED / _DISABLED
        if max_tokens is not None:
            params.image_max_tokens = max_tokens
        ctx = mtmd_cpp.mtmd_init_from_file(path.encode(), None, params)
        if not ctx:
            sys.stderr.write("".join(lines[-20:]))
            return None
        figures = parse_mtmd_log("".join(lines).splitlines())
        mtmd_cpp.mtmd_free(ctx)
        if figures is None:
            sys.stderr.write("no figures in mtmd's log:\n" + "".join(lines[-20:]))
        return figures

    figures = load(None)
    cap = warmup_cap(figures, spec.token_pixels) if figures is not None else None
    if cap is not None:
        figures = load(cap)
        if figures is not None and figures.max_pixels > figures.warmup_pixels:
            sys.stderr.write(f"image_max_tokens {cap} leaves images of {figures.max_pixels} pixels, beyond the "
                             f"warmup's {figures.warmup_pixels}\n")
            return 1
    if figures is None:
        return 1
    print(json.dumps({"weights_mib": figures.weights_mib, "compute_mib": figures.compute_mib,
                      "flash_attn": figures.flash_attn, "image_max_tokens": cap,
                      "warmup_pixels": figures.warmup_pixels, "max_pixels": figures.max_pixels}))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(_main(sys.argv[1:]))
