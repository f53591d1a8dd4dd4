"""The sizing vocabulary below both the plan and partial offload: per-type options, candidates, the Sizer.

``Sizer`` answers "does this placement hold this context?" for one model, cache
type and device set, from the pure model or, where a calibration is given, from
llama.cpp's own figures (``sizing.memory.measured``). ``sizing.plan.make`` and
``sizing.plan.offload`` both build on it, and on nothing of each other.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, Sequence

from ..memory.context import ContextConfig
from .device import Device
from ..errors import ConfigError
from ..memory.kv import kv_cells
from ..memory.measured import Calibration, ConfigKey, Figures, placement_key
from ..memory.estimate import MemoryEstimate, estimate, resolve_flash_attn
from ..memory.draft import draft_config, draft_placement
from ..memory.mtp import mtp_config
from ..memory import gpu as gpu_terms
from ..memory.placement import Placement, assign_slots
from .request import PlanRequest, context_config
from ..model.spec import ModelSpec

Verdict = Literal["cpu", "one_card", "split", "partial_offload", "refused"]
RefusalCode = Literal["INSUFFICIENT_MEMORY", "SPLIT_NOT_HONOURED", "INVALID_CONFIG"]


def held_whole_verdict(verdict: Verdict, has_gpus: bool) -> bool:
    """Held whole where it runs best: on the cards (none partly in host memory), or on a machine without cards.
    (A model the cards cannot hold at all is planned by the offload search, verdict ``cpu``.)"""
    return verdict in ("one_card", "split") or (verdict == "cpu" and not has_gpus)


@dataclass(frozen=True)
class Candidate:
    """One placement considered for partial offload, with its predicted speed."""

    placement: Placement
    n_ctx: int
    decode_tokens_per_s: float
    prompt_tokens_per_s: float
    gpu_weights_bytes: int
    host_weights_bytes: int
    disk_weights_bytes: int
    description: str


@dataclass(frozen=True)
class CacheTypeOption:
    """The largest context for one cache type, and what it costs."""

    cache_type: str
    n_ctx: int
    """0 when nothing fits."""
    verdict: Verdict
    placement: Placement
    estimate: MemoryEstimate | None
    error: str | None = None
    refusal: RefusalCode | None = None
    candidates: tuple[Candidate, ...] = ()
    warnings: tuple[str, ...] = ()
    decode_tokens_per_s: float | None = None
    """The speed model's decode figure for this row's placement (``sizing.plan.offload.speed``)."""
    prompt_tokens_per_s: float | None = None
    largest_n_ctx: int = 0
    """The largest context any placement considered for this type holds (a partial-offload row's own
    placement may hold less: it is the fastest that holds the minimum context)."""



class Sizer:
    """Estimates and fit checks for one model, cache type and device set."""

    def __init__(self, spec: ModelSpec, gpus: Sequence[Device], host: Device, req: PlanRequest, cache: str,
                 calibration: Calibration | None = None) -> None:
        self.spec = spec
        self.gpus = list(gpus)
        self.host = host
        self.req = req
        self.cache = cache
        self.calibration = calibration

    def figures(self, placement: Placement, cfg: ContextConfig) -> Figures | None:
        """llama.cpp's measured figures for this configuration (and, on a GPU backend, placement), if calibrated."""
        return _figures(self.spec, self.calibration, placement, cfg)

    def draft_figures(self, placement: Placement, cfg: ContextConfig) -> Figures | None:
        """The draft model's measured figures where it sits for this main placement (``sizing.memory.draft``)."""
        draft = self.req.draft
        if draft is None or draft.calibration is None:
            return None
        dpl, _ = draft_placement(placement, draft.spec.n_layer_all, self.spec.n_layer_all)
        return _figures(draft.spec, draft.calibration, dpl, draft_config(cfg))

    def mtp_figures(self, placement: Placement, cfg: ContextConfig) -> Figures | None:
        """llama.cpp's measured figures for the MTP head's context beside this one (``sizing.memory.mtp``)."""
        if not cfg.mtp:
            return None
        return _figures(self.spec, self.calibration, placement, mtp_config(cfg))

    def estimate(self, placement: Placement, n_ctx: int) -> MemoryEstimate:
        labels = [self.gpus[i].label for i in placement.gpus]
        cfg = context_config(self.req, self.cache, n_ctx)
        return estimate(
            self.spec, cfg, placement, gpu_labels=labels, allowance_bytes=self.req.allowance_bytes,
            figures=self.figures(placement, cfg),
            measured_on=self.calibration.backend if self.calibration is not None else "CPU",
            # Without a local GPU (a worker's device has no pinned host buffer), or loaded with the CPU alone (a
            # CPU-only plan where a card's backend says so: ModelParams.host_only), the host's buffer types are
            # llama.cpp's extra CPU ones, then CPU (make_cpu_buft_list).
            cpu_extra=(self.req.extra_buffers if host_only(placement, self.gpus)
                       or not any(g.kind != "rpc" for g in self.gpus) else None),
            draft=self.req.draft, draft_figures=self.draft_figures(placement, cfg), projector=self.req.projector,
            mtp_figures=self.mtp_figures(placement, cfg),
            remote={g.label: g.remote_kind for g in self.gpus if g.kind == "rpc"},
            cards=[card_of(self.req, self.gpus[i]) for i in placement.gpus],
            host_features=self.req.extra_buffers,
        )

    def shortfalls(self, est: MemoryEstimate, placement: Placement) -> list[int]:
        """Bytes each used GPU is missing (negative: to spare)."""
        return [need.total_bytes - self.gpus[i].free_bytes for need, i in zip(est.gpus, placement.gpus)]

    def host_fits(self, est: MemoryEstimate, *, weights_may_spill: bool = False) -> bool:
        """Host memory holds its share; with ``weights_may_spill`` (partial offload), weights past
        MemAvailable are read from the mmapped file instead, so only the rest must fit."""
        need = est.host.total_bytes - (est.host.weights_bytes if weights_may_spill else 0)
        return need <= self.host.free_bytes

    def fits(self, placement: Placement, n_ctx: int, *, weights_may_spill: bool = False) -> bool:
        est = self.estimate(placement, n_ctx)
        return self.host_fits(est, weights_may_spill=weights_may_spill) and all(s <= 0 for s in self.shortfalls(est, placement))

    def balanced_split(self, idx: Sequence[int], n_ctx: int, *, keep_all: bool = False, n_gpu_layers: int | None = None,
                       n_cpu_moe: int = 0, weights_may_spill: bool = False) -> Placement | None:
        """A layer split of ``n_gpu_layers`` slots (default: all) over ``idx`` that fits at ``n_ctx``, or None.

        Starts from shares proportional to each card's free memory less its allowance
        (llama.cpp's default split), then moves one slot at a time off the card that is
        shortest onto the card with the most room, as long as that reduces the worst
        shortfall (the second source document's "moves layers off the short card").
        """
        n_all = self.spec.n_layer_all
        slots_n = n_all + 1 if n_gpu_layers is None else n_gpu_layers
        if not idx or slots_n <= 0:
            return None
        shares = [max(self.gpus[i].free_bytes - allowance(self.req, self.gpus[i]), 0) for i in idx]
        if sum(shares) <= 0:
            return None
        slots = assign_slots(n_all, slots_n, [float(s) for s in shares])
        counts = [sum(1 for s in slots if s == p) for p in range(len(idx))]
        best: float | None = None
        for _ in range(slots_n * len(idx) + 1):
            if keep_all and min(counts) == 0:
                return None
            pl = replace(split_placement(idx, counts), n_cpu_moe=n_cpu_moe)
            est = self.estimate(pl, n_ctx)
            if not self.host_fits(est, weights_may_spill=weights_may_spill):
                return None
            over = self.shortfalls(est, pl)
            worst = max(over)
            if worst <= 0:
                return pl
            if best is not None and worst >= best:
                return None
            best = worst
            short = over.index(worst)
            room = sorted((o, p) for p, o in enumerate(over) if p != short)
            if counts[short] == 0 or not room or room[0][0] >= 0:
                return None
            counts[short] -= 1
            counts[room[0][1]] += 1
        return None


