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
  (partial offload, ``sizing.plan.offload``) unless that is disallowed; then the
  refusal lists every card's figures.
- the cache type loaded is the one asked for, or with ``auto`` (the default) the
  most precise one whose context reaches the ceiling (``sizing.plan.auto_cache``).

With a ``Calibration`` (llama.cpp's own figures, ``sizing.memory.measured``; the
service measures them for every architecture whose graph is not mirrored and
for GPU backends) the same search runs on measured figures; every estimate says
which figures are ``simulated`` and which ``measured``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

from ..memory.context import ContextConfig, pad
from ..memory.draft import DraftModel
from ..memory.mtp import MTP_ARCHITECTURES, mtp_supported
from .device import Device, free_memory_note
from ..units import MIB
from ..errors import ConfigError
from .fit import largest_fitting
from ..memory.measured import Calibration
from ..memory.estimate import MemoryEstimate
from .offload import plan_offload, speed
from ..memory.placement import Placement
from .auto_cache import choose_cache_type
from .request import (AUTO_CACHE_TYPE, AUTO_CACHE_TYPES, DEFAULT_CACHE_TYPES, PlanRequest, context_config, ctx_cap,
                      ctx_floor)
from .sizer import (CacheTypeOption, Candidate, RefusalCode, Sizer, Verdict, allowance, proportional_counts, slot_counts,
                    split_placement)
from ..model.spec import ModelSpec
from .speed import Tiers

__all__ = ["DRAFT_REFUSAL", "MTP_REFUSAL", "AUTO_CACHE_TYPE", "AUTO_CACHE_TYPES", "DEFAULT_CACHE_TYPES", "CacheTypeOption", "Candidate", "Plan",
           "PlanRequest", "RefusalCode", "Sizer", "Verdict", "context_config", "ctx_cap", "ctx_floor", "make_plan"]


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
    cache_type_reason: str = ""
    """Why ``cfg.type_k`` is what it is: ``auto``'s choice and what it passed over (also among ``reasons``), or
    the type as asked for."""
    refusal: RefusalCode | None = None
    candidates: tuple[Candidate, ...] = ()
    warnings: tuple[str, ...] = ()
    predicted_decode_tokens_per_s: float | None = None
    predicted_prompt_tokens_per_s: float | None = None
    """The speed model's figures for the chosen placement (``sizing.plan.speed``), checked against measured ones."""
    calibration: Calibration | None = field(default=None, compare=False, repr=False)
    """llama.cpp's measured figures the plan used (None: every figure simulated)."""
    draft_refusal: str | None = None
    """Why the draft model asked for is not in this plan (``DRAFT_REFUSAL``), with its figures; None: it is, or
    none was asked for."""
    mtp_refusal: str | None = None
    """Why the MTP head asked for (``PlanRequest.mtp``) is not in this plan (``MTP_REFUSAL``); None: it is
    (``cfg.mtp``), or none was asked for."""

    @property
    def draft(self) -> DraftModel | None:
        """The draft model this plan loads beside the main one (None: none)."""
        return self.request.draft

    @property
    def fits(self) -> bool:
        return self.verdict != "refused"



def _search(fits_at: Callable[[int], bool], floor: int, cap: int) -> int:
    return largest_fitting(fits_at, floor, cap)


def _option(sz: Sizer, cap: int) -> CacheTypeOption:
    spec, gpus, req, cache = sz.spec, sz.gpus, sz.req, sz.cache
    floor = ctx_floor(spec, req, cap)
    try:
        # Validate the cache type and the flash-attention rule once, before searching.
        sz.estimate(Placement(), pad(floor))
    except ConfigError as exc:
        return CacheTypeOption(cache, 0, "refused", Placement(), None, error=str(exc), refusal="INVALID_CONFIG")

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
            proportional = split_placement(idx, proportional_counts(sz, idx))
            counts = slot_counts(spec, proportional)
            if min(counts) == 0 or any(g.free_bytes <= (req.allowance_bytes if g.kind == "rpc" else allowance(req, g))
                                       for g in gpus):
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


