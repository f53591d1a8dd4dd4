"""Planning: a load or dry-run request turned into a ``Plan``, calibrated by llama.cpp where the model is not proven.

The pure planner (``sizing.plan.make.make_plan``) answers in milliseconds from the
simulation where it is proven: the mirrored graphs (``sizing.model.arch.MIRRORED``)
on a CPU build. Everywhere else (architectures whose graph is not mirrored, the
``special`` caches, unknown architectures, any GPU backend) ``Planner`` takes
llama.cpp's own figures first (``service.engine.calibrate``):

1. sample each cache type's configuration at a few contexts (the minimum, the
   largest allowed, the sliding-window kink, midway) in a long-lived dry-run
   worker, fit the figures (``sizing.memory.measured``) and solve on them;
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

Several models on the same devices (``Planner.place``): the plan is made on the
memory left beside the residents (``sizing.plan.residency.available``); when it does not
fit there, the smallest set of idle, unpinned residents whose memory makes it fit
is chosen (least recently used first) before anything is unloaded. ``plan_set``
answers whether several models fit together, and how.

Blocking (subprocesses): call from a thread.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Literal, Sequence

from sizing.errors import ConfigError, DeviceError, SizingError
from sizing.memory import (Calibration, compute_mirrored, ConfigKey, ContextConfig, DraftModel, kv_cells,
                           MemoryEstimate, mtp_config, mtp_supported, placement_key, resolve_flash_attn)
from sizing.model import arch as archs, ModelSpec
from sizing.plan import (available, context_config, ctx_cap, ctx_floor, decide_placement, Decision,
                         decision_request, Device, held_bytes, held_summary, Holding, lru, make_plan, Plan,
                         plan_json, PlanRequest)
from sizing.probe import host_memory, parse_declared
from sizing.units import MIB, mib

from ..catalog.projectors import ProjectorSource
from ..engine.calibrate import Calibrator, FileIdentity, add_samples, points
from ..engine.cpu import RepackChoice, host_repack
from ..engine.dryrun import DryRunError, DryRunResult
from ..engine.params import device_params, ModelParams, rpc_endpoints
from ..engine.prompt_cache import plan_budget
from ..errors import BadRequest, NotReady
from ..options import LoadOptions, merged
from ..rpc.client import Absent, silent_worker
from ..settings import Settings
from .confirm import Confirmation, Confirmer

log = logging.getLogger(__name__)

MAX_ROUNDS = 10
"""Solve-and-confirm rounds (each one batch of dry runs) before the plan falls back to measured contexts only."""


WORKERS_ABSENT = "workers not available"
"""How a refused plan's reason names the workers it could not count on (``Planner.absent_workers``)."""

DraftResolver = Callable[[str], DraftModel]
"""A draft model's name to its probed file (the registry's: ``ModelManager``); ``BadRequest`` for a name it does not
know or a file it cannot read."""


