"""The load's own check: llama.cpp's dry run of a plan with exactly the engine's parameters
(``service.engine.params``), its figures beside the plan's. Where they exceed the plan's on a device, the measurement
joins the calibration and the plan is solved again (``Planner.calibrated``); a refusal comes only when no arrangement
fits. A plan's draft model is checked the same way, and left out where it needs more than predicted.

Blocking (subprocesses): call from a thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Literal, Sequence

from sizing.memory import Calibration, ConfigKey, draft_config, draft_placement, placement_key, resolve_flash_attn
from sizing.model import ModelSpec
from sizing.plan import Device, DRAFT_REFUSAL, make_plan, Plan, PlanRequest
from sizing.units import MIB, mib

from ..engine.calibrate import Calibrator, FileIdentity, add_samples
from ..engine.dryrun import DryRunError, DryRunResult
from ..engine.params import draft_params, plan_params
from ..errors import BadRequest, InsufficientMemory
from ..settings import Settings

log = logging.getLogger(__name__)

PlanOn = Callable[..., Plan]
"""``Planner.plan_on``: a model planned on these devices (for the plan without its refused draft)."""
Calibrated = Callable[[ModelSpec, str, FileIdentity, str, Sequence[Device], Device, PlanRequest], Plan]
"""``Planner.calibrated``: the plan solved on the model's calibration, every row confirmed at its context."""