def host_only(placement: Placement, gpus: Sequence[Device]) -> bool:
    """Whether a placement loads with the CPU alone: CPU-only, beside a card whose backend keeps CPU-only plans off
    the cards (``sizing.memory.gpu.BackendTerms.cpu_plans_host_only``; ``service.engine.params.device_params``)."""
    return placement.cpu_only and any(g.kind == "gpu" and gpu_terms.terms(g.backend.prefix).cpu_plans_host_only
                                      for g in gpus)


def card_of(req: PlanRequest, dev: Device) -> gpu_terms.Card:
    """What the estimate needs of a card beyond its label: its backend (whose row of ``sizing.memory.gpu`` gives
    its terms), the allowance the request sets for that backend, and ggml's alignment and largest tensor for it."""
    prefix = dev.backend.prefix if dev.kind == "gpu" else gpu_terms.CUDA_TERMS.prefix
    return gpu_terms.Card(prefix, dict(req.backend_allowance_bytes).get(prefix), dev.alignment_bytes,
                          dev.max_tensor_bytes)


def allowance(req: PlanRequest, dev: Device) -> int:
    """The runner's device context a card must keep free beside the plan (its backend's: CUDA's
    ``req.allowance_bytes``, Vulkan's...); none on a worker's device (the worker's own context is already out of
    the free memory it reports)."""
    if dev.kind == "rpc":
        return 0
    card = card_of(req, dev)
    if card.allowance_bytes is not None:
        return card.allowance_bytes
    row = gpu_terms.terms(card.backend).allowance_bytes
    return row if row is not None else req.allowance_bytes