def _refused(sz: Sizer, placement: Placement, floor: int, why: str) -> CacheTypeOption:
    """A refusal that carries every figure: the estimate at the minimum context."""
    est = sz.estimate(placement, floor)
    return CacheTypeOption(sz.cache, 0, "refused", placement, est, error=why, refusal="INSUFFICIENT_MEMORY")


def _offload_or_refuse(sz: Sizer, idx: list[int], floor: int, cap: int, why: str) -> CacheTypeOption:
    """Partial offload when allowed (``sizing.plan.offload``), else a refusal with the best full-offload figures."""
    order = sorted(idx, key=lambda i: (-sz.gpus[i].free_bytes, i))
    proportional = split_placement(sorted(order), proportional_counts(sz, sorted(order))) if order else Placement()
    if len(order) == 1:
        proportional = Placement(gpus=(order[0],), n_gpu_layers=sz.spec.n_layer_all + 1, tensor_split=(1.0,))
    if sz.req.allow_offload:
        opt = plan_offload(sz, sorted(order), floor, cap)
        if opt is not None:
            return opt
    return _refused(sz, proportional, floor, why + ("" if sz.req.allow_offload else "; offloading layers to host memory is disabled"))


def _with_speed(sz: Sizer, opt: CacheTypeOption, floor: int, tiers: Tiers) -> CacheTypeOption:
    """A row with its placement's predicted speed, and the largest context any considered placement holds.

    The speed is predicted with a KV cache of the minimum context (half full), so a row's speed depends on its
    placement alone: more free memory can only bring a faster placement within reach (never a slower one).
    """
    if opt.estimate is None or opt.verdict == "refused" or not opt.n_ctx:
        return opt
    at = max(min(floor, opt.n_ctx), 1)
    decode, prompt, _ = speed(sz, opt.placement, sz.estimate(opt.placement, at), at, tiers)
    largest = max([opt.n_ctx, *(c.n_ctx for c in opt.candidates)])
    return replace(opt, decode_tokens_per_s=decode, prompt_tokens_per_s=prompt, largest_n_ctx=largest)


DRAFT_REFUSAL = "DRAFT_DOES_NOT_FIT"
"""The code of a draft model the plan leaves out (``Plan.draft_refusal``)."""
MTP_REFUSAL = "MTP_NOT_LOADED"
"""The code of an MTP head the plan leaves out (``Plan.mtp_refusal``)."""


def make_plan(spec: ModelSpec, gpus: Sequence[Device], host: Device, req: PlanRequest = PlanRequest(),
              calibration: Calibration | None = None) -> Plan:
    """Plan a load, with the MTP head asked for (``req.mtp``, ``sizing.memory.mtp``) on the terms of a draft model:
    the plan with it is taken when it fits with the verdict, context and cache type the plan without it has;
    otherwise the plan without it, saying why (``Plan.mtp_refusal``). A head is sized only with llama.cpp's
    figures for its context (its compute buffer is not mirrored): without a calibration of it, it is left out."""
    if not req.mtp:
        return _draft_plan(spec, gpus, host, req, calibration)
    without = _draft_plan(spec, gpus, host, replace(req, mtp=False), calibration)
    why = _mtp_unplannable(spec, req, calibration)
    if why is None:
        plan = _draft_plan(spec, gpus, host, req, calibration)
        if plan.fits and without.fits and (plan.verdict == without.verdict and plan.cfg.n_ctx >= without.cfg.n_ctx
                                           and plan.cfg.type_k == without.cfg.type_k):
            return plan
        cost = plan.estimate.mtp if plan.estimate is not None else None
        size = (f" ({cost.total_bytes / MIB:.0f} MiB: {cost.weights_bytes / MIB:.0f} MiB of NextN weights)"
                if cost is not None and cost.total_bytes < 1 << 59 else "")
        with_it = (f"{plan.cfg.n_ctx} tokens of {plan.cfg.type_k} cache ({plan.verdict})" if plan.fits
                   else f"refused ({plan.refusal})")
        why = (f"the MTP head{size} would leave the plan at {with_it}, against {without.cfg.n_ctx} tokens of "
               f"{without.cfg.type_k} cache ({without.verdict}) without it")
    why = f"{MTP_REFUSAL}: {spec.architecture}'s MTP head not loaded: {why}"
    return replace(without, mtp_refusal=why, warnings=(*without.warnings, why))


