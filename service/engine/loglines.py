"""The llama.cpp log lines the service reads figures from, in one place.

Formats of the llama.cpp vendored by llama-cpp-python 0.3.36: ``src/llama-model.cpp``
(load_tensors), ``src/llama-kv-cache.cpp``, ``src/llama-memory-recurrent.cpp``, ``src/llama-kv-cache-iswa.cpp`` and
``src/llama-context.cpp`` (sched_reserve, output_reserve). Both the real load
(``service.engine.llama``) and the no_alloc dry run (``service.engine.dryrun``) parse them.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import re
import threading
from dataclasses import dataclass
from typing import Any, Sequence

from sizing.units import gpu_label

from .base import Allocation

log = logging.getLogger(__name__)
MIB = 1 << 20
RE_DEVICE = re.compile(r"device (\d+)")

MODEL_BUFFER = re.compile(r"load_tensors:\s+(\S+) model buffer size =\s+([\d.]+) MiB")
KV_BUFFER = re.compile(r"llama_kv_cache:\s+(\S+) KV buffer size =\s+([\d.]+) MiB")
OUTPUT_BUFFER = re.compile(r"llama_context:\s+(\S+)\s+output buffer size =\s+([\d.]+) MiB")
COMPUTE_BUFFER = re.compile(r"sched_reserve:\s+(\S+) compute buffer size =\s+([\d.]+) MiB")
OFFLOADED = re.compile(r"load_tensors: offloaded (\d+)/(\d+) layers to GPU")
KV_CACHE = re.compile(
    r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers,\s*(\d+)/(\d+) seqs\), "
    r"K \((\w+)\):\s*([\d.]+) MiB, V \((\w+)\):\s*([\d.]+) MiB"
)
RECURRENT_STATE = re.compile(
    r"llama_memory_recurrent: size =\s*([\d.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers,\s*(\d+) seqs\s+(\d+) rs_seq\), "
    r"R \((\w+)\):\s*([\d.]+) MiB, S \((\w+)\):\s*([\d.]+) MiB"
)
RS_BUFFER = re.compile(r"llama_memory_recurrent:\s+(\S+) RS buffer size =\s+([\d.]+) MiB")
LAYER_DEVICE = re.compile(r"load_tensors: layer\s+(\d+) assigned to device (\S+?),")
ISWA_CACHE = re.compile(r"llama_kv_cache_iswa: creating\s+(non-SWA|SWA) KV cache, size = (\d+) cells")
N_CTX = re.compile(r"llama_context: n_ctx\s+=\s+(\d+)")
N_CTX_SEQ = re.compile(r"llama_context: n_ctx_seq\s+=\s+(\d+)")
FLASH_ATTN = re.compile(r"llama_context: flash_attn\s+=\s+(\w+)")
FLASH_ATTN_RESOLVED = re.compile(r"resolve_fused_ops: Flash Attention (enabled|not supported)", re.I)
GRAPH_RESERVE = re.compile(r"graph_reserve: reserving a graph for ubatch with n_tokens =\s*(\d+), n_seqs =\s*(\d+), "
                           r"n_outputs =\s*(\d+)")
SCHED_SPLIT = re.compile(r"## SPLIT #(\d+): (.+?) # (\d+) inputs")
SCHED_SPLIT_INPUT = re.compile(r"\[(\S+) \(\s*(\d+[KM])\)\]")
SCHED_COPIES = re.compile(r"sched_reserve: reserve took .*, sched copies = (\d+)")
SCHED_NORM_INPUT = re.compile(r"norm-\d+")
"""A layer's norm (``build_norm``'s ``cb(cur, "norm", il)``) as a split's input name."""


EXTRA_CPU_BUFFERS = ("AMX", "CPU_REPACK")
"""The CPU backend's extra buffer types (``sizing.memory.repack.EXTRA_BUFFERS``): rows of their own in what is reported."""


