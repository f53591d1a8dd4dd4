"""The plan: for each KV cache type the largest context, the placement, the verdict.

Pure: takes a ``ModelSpec``, the devices (GPUs and host memory) and a
``PlanRequest``; returns a ``Plan`` value. Computed once per load request;
nothing downstream recomputes sizes.

The rules (the second source document's, done for llama.cpp):
- one card when one card holds the model at the minimum context: the card
  with the most free memory (``auto``), or the card named;
- otherwise a layer split over the cards with the most free memory first,
  only as many as needed; layers are moved off a card that comes out short
  onto one with room until every card fits or no arrangement can;
- ``"all"`` splits over every card even when one would do, and is refused
  (SPLIT_NOT_HONOURED) when a card would get no layer;
- a model no arrangement of cards holds runs with some layers in host memory
  (partial offload, ``sizing.offload``) unless that is disallowed; then the
  refusal lists every card's figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Literal, Sequence

from .config import ContextConfig, FlashAttn, pad
from .devices import MIB, Device
from .errors import ConfigError
from .fit import largest_fitting
from .memory import DEFAULT_GPU_ALLOWANCE_BYTES, MemoryEstimate, estimate
from .placement import Placement, assign_slots
from .spec import ModelSpec

Verdict = Literal["cpu", "one_card", "split", "partial_offload", "refused"]
RefusalCode = Literal["INSUFFICIENT_MEMORY", "SPLIT_NOT_HONOURED", "INVALID_CONFIG"]
DEFAULT_CACHE_TYPES = ("f16", "q8_0", "q4_0")


@dataclass(frozen=True)
class PlanRequest:
    """What the caller asks of a plan. ``n_ctx`` None means: the largest that fits."""

    n_ctx: int | None = None
    cache_types: tuple[str, ...] = DEFAULT_CACHE_TYPES
    cache_type: str = "q8_0"
    """The type to load with (reported even when not in ``cache_types``)."""
    flash_attn: FlashAttn = "auto"
    ctx_ceiling: int | None = None
    min_ctx: int = 4096
    n_ubatch: int = 512
    n_batch: int = 512
    n_seq_max: int = 1
    kv_unified: bool = False
    swa_full: bool = False
    allowance_bytes: int = DEFAULT_GPU_ALLOWANCE_BYTES
    gpu: int | Literal["auto", "all"] = "auto"
    tensor_split: tuple[float, ...] | None = None
    allow_offload: bool = True
    """Whether a model the cards cannot hold may run with some layers in host memory."""
    host_bandwidth_bytes_per_s: float = 40e9
    """Host memory read bandwidth for the speed model (measured at service start, overridable)."""
    disk_bandwidth_bytes_per_s: float = 2e9
    """Model file read bandwidth for weights past MemAvailable."""
    cpu_cores: int = 8
    """CPU cores for the host's share of the work (the service passes the machine's count)."""


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


@dataclass(frozen=True)
class Plan:
    """The chosen configuration and the evidence for it."""

    model: ModelSpec
    gpus: tuple[Device, ...]
    host: Device
    request: PlanRequest
    verdict: Verdict
    cfg: ContextConfig
    placement: Placement
    estimate: MemoryEstimate | None
    options: tuple[CacheTypeOption, ...]
    ctx_cap: int
    reasons: tuple[str, ...] = field(default=())
    refusal: RefusalCode | None = None
    candidates: tuple[Candidate, ...] = ()
    warnings: tuple[str, ...] = ()
    predicted_decode_tokens_per_s: float | None = None
    predicted_prompt_tokens_per_s: float | None = None
    """The speed model's figures for the chosen placement (``sizing.speed``), checked against measured ones."""

    @property
    def fits(self) -> bool:
        return self.verdict != "refused"


def ctx_cap(spec: ModelSpec, req: PlanRequest) -> int:
    """Upper bound on n_ctx: n_ctx_train, the ceiling, and the requested n_ctx."""
    cap = spec.n_ctx_train if spec.n_ctx_train > 0 else 4096
    if req.ctx_ceiling:
        cap = min(cap, req.ctx_ceiling)
    if req.n_ctx:
        cap = min(cap, req.n_ctx)
    return cap