def _mtp_unplannable(spec: ModelSpec, req: PlanRequest, calibration: Calibration | None) -> str | None:
    """Why no plan can hold the head asked for, whatever the memory; None: it can be sized."""
    if not mtp_supported(spec):
        return "the file carries no MTP head this engine drafts with (one NextN block of " + ", ".join(
            sorted(MTP_ARCHITECTURES)) + ")"
    if req.draft is not None:
        return f"the draft model {req.draft.label} drafts instead"
    if req.draft_rows <= 0:
        return "speculative decoding is off"
    if calibration is None or not any(key.mtp_context for key, _ in calibration.configs):
        return "llama.cpp's dry run of its context has not measured it (its compute buffer is not mirrored)"
    return None


def _draft_plan(spec: ModelSpec, gpus: Sequence[Device], host: Device, req: PlanRequest,
                calibration: Calibration | None) -> Plan:
    """Plan a load, with the draft model asked for (``req.draft``) where it costs the main model nothing it is
    owed: the plan with the draft is taken when it fits with the verdict, context and cache type the plan without
    it has (so a context at the ceiling stays there), or ``req.draft_squeeze`` asks for it; otherwise the plan without the draft,
    saying why (``Plan.draft_refusal``, with both contexts and the draft's bytes). A model with a recurrent state
    gets no draft (the engine cannot take back rejected drafts there)."""
    draft = req.draft
    if draft is None:
        return _make_plan(spec, gpus, host, req, calibration)
    without = _make_plan(spec, gpus, host, replace(req, draft=None), calibration)
    if any(layer.has_state for layer in spec.layers):
        why = (f"{DRAFT_REFUSAL}: draft model {draft.label} not loaded: {spec.architecture} keeps a recurrent state, "
               "which cannot take back a rejected draft's tokens")
        return replace(without, draft_refusal=why, warnings=(*without.warnings, why))
    plan = _make_plan(spec, gpus, host, req, calibration)
    if plan.fits and (req.draft_squeeze or not without.fits or (
            plan.verdict == without.verdict and plan.cfg.n_ctx >= without.cfg.n_ctx
            and plan.cfg.type_k == without.cfg.type_k)):
        return plan
    cost = plan.estimate.draft if plan.estimate is not None else None
    if cost is None and without.estimate is not None:
        sz = Sizer(spec, gpus, host, req, without.cfg.type_k, calibration)
        cost = sz.estimate(without.placement, without.cfg.n_ctx).draft
    size = f" ({cost.total_bytes / MIB:.0f} MiB on {cost.device})" if cost is not None else ""
    with_it = (f"{plan.cfg.n_ctx} tokens of {plan.cfg.type_k} cache ({plan.verdict})" if plan.fits
               else f"refused ({plan.refusal})")
    why = (f"{DRAFT_REFUSAL}: draft model {draft.label}{size} not loaded: with it the plan is {with_it}, without it "
           f"{without.cfg.n_ctx} tokens of {without.cfg.type_k} cache ({without.verdict}); set draft_squeeze to keep "
           "the draft at that cost")
    return replace(without, draft_refusal=why, warnings=(*without.warnings, why))