@dataclass(frozen=True)
class Confirmation:
    """The load's dry run: llama.cpp's figures beside the plan's, and the plan to load (re-solved if they disagreed)."""

    status: Literal["confirmed", "replanned", "not_run", "timeout", "crashed"]
    plan: Plan
    seconds: float = 0.0
    error: str | None = None
    kv_mib: dict[str, float | None] = field(default_factory=dict)
    state_mib: dict[str, float | None] = field(default_factory=dict)
    compute_mib: dict[str, dict[str, float | None]] = field(default_factory=dict)
    replanned_from: dict[str, Any] | None = None
    """The first plan's chosen figures when the measurement sent it back to the solver."""
    layer_devices: dict[int, str] = field(default_factory=dict)
    """llama.cpp's layer assignment for the dry run (``load_tensors: layer N assigned to device D``)."""
    weight_buffers: dict[str, list[str]] = field(default_factory=dict)
    """The weight buffers (CPU, CPU_REPACK, AMX, CUDA0...) the plan predicts and the ones the dry run creates."""
    draft: dict[str, Any] | None = None
    """The draft model's own dry run beside its lines of the plan (``Confirmer._confirm_draft``)."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"status": self.status, "seconds": round(self.seconds, 3)}
        if self.error:
            out["error"] = self.error
        if self.kv_mib:
            out["kv_mib"] = self.kv_mib
        if self.state_mib:
            out["state_mib"] = self.state_mib
        if self.compute_mib:
            out["compute_mib"] = self.compute_mib
        if self.weight_buffers:
            out["weight_buffers"] = self.weight_buffers
        if self.replanned_from is not None:
            out["replanned_from"] = self.replanned_from
            out["n_ctx"] = self.plan.cfg.n_ctx
        if self.draft is not None:
            out["draft"] = self.draft
        return out




class Confirmer:
    """Confirms plans by llama.cpp's dry run (in the calibrator's worker where there is one, else a dry run of its
    own), for the planner that owns it."""

    def __init__(self, settings: Settings, calibrator: Calibrator | None, plan_on: PlanOn,
                 calibrated: Calibrated) -> None:
        self.settings = settings
        self.calibrator = calibrator
        self._plan_on = plan_on
        self._calibrated = calibrated

    def confirm(self, plan: Plan, path: str, name: str, *, timeout_s: float | None = None) -> Confirmation:
        """llama.cpp's dry run of ``plan`` with the engine's exact parameters; re-solve when it needs more."""
        from ..engine.dryrun import dry_run

        t0 = time.perf_counter()
        mp = plan_params(plan)[0]
        timeout = timeout_s or self.settings.confirm_timeout_s
        try:
            if self.calibrator is not None:
                result = self.calibrator.measure(path, mp, [plan.cfg])[0]
                layers = self.calibrator.layer_devices(path, mp)
                buffers = set(self.calibrator.model_buffers(path, mp))
            else:
                result = dry_run(path, plan.cfg, model=mp, timeout_s=timeout)
                layers, buffers = {}, set()
        except DryRunError as exc:
            log.warning("dry-run confirmation of %s could not run: %s", name, exc)
            return Confirmation("not_run", plan, error=str(exc))
        seconds = time.perf_counter() - t0
        if result.failure is not None:
            if result.failure.kind in ("refused", "load_failed"):
                raise BadRequest(
                    f"llama.cpp {'refuses this configuration' if result.failure.kind == 'refused' else 'cannot load this file'}"
                    f" for '{name}': {result.failure.message}", param="model",
                    log_tail=list(result.failure.log_tail[-8:]),
                )
            log.warning("dry-run confirmation of %s did not finish (%s): %s", name, result.failure.kind,
                        result.failure.message)
            return Confirmation(result.failure.kind, plan, seconds, result.failure.message)  # type: ignore[arg-type]
        conf = _figures(plan, result, seconds, layers, buffers)
        if plan.draft is not None:
            conf = self._confirm_draft(conf, path, timeout, mp.use_extra_bufts)
            plan = conf.plan
        wb = conf.weight_buffers
        if wb and sorted(wb["predicted"]) != wb["llama_cpp"]:
            log.warning("llama.cpp's dry run of %s puts the weights in other buffers than predicted: %s", name, wb)
        est = plan.estimate
        if est is None:
            return conf
        over = _exceeds(plan, result)
        if not over:
            return conf
        log.warning("llama.cpp's dry run of %s needs more than predicted on %s (%s): solving again with its figures",
                    name, ", ".join(over), _summary(conf))
        replanned = self._replan_with(plan, path, result)
        before = {"n_ctx": plan.cfg.n_ctx, "verdict": plan.verdict, "kv_mib": conf.kv_mib,
                  "state_mib": conf.state_mib, "compute_mib": conf.compute_mib}
        if not replanned.fits:
            detail = "; ".join(replanned.reasons) or "no arrangement holds the model with llama.cpp's figures"
            raise InsufficientMemory(
                f"llama.cpp's dry run needs more than predicted on {', '.join(over)} ({_summary(conf)}) and no "
                f"arrangement fits with its figures: {detail}", device=over[0], confirmation=conf.to_json())
        log.info("re-planned %s with llama.cpp's figures: n_ctx %d -> %d (%s)", name, plan.cfg.n_ctx,
                 replanned.cfg.n_ctx, replanned.verdict)
        return replace(conf, status="replanned", plan=replanned, replanned_from=before)

    def _confirm_draft(self, conf: Confirmation, path: str, timeout: float, use_extra_bufts: bool) -> Confirmation:
        """llama.cpp's dry run of the plan's draft model, with the engine's parameters for it, beside its lines of the
        plan. Where it needs more than predicted, the plan is the one without the draft (which needs less on every
        device), saying why: a draft the plan cannot vouch for is not loaded."""
        from ..engine.dryrun import dry_run

        plan = conf.plan
        draft = plan.draft
        assert draft is not None and plan.estimate is not None and plan.estimate.draft is not None
        dplan = draft_plan(plan)
        mp = draft_params(plan, use_extra_bufts=use_extra_bufts)[0]
        t0 = time.perf_counter()
        try:
            if self.calibrator is not None:
                result = self.calibrator.measure(draft.path, mp, [dplan.cfg])[0]
            else:
                result = dry_run(draft.path, dplan.cfg, model=mp, timeout_s=timeout)
        except DryRunError as exc:
            log.warning("dry-run confirmation of the draft model %s could not run: %s", draft.label, exc)
            return replace(conf, draft={"status": "not_run", "error": str(exc)})
        if result.failure is not None:
            why = f"llama.cpp's dry run of it {result.failure.kind}: {result.failure.message}"
        else:
            figures = _figures(dplan, result, time.perf_counter() - t0, {}, set())
            over = _exceeds(dplan, result)
            if not over:
                return replace(conf, draft=figures.to_json())
            why = f"llama.cpp's dry run of it needs more than predicted on {', '.join(over)} ({_summary(figures)})"
        text = f"{DRAFT_REFUSAL}: draft model {draft.label} not loaded: {why}"
        log.warning("%s", text)
        without = self._plan_on(plan.model, plan.gpus, plan.host, replace(plan.request, draft=None), path=path)
        without = replace(without, draft_refusal=text, warnings=(*without.warnings, text))
        return replace(conf, status="replanned", plan=without, draft={"status": "refused", "error": why},
                       replanned_from={"n_ctx": plan.cfg.n_ctx, "verdict": plan.verdict, "draft": draft.label})

    def _replan_with(self, plan: Plan, path: str, result: DryRunResult) -> Plan:
        """The plan solved again with the confirmation's figures added to its calibration (and, with a
        calibrator, every row confirmed at its new context)."""
        spec = plan.model
        ident = FileIdentity.of(list(spec.source.shards) or [path])
        backend = "CPU"
        if self.calibrator is not None:
            try:
                backend = self.calibrator.backend(ident, path)
            except DryRunError:
                pass
        cal = self.calibrator.cached(ident, backend) if self.calibrator is not None else (
            plan.calibration or Calibration(backend))
        flash = result.flash_attn if result.flash_attn is not None else resolve_flash_attn(plan.cfg, spec)
        key = ConfigKey.of(plan.cfg, flash)
        pl = plan.placement
        pkey = None if backend == "CPU" else placement_key(pl.n_gpu_layers, pl.tensor_split, pl.n_cpu_moe)
        cal, _ = add_samples(cal, spec, key, [result], pkey)
        if self.calibrator is None:
            return make_plan(spec, plan.gpus, plan.host, plan.request, calibration=cal)
        self.calibrator.store(ident, cal)
        return self._calibrated(spec, path, ident, backend, plan.gpus, plan.host, plan.request)


def _measured_compute(plan: Plan, result: DryRunResult, device: str) -> float | None:
    """llama.cpp's compute buffer for one of the plan's devices. A CPU build (no GPU buffer in the log) runs the
    whole graph on the CPU: that figure stands for each card's graph, and says nothing of the host's share."""
    if device in result.compute_mib:
        if device == "CPU" and plan.estimate is not None and plan.estimate.gpus and not any(
                k != "CPU" for k in result.compute_mib):
            return None
        return result.compute_mib[device]
    if device != "CPU" and set(result.compute_mib) == {"CPU"}:
        return result.compute_mib["CPU"]
    return None


def draft_plan(plan: Plan) -> Plan:
    """The plan's draft model as a plan of its own (its spec, context, placement and estimate, on the plan's
    devices): what its dry run is compared with."""
    draft, est = plan.draft, plan.estimate
    assert draft is not None and est is not None and est.draft is not None
    dpl, _ = draft_placement(plan.placement, draft.spec.n_layer_all, plan.model.n_layer_all)
    return replace(plan, model=draft.spec, cfg=draft_config(plan.cfg), placement=dpl, estimate=est.draft.estimate,
                   request=replace(plan.request, draft=None), calibration=draft.calibration, candidates=(),
                   draft_refusal=None)


def _figures(plan: Plan, result: DryRunResult, seconds: float, layers: dict[int, str],
             buffers: set[str]) -> Confirmation:
    est = plan.estimate
    if est is None:
        return Confirmation("confirmed", plan, seconds, layer_devices=layers)
    compute: dict[str, dict[str, float | None]] = {}
    for d in est.devices:
        compute[d.device] = {"predicted": mib(d.compute_bytes),
                             "llama_cpp": _measured_compute(plan, result, d.device)}
    weights: dict[str, list[str]] = {}
    if buffers:
        # The weight buffers the dry run creates (CPU, CUDA0..., the extra CPU ones: CPU_REPACK, AMX) beside the
        # plan's. A no_alloc load names them but logs their size as 0: sizes are checked against the real load.
        weights = {"predicted": [d.device for d in est.devices if d.weights_bytes]
                   + [b for b, n in est.host.extra_weights if n], "llama_cpp": sorted(buffers)}
    return Confirmation(
        "confirmed", plan, seconds,
        kv_mib={"predicted": mib(est.kv_bytes), "llama_cpp": result.kv_mib},
        state_mib={"predicted": mib(est.state_bytes), "llama_cpp": result.state_mib},
        compute_mib=compute, layer_devices=layers, weight_buffers=weights,
    )


def _exceeds(plan: Plan, result: DryRunResult) -> list[str]:
    """Devices where llama.cpp's figures exceed the plan's by more than the log's resolution."""
    est = plan.estimate
    assert est is not None
    tol = 0.011  # one figure rounded to 0.01 MiB
    over: list[str] = []
    kv_extra = result.kv_mib - est.kv_bytes / MIB  # up to two caches (full, SWA), each rounded
    state_extra = result.state_mib - est.state_bytes / MIB
    for d in est.devices:
        measured = _measured_compute(plan, result, d.device)
        if measured is not None and measured - d.compute_bytes / MIB > tol:
            over.append(d.device)
        elif (kv_extra > 2 * tol and d.kv_bytes) or (state_extra > tol and d.state_bytes):
            over.append(d.device)
    return over


def _summary(c: Confirmation) -> str:
    parts = []
    if c.kv_mib:
        parts.append(f"KV {c.kv_mib.get('predicted')} predicted / {c.kv_mib.get('llama_cpp')} llama.cpp MiB")
    for dev, f in c.compute_mib.items():
        if f.get("llama_cpp") is not None:
            parts.append(f"{dev} compute {f['predicted']} predicted / {f['llama_cpp']} llama.cpp MiB")
    return ", ".join(parts)
