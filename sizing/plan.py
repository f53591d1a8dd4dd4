"""The plan: for each KV cache type the largest context, the placement, the verdict.

Pure: takes a ``ModelSpec``, the devices (GPUs and host memory) and a
``PlanRequest``; returns a ``Plan`` value. Computed once per load request;
nothing downstream recomputes sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, Sequence

from .config import ContextConfig, FlashAttn, pad
from .devices import MIB, Device
from .errors import ConfigError
from .fit import largest_fitting
from .memory import DEFAULT_GPU_ALLOWANCE_BYTES, MemoryEstimate, estimate
from .placement import Placement
from .spec import ModelSpec

Verdict = Literal["cpu", "one_card", "split", "partial_offload", "refused"]
DEFAULT_CACHE_TYPES = ("f16", "q8_0", "q4_0")


@dataclass(frozen=True)
class PlanRequest:
    """What the caller asks of a plan. ``n_ctx`` None means: the largest that fits."""

    n_ctx: int | None = None
    cache_types: tuple[str, ...] = DEFAULT_CACHE_TYPES
    cache_type: str = "q8_0"
    """The type to load with (must be one of ``cache_types`` or is added)."""
    flash_attn: FlashAttn = "auto"
    ctx_ceiling: int | None = None
    min_ctx: int = 4096
    n_ubatch: int = 512
    n_batch: int = 512
    n_seq_max: int = 1
    swa_full: bool = False
    allowance_bytes: int = DEFAULT_GPU_ALLOWANCE_BYTES
    gpu: int | Literal["auto", "all"] = "auto"
    tensor_split: tuple[float, ...] | None = None
    allow_offload: bool = True
    """Whether a model the cards cannot hold may run with some layers on the host."""


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


def _base_cfg(req: PlanRequest, cache: str, n_ctx: int) -> ContextConfig:
    return ContextConfig(
        n_ctx=n_ctx,
        type_k=cache,
        type_v=cache,
        flash_attn=req.flash_attn,
        n_ubatch=req.n_ubatch,
        n_batch=req.n_batch,
        n_seq_max=req.n_seq_max,
        swa_full=req.swa_full,
    )


def _fits(est: MemoryEstimate, gpus: Sequence[Device], host: Device) -> bool:
    if any(need.total_bytes > dev.free_bytes for need, dev in zip(est.gpus, gpus)):
        return False
    return est.host.total_bytes <= host.free_bytes


def _split_for(gpus: Sequence[Device], allowance: int) -> tuple[float, ...]:
    return tuple(max(g.free_bytes - allowance, 0) / MIB for g in gpus)


def _candidates(spec: ModelSpec, gpus: Sequence[Device], req: PlanRequest) -> list[tuple[Verdict, Placement, list[int]]]:
    """Placements to try, best first: (verdict, placement, positions into ``gpus``)."""
    full = spec.n_layer_all + 1
    if not gpus:
        return [("cpu", Placement(), [])]
    order = sorted(range(len(gpus)), key=lambda i: -gpus[i].free_bytes)
    out: list[tuple[Verdict, Placement, list[int]]] = []
    if isinstance(req.gpu, int):
        out.append(("one_card", Placement(gpus=(req.gpu,), n_gpu_layers=full, tensor_split=(1.0,)), [req.gpu]))
        return out
    if req.gpu == "all" or req.tensor_split:
        idx = list(range(len(gpus)))
        split = req.tensor_split or _split_for(gpus, req.allowance_bytes)
        verdict: Verdict = "split" if len(idx) > 1 else "one_card"
        return [(verdict, Placement(gpus=tuple(idx), n_gpu_layers=full, tensor_split=tuple(split)), idx)]
    out.append(("one_card", Placement(gpus=(order[0],), n_gpu_layers=full, tensor_split=(1.0,)), [order[0]]))
    for k in range(2, len(gpus) + 1):
        idx = sorted(order[:k])
        chosen = [gpus[i] for i in idx]
        out.append(("split", Placement(gpus=tuple(idx), n_gpu_layers=full, tensor_split=_split_for(chosen, req.allowance_bytes)), idx))
    return out


def _option(spec: ModelSpec, gpus: Sequence[Device], host: Device, req: PlanRequest, cache: str, cap: int) -> CacheTypeOption:
    floor = min(req.min_ctx, cap)
    try:
        # Validate the cache type and flash-attention rule once, before searching.
        estimate(spec, _base_cfg(req, cache, pad(floor)))
    except (ConfigError, KeyError) as exc:
        return CacheTypeOption(cache, 0, "refused", Placement(), None, error=str(exc.args[0] if isinstance(exc, KeyError) else exc))
    for verdict, placement, idx in _candidates(spec, gpus, req):
        used = [gpus[i] for i in idx]
        labels = [used_dev.label for used_dev in used]

        def est_at(n: int) -> MemoryEstimate:
            return estimate(spec, _base_cfg(req, cache, n), placement, gpu_labels=labels, allowance_bytes=req.allowance_bytes)

        n = largest_fitting(lambda n: _fits(est_at(n), used, host), floor, cap)
        if n:
            return CacheTypeOption(cache, n, verdict, placement, est_at(n))
    # Nothing holds the minimum context: report the best candidate's figures at the floor.
    verdict, placement, idx = _candidates(spec, gpus, req)[-1 if gpus else 0]
    labels = [gpus[i].label for i in idx]
    est = estimate(spec, _base_cfg(req, cache, floor), placement, gpu_labels=labels, allowance_bytes=req.allowance_bytes)
    return CacheTypeOption(cache, 0, "refused", placement, est, error="does not fit at the minimum context")


def make_plan(spec: ModelSpec, gpus: Sequence[Device], host: Device, req: PlanRequest = PlanRequest()) -> Plan:
    """Plan a load: per cache type the largest context; the chosen type's placement and estimate."""
    cap = ctx_cap(spec, req)
    types = tuple(dict.fromkeys((*req.cache_types, req.cache_type)))
    options = tuple(_option(spec, gpus, host, req, t, cap) for t in types)
    chosen = next(o for o in options if o.cache_type == req.cache_type)
    reasons: list[str] = []
    if chosen.error:
        reasons.append(f"{chosen.cache_type}: {chosen.error}")
    n_ctx = chosen.n_ctx or min(req.min_ctx, cap)
    cfg = _base_cfg(req, chosen.cache_type, n_ctx)
    if chosen.estimate is not None:
        cfg = replace(cfg, flash_attn="on" if chosen.estimate.flash_attn else "off")
    if chosen.n_ctx and chosen.n_ctx < spec.n_ctx_train:
        reasons.append(
            f"context {chosen.n_ctx} of the model's {spec.n_ctx_train}: "
            + ("capped by the configured ceiling" if chosen.n_ctx == cap and cap < spec.n_ctx_train else "limited by free memory")
        )
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
    )