def plan_request(settings: Settings, opts: LoadOptions, host_bandwidth_bytes_per_s: float | None = None,
                 repack: RepackChoice | None = None, drafts: DraftResolver | None = None,
                 cpu_flops_per_core: float | None = None) -> PlanRequest:
    """The load options, merged over the settings (``service.options.merged``), as a ``PlanRequest``; ``repack``:
    this host's choice of llama.cpp's extra CPU buffer types (``service.engine.cpu``; None: decided where llama.cpp
    loads it); ``drafts`` finds the draft model the options name (without: a draft model named is an error)."""
    o = merged(settings, None, opts)
    draft = None
    # A draft model where drafts are made: speculation on and outputs not batch-invariant (the engine drafts nothing
    # then, as for n-gram drafts).
    if o.draft_model and settings.speculative != "off" and not o.batch_invariant:
        if drafts is None:
            raise BadRequest("a draft model cannot be planned here", param="draft_model")
        draft = drafts(o.draft_model)
    if o.batch_invariant and repack is not None and repack.on:  # the engine loads without them (LlamaEngine)
        repack = replace(repack, on=False, reason="batch-invariant outputs (GGUF_BATCH_INVARIANT or the models file)")
    return PlanRequest(
        n_ctx=o.n_ctx,
        cache_types=tuple(t.strip() for t in settings.cache_types.split(",") if t.strip()),
        cache_type=o.cache_type or settings.cache_type,
        flash_attn=o.flash_attn or settings.flash_attn,
        context_length=o.context_length,
        min_ctx=settings.min_context,
        n_ubatch=settings.n_ubatch,
        n_batch=settings.n_batch,
        n_seq_max=o.parallel or settings.parallel,
        # Batch-invariant outputs: a KV stream per slot. In one unified cache llama.cpp puts a sequence's new cells
        # wherever cells are free, below its older ones too (src/llama-kv-cache.cpp ``find_slot`` starts from cell 0
        # once more cells are free before its head than the batch needs twice), and CPU flash attention visits a
        # sequence's cells in cell order (ggml-cpu/ops.cpp): the same request then rounded otherwise.
        kv_unified=bool(o.kv_unified) and not o.batch_invariant,
        swa_full=bool(o.swa_full),
        allowance_bytes=settings.gpu_allowance_mib * MIB,
        backend_allowance_bytes=(("Vulkan", settings.vulkan_allowance_mib * MIB),),
        gpu=o.gpu if o.gpu is not None else "auto",
        tensor_split=o.tensor_split,
        allow_offload=settings.allow_offload,
        host_bandwidth_bytes_per_s=(settings.host_bandwidth_gbps * 1e9 if settings.host_bandwidth_gbps
                                    else host_bandwidth_bytes_per_s or 40e9),
        disk_bandwidth_bytes_per_s=settings.disk_bandwidth_gbps * 1e9,
        cpu_cores=settings.n_threads or os.cpu_count() or 1,
        cpu_flops_per_core=(settings.cpu_gflops_per_core * 1e9 if settings.cpu_gflops_per_core
                            else cpu_flops_per_core),
        embedding_tokens=0 if settings.embeddings == "off" else settings.embedding_tokens,
        embedding_gpu=settings.embeddings == "on",
        # The drafts' logits rows (self-speculation; not in batch-invariant mode, whose few drafts a step take idle
        # slots' rows), and there a quantized cache where attention runs on the CPU (``quantized_cpu_cache``).
        draft_rows=settings.draft_max if settings.speculative != "off" and not o.batch_invariant else 0,
        quantized_cpu_cache=bool(o.batch_invariant),
        draft=draft,
        draft_squeeze=bool(o.draft_squeeze),
        cpu_repack=repack.on if repack is not None else None,
        cpu_repack_reason=repack.reason if repack is not None else "",
        cpu_features=repack.features if repack is not None else frozenset(),
    )


def prompt_cache_json(settings: Settings, plan: Plan) -> dict[str, Any]:
    """The plan's line for the prompt cache beyond the slots (``service.engine.prompt_cache``): the host memory a
    load of this plan may keep idle conversations in, and where they go on disk."""
    host = plan.estimate.host.total_bytes if plan.estimate is not None else 0
    on = settings.cache_prompt and settings.prompt_cache_mib > 0
    budget = plan_budget(plan, settings.prompt_cache_mib * MIB) if on else 0
    out: dict[str, Any] = {
        "budget_mib": round(budget / MIB, 1), "ceiling_mib": settings.prompt_cache_mib if on else 0,
        "why": (f"half of the {max(0, plan.host.free_bytes - host) / MIB:.0f} MiB of host memory the plan leaves free, "
                f"at most GGUF_PROMPT_CACHE_MIB ({settings.prompt_cache_mib})") if on else
               ("off (GGUF_PROMPT_CACHE_MIB=0)" if settings.cache_prompt else "off (GGUF_CACHE_PROMPT off)"),
        "disk_dir": settings.prompt_cache_dir if settings.cache_prompt else None,
    }
    if out["disk_dir"]:
        out["disk_ceiling_mib"] = settings.prompt_cache_disk_mib
    return out


