"""What ``GET /api/models`` and the metrics show of the residency: each model, the devices, the queues."""

from __future__ import annotations

import time
from typing import Any, Protocol, Sequence

from sizing.memory import MemoryEstimate
from sizing.plan import Device, Holding, held_bytes, plan_json
from sizing.units import mib

from ..catalog.models import Registry
from ..engine.base import LoadReport
from ..errors import ServiceError
from ..keepalive import keep_alive_json
from ..planning.planner import Planner, prompt_cache_json
from ..settings import Settings
from .state import ModelState
from .swaps import SwapScheduler



class Residency(Protocol):
    """What the views read of the residency (``ModelManager``), public members only."""

    @property
    def settings(self) -> Settings: ...

    @property
    def registry(self) -> Registry: ...

    @property
    def planner(self) -> Planner: ...

    def loaded(self) -> list[ModelState]: ...

    def inventory(self) -> tuple[list[Device], Device]: ...

    def holdings(self, states: Sequence[ModelState] | None = None) -> list[Holding]: ...

    @property
    def scheduler(self) -> SwapScheduler: ...


def describe(manager: Residency, state: ModelState | None) -> dict[str, Any] | None:
    if state is None:
        return None
    out: dict[str, Any] = {"name": state.name, "state": state.state, "error": state.error}
    if state.entry is not None:
        out["origin"] = state.entry.origin
    out["aliases"] = manager.registry.aliases_of(state.name)
    out["pinned"] = state.pinned
    q = manager.scheduler.queue_of(state.name)
    if q is not None and (waiting := len(q.live())):
        out["waiting"] = waiting
    if manager.scheduler.is_reloading(state.name):
        out["reloading"] = True
    if state.serving and manager.scheduler.yields(state):
        out["yields_to"] = manager.scheduler.asked_by(state.name)
    if state.plan is not None:
        out["plan"] = plan_json(state.plan)
        out["prompt_cache"] = prompt_cache_json(manager.settings, state.plan)
        if state.serving:
            out["prompt_cache"]["holds"] = getattr(state.engine, "prompt_cache_gauges", None) or {}
    if state.confirmation is not None:
        out["confirmation"] = state.confirmation
    if state.unloaded_why is not None and state.state == "unloaded":
        out["unloaded"] = state.unloaded_why
    runner_json = getattr(state.engine, "runner_json", None)
    if runner_json is not None:
        out["runner"] = runner_json()
    if state.serving and state.report is not None and state.plan is not None:
        out.update(_serving_json(state, state.report, state.plan.estimate))
        out.update(_companions_json(state.report, state.plan.estimate))
    return out


def _serving_json(state: ModelState, report: LoadReport, est: MemoryEstimate | None) -> dict[str, Any]:
    """A serving model's context, use and memory: llama.cpp's allocations beside the plan's, per device."""
    out: dict[str, Any] = {}
    held = held_bytes(est) if est is not None else {}
    out["n_ctx"] = report.n_ctx
    out["load_seconds"] = round(report.load_seconds, 3)
    out["devices"] = [d.device for d in est.devices if held.get(d.device)] if est is not None else []
    out["in_flight"] = state.leases
    out["busy"] = state.busy
    out["idle_s"] = round(max(0.0, time.monotonic() - state.last_used), 3)
    out["keep_alive_s"] = keep_alive_json(state.keep_alive_s)
    out["expires_in_s"] = None if state.expires_at is None else round(max(0.0, state.expires_at - time.time()), 3)
    rows = allocation_rows(est) if est is not None else {}
    grown = report.draft_output_bytes
    out["memory"] = [
        {
            "device": a.device,
            "allocated_mib": mib(a.total_bytes + (grown if a.device == "CPU" else 0)),
            "allocated": {
                "weights_mib": mib(a.weights_bytes),
                "kv_mib": mib(a.kv_bytes),
                "compute_mib": mib(a.compute_bytes),
                "output_mib": mib(a.output_bytes),
                # The output buffer (host memory, CUDA_Host's too) grown for drafts' logits rows
                # (LoadReport.draft_output_bytes).
                **({"draft_output_mib": mib(grown)} if grown and a.device == "CPU" else {}),
            },
            "predicted_mib": mib(rows[a.device]) if a.device in rows else None,
            "held_mib": mib(held[a.device]) if a.device in held else None,
        }
        for a in report.allocations
    ]
    return out


