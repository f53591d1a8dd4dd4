"""Planning: a load or dry-run request turned into a ``Plan``, calibrated by llama.cpp where the model is not proven.

The pure planner (``sizing.plan.make_plan``) answers in milliseconds from the
simulation where it is proven: the mirrored graphs (``sizing.arch.MIRRORED``)
on a CPU build. Everywhere else (architectures whose graph is not mirrored, the
``special`` caches, unknown architectures, any GPU backend) ``Planner`` takes
llama.cpp's own figures first (``service.engine.calibrate``):

1. sample each cache type's configuration at a few contexts (the minimum, the
   largest allowed, the sliding-window kink, midway) in a long-lived dry-run
   worker, fit the figures (``sizing.measured``) and solve on them;
2. confirm each row at its chosen context with one more dry run; where that
   point was not sampled yet, solve again with it, until every row's context
   was measured (llama-server's ``--fit`` interpolates the same way, loading
   the model at each step);
3. cache the samples per (file identity, backend): the next dry run of the same
   model measures nothing.

``confirm`` is the load's own check: llama.cpp's dry run with exactly the
engine's parameters (``service.engine.params``). When its figures exceed the
plan's on a device, the measurement joins the calibration and the plan is solved
again; a refusal comes only when no arrangement fits. Both figures are reported.

Blocking (subprocesses): call from a thread. The API is typed for a caller that
plans several residents at once (``credit`` / ``Planner.devices``).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Literal, Sequence

from sizing import arch as archs
from sizing.compute import compute_mirrored
from sizing.config import ContextConfig
from sizing.device import MIB, Device
from sizing.devices import host_memory, parse_declared
from sizing.errors import ConfigError, DeviceError, SizingError
from sizing.kv import kv_cells
from sizing.measured import Calibration, ConfigKey, placement_key
from sizing.memory import MemoryEstimate, resolve_flash_attn
from sizing.plan import Plan, PlanRequest, make_plan
from sizing.request import context_config, ctx_cap, ctx_floor
from sizing.spec import ModelSpec

from .engine.calibrate import Calibrator, FileIdentity, add_samples, points
from .engine.dryrun import DryRunError, DryRunResult
from .engine.params import ModelParams, model_params, plan_params
from .errors import BadRequest, InsufficientMemory
from .settings import Settings

log = logging.getLogger(__name__)

MAX_ROUNDS = 10
"""Solve-and-confirm rounds (each one batch of dry runs) before the plan falls back to measured contexts only."""


@dataclass(frozen=True)
class LoadOptions:
    """What a load or dry-run request may override; None keeps the settings' value."""

    n_ctx: int | None = None
    cache_type: str | None = None
    flash_attn: Literal["on", "off", "auto"] | None = None
    gpu: int | Literal["auto", "all"] | None = None
    tensor_split: tuple[float, ...] | None = None
    n_seq_max: int | None = None
    swa_full: bool | None = None
    gpus: Sequence[dict[str, Any]] | None = None
    """Hypothetical cards (dry-run only): [{name, free_mib, total_mib}]."""
    confirm: bool | None = None
    """Confirm the plan with llama.cpp's dry run before loading (None: the setting)."""