def _make_plan(spec: ModelSpec, gpus: Sequence[Device], host: Device, req: PlanRequest,
               calibration: Calibration | None) -> Plan:
    """Plan a load: per cache type the largest context; the chosen type's placement and estimate. The chosen
    type is ``req.cache_type``, or with ``auto`` the one ``sizing.plan.auto_cache`` picks from the rows (its
    sentence among the reasons): ``cfg.type_k`` is always a concrete type.

    ``calibration``: llama.cpp's measured figures for this model (``sizing.memory.measured``), used wherever they
    cover a configuration; the simulation everywhere else.
    """
    if req.draft_rows and any(layer.has_state for layer in spec.layers):
        # A recurrent state cannot take back a rejected draft's tokens (llama.cpp refuses to remove a tail from
        # it): the engine does not draft on these models, so the plan holds no rows for it.
        req = replace(req, draft_rows=0)
    cap = ctx_cap(spec, req)
    floor = ctx_floor(spec, req, cap)
    tiers = Tiers.for_request(req)
    auto = req.cache_type == AUTO_CACHE_TYPE
    wanted = AUTO_CACHE_TYPES if auto else (req.cache_type,)
    types = tuple(dict.fromkeys(t for t in (*req.cache_types, *wanted) if t != AUTO_CACHE_TYPE))
    options = tuple(
        _with_speed(sz, _option(sz, cap), floor, tiers)
        for sz in (Sizer(spec, gpus, host, req, t, calibration) for t in types)
    )
    if auto:
        by_type = {o.cache_type: o for o in options}
        quantized = req.quantized_cpu_cache and not gpus
        among = [t for t in AUTO_CACHE_TYPES if t != "f16"] if quantized else AUTO_CACHE_TYPES
        chosen, type_reason = choose_cache_type([by_type[t] for t in among], cap, bool(gpus))
        if quantized:
            type_reason += " (f16 left out: batch-invariant outputs need CPU attention over a quantized cache)"
    else:
        chosen = next(o for o in options if o.cache_type == req.cache_type)
        type_reason = f"cache type {chosen.cache_type}: as asked (not auto)"
    reasons: list[str] = []
    if req.n_ctx and req.n_ctx > cap:
        reasons.append(f"requested n_ctx {req.n_ctx} capped at {cap} (n_ctx_train {spec.n_ctx_train}"
                       + (f", ceiling {req.context_length})" if req.context_length else ")"))
    if auto:
        reasons.append(type_reason)
    if chosen.error:
        reasons.append(f"{chosen.cache_type}: {chosen.error}")
    n_ctx = chosen.n_ctx or floor
    cfg = context_config(req, chosen.cache_type, n_ctx)
    if not cfg.applies_embedding(chosen.placement.cpu_only):
        cfg = replace(cfg, embedding_tokens=0)  # the engine creates no embedding context for this placement
    if chosen.estimate is not None:
        cfg = replace(cfg, flash_attn="on" if chosen.estimate.flash_attn else "off")
    if chosen.n_ctx and chosen.n_ctx < spec.n_ctx_train:
        if chosen.n_ctx == cap and req.n_ctx:
            why = "as requested"
        elif chosen.n_ctx == cap and req.context_length and cap < spec.n_ctx_train:
            why = "capped by the configured ceiling"
        else:
            why = "limited by free memory"
        reasons.append(f"context {chosen.n_ctx} of the model's {spec.n_ctx_train}: {why}")
    if chosen.verdict == "one_card":
        reasons.append(f"one card holds the model: {gpus[chosen.placement.gpus[0]].label} {gpus[chosen.placement.gpus[0]].name}")
    elif chosen.verdict == "split":
        reasons.append("split over " + ", ".join(f"{gpus[i].label}" for i in chosen.placement.gpus))
    elif chosen.verdict == "cpu":
        reasons.append("no GPU: the whole model runs on the CPU from host memory")
    # A card whose free memory could not be read: the plan says what it planned on instead.
    unread = tuple(note for i in chosen.placement.gpus if i < len(gpus) and (note := free_memory_note(gpus[i])))
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
        cache_type_reason=type_reason,
        refusal=chosen.refusal,
        candidates=chosen.candidates,
        warnings=(*chosen.warnings, *unread),
        predicted_decode_tokens_per_s=chosen.decode_tokens_per_s,
        predicted_prompt_tokens_per_s=chosen.prompt_tokens_per_s,
        calibration=calibration,
    )