def _companions_json(report: LoadReport, est: MemoryEstimate | None) -> dict[str, Any]:
    """The draft model's, the MTP context's and the vision projector's memory, allocated beside predicted."""
    out: dict[str, Any] = {}
    draft = est.draft if est is not None else None
    if draft is not None:
        drows = allocation_rows(draft.estimate)
        out["draft"] = {
            "name": draft.name, "path": draft.path, "device": draft.device,
            "memory": [{"device": a.device, "allocated_mib": mib(a.total_bytes),
                        "predicted_mib": mib(drows[a.device]) if a.device in drows else None}
                       for a in report.draft_allocations],
        }
    mm = est.mtp if est is not None else None
    if mm is not None:
        rows = report.mtp_rows_bytes
        out["mtp"] = {
            **mm.to_json(),
            # The NextN weights are in the model's rows above; these are the MTP context's and the hidden rows.
            "memory": [{"device": a.device,
                        "allocated_mib": mib(a.total_bytes + (rows if a.device == "CPU" else 0)),
                        "predicted_mib": mib(mm.logged_on(a.device) + (rows if a.device == "CPU" else 0))}
                       for a in report.mtp_allocations],
        }
    pm = est.projector if est is not None else None
    if pm is not None:
        out["projector"] = {
            **pm.to_json(),
            "memory": [{"device": a.device, "allocated_mib": mib(a.total_bytes),
                        "allocated": {"weights_mib": mib(a.weights_bytes), "compute_mib": mib(a.compute_bytes)},
                        "predicted_mib": mib(pm.total_bytes) if a.device == pm.device else None}
                       for a in report.projector_allocations],
        }
    return out


def admission(manager: Residency) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Per model with requests waiting to be admitted: how many (``waiting``), the oldest one's wait
    (``oldest_s``), the busy models its swap waits for (``blocked_on``); and the loaded models that yield
    (admit no new request until a swap that waits for their memory has run)."""
    now = time.monotonic()
    waiting: dict[str, dict[str, Any]] = {}
    for q in manager.scheduler.queues():
        live = q.live()
        if live:
            waiting[q.name] = {"waiting": len(live), "oldest_s": now - live[0].since,
                               "blocked_on": list(q.blocked_on), "loading": q.loading}
    return waiting, [s.name for s in manager.loaded() if manager.scheduler.yields(s)]


def devices_json(manager: Residency) -> list[dict[str, Any]]:
    """Each device as read now, and what each loaded model holds there (its plan's bytes, its CUDA context included).
    Blocking (NVML)."""
    try:
        gpus, host = manager.inventory()
    except ServiceError:
        return []
    holdings = manager.holdings()
    out = []
    for dev in (*gpus, host):
        shares = [{"model": h.name, "held_mib": mib(n), "pinned": h.pinned, "busy": h.busy}
                  for h in holdings if (n := held_bytes(h.estimate).get(dev.label, 0))]
        out.append({"device": dev.label, "name": dev.name, "total_mib": mib(dev.total_bytes),
                    "free_mib": mib(dev.free_bytes), "free_memory": dev.free_memory,
                    "live": (manager.planner.live and dev.free_memory != "unreported") or dev.kind == "host",
                    "models": shares})
    return out


def allocation_rows(est: Any) -> dict[str, int]:
    """The plan's bytes per row of llama.cpp's allocation log (what ``parse_allocations`` reports): each device's
    buffers without what the log does not show (the allowance, the CUDA pool bound, the embedding context),
    the host's weights in the extra CPU buffer types (CPU_REPACK, AMX) as rows of their own. A draft model's bytes
    and a vision projector's are not in them: their loads log lines of their own (``LoadReport.draft_allocations``,
    ``MemoryEstimate.draft``; ``LoadReport.projector_allocations``, ``MemoryEstimate.projector``)."""
    out: dict[str, int] = {}
    for d in est.devices:
        out[d.device] = (d.total_bytes - d.allowance_bytes - d.pool_bytes - d.embedding_bytes
                         - d.extra_weights_bytes - d.draft_model_bytes - d.projector_bytes - d.mtp_bytes)
        for buffer, n in d.extra_weights:
            out[buffer] = out.get(buffer, 0) + n
    return out