def plan_request(settings: Settings, opts: LoadOptions, host_bandwidth_bytes_per_s: float | None = None) -> PlanRequest:
    """The settings, overridden by a request's options, as a ``PlanRequest``."""
    split = opts.tensor_split
    if split is None and settings.tensor_split:
        try:
            split = tuple(float(x) for x in settings.tensor_split.split(","))
        except ValueError as exc:
            raise BadRequest(f"GGUF_TENSOR_SPLIT is not a list of numbers: {settings.tensor_split}") from exc
    cache = opts.cache_type or settings.cache_type
    return PlanRequest(
        n_ctx=opts.n_ctx,
        cache_types=tuple(t.strip() for t in settings.cache_types.split(",") if t.strip()),
        cache_type=cache,
        flash_attn=opts.flash_attn or settings.flash_attention,
        ctx_ceiling=settings.context_length,
        min_ctx=settings.min_context,
        n_ubatch=settings.n_ubatch,
        n_batch=settings.n_batch,
        n_seq_max=opts.n_seq_max or settings.parallel,
        kv_unified=settings.kv_unified,
        swa_full=settings.swa_full if opts.swa_full is None else opts.swa_full,
        allowance_bytes=settings.gpu_allowance_mib * MIB,
        gpu=opts.gpu if opts.gpu is not None else "auto",
        tensor_split=split,
        allow_offload=settings.allow_offload,
        host_bandwidth_bytes_per_s=(settings.host_bandwidth_gbps * 1e9 if settings.host_bandwidth_gbps
                                    else host_bandwidth_bytes_per_s or 40e9),
        disk_bandwidth_bytes_per_s=settings.disk_bandwidth_gbps * 1e9,
        cpu_cores=settings.n_threads or os.cpu_count() or 1,
    )


def credit(gpus: Sequence[Device], host: Device, estimates: Sequence[MemoryEstimate]) -> tuple[list[Device], Device]:
    """Free memory as it will be once the models behind ``estimates`` are unloaded: their bytes added back.

    The per-card allowance (CUDA context) stays held by the process; host weights are mmapped file pages and are
    not credited.
    """
    out = list(gpus)
    for est in estimates:
        by_label = {d.device: d for d in est.gpus}
        for i, g in enumerate(out):
            d = by_label.get(g.label)
            if d is not None:
                out[i] = replace(g, free_bytes=min(g.total_bytes, g.free_bytes + d.total_bytes - d.allowance_bytes))
        h = est.host
        host = replace(host, free_bytes=min(host.total_bytes, host.free_bytes + h.kv_bytes + h.state_bytes
                                            + h.compute_bytes + h.output_bytes))
    return out, host


def needs_calibration(spec: ModelSpec, backend: str) -> bool:
    """Whether the pure model is unproven here: a GPU backend, an unmirrored graph, a cache it does not mirror."""
    t = archs.traits(spec.architecture)
    return backend != "CPU" or not spec.arch_known or t.memory == "special" or not compute_mirrored(spec)


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
        if self.replanned_from is not None:
            out["replanned_from"] = self.replanned_from
            out["n_ctx"] = self.plan.cfg.n_ctx
        return out