def needs_calibration(spec: ModelSpec, backend: str) -> bool:
    """Whether the pure model is unproven here: a GPU backend, an unmirrored graph, a cache it does not mirror."""
    t = archs.traits(spec.architecture)
    return backend != "CPU" or not spec.arch_known or t.memory == "special" or not compute_mirrored(spec)


@dataclass(frozen=True)
class Placed:
    """Where a load goes beside the residents: its plan, whom it is planned beside, whom it unloads first."""

    plan: Plan
    beside: tuple[str, ...] = ()
    """Residents the plan was made beside (they keep their memory)."""
    evict: tuple[str, ...] = ()
    """Residents to unload before the load, least recently used first (idle and unpinned, unless forced)."""
    busy: tuple[str, ...] = ()
    """Set when the plan fits only with the memory of residents that are generating now (a 409 unless forced)."""
    held: dict[str, dict[str, int]] = field(default_factory=dict)
    """Device -> resident -> bytes, for the residents the plan was made beside (a refusal's figures)."""
    pinned: tuple[str, ...] = ()
    """Residents that may not be evicted because they are pinned."""
    count_limited: bool = False
    """The plan fits in memory but ``max_loaded_models`` models are loaded and none of them may go."""

    def to_json(self) -> dict[str, Any]:
        return {"beside": list(self.beside), "evict": list(self.evict), "busy": list(self.busy),
                "pinned": list(self.pinned),
                "held_mib": {d: {n: mib(b) for n, b in by.items()} for d, by in self.held.items()}}


@dataclass(frozen=True)
class SetMember:
    """One model of a set dry-run: its name, plan and what it holds per device."""

    name: str
    plan: Plan
    held: dict[str, int]


@dataclass(frozen=True)
class SetPlan:
    """Whether several models fit together on these devices, and how (``Planner.plan_set``)."""

    fits: bool
    members: tuple[SetMember, ...]
    gpus: tuple[Device, ...]
    host: Device
    how: Literal["largest_contexts", "smallest_contexts", "refused"]
    """``largest_contexts``: each model got the largest context that leaves the later ones their smallest;
    ``smallest_contexts``: they fit only at their smallest contexts; ``refused``: not even then."""
    refused: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """Per card (and the host): each model's weights, KV, state, compute and output, and what is left."""
        devices = []
        for dev in (*self.gpus, self.host):
            label = dev.label
            models = []
            for m in self.members:
                est = m.plan.estimate
                d = next((x for x in est.devices if x.device == label), None) if est is not None else None
                if d is None or not m.held.get(label):
                    continue
                models.append({"model": m.name, "weights_mib": mib(d.weights_bytes),
                               "kv_mib": mib(d.kv_bytes), "state_mib": mib(d.state_bytes),
                               "compute_mib": mib(d.compute_bytes),
                               "output_mib": mib(d.output_bytes),
                               "gpu_pool_mib": mib(d.pool_bytes),
                               "allowance_mib": mib(d.allowance_bytes),
                               "total_mib": mib(m.held[label])})
            # Each model's runner process holds its own CUDA context on the card (sizing.plan.residency): in its total.
            allowance = sum(g.allowance_bytes for m in self.members if m.plan.estimate is not None
                            for g in m.plan.estimate.gpus if g.device == label)
            used = sum(m.held.get(label, 0) for m in self.members)
            devices.append({"device": label, "name": dev.name, "total_mib": mib(dev.total_bytes),
                            "free_mib": mib(dev.free_bytes), "models": models,
                            "allowance_mib": mib(allowance),
                            "left_mib": round((dev.free_bytes - used) / MIB, 2)})
        return {"fits": self.fits, "how": self.how, "refused": list(self.refused),
                "models": [{"model": m.name, "verdict": m.plan.verdict, "n_ctx": m.plan.cfg.n_ctx,
                            "cache_type": m.plan.cfg.type_k, "plan": plan_json(m.plan)} for m in self.members],
                "devices": devices}


