"""A load that cannot go ahead, as the domain error its refusal names: 409 when busy models hold the memory, 507 with
every card's figures and the residents holding them (the source document's refusals), the plan as a summary."""

from __future__ import annotations

from typing import Any

from sizing.plan import Plan
from sizing.units import MIB

from ..errors import BadRequest, Busy, InsufficientMemory, SplitNotHonoured
from ..planning.planner import WORKERS_ABSENT, Placed

PLAN_URL = "/api/dry-run"
"""Where a refused load's whole plan is: POST the load's body there (a refusal carries only a summary)."""


def refusal_message(plan: Plan, placed: Placed | None = None) -> str:
    est = plan.estimate
    parts = [f"model '{plan.model.name}' does not fit at {plan.cfg.n_ctx} tokens ({plan.cfg.type_k} cache)"
             + (f" beside {', '.join(placed.beside)}" if placed is not None and placed.beside else "")]
    held = placed.held if placed is not None else {}
    if est is not None:
        by_label = {g.label: g for g in plan.gpus}
        for d in est.devices:
            dev = plan.host if d.device == "CPU" else by_label.get(d.device)
            free = dev.free_bytes if dev is not None else 0
            missing = max(d.total_bytes - free, 0)
            label = f"{d.device} ({dev.name})" if dev is not None and d.device != "CPU" else d.device
            holders = held.get(d.device, {})
            parts.append(
                f"{label}: needs {d.total_bytes / MIB:.0f} MiB (weights {d.weights_bytes / MIB:.0f}, KV {d.kv_bytes / MIB:.0f}, "
                f"compute {d.compute_bytes / MIB:.0f}, allowance {d.allowance_bytes / MIB:.0f}), free {free / MIB:.0f} MiB"
                + (f", missing {missing / MIB:.0f} MiB" if missing else "")
                + (" (held by " + ", ".join(f"{n} {b / MIB:.0f} MiB" + (" pinned" if placed and n in placed.pinned else "")
                                             for n, b in holders.items()) + ")" if holders else "")
            )
    # The workers of GGUF_RPC_WORKERS the plan could not count on, and why (service.planning.planner).
    parts.extend(r for r in plan.reasons if r.startswith(WORKERS_ABSENT))
    return "; ".join(parts)


def plan_summary(plan: Plan) -> dict[str, Any]:
    """A refused plan in short, for an error body: its context, cache type, verdict and per device what it needs,
    what is free and what is missing (MiB). The whole plan: ``POST /api/dry-run`` (``PLAN_URL``) with the body."""
    est = plan.estimate
    devices = []
    if est is not None:
        by_label = {g.label: g for g in plan.gpus}
        for d in est.devices:
            dev = plan.host if d.device == "CPU" else by_label.get(d.device)
            free = dev.free_bytes if dev is not None else 0
            devices.append({"device": d.device, "name": dev.name if dev is not None and d.device != "CPU" else None,
                            "needs_mib": round(d.total_bytes / MIB), "free_mib": round(free / MIB),
                            "missing_mib": round(max(d.total_bytes - free, 0) / MIB)})
    return {"model": plan.model.name, "n_ctx": plan.cfg.n_ctx, "cache_type": plan.cfg.type_k,
            "verdict": plan.verdict, "devices": devices}


def raise_refusal(placed: Placed | Plan) -> None:
    """A placement that cannot be loaded becomes the domain error its refusal names (one place decides the
    status): 409 when busy models hold the memory, 507 with every card's figures and the residents holding them.
    The body stays short: the plan in summary (``plan``) and where the whole one is (``plan_url``)."""
    p = placed if isinstance(placed, Placed) else Placed(placed)
    plan = p.plan
    details: dict[str, Any] = {"residents": p.to_json()} if p.beside or p.busy else {}
    details.update(plan=plan_summary(plan), plan_url=PLAN_URL)
    if p.busy:
        raise Busy(f"the memory '{plan.model.name}' needs is held by models generating now: {', '.join(p.busy)}; "
                   "retry when they finish, or send force: true to end them", **details)
    if plan.fits and p.count_limited:
        raise InsufficientMemory(
            f"{len(p.beside)} models are loaded (GGUF_MAX_LOADED_MODELS) and none of them may be unloaded "
            f"(pinned: {', '.join(p.pinned) or 'none'}; the others are busy)", **details)
    if plan.fits:
        return
    reason = "; ".join(plan.reasons) or "the model does not fit"
    if plan.refusal == "SPLIT_NOT_HONOURED":
        raise SplitNotHonoured(reason, param="gpu", plan=plan_summary(plan), plan_url=PLAN_URL)
    if plan.refusal == "INVALID_CONFIG":
        param = "gpu" if "gpu" in reason or "tensor_split" in reason else "cache_type"
        raise BadRequest(reason, param=param)
    raise InsufficientMemory(refusal_message(plan, p), **details)