class Planner:
    """Plans for the service: devices (live, declared or hypothetical), settings, calibration, confirmation."""

    def __init__(self, settings: Settings, devices: Callable[[], tuple[list[Device], Device]],
                 calibrator: Calibrator | None = None, host_bandwidth_bytes_per_s: float | None = None) -> None:
        self.settings = settings
        self._devices = devices
        self.calibrator = calibrator
        self.host_bandwidth_bytes_per_s = host_bandwidth_bytes_per_s

    def request(self, opts: LoadOptions) -> PlanRequest:
        return plan_request(self.settings, opts, self.host_bandwidth_bytes_per_s)

    def devices(self, opts: LoadOptions, replacing: Sequence[MemoryEstimate] = ()) -> tuple[list[Device], Device]:
        """The cards and host to plan for: hypothetical ones from the request, else the live (credited with what
        ``replacing`` holds: a declared inventory already excludes it) or declared inventory."""
        try:
            if opts.gpus is not None:
                return parse_declared(list(opts.gpus)), host_memory()
            gpus, host = self._devices()
        except DeviceError as exc:
            raise BadRequest(str(exc), param="gpus") from exc
        credited, host = credit(gpus, host, replacing)
        if not (self.settings.gpus_file or self.settings.gpus_json):
            gpus = credited
        return gpus, host

    def plan(self, spec: ModelSpec, opts: LoadOptions, *, path: str | None = None,
             replacing: Sequence[MemoryEstimate] = ()) -> Plan:
        """The plan for a probed model; calibrated when ``path`` is a local file and the model is not proven."""
        gpus, host = self.devices(opts, replacing)
        req = self.request(opts)
        try:
            return self.plan_on(spec, gpus, host, req, path=path)
        except ConfigError as exc:
            raise BadRequest(str(exc), param="cache_type") from exc
        except SizingError as exc:
            raise BadRequest(str(exc)) from exc

    def plan_on(self, spec: ModelSpec, gpus: Sequence[Device], host: Device, req: PlanRequest, *,
                path: str | None = None) -> Plan:
        """``make_plan`` on these devices, with llama.cpp's figures where they are needed and can be had."""
        if path is None or self.calibrator is None or not self.settings.calibrate:
            plan = make_plan(spec, gpus, host, req)
            if needs_calibration(spec, "CPU"):
                why = "no local file to measure" if path is None else "calibration is off (GGUF_CALIBRATE)"
                plan = replace(plan, warnings=(*plan.warnings, f"{spec.architecture}: every figure simulated ({why}); "
                                               "the compute buffer of this architecture is an estimate"))
            return plan
        ident = FileIdentity.of(list(spec.source.shards) or [path])
        try:
            backend = self.calibrator.backend(ident, path)
        except DryRunError as exc:
            log.warning("calibration of %s could not start: %s", spec.name, exc)
            plan = make_plan(spec, gpus, host, req)
            return replace(plan, warnings=(*plan.warnings, f"calibration could not run: {exc}"))
        if not needs_calibration(spec, backend):
            return make_plan(spec, gpus, host, req)
        return self._calibrated(spec, path, ident, backend, gpus, host, req)

    # -- calibration

    def _calibrated(self, spec: ModelSpec, path: str, ident: FileIdentity, backend: str, gpus: Sequence[Device],
                    host: Device, req: PlanRequest) -> Plan:
        assert self.calibrator is not None
        cal = self.calibrator.cached(ident, backend)
        cap = ctx_cap(spec, req)
        floor = ctx_floor(spec, req, cap)
        t0 = time.perf_counter()
        measured = 0
        plan = make_plan(spec, gpus, host, req, calibration=cal)
        for _ in range(MAX_ROUNDS):
            todo = self._todo(spec, plan, cal, backend, gpus, req, floor, cap)
            if not todo:
                break
            for mp, items in todo.items():
                results = self.calibrator.measure(path, mp, [c for _, _, c in items])
                measured += len(results)
                cal = self._absorb(spec, cal, items, results)
            self.calibrator.store(ident, cal)
            plan = make_plan(spec, gpus, host, req, calibration=cal)
        else:
            # llama.cpp's compute peak is not monotone in the context: a search can keep finding contexts not
            # measured yet. Only measured ones may be chosen then.
            log.warning("calibration of %s did not settle in %d rounds: choosing among measured contexts only",
                        spec.name, MAX_ROUNDS)
            plan = make_plan(spec, gpus, host, req, calibration=replace(cal, strict=True))
        if measured:
            log.info("calibrated %s (%s backend): %d dry runs in %.2f s, %d samples cached", spec.name, backend,
                     measured, time.perf_counter() - t0, cal.n_samples)
        return plan

    def _todo(self, spec: ModelSpec, plan: Plan, cal: Calibration, backend: str, gpus: Sequence[Device],
              req: PlanRequest, floor: int, cap: int
              ) -> dict[ModelParams, list[tuple[ConfigKey, str | None, ContextConfig]]]:
        """What to measure next: the sample points of each row not calibrated yet, and each row's chosen context
        where it was not measured. Each point is filed under its own configuration key (n_ubatch follows a
        context shorter than n_batch)."""
        todo: dict[ModelParams, list[tuple[ConfigKey, str | None, ContextConfig]]] = {}
        for opt in plan.options:
            if opt.refusal == "INVALID_CONFIG":
                continue
            base = context_config(req, opt.cache_type, floor)
            try:
                flash = resolve_flash_attn(base, spec)
            except ConfigError:
                continue
            pl = opt.placement
            if backend == "CPU":
                pkey, mp = None, ModelParams()
            else:
                pkey = placement_key(pl.n_gpu_layers, pl.tensor_split, pl.n_cpu_moe)
                mp = model_params(pl, [g.index for g in gpus], n_devices=len(gpus))
            items = todo.setdefault(mp, [])
            chosen = context_config(req, opt.cache_type, opt.n_ctx or floor)
            wanted = [] if cal.get(ConfigKey.of(chosen, flash), pkey) is not None else points(spec, base, floor, cap)
            for c in [*wanted, chosen]:
                key = ConfigKey.of(c, flash)
                if cal.refusal(key, pkey) is not None:
                    continue
                cells = kv_cells(spec, c)
                got = cal.get(key, pkey)
                if got is not None and got.sampled_at(cells.full, cells.swa) is not None:
                    continue
                if not any(k == key and p == pkey and kv_cells(spec, x) == cells for k, p, x in items):
                    items.append((key, pkey, c))
        return {mp: items for mp, items in todo.items() if items}

    def _absorb(self, spec: ModelSpec, cal: Calibration, items: Sequence[tuple[ConfigKey, str | None, ContextConfig]],
                results: Sequence[DryRunResult]) -> Calibration:
        by_key: dict[tuple[ConfigKey, str | None], list[DryRunResult]] = {}
        for (key, pkey, _), r in zip(items, results):
            by_key.setdefault((key, pkey), []).append(r)
        for (key, pkey), rs in by_key.items():
            cal, failed = add_samples(cal, spec, key, rs, pkey)
            for r in failed:
                f = r.failure
                if f is not None and f.kind == "refused":
                    cal = cal.with_refusal(key, pkey, f.message)
                elif f is not None:
                    log.warning("a calibration dry run of %s failed (%s): %s", spec.name, f.kind, f.message)
                    if cal.get(key, pkey) is None:
                        cal = cal.with_refusal(key, pkey, f"the dry run {f.kind}: {f.message}")
        return cal

    # -- the load's confirmation

    def confirm(self, plan: Plan, path: str, name: str, *, timeout_s: float | None = None) -> Confirmation:
        """llama.cpp's dry run of ``plan`` with the engine's exact parameters; re-solve when it needs more."""
        from .engine.dryrun import dry_run

        t0 = time.perf_counter()
        mp = plan_params(plan)[0]
        timeout = timeout_s or self.settings.confirm_timeout_s
        try:
            if self.calibrator is not None:
                result = self.calibrator.measure(path, mp, [plan.cfg])[0]
                layers = self.calibrator.layer_devices(path, mp)
            else:
                result = dry_run(path, plan.cfg, model=mp, timeout_s=timeout)
                layers = {}
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
        conf = _figures(plan, result, seconds, layers)
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

    def release(self) -> None:
        """Stop the dry-run workers (before a real load: on a GPU build each holds a device context)."""
        if self.calibrator is not None:
            self.calibrator.release()

    def close(self) -> None:
        if self.calibrator is not None:
            self.calibrator.close()


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


def _figures(plan: Plan, result: DryRunResult, seconds: float, layers: dict[int, str]) -> Confirmation:
    est = plan.estimate
    if est is None:
        return Confirmation("confirmed", plan, seconds, layer_devices=layers)
    compute: dict[str, dict[str, float | None]] = {}
    for d in est.devices:
        compute[d.device] = {"predicted": round(d.compute_bytes / MIB, 2),
                             "llama_cpp": _measured_compute(plan, result, d.device)}
    return Confirmation(
        "confirmed", plan, seconds,
        kv_mib={"predicted": round(est.kv_bytes / MIB, 2), "llama_cpp": result.kv_mib},
        state_mib={"predicted": round(est.state_bytes / MIB, 2), "llama_cpp": result.state_mib},
        compute_mib=compute, layer_devices=layers,
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


__all__ = ["Confirmation", "LoadOptions", "Planner", "credit", "needs_calibration", "plan_request"]
