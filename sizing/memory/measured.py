"""llama.cpp's own measurements as values the pure planner can use: calibrations.

A calibration is a handful of llama.cpp no_alloc dry runs of one model for one
configuration (everything of ``llama_context_params`` but n_ctx), each at a
different context length. The service takes them (``service.planning.planner``); this
module only holds them and reads figures off them:

- KV and recurrent state: every cache tensor is ``row_bytes x cells x streams``
  (``llama_kv_cache::llama_kv_cache``, ``llama_memory_recurrent``), so the full
  cache is linear in its cells, the sliding-window cache in its cells, the state
  constant; one sample gives the bytes per cell (the log's 0.01 MiB rounded up).
- compute buffer: within one graph structure every tensor's size is linear in the
  KV cells, so the allocator's peak is piecewise linear in the full cells (and in
  the sliding cells, which stop growing at the window: ``sizing.memory.kv.kv_cells``).
  It is **neither convex nor monotone**: the best-fit allocator's choices change
  with the sizes (measured with llama.cpp: gpt-oss-20b, f16, flash attention,
  511.00 MiB at one context and 409.63 MiB at a longer one; Jamba-Mini-1.5 and
  Qwen3-Next 30 MiB above the chord between two samples). So a figure between two
  samples (the chord) is an estimate for the search, and the service measures
  every context a plan chooses (``service.planning.planner``); with ``strict`` only
  measured contexts count (the fallback when the search does not settle).

The planner asks for a figure at a configuration (``Calibration.figures``); when
there is none it simulates. Every estimate records which it used
(``sizing.memory.estimate.DeviceMemory.sources``).

Pure: values in, values out.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Literal, Mapping

from .context import ContextConfig

MIB = 1 << 20
Source = Literal["simulated", "measured"]


def mib_to_bytes(mib: float) -> int:
    """A log figure (``%.2f MiB``) as bytes, rounded up to the top of its 0.01 MiB interval: never an under-count."""
    if mib <= 0:
        return 0
    return int(math.ceil((mib + 0.005) * MIB))


@dataclass(frozen=True)
class ConfigKey:
    """Everything a dry run's figures depend on besides the context length (and the placement on a GPU)."""

    type_k: str
    type_v: str
    flash_attn: bool
    n_ubatch: int
    n_seq_max: int
    kv_unified: bool
    swa_full: bool
    offload_kqv: bool = True
    mtp_context: bool = False
    """The figures are an MTP context's (``sizing.memory.mtp``), not the model's own context's."""

    @classmethod
    def of(cls, cfg: ContextConfig, flash: bool) -> "ConfigKey":
        return cls(cfg.type_k, cfg.type_v, flash, cfg.n_ubatch_effective, max(cfg.n_seq_max, 1), cfg.kv_unified,
                   cfg.swa_full, cfg.offload_kqv, cfg.mtp_context)


@dataclass(frozen=True)
class Sample:
    """One dry run: llama.cpp's figures at one context length (bytes, from the log's MiB)."""

    n_ctx: int
    full_cells: int
    """Cells per stream of the full-attention cache (``n_ctx_seq``)."""
    swa_cells: int
    kv_full_bytes: int
    kv_swa_bytes: int
    state_bytes: int
    compute_bytes: Mapping[str, int]
    """``sched_reserve`` compute buffer per buffer name (``CPU``, ``CUDA0``, ``CUDA_Host`` ...)."""
    output_bytes: int
    state_device_bytes: Mapping[str, int] = field(default_factory=dict)
    """``RS buffer size`` per buffer name (the recurrent state is really allocated, even in a dry run)."""


@dataclass(frozen=True)
class ComputeFigure:
    bytes: int
    exact: bool
    """True at a sampled point or between two (an upper bound); False when extrapolated past the last sample."""


@dataclass(frozen=True)
class Figures:
    """What a calibration says about one configuration at one context length."""

    kv_full_bytes: int | None
    kv_swa_bytes: int | None
    state_bytes: int | None
    compute_bytes: Mapping[str, int]
    output_bytes: int | None
    exact: bool
    """Every figure measured at this point or bounded by two measured points."""

    @property
    def kv_bytes(self) -> int | None:
        if self.kv_full_bytes is None:
            return None
        return self.kv_full_bytes + (self.kv_swa_bytes or 0)