def row_of(buffer_name: str) -> str:
    """A llama.cpp buffer's row in what the service reports: CPU, CPU_Mapped, CUDA_Host -> CPU; CUDA0 -> CUDA0;
    the CPU backend's extra buffer types (repacked copies of weights) stay rows of their own, as the plan
    predicts them."""
    if buffer_name in EXTRA_CPU_BUFFERS:
        return buffer_name
    if buffer_name.startswith("CPU") or buffer_name.endswith("_Host"):
        return "CPU"
    return buffer_name


def model_buffers_mib(lines: Any) -> dict[str, float]:
    """``load_tensors: X model buffer size = N MiB`` lines summed per row (``row_of``)."""
    out: dict[str, float] = {}
    for line in lines:
        m = MODEL_BUFFER.search(line)
        if m:
            row = row_of(m.group(1))
            out[row] = round(out.get(row, 0.0) + float(m.group(2)), 2)
    return out


class LogCollector:
    """llama.cpp's log, as whole lines, for a process that only collects it (the dry-run child, a benchmark):
    sets the process-wide log callback. The engine's process logs through ``LogTap``."""

    def __init__(self) -> None:
        import ctypes

        import llama_cpp

        self.lines: list[str] = []
        self.partial = ""

        @llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]
        def _cb(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
            *done, self.partial = (self.partial + (text.decode("utf-8", "replace") if text else "")).split("\n")
            self.lines.extend(done)

        self._callback: Any = _cb  # kept: ctypes callbacks must outlive their use
        llama_cpp.llama_log_set(_cb, ctypes.c_void_p(0))

    def text(self) -> list[str]:
        """The lines so far, the unfinished one included."""
        return self.lines + ([self.partial] if self.partial else [])


@dataclass(frozen=True)
class SchedGraph:
    """One graph the scheduler split while a context reserved its buffers: the ``graph_reserve`` line's ubatch and,
    per split, its backend and input tensors as ``(name, size)`` with llama.cpp's rounded size (``fmt_size``:
    ``"1M"``, ``"16K"``). Only logged with ``GGML_SCHED_DEBUG`` set (the dry-run child sets it)."""

    n_tokens: int
    n_seqs: int
    n_outputs: int
    splits: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()


def parse_sched_graphs(lines: Sequence[str]) -> list[SchedGraph]:
    """The graphs of ``lines`` in their order (``ggml_backend_sched_print_assignments``'s split headers)."""
    out: list[SchedGraph] = []
    for line in lines:
        if m := GRAPH_RESERVE.search(line):
            out.append(SchedGraph(int(m.group(1)), int(m.group(2)), int(m.group(3))))
        elif (m := SCHED_SPLIT.search(line)) and out:
            inputs = tuple((i.group(1), i.group(2)) for i in SCHED_SPLIT_INPUT.finditer(line, m.end()))
            g = out[-1]
            out[-1] = SchedGraph(g.n_tokens, g.n_seqs, g.n_outputs, (*g.splits, (m.group(2), inputs)))
    return out


def ggml_fmt_size(n: int) -> str:
    """ggml-backend.cpp's ``fmt_size``: whole MiB from 1 MiB up, whole KiB below."""
    return f"{n // MIB}M" if n >= MIB else f"{n // 1024}K"


def parse_allocations(lines: list[str]) -> tuple[tuple[Allocation, ...], tuple[int, int] | None]:
    """Per-device bytes from llama.cpp's load log, and the offloaded/total layer counts."""
    acc: dict[str, dict[str, float]] = {}
    offloaded = None
    for line in lines:
        for rx, kind in ((MODEL_BUFFER, "weights"), (KV_BUFFER, "kv"), (OUTPUT_BUFFER, "output"),
                         (COMPUTE_BUFFER, "compute")):
            m = rx.search(line)
            if m:
                dev = row_of(m.group(1))
                acc.setdefault(dev, {}).setdefault(kind, 0.0)
                acc[dev][kind] += float(m.group(2))
        m = OFFLOADED.search(line)
        if m:
            offloaded = (int(m.group(1)), int(m.group(2)))
    allocs = tuple(
        Allocation(
            device=dev,
            weights_bytes=int(f.get("weights", 0) * MIB),
            kv_bytes=int(f.get("kv", 0) * MIB),
            compute_bytes=int(f.get("compute", 0) * MIB),
            output_bytes=int(f.get("output", 0) * MIB),
        )
        for dev, f in sorted(acc.items(), key=lambda kv: (kv[0] != "CPU", kv[0] not in EXTRA_CPU_BUFFERS, kv[0]))
    )
    return allocs, offloaded


def projector_allocations(lines: list[str], device: str) -> tuple[Allocation, ...]:
    """The vision projector's buffers from mtmd's load log (``sizing.probe.mtmd.parse_mtmd_log``: ``model size``
    and each buffer type's ``compute buffer size``), its weights on ``device`` (the plan's: mtmd names none)."""
    from sizing.probe import parse_mtmd_log

    figures = parse_mtmd_log(lines)
    if figures is None:
        return ()
    acc: dict[str, list[float]] = {device: [figures.weights_mib, 0.0]}
    for buft, value in figures.compute_mib.items():
        acc.setdefault(row_of(buft), [0.0, 0.0])[1] += value
    return tuple(Allocation(device=dev, weights_bytes=int(w * MIB), compute_bytes=int(c * MIB))
                 for dev, (w, c) in acc.items())


class LogTap:
    """One process-wide llama.cpp log callback for the engine's process; lines go to logging and, while
    capturing (a load), to a list: warnings and errors at warning level, the rest at debug."""

    _lock = threading.Lock()
    _installed = False
    _callback: Any = None
    _capture: list[str] | None = None
    _partial = ""
    _recent: "collections.deque[str]" = collections.deque(maxlen=32)
    """The last warning and error lines: where an allocation failed names its device."""

    @classmethod
    def install(cls) -> None:
        import llama_cpp

        with cls._lock:
            if cls._installed:
                return

            @llama_cpp.llama_log_callback  # type: ignore[untyped-decorator]
            def _cb(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
                cls._on_text(level, text.decode("utf-8", "replace") if text else "")

            cls._callback = _cb  # keep a reference: ctypes callbacks must outlive their use
            llama_cpp.llama_log_set(_cb, ctypes.c_void_p(0))
            try:  # mtmd (the vision projector, ``service.engine.vision``) logs through its own setter
                from llama_cpp import mtmd_cpp

                mtmd_cpp.mtmd_log_set(_cb, ctypes.c_void_p(0))
                mtmd_cpp.mtmd_helper_log_set(_cb, ctypes.c_void_p(0))
            except (ImportError, OSError, AttributeError) as exc:  # a build without it: no projector loads
                log.debug("mtmd's log not tapped: %s", exc)
            cls._installed = True

    @classmethod
    def _on_text(cls, level: int, text: str) -> None:
        buf = cls._partial + text
        *lines, cls._partial = buf.split("\n")
        for line in lines:
            if cls._capture is not None:
                cls._capture.append(line)
            if level in (3, 4):  # GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR
                cls._recent.append(line)
                log.warning("llama.cpp: %s", line)
            else:
                log.debug("llama.cpp: %s", line)

    @classmethod
    def start(cls) -> list[str]:
        cls._capture = []
        return cls._capture

    @classmethod
    def stop(cls) -> None:
        cls._capture = None

    @classmethod
    def failed_device(cls) -> str | None:
        """The device of the latest failed allocation in llama.cpp's log (ggml-cuda.cu: "... on device N ...")."""
        for line in reversed(cls._recent):
            if "alloc" in line.lower() or "out of memory" in line.lower():
                m = RE_DEVICE.search(line)
                if m:
                    return gpu_label(int(m.group(1)))
        return None