def _figures(spec: ModelSpec, cal: Calibration | None, placement: Placement, cfg: ContextConfig) -> Figures | None:
    if cal is None:
        return None
    flash = resolve_flash_attn(cfg, spec)
    pkey = None if cal.placement_independent else placement_key(
        placement.n_gpu_layers, placement.tensor_split, placement.n_cpu_moe)
    key = ConfigKey.of(cfg, flash)
    refused = cal.refusal(key, pkey)
    if refused is not None:
        raise ConfigError(f"llama.cpp refuses this configuration: {refused}")
    c = cal.get(key, pkey)
    if c is None:
        return None
    cells = kv_cells(spec, cfg)
    return c.figures(cells.full, cells.swa, strict=cal.strict)


def split_placement(idx: Sequence[int], counts: Sequence[int]) -> Placement:
    """Slots per card as llama.cpp's tensor_split: proportions equal to the counts give exactly them."""
    if len(idx) == 1:
        return Placement(gpus=tuple(idx), n_gpu_layers=sum(counts), tensor_split=(1.0,))
    return Placement(gpus=tuple(idx), n_gpu_layers=sum(counts), tensor_split=tuple(float(c) for c in counts))


def proportional_counts(sz: Sizer, idx: Sequence[int]) -> list[int]:
    """Slots per card under llama.cpp's default split (proportional to free memory less the allowance)."""
    shares = [float(max(sz.gpus[i].free_bytes - allowance(sz.req, sz.gpus[i]), 0)) for i in idx]
    if sum(shares) <= 0:
        shares = [1.0] * len(idx)
    slots = assign_slots(sz.spec.n_layer_all, sz.spec.n_layer_all + 1, shares)
    return [sum(1 for s in slots if s == p) for p in range(len(idx))]


def slot_counts(spec: ModelSpec, pl: Placement) -> list[int]:
    """Slots each card of a placement receives."""
    slots = pl.slots(spec.n_layer_all)
    return [sum(1 for s in slots if s == p) for p in range(len(pl.gpus))]