@dataclass(frozen=True)
class Calibrated:
    """The samples of one configuration, sorted by full cells; reads figures off them."""

    key: ConfigKey
    samples: tuple[Sample, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "samples", tuple(sorted(self.samples, key=lambda s: (s.full_cells, s.swa_cells))))

    def with_sample(self, s: Sample) -> "Calibrated":
        keep = [x for x in self.samples if (x.full_cells, x.swa_cells) != (s.full_cells, s.swa_cells)]
        return Calibrated(self.key, (*keep, s))

    def sampled_at(self, full_cells: int, swa_cells: int) -> Sample | None:
        return next((s for s in self.samples if (s.full_cells, s.swa_cells) == (full_cells, swa_cells)), None)

    def _per_cell(self, attr: str, cells_attr: str) -> float:
        """Bytes per cell of one cache (all streams), from the sample with the most cells (least rounding)."""
        best = max(self.samples, key=lambda s: getattr(s, cells_attr))
        cells = getattr(best, cells_attr)
        return getattr(best, attr) / cells if cells else 0.0

    def compute_at(self, device: str, full_cells: int, swa_cells: int) -> ComputeFigure | None:
        """The compute buffer of ``device`` at these cells: sampled, interpolated (an upper bound for a convex
        peak), the first sample's figure below it, or the last chord extrapolated (not exact)."""
        pts = [(s.full_cells, s.swa_cells, s.compute_bytes[device]) for s in self.samples if device in s.compute_bytes]
        if not pts:
            return None
        exact = next((c for f, w, c in pts if (f, w) == (full_cells, swa_cells)), None)
        if exact is not None:
            return ComputeFigure(exact, True)
        xs = [f for f, _, _ in pts]
        i = bisect.bisect_left(xs, full_cells)
        if i == 0:
            return ComputeFigure(pts[0][2], True)
        if i < len(pts):
            (x0, _, y0), (x1, _, y1) = pts[i - 1], pts[i]
            if x1 == x0:
                return ComputeFigure(max(y0, y1), True)
            return ComputeFigure(int(math.ceil(y0 + (y1 - y0) * (full_cells - x0) / (x1 - x0))), True)
        if len(pts) == 1:
            return ComputeFigure(pts[0][2], False)
        (x0, _, y0), (x1, _, y1) = pts[-2], pts[-1]
        slope = max((y1 - y0) / (x1 - x0), 0.0) if x1 != x0 else 0.0
        return ComputeFigure(int(math.ceil(y1 + slope * (full_cells - x1))), False)

    def figures(self, full_cells: int, swa_cells: int, strict: bool = False) -> Figures:
        """The figures at these cells; with ``strict``, a context that was not measured gets no room at all
        (a compute buffer too large for any device), so only measured contexts can be chosen."""
        if strict and self.sampled_at(full_cells, swa_cells) is None:
            never = 1 << 60
            devices = sorted({d for s in self.samples for d in s.compute_bytes}) or ["CPU"]
            return Figures(None, None, None, {d: never for d in devices}, None, exact=False)
        n_stream_full = self._per_cell("kv_full_bytes", "full_cells")
        n_stream_swa = self._per_cell("kv_swa_bytes", "swa_cells")
        devices = sorted({d for s in self.samples for d in s.compute_bytes})
        compute: dict[str, int] = {}
        exact = True
        for d in devices:
            c = self.compute_at(d, full_cells, swa_cells)
            if c is not None:
                compute[d] = c.bytes
                exact = exact and c.exact
        last = self.samples[-1]
        return Figures(
            kv_full_bytes=int(math.ceil(n_stream_full * full_cells)),
            kv_swa_bytes=int(math.ceil(n_stream_swa * swa_cells)),
            state_bytes=max(s.state_bytes for s in self.samples),
            compute_bytes=compute,
            output_bytes=last.output_bytes,
            exact=exact,
        )


@dataclass(frozen=True)
class Calibration:
    """Every calibrated configuration of one model on one backend.

    ``backend`` is ``CPU`` when every figure came from a CPU build (the whole graph runs on the CPU, so the
    placement does not change them: a declared GPU gets the CPU's compute buffer as its own, as the simulation
    does), or the GPU backend's name, where figures belong to the placement they were measured with
    (``placement`` keys; ``None`` in a CPU calibration).
    """

    backend: str
    configs: Mapping[tuple[ConfigKey, str | None], Calibrated] = field(default_factory=dict)
    refusals: Mapping[tuple[ConfigKey, str | None], str] = field(default_factory=dict)
    """Configurations llama.cpp refused to create, with its reason (the plan refuses them too)."""
    strict: bool = False
    """Only measured contexts fit (``Calibrated.figures``)."""

    def _k(self, key: ConfigKey, placement: str | None) -> tuple[ConfigKey, str | None]:
        return (key, placement if self.backend != "CPU" else None)

    def get(self, key: ConfigKey, placement: str | None = None) -> Calibrated | None:
        return self.configs.get(self._k(key, placement))

    def refusal(self, key: ConfigKey, placement: str | None = None) -> str | None:
        return self.refusals.get(self._k(key, placement))

    def with_config(self, cal: Calibrated, placement: str | None = None) -> "Calibration":
        configs = dict(self.configs)
        configs[self._k(cal.key, placement)] = cal
        return Calibration(self.backend, configs, self.refusals, self.strict)

    def with_refusal(self, key: ConfigKey, placement: str | None, reason: str) -> "Calibration":
        refusals = dict(self.refusals)
        refusals[self._k(key, placement)] = reason
        return Calibration(self.backend, self.configs, refusals, self.strict)

    @property
    def n_samples(self) -> int:
        return sum(len(c.samples) for c in self.configs.values())

    @property
    def placement_independent(self) -> bool:
        return self.backend == "CPU"


def placement_key(n_gpu_layers: int, tensor_split: tuple[float, ...], n_cpu_moe: int) -> str:
    """The placement a GPU calibration belongs to, as a short string."""
    return f"ngl={n_gpu_layers};split={','.join(f'{x:g}' for x in tensor_split)};cpu_moe={n_cpu_moe}"