def ctx_floor(spec: ModelSpec, req: PlanRequest, cap: int) -> int:
    """The smallest context a placement must hold to count: the requested n_ctx, else the minimum."""
    if req.n_ctx:
        return cap
    return min(req.min_ctx, cap)


def context_config(req: PlanRequest, cache: str, n_ctx: int) -> ContextConfig:
    """The llama.cpp context parameters for this request at ``n_ctx``."""
    return ContextConfig(
        n_ctx=n_ctx,
        type_k=cache,
        type_v=cache,
        flash_attn=req.flash_attn,
        n_ubatch=req.n_ubatch,
        n_batch=req.n_batch,
        n_seq_max=req.n_seq_max,
        kv_unified=req.kv_unified,
        swa_full=req.swa_full,
    )


class Sizer:
    """Estimates and fit checks for one model, cache type and device set."""

    def __init__(self, spec: ModelSpec, gpus: Sequence[Device], host: Device, req: PlanRequest, cache: str) -> None:
        self.spec = spec
        self.gpus = list(gpus)
        self.host = host
        self.req = req
        self.cache = cache

    def estimate(self, placement: Placement, n_ctx: int) -> MemoryEstimate:
        labels = [self.gpus[i].label for i in placement.gpus]
        return estimate(
            self.spec, context_config(self.req, self.cache, n_ctx), placement,
            gpu_labels=labels, allowance_bytes=self.req.allowance_bytes,
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
        shares = [max(self.gpus[i].free_bytes - self.req.allowance_bytes, 0) for i in idx]
        if sum(shares) <= 0:
            return None
        slots = assign_slots(n_all, slots_n, [float(s) for s in shares])
        counts = [sum(1 for s in slots if s == p) for p in range(len(idx))]
        best: float | None = None
        for _ in range(slots_n * len(idx) + 1):
            if keep_all and min(counts) == 0:
                return None
            pl = replace(_split_placement(idx, counts), n_cpu_moe=n_cpu_moe)
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


def _split_placement(idx: Sequence[int], counts: Sequence[int]) -> Placement:
    """Slots per card as llama.cpp's tensor_split: proportions equal to the counts give exactly them."""
    if len(idx) == 1:
        return Placement(gpus=tuple(idx), n_gpu_layers=sum(counts), tensor_split=(1.0,))
    return Placement(gpus=tuple(idx), n_gpu_layers=sum(counts), tensor_split=tuple(float(c) for c in counts))


def _search(fits_at: Callable[[int], bool], floor: int, cap: int) -> int:
    return largest_fitting(fits_at, floor, cap)


def _option(spec: ModelSpec, gpus: Sequence[Device], host: Device, req: PlanRequest, cache: str, cap: int) -> CacheTypeOption:
    floor = ctx_floor(spec, req, cap)
    sz = Sizer(spec, gpus, host, req, cache)
    try:
        # Validate the cache type and the flash-attention rule once, before searching.
        estimate(spec, context_config(req, cache, pad(floor)))
    except (ConfigError, KeyError) as exc:
        msg = str(exc.args[0]) if isinstance(exc, KeyError) else str(exc)
        return CacheTypeOption(cache, 0, "refused", Placement(), None, error=msg, refusal="INVALID_CONFIG")

    full = spec.n_layer_all + 1
    n = len(gpus)
    if n == 0:
        cpu = Placement()
        best = _search(lambda c: sz.fits(cpu, c), floor, cap)
        if best:
            return CacheTypeOption(cache, best, "cpu", cpu, sz.estimate(cpu, best))
        return _offload_or_refuse(sz, [], floor, cap, "host memory cannot hold the model at the minimum context")

    if isinstance(req.gpu, int):
        if not 0 <= req.gpu < n:
            return CacheTypeOption(cache, 0, "refused", Placement(), None,
                                   error=f"gpu {req.gpu} does not exist ({n} cards)", refusal="INVALID_CONFIG")
        one = Placement(gpus=(req.gpu,), n_gpu_layers=full, tensor_split=(1.0,))
        best = _search(lambda c: sz.fits(one, c), floor, cap)
        if best:
            return CacheTypeOption(cache, best, "one_card", one, sz.estimate(one, best))
        return _offload_or_refuse(sz, [req.gpu], floor, cap, f"card {req.gpu} cannot hold the model at {floor} tokens")

    if req.tensor_split is not None:
        if len(req.tensor_split) != n or any(s < 0 for s in req.tensor_split) or sum(req.tensor_split) <= 0:
            return CacheTypeOption(cache, 0, "refused", Placement(), None, refusal="INVALID_CONFIG",
                                   error=f"tensor_split needs {n} non-negative proportions, got {list(req.tensor_split)}")
        idx = [i for i in range(n) if req.tensor_split[i] > 0]
        given = Placement(gpus=tuple(idx), n_gpu_layers=full, tensor_split=tuple(req.tensor_split[i] for i in idx))
        best = _search(lambda c: sz.fits(given, c), floor, cap)
        verdict: Verdict = "split" if len(idx) > 1 else "one_card"
        if best:
            return CacheTypeOption(cache, best, verdict, given, sz.estimate(given, best))
        return _refused(sz, given, floor, f"the tensor_split {list(req.tensor_split)} does not fit at {floor} tokens")

    if req.gpu == "all":
        idx = list(range(n))
        at_floor = sz.balanced_split(idx, floor, keep_all=True)
        if at_floor is None:
            proportional = _split_placement(idx, _proportional_counts(sz, idx))
            counts = _counts(spec, proportional)
            if min(counts) == 0 or any(g.free_bytes <= req.allowance_bytes for g in gpus):
                est = sz.estimate(proportional, floor)
                share = ", ".join(
                    f"{gpus[i].label} {c} layers ({d.weights_bytes / MIB:.0f} MiB of weights, {gpus[i].free_bytes / MIB:.0f} MiB free)"
                    for i, c, d in zip(idx, counts, est.gpus)
                )
                return CacheTypeOption(cache, 0, "refused", proportional, est, refusal="SPLIT_NOT_HONOURED",
                                       error=f"a split over all {n} cards would leave a card without layers: {share}")
            return _refused(sz, proportional, floor, f"the {n} cards cannot hold the model at {floor} tokens")
        best = _search(lambda c: sz.balanced_split(idx, c, keep_all=True) is not None, floor, cap)
        pl = sz.balanced_split(idx, best, keep_all=True)
        assert pl is not None
        return CacheTypeOption(cache, best, "split", pl, sz.estimate(pl, best))

    # auto: the card with the most free memory, else the fewest cards that hold it.
    order = sorted(range(n), key=lambda i: (-gpus[i].free_bytes, i))
    one = Placement(gpus=(order[0],), n_gpu_layers=full, tensor_split=(1.0,))
    if sz.fits(one, floor):
        best = _search(lambda c: sz.fits(one, c), floor, cap)
        return CacheTypeOption(cache, best, "one_card", one, sz.estimate(one, best))
    for k in range(2, n + 1):
        idx = sorted(order[:k])
        if sz.balanced_split(idx, floor) is None:
            continue
        best = _search(lambda c: sz.balanced_split(idx, c) is not None, floor, cap)
        pl = sz.balanced_split(idx, best)
        assert pl is not None
        return CacheTypeOption(cache, best, "split", pl, sz.estimate(pl, best))
    return _offload_or_refuse(sz, list(range(n)), floor, cap, f"no arrangement of the {n} cards holds the model at {floor} tokens")


def _proportional_counts(sz: Sizer, idx: Sequence[int]) -> list[int]:
    shares = [float(max(sz.gpus[i].free_bytes - sz.req.allowance_bytes, 0)) for i in idx]
    if sum(shares) <= 0:
        shares = [1.0] * len(idx)
    slots = assign_slots(sz.spec.n_layer_all, sz.spec.n_layer_all + 1, shares)
    return [sum(1 for s in slots if s == p) for p in range(len(idx))]


def _counts(spec: ModelSpec, pl: Placement) -> list[int]:
    slots = pl.slots(spec.n_layer_all)
    return [sum(1 for s in slots if s == p) for p in range(len(pl.gpus))]


def _refused(sz: Sizer, placement: Placement, floor: int, why: str) -> CacheTypeOption:
    """A refusal that carries every figure: the estimate at the minimum context."""
    est = sz.estimate(placement, floor)
    return CacheTypeOption(sz.cache, 0, "refused", placement, est, error=why, refusal="INSUFFICIENT_MEMORY")


def _offload_or_refuse(sz: Sizer, idx: list[int], floor: int, cap: int, why: str) -> CacheTypeOption:
    """Partial offload when allowed (``sizing.offload``), else a refusal with the best full-offload figures."""
    order = sorted(idx, key=lambda i: (-sz.gpus[i].free_bytes, i))
    proportional = _split_placement(sorted(order), _proportional_counts(sz, sorted(order))) if order else Placement()
    if len(order) == 1:
        proportional = Placement(gpus=(order[0],), n_gpu_layers=sz.spec.n_layer_all + 1, tensor_split=(1.0,))
    if sz.req.allow_offload:
        from .offload import plan_offload

        opt = plan_offload(sz, sorted(order), floor, cap)
        if opt is not None:
            return opt
    return _refused(sz, proportional, floor, why + ("" if sz.req.allow_offload else "; offloading layers to host memory is disabled"))


def make_plan(spec: ModelSpec, gpus: Sequence[Device], host: Device, req: PlanRequest = PlanRequest()) -> Plan:
    """Plan a load: per cache type the largest context; the chosen type's placement and estimate."""
    cap = ctx_cap(spec, req)
    types = tuple(dict.fromkeys((*req.cache_types, req.cache_type)))
    options = tuple(_option(spec, gpus, host, req, t, cap) for t in types)
    chosen = next(o for o in options if o.cache_type == req.cache_type)
    reasons: list[str] = []
    if req.n_ctx and req.n_ctx > cap:
        reasons.append(f"requested n_ctx {req.n_ctx} capped at {cap} (n_ctx_train {spec.n_ctx_train}"
                       + (f", ceiling {req.ctx_ceiling})" if req.ctx_ceiling else ")"))
    if chosen.error:
        reasons.append(f"{chosen.cache_type}: {chosen.error}")
    n_ctx = chosen.n_ctx or ctx_floor(spec, req, cap)
    cfg = context_config(req, chosen.cache_type, n_ctx)
    if chosen.estimate is not None:
        cfg = replace(cfg, flash_attn="on" if chosen.estimate.flash_attn else "off")
    if chosen.n_ctx and chosen.n_ctx < spec.n_ctx_train:
        if chosen.n_ctx == cap and req.n_ctx:
            why = "as requested"
        elif chosen.n_ctx == cap and req.ctx_ceiling and cap < spec.n_ctx_train:
            why = "capped by the configured ceiling"
        else:
            why = "limited by free memory"
        reasons.append(f"context {chosen.n_ctx} of the model's {spec.n_ctx_train}: {why}")
    decode = prompt = None
    if chosen.estimate is not None and chosen.verdict != "refused":
        from .offload import speed
        from .speed import Tiers

        tiers = Tiers.for_request(req)
        sz = Sizer(spec, gpus, host, req, chosen.cache_type)
        decode, prompt, _ = speed(sz, chosen.placement, chosen.estimate, chosen.n_ctx, tiers)
    if chosen.verdict == "one_card":
        reasons.append(f"one card holds the model: {gpus[chosen.placement.gpus[0]].label} {gpus[chosen.placement.gpus[0]].name}")
    elif chosen.verdict == "split":
        reasons.append("split over " + ", ".join(f"{gpus[i].label}" for i in chosen.placement.gpus))
    elif chosen.verdict == "cpu":
        reasons.append("no GPU: the whole model runs on the CPU from host memory")
    return Plan(
        model=spec,
        gpus=tuple(gpus),
        host=host,
        request=req,
        verdict=chosen.verdict,
        cfg=cfg,
        placement=chosen.placement,
        estimate=chosen.estimate,
        options=options,
        ctx_cap=cap,
        reasons=tuple(reasons),
        refusal=chosen.refusal,
        candidates=chosen.candidates,
        warnings=chosen.warnings,
        predicted_decode_tokens_per_s=decode,
        predicted_prompt_tokens_per_s=prompt,
    )