def _lost_worker(name: str, workers: Sequence[str], results: Sequence[DryRunResult]) -> None:
    """A dry run over ggml-rpc workers that crashed or ran out of time while one of them does not answer lost that
    worker (its host, link or process gone; ggml-rpc aborts the process): ``NotReady`` naming it, and nothing
    cached. Cached, the failure would refuse the configuration for good, though the worker comes back."""
    failed = next((r.failure for r in results if r.failure is not None and r.failure.kind in ("crashed", "timeout")),
                  None)
    if failed is None:
        return
    silent = silent_worker(workers)
    if silent is not None:
        raise NotReady(f"the dry run of {name} over its workers {failed.kind} ({failed.message}): {silent}; "
                       "retry once it answers", retry_after_s=5)


class Planner:
    """Plans for the service: devices (live, declared or hypothetical), settings, calibration, confirmation,
    and residency (beside loaded models, eviction)."""

    def __init__(self, settings: Settings, devices: Callable[[], tuple[list[Device], Device]],
                 calibrator: Calibrator | None = None, host_bandwidth_bytes_per_s: float | None = None,
                 *, live: bool | None = None) -> None:
        self.settings = settings
        self._devices = devices
        self.calibrator = calibrator
        self.host_bandwidth_bytes_per_s = host_bandwidth_bytes_per_s
        self.cpu_flops_per_core: float | None = None
        """The host's decode FLOP/s per thread as measured (``service.engine.cpu_speed``; None: the constant)."""
        self.live = not (settings.gpus_file or settings.gpus_json) if live is None else live
        """Whether the cards' figures are live (NVML: they already exclude the residents) or declared."""
        self.absent_workers: Sequence[Absent] = ()
        """The workers of ``GGUF_RPC_WORKERS`` the last inventory left out, and why (``service.rpc.client``)."""
        self.drafts: DraftResolver | None = None
        """Finds the draft model a load names (``draft_model``); set by the model manager, which has the registry."""
        self.confirmer = Confirmer(settings, calibrator, self.plan_on, self.calibrated)
        self.projectors = ProjectorSource(settings.models_dir, calibrate=settings.calibrate,
                                          has_gpus=lambda: self.live and bool(self._devices()[0]))
        """Finds a model's vision projector (``mmproj``) and measures it."""

    @functools.cached_property
    def repack(self) -> RepackChoice:
        """This host's choice of llama.cpp's extra CPU buffer types (``GGUF_CPU_REPACK``), read once."""
        choice = host_repack(self.settings.cpu_repack)
        log.info("CPU weight repacking %s (%s)", "on" if choice.on else "off", choice.reason)
        return choice

    def request(self, opts: LoadOptions, spec: ModelSpec | None = None, path: str | None = None) -> PlanRequest:
        """The plan request for ``opts``; with the model (``spec``, its file ``path``), its vision projector too
        (``service.catalog.projectors``: the file ``mmproj`` names or one beside the model, mtmd's figures for it)."""
        req = plan_request(self.settings, opts, self.host_bandwidth_bytes_per_s, self.repack, self.drafts,
                           self.cpu_flops_per_core)
        if spec is None:
            return req
        o = merged(self.settings, None, opts)
        if (self.settings.mtp != "off" and req.draft is None and req.draft_rows > 0 and mtp_supported(spec)):
            req = replace(req, mtp=True)  # the head's context is then calibrated beside the model's (``_todo``)
        offload = o.mmproj_offload if o.mmproj_offload is not None else self.settings.mmproj_offload
        projector = self.projectors.projector(o.mmproj, path, spec, offload=offload)
        return replace(req, projector=projector) if projector is not None else req

    def inventory(self, opts: LoadOptions = LoadOptions()) -> tuple[list[Device], Device, bool]:
        """The cards and host as read now, and whether residents count on them (False for hypothetical cards,
        which hold none of this server's models)."""
        try:
            if opts.gpus is not None:
                self.absent_workers = ()  # hypothetical cards: no worker was asked, none is missing
                return parse_declared(list(opts.gpus)), host_memory(), False
            gpus, host = self._devices()
        except DeviceError as exc:
            raise BadRequest(str(exc), param="gpus") from exc
        return list(gpus), host, True

    def devices(self, opts: LoadOptions, kept: Sequence[MemoryEstimate] = (),
                freed: Sequence[MemoryEstimate] = ()) -> tuple[list[Device], Device]:
        """The cards and host to plan for: hypothetical ones from the request as given, else the live or
        declared inventory as it is beside the residents ``kept`` once those ``freed`` are unloaded."""
        gpus, host, resident = self.inventory(opts)
        if not resident:
            return gpus, host
        return available(gpus, host, kept, freed, live=self.live)

    def plan(self, spec: ModelSpec, opts: LoadOptions, *, path: str | None = None,
             kept: Sequence[MemoryEstimate] = (), freed: Sequence[MemoryEstimate] = ()) -> Plan:
        """The plan for a probed model beside ``kept`` (``freed`` unloaded first); calibrated when ``path`` is a
        local file and the model is not proven."""
        gpus, host = self.devices(opts, kept, freed)
        return self._plan_checked(spec, gpus, host, self.request(opts, spec, path), path)

    def _plan_checked(self, spec: ModelSpec, gpus: Sequence[Device], host: Device, req: PlanRequest,
                      path: str | None) -> Plan:
        try:
            return self.plan_on(spec, gpus, host, req, path=path)
        except ConfigError as exc:
            raise BadRequest(str(exc), param="cache_type") from exc
        except SizingError as exc:
            raise BadRequest(str(exc)) from exc

    def place(self, spec: ModelSpec, opts: LoadOptions, *, path: str | None = None,
              residents: Sequence[Holding] = (), replacing: str | None = None, max_models: int | None = None,
              force: bool = False) -> Placed:
        """Where a load of ``spec`` goes beside ``residents``, decided before anything is unloaded.

        ``replacing``: the resident this load reloads (its memory counts as free). The plan is made beside the
        others; whether it stays beside them or evicts some first is ``sizing.plan.residency.decide_placement``
        (pure: the planning on the memory left is passed in).
        """
        gpus0, host0, resident = self.inventory(opts)
        req = self.request(opts, spec, path)
        if not resident:  # hypothetical cards: none of the residents is on them
            return Placed(self._plan_checked(spec, gpus0, host0, req, path))
        own = [h.estimate for h in residents if h.name == replacing]
        others = [h for h in residents if h.name != replacing]
        dreq = decision_request(spec, req)

        def plan_with(evicted: tuple[Holding, ...], r: PlanRequest) -> Plan:
            gone = {h.name for h in evicted}
            kept = [h.estimate for h in others if h.name not in gone]
            gpus, host = available(gpus0, host0, kept, [*own, *(h.estimate for h in evicted)], live=self.live)
            return self._plan_checked(spec, gpus, host, r, path)

        def placed(d: Decision) -> Placed:
            gone = {h.name for h in d.evicted}
            kept = [h for h in lru(others) if h.name not in gone]
            return Placed(d.plan, tuple(h.name for h in kept), tuple(h.name for h in d.evicted),
                          busy=tuple(h.name for h in d.busy), held=held_summary(kept),
                          pinned=tuple(h.name for h in others if h.pinned), count_limited=d.count_limited)

        return placed(decide_placement(others, plan_with, req, dreq, max_models=max_models, force=force))

    def plan_set(self, items: Sequence[tuple[str, ModelSpec, LoadOptions, str | None]], opts: LoadOptions,
                 kept: Sequence[Holding] = (), freed: Sequence[Holding] = ()) -> SetPlan:
        """Whether these models fit together on the devices (hypothetical ones from ``opts.gpus``, else these,
        beside the residents ``kept``, with those ``freed`` counted as unloaded), and how: loaded in this order,
        each planned beside the ones before it.

        First every model at its smallest context (the requested ``n_ctx``, else the minimum): if they do not
        fit so, they do not fit. Then each gets the largest context that still leaves the models after it their
        smallest ones; where that arrangement does not hold, the smallest contexts are the answer.
        """
        gpus0, host0, resident = self.inventory(opts)
        base_kept = [h.estimate for h in kept] if resident else []
        base_freed = [h.estimate for h in freed] if resident else []
        live = self.live if resident else False

        def on(members: Sequence[MemoryEstimate]) -> tuple[list[Device], Device]:
            return available(gpus0, host0, [*base_kept, *members], base_freed, live=live)

        smallest: list[SetMember] = []
        refused: list[str] = []
        for name, spec, o, path in items:
            req = self.request(o, spec, path)
            g, h = on([m.plan.estimate for m in smallest if m.plan.estimate is not None])
            p = self._plan_checked(spec, g, h, decision_request(spec, req), path)
            if not p.fits or p.estimate is None:
                refused.append(name)
            smallest.append(SetMember(name, p, held_bytes(p.estimate) if p.estimate is not None else {}))
        g, h = on(())
        if refused:
            return SetPlan(False, tuple(smallest), tuple(g), h, "refused", tuple(refused))
        largest: list[SetMember] = []
        for i, (name, spec, o, path) in enumerate(items):
            later = [m.plan.estimate for m in smallest[i + 1:] if m.plan.estimate is not None]
            g, h = on([*(m.plan.estimate for m in largest if m.plan.estimate is not None), *later])
            p = self._plan_checked(spec, g, h, self.request(o, spec, path), path)
            if not p.fits or p.estimate is None:
                return SetPlan(True, tuple(smallest), tuple(on(())[0]), on(())[1], "smallest_contexts")
            largest.append(SetMember(name, p, held_bytes(p.estimate)))
        g, h = on(())
        return SetPlan(True, tuple(largest), tuple(g), h, "largest_contexts")

    def plan_on(self, spec: ModelSpec, gpus: Sequence[Device], host: Device, req: PlanRequest, *,
                path: str | None = None) -> Plan:
        """``make_plan`` on these devices, with llama.cpp's figures where they are needed and can be had (for the draft
        model too: its own calibration, made as for a model planned alone on these devices)."""
        if req.draft is not None and path is not None:
            req = self._draft_calibrated(req, gpus, host)
        if path is None or self.calibrator is None or not self.settings.calibrate:
            plan = self._with_absent(make_plan(spec, gpus, host, req))
            if needs_calibration(spec, "CPU"):
                why = "no local file to measure" if path is None else "calibration is off (GGUF_CALIBRATE)"
                plan = replace(plan, warnings=(*plan.warnings, f"{spec.architecture}: every figure simulated ({why}); "
                                               "the compute buffer of this architecture is an estimate"))
            return plan
        ident = FileIdentity.of(list(spec.source.shards) or [path])
        workers = rpc_endpoints(gpus)
        if workers:
            # Over workers every figure is llama.cpp's, measured with them registered (their buffers' sizes come
            # from them: GET_ALLOC_SIZE), filed under the set of workers the placements' indexes refer to.
            return self._with_absent(self.calibrated(spec, path, ident, f"RPC({','.join(workers)})", gpus, host, req))
        try:
            backend = self.calibrator.backend(ident, path)
        except DryRunError as exc:
            log.warning("calibration of %s could not start: %s", spec.name, exc)
            plan = make_plan(spec, gpus, host, req)
            return replace(plan, warnings=(*plan.warnings, f"calibration could not run: {exc}"))
        if not needs_calibration(spec, backend) and not req.mtp:  # an MTP head's compute buffer is not mirrored
            return self._with_absent(make_plan(spec, gpus, host, req))
        return self._with_absent(self.calibrated(spec, path, ident, backend, gpus, host, req))

    def _with_absent(self, plan: Plan) -> Plan:
        """A plan that does not fit names the workers it could not count on (``GGUF_RPC_WORKERS``), and why."""
        if plan.fits or not self.absent_workers:
            return plan
        why = WORKERS_ABSENT + ": " + "; ".join(str(a) for a in self.absent_workers)
        return replace(plan, reasons=(*plan.reasons, why))

    # -- calibration

    def _draft_calibrated(self, req: PlanRequest, gpus: Sequence[Device], host: Device) -> PlanRequest:
        """``req`` with llama.cpp's figures for its draft model where the pure model does not prove it here (an
        unmirrored graph, a GPU backend): the draft planned alone on these devices over the same contexts, which
        calibrates it at the sample points the main plan's search interpolates between."""
        draft = req.draft
        assert draft is not None
        if self.calibrator is None or not self.settings.calibrate or not draft.path:
            return req
        ident = FileIdentity.of(list(draft.spec.source.shards) or [draft.path])
        try:
            backend = self.calibrator.backend(ident, draft.path)
        except DryRunError as exc:
            log.warning("calibration of the draft model %s could not start: %s", draft.label, exc)
            return req
        if not needs_calibration(draft.spec, backend):
            return req
        alone = replace(req, draft=None, draft_rows=0, embedding_tokens=0)
        cal = self.calibrated(draft.spec, draft.path, ident, backend, gpus, host, alone).calibration
        return replace(req, draft=replace(draft, calibration=cal))

    def calibrated(self, spec: ModelSpec, path: str, ident: FileIdentity, backend: str, gpus: Sequence[Device],
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
                if mp.rpc_workers:
                    _lost_worker(spec.name, mp.rpc_workers, results)
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
                pkey, mp = None, ModelParams(use_extra_bufts=req.cpu_repack is not False)
            else:
                pkey = placement_key(pl.n_gpu_layers, pl.tensor_split, pl.n_cpu_moe)
                mp = device_params(pl, gpus)
            chosen = context_config(req, opt.cache_type, opt.n_ctx or floor)
            sets: list[tuple[ModelParams, Callable[[ContextConfig], ContextConfig]]] = [(mp, lambda c: c)]
            if req.mtp:  # the MTP head's context, on the model loaded with its NextN block (``sizing.memory.mtp``)
                sets.append((replace(mp, load_mtp=True), mtp_config))
            for m, as_cfg in sets:
                items = todo.setdefault(m, [])
                first = as_cfg(chosen)
                wanted = ([] if cal.get(ConfigKey.of(first, flash), pkey) is not None
                          else [as_cfg(c) for c in points(spec, base, floor, cap)])
                for c in [*wanted, first]:
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
        """llama.cpp's dry run of ``plan`` with the engine's exact parameters; re-solve when it needs more
        (``service.planning.confirm``)."""
        return self.confirmer.confirm(plan, path, name, timeout_s=timeout_s)

    def release(self) -> None:
        """Stop the dry-run workers (before a real load: on a GPU build each holds a device context)."""
        if self.calibrator is not None:
            self.calibrator.release()

    def close(self) -> None:
        if self.calibrator is not None:
            self.calibrator.close()


__all__ = ["WORKERS_ABSENT", "Confirmation", "LoadOptions", "Placed", "Planner", "SetMember", "SetPlan", "needs_calibration",
           "plan_request"]
