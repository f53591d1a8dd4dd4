"""Residency and lifecycle: the models loaded at once, each with its own engine, plan and queue.

States per model: unloaded -> loading -> loaded | failed; a loaded model goes
back to unloaded when it is unloaded, evicted or idle past its keep_alive.

A load is planned beside the loaded models on the memory they leave
(``service.planning.planner.Planner.place``, off the event loop). When it does not fit
there, the smallest set of idle, unpinned models whose memory makes it fit is
chosen, least recently used first, before anything is unloaded; busy models
(a request queued or running) and pinned ones are never evicted, so a refusal
(507 with every card's figures and the residents holding them; 409 when only
busy models hold the memory) leaves every model serving. Then llama.cpp's dry
run confirms the plan, the chosen models are unloaded, and the new one loads
into an engine of its own (``EngineFactory``) behind a runner of its own. A
load that fails after unloading anything loads those models again.

A request goes to the model its ``model`` names (or an alias's model):
``acquire`` returns a ``Lease`` that keeps the model busy until its generation
ends. With ``GGUF_LOAD_ON_DEMAND`` a request for a model that is not loaded
waits in that model's queue (at most ``GGUF_QUEUE_SIZE``, for at most
``GGUF_LOAD_ON_DEMAND_WAIT_S``, then 503 with Retry-After) and one scheduler
task loads the models that requests wait for, oldest waiting request first;
everything waiting for a model is admitted together when it loads (leases
granted before the load lock is released, so nothing evicts it first).

Swaps are fair: when a load needs the memory of busy models (the forced
placement's victims), it waits for them instead of a 409, and they *yield*:
they finish what they admitted, but new requests for them queue behind the
swap, which runs once they are idle. A model yields only after its slice, as
long as its own load took (at most a quarter of the wait limit), so a swap
is paid for by at least as much serving and two busy models alternate instead
of thrashing. When every request waiting for the swap has gone, the victims
admit again. A reload (a load of a loaded model with new options) holds new
requests for it the same way while it waits for running generations and loads:
they are answered by the new model (by the old one when the reload gives up),
and ``/ready`` keeps naming the model. Idle models are unloaded after their
keep_alive (the model's, or the last request's; Ollama's semantics).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import replace
from typing import Any, Callable, Sequence, Union

from sizing.plan import Device, Holding, Plan, plan_table
from sizing.probe import host_memory
from sizing.units import MIB

from ..catalog.downloads import Downloads
from ..catalog.models import ModelEntry, Registry
from ..engine.base import Engine
from ..engine.calibrate import Calibrator
from ..engine.devices import LocalDevices
from ..errors import Busy, NotReady, ServiceError
from ..keepalive import parse_keep_alive
from ..options import LoadOptions, merged
from ..planning.planner import Placed, Planner, SetPlan
from ..rpc.client import parse_workers, worker_devices
from ..rpc.health import WorkerWatch
from ..settings import Settings
from . import views
from .engines import EngineFactory, start_engine
from .placing import Placing
from .prompt_caches import rebudget_prompt_caches, shrink_prompt_caches
from .refusals import raise_refusal
from .routing import not_ready_state, route
from .state import Lease, ModelState
from .swaps import Blocked, SwapScheduler, WaitQueue
from .timers import KeepAliveTimers

log = logging.getLogger(__name__)


def _wants_room(placed: Placed) -> bool:
    """The load would evict a model, wait for busy ones or be refused, for memory (not for the count limit)."""
    return bool(placed.evict or placed.busy or placed.plan.refusal is not None) and not placed.count_limited


class ModelManager:
    """Owns the loaded models (each with its engine and runner), their states and plans, and the load lock."""

    def __init__(self, settings: Settings, registry: Registry, engines: Union[EngineFactory, Engine],
                 devices: Callable[[], tuple[list[Device], Device]] | None = None, *, live: bool | None = None,
                 max_models: int | None = None) -> None:
        """``engines``: a factory (one engine per loaded model) or one engine instance, which then serves one
        model at a time (a load replaces the loaded model, as in a single-model server). ``devices`` and
        ``live``: an inventory other than the settings' (tests), and whether its figures are live."""
        self.settings = settings
        self.registry = registry
        single = hasattr(engines, "load") and not isinstance(engines, type)
        self._engine_factory: EngineFactory = (lambda _s: engines) if single else engines  # type: ignore[assignment,return-value]
        self.max_models = 1 if single else (max_models or settings.max_loaded_models)
        self.models: dict[str, ModelState] = {}
        """Every model that has a state (loaded, loading, failed, unloaded after being loaded)."""
        self.last_failed: ModelState | None = None
        self._devices = devices or self._live_devices
        self.local_devices = LocalDevices(declared_path=settings.gpus_file, declared_json=settings.gpus_json,
                                          margin_pct=settings.unreported_free_margin_pct)
        """This machine's cards: declared, or ggml's list as llama.cpp will use them (``service.engine.devices``)."""
        self.rpc_workers = parse_workers(settings.rpc_workers, runner_process=settings.runner_process)
        """The ggml-rpc workers a model may be placed on (``GGUF_RPC_WORKERS``)."""
        self.worker_watch = WorkerWatch(self.rpc_workers)
        """Which workers answer, and since when one does not (``/ready``, ``/api/models``, the metrics)."""
        self.worker_watch.start()
        self.load_lock = asyncio.Lock()
        self.reloads: set[str] = set()
        """Models a reload is replacing now: their new requests wait for it; /ready and routing still name them."""
        self.held_back: set[str] = set()
        """Idle models a swap is about to unload: no new request is admitted to them meanwhile."""
        self.changes = 0
        """Counts loads and unloads: a swap that waits is placed again when it changed."""
        self.scheduler = SwapScheduler(self)
        """Fair admission to models that are not loaded, reloading or yielding (``service.residency.swaps``)."""
        self.timers = KeepAliveTimers(self._unload_idle, self.scheduler.kick)
        self.loads = 0
        """Engine loads done (each model load, restores included): what load-on-demand counts."""
        self.swaps = 0
        """Loads on demand that unloaded another model first."""
        self.runner_events: dict[str, int] = {}
        """Runner processes' deaths, restarts and failures so far (``died``, ``restarted``, ``failed``)."""
        self.host_bandwidth_bytes_per_s: float | None = None
        if settings.host_bandwidth_gbps is None:
            from sizing.probe import measure_host_bandwidth

            self.host_bandwidth_bytes_per_s = measure_host_bandwidth()
        self.planner = Planner(settings, lambda: self._devices(), Calibrator(timeout_s=settings.calibrate_timeout_s),
                               self.host_bandwidth_bytes_per_s, live=live)
        if settings.cpu_gflops_per_core is None:
            from service.engine.cpu_speed import decode_flops_per_core

            self.planner.cpu_flops_per_core = decode_flops_per_core(settings.n_threads or os.cpu_count() or 1,
                                                                    self.planner.repack.on)
        self.placing = Placing(settings, registry, self.planner, self.max_models)
        self.planner.drafts = self.placing.draft_model
        self.downloads = Downloads(settings, registry, self.planner, self._kept_estimates)
        self.default_keep_alive_s = parse_keep_alive(settings.keep_alive, param="GGUF_KEEP_ALIVE")

    def _live_devices(self) -> tuple[list[Device], Device]:
        gpus = self.local_devices.cards()
        if self.rpc_workers:
            # The workers' devices come first, as llama.cpp lists them (service.rpc.client). A worker that serves
            # a client now (a model of this server's, or another's) is left out: a dry run or load over it would
            # wait for that client to leave. A dry run's child of ours waiting for its next dry run is such a
            # client: it goes first.
            if self.planner.calibrator is not None:
                self.planner.calibrator.release_rpc()
            rpc, self.planner.absent_workers = worker_devices(self.rpc_workers)
            gpus = [*rpc, *gpus]
        host = host_memory()
        if self.settings.host_memory_mib is not None:
            ceiling = int(self.settings.host_memory_mib * MIB)
            host = replace(host, free_bytes=min(host.free_bytes, ceiling), total_bytes=min(host.total_bytes, ceiling))
        return gpus, host

    # -- views

    def loaded(self) -> list[ModelState]:
        """The models serving now, in the order they were loaded."""
        return [s for s in self.models.values() if s.serving]

    @property
    def ready(self) -> bool:
        return bool(self.loaded())

    def resident(self, name: str) -> ModelState | None:
        st = self.models.get(self.registry.canonical(name))
        return st if st is not None and st.serving else None

    def not_ready_state(self) -> tuple[str, str | None]:
        """Why nothing serves: ``loading``, ``failed`` (with the error) or ``no model``."""
        return not_ready_state(self.models, self.last_failed)

    def holdings(self, states: Sequence[ModelState] | None = None) -> list[Holding]:
        out = []
        for s in self.loaded() if states is None else states:
            h = s.holding()
            if h is not None:
                out.append(h)
        return out

    def _kept_estimates(self) -> list[Any]:
        return [h.estimate for h in self.holdings()]

    def inventory(self) -> tuple[list[Device], Device]:
        """The devices as read now (live or declared), before any resident is counted. Blocking (NVML)."""
        gpus, host, _ = self.planner.inventory()
        return gpus, host

    # -- planning (off the event loop)

    async def plan(self, name: str, opts: LoadOptions) -> tuple[ModelEntry, Placed]:
        """Where a load of ``name`` would go beside the loaded models, and whom it would evict; nothing is
        loaded or unloaded. Off the event loop (probing, llama.cpp's dry runs where the plan is calibrated)."""
        holdings = self.holdings()
        return await asyncio.to_thread(self.placing.place, name, opts, holdings, False)

    async def plan_remote(self, location: str, opts: LoadOptions, run: Callable[..., Any] | None = None) -> Placed:
        """Where a model that is not here would go (an http(s) URL or ``hf://owner/repo/file.gguf``, read by its
        header only), beside the loaded models. ``run`` runs the blocking probe (the remote probes' threads)."""
        holdings = self.holdings()

        def work() -> Placed:
            return self.placing.place_remote(location, opts, holdings)

        if run is not None:
            return await run(work)  # type: ignore[no-any-return]
        return await asyncio.to_thread(work)

    async def plan_set(self, items: Sequence[tuple[str, LoadOptions]], opts: LoadOptions, *,
                       beside_residents: bool = False) -> SetPlan:
        """Whether these models fit together (``Planner.plan_set``): on the devices as they would be with none of
        the loaded models, or beside them all (``beside_residents``)."""
        holdings = self.holdings()
        return await asyncio.to_thread(self.placing.place_set, items, opts, holdings, beside_residents)

    # -- loading

    async def load(self, name: str, opts: LoadOptions = LoadOptions(), *, force: bool = False,
                   keep_alive_s: float | None = None) -> ModelState:
        """Plan beside the loaded models, refuse with figures if it cannot fit (evicting idle ones if it must),
        confirm with llama.cpp, then load into an engine of its own.

        Loading a model that is loaded reloads it with the new options: that waits up to ``load_wait_s`` for its
        running generations (then ``Busy``, 409, and it keeps serving); ``force`` ends them instead, and makes
        busy models eviction candidates too. New requests for it meanwhile wait for the reload."""
        try:
            async with self.load_lock:
                return await self._load_locked(name, opts, force, keep_alive_s)
        finally:
            self.scheduler.kick()

    async def load_for(self, q: WaitQueue) -> ModelState:
        """A load on demand for the requests waiting in ``q``, with the default options (the scheduler's call,
        under the load lock)."""
        return await self._load_locked(q.name, LoadOptions(), False, None, swap=q)

    async def _load_locked(self, name: str, opts: LoadOptions, force: bool, keep_alive_s: float | None,
                           swap: WaitQueue | None = None) -> ModelState:
        """The load, with the load lock held. ``swap``: a load on demand for the requests of that queue, which
        raises ``Blocked`` instead of ``Busy`` when it needs the memory of busy models, and admits no new request
        to the idle models it unloads."""
        t0 = time.monotonic()
        entry = await asyncio.to_thread(self.registry.resolve, name)
        key = entry.name
        previous = self.models.get(key)
        replacing = previous if previous is not None and previous.serving else None
        placeholder = None
        if replacing is None:  # /api/models and /ready say loading from the start; planning runs in a thread
            placeholder = ModelState(name=key, state="loading", entry=entry, path=entry.path)
            self.models[key] = placeholder
        shrunk = emptied = False
        try:
            for attempt in range(3):
                holdings = self.holdings()
                _, placed = await asyncio.to_thread(self.placing.place, key, opts, holdings, force)
                if not shrunk and _wants_room(placed):
                    shrunk = True
                    emptied = await shrink_prompt_caches(self.loaded, key)
                    if emptied:  # their memory first, then a model's
                        holdings = self.holdings()
                        _, placed = await asyncio.to_thread(self.placing.place, key, opts, holdings, force)
                if swap is not None and placed.busy:  # wait for the fewest of them that make room
                    _, forced = await asyncio.to_thread(self.placing.place, key, opts, holdings, True)
                    victims_ = forced.evict or placed.busy
                    raise Blocked(victims_, [h.name for h in holdings if h.busy and h.name in victims_])
                raise_refusal(placed)
                victims = [self.models[n] for n in placed.evict if n in self.models]
                if force or not any(v.busy or not v.serving for v in victims):
                    break
                if swap is not None:  # a victim became busy while the plan was made: wait for it
                    late = [v.name for v in victims if v.busy or not v.serving]
                    raise Blocked(late, late)
                if attempt == 2:  # a victim became busy while the plan was made, three times over
                    raise Busy(f"the models this load would unload became busy: "
                               f"{', '.join(v.name for v in victims if v.busy)}; retry")
        except BaseException:
            if placeholder is not None:  # a refusal changes nothing
                self._put_back(key, previous)
            raise
        held = {v.name for v in victims} - self.held_back if swap is not None else set()
        self.held_back |= held
        try:
            state = await self._load_placed(entry, placed, victims, replacing, placeholder, previous, opts, force,
                                            keep_alive_s, t0)
        finally:
            self.held_back -= held
            self.reloads.discard(key)
            if emptied:
                await rebudget_prompt_caches(self.settings, self.loaded, key)
        if swap is not None and victims:
            self.swaps += 1
        return state

    async def _load_placed(self, entry: ModelEntry, placed: Placed, victims: list[ModelState],
                           replacing: ModelState | None, placeholder: ModelState | None, previous: ModelState | None,
                           opts: LoadOptions, force: bool, keep_alive_s: float | None, t0: float) -> ModelState:
        """Confirm the placement with llama.cpp, unload the victims (and the model a reload replaces), load.
        ``t0``: when the load began (its cost, ``load_s``, counts from there)."""
        key = entry.name
        plan = placed.plan
        config = entry.config
        state = ModelState(name=key, state="loading", plan=plan, path=entry.path, entry=entry, pinned=config.pinned,
                           batch_invariant=bool(merged(self.settings, config.options, opts).batch_invariant),
                           keep_alive_s=config.keep_alive_s if config.keep_alive_s is not None
                           else self.default_keep_alive_s)
        if placeholder is not None:
            self.models[key] = state
        if opts.confirm if opts.confirm is not None else self.settings.confirm:
            try:
                conf = await asyncio.to_thread(self.planner.confirm, plan, entry.path, entry.name)
                state.confirmation = conf.to_json()
                if conf.status == "replanned":
                    plan = state.plan = conf.plan
                    raise_refusal(replace(placed, plan=plan))
            except ServiceError as exc:
                state.state, state.error = "failed", exc.message
                self.last_failed = state
                if placeholder is not None:
                    self.models[key] = state
                raise
            except BaseException:
                if placeholder is not None:
                    self._put_back(key, previous)
                raise
        # The dry-run workers hold no model, but on a GPU build a device context each: gone before the load.
        await asyncio.to_thread(self.planner.release)
        evicted: list[ModelState] = []
        waited = 0.0
        if replacing is not None:  # the one that may wait for its generations (then 409, nothing unloaded)
            # Its new requests wait for the reload (routing and /ready still name it), not "no model".
            self.reloads.add(key)
            t_wait = time.monotonic()
            await self._unload_state(replacing, force=force, wait_s=self.settings.load_wait_s, why="reloaded")
            waited = time.monotonic() - t_wait
            self.models[key] = state
        for v in victims:
            await self._unload_state(v, force=force, wait_s=self.settings.load_wait_s, why=f"evicted for {key}")
            evicted.append(v)
        if evicted:
            log.info("evicted %s (least recently used, idle) to load %s", ", ".join(v.name for v in evicted), key)
        log.info("loading %s with plan:\n%s", key, plan_table(plan))
        try:
            await self._start(state, plan)
        except Exception as exc:
            state.state = "failed"
            state.error = exc.message if isinstance(exc, ServiceError) else str(exc)
            self.last_failed = self.models[key] = state
            for old in ([replacing] if replacing is not None else []) + evicted:
                await self._restore(old)
            raise
        state.loaded_at = time.monotonic()
        state.load_s = state.loaded_at - t0 - waited
        self.changes += 1
        self.models[key] = state
        self.timers.idle(state, keep_alive_s)
        assert state.report is not None
        log.info("loaded %s: n_ctx %d in %.2f s; llama.cpp allocated %s", key, state.report.n_ctx,
                 state.report.load_seconds,
                 ", ".join(f"{a.device} {a.total_bytes / MIB:.1f} MiB" for a in state.report.allocations))
        return state

    async def _start(self, state: ModelState, plan: Plan) -> None:
        """A fresh engine and runner for ``state``, and the load (raises what the engine raised)."""
        loop = asyncio.get_running_loop()
        await start_engine(self.settings, self._engine_factory, state, plan,
                           lambda event, detail: loop.call_soon_threadsafe(self._runner_event, state, event, detail))
        self.loads += 1

    def _runner_event(self, st: ModelState, event: str, detail: str) -> None:
        """A model's runner process died, was restarted, or gave up (``ProcessEngine``); on the event loop."""
        self.runner_events[event] = self.runner_events.get(event, 0) + 1
        if event != "failed" or self.models.get(st.name) is not st or st.state != "loaded":
            return
        # Its process is reaped: the memory it held is free again, and the model no longer counts as resident.
        st.state, st.error = "failed", f"runner process: {detail}"
        self.last_failed = st
        if st.runner is not None:
            st.runner.interrupt(NotReady(f"model '{st.name}' failed: {detail}", state="failed"))
            st.runner.stop()
        if st.timer is not None:
            st.timer.cancel()
        st.runner, st.timer, st.expires_at = None, None, None

    async def _unload_idle(self, st: ModelState) -> None:
        """A keep_alive timer fired (``KeepAliveTimers``): unload ``st`` if it is still idle and expired."""
        async with self.load_lock:
            if self.models.get(st.name) is not st or not st.serving or st.busy or st.expires_at is None \
                    or st.expires_at > time.time() + 0.05:
                return
            idle_s = time.monotonic() - st.last_used
            try:
                await self._unload_state(st, force=False, wait_s=self.settings.load_wait_s,
                                         why=f"keep_alive: idle {idle_s:.1f} s")
            except ServiceError as exc:  # a request came in meanwhile: it stays
                log.info("keep_alive unload of %s skipped: %s", st.name, exc.message)

    async def _restore(self, previous: ModelState) -> None:
        """Reload a model that a failed load unloaded, with its plan, so the service keeps what it served."""
        if previous.path is None or previous.plan is None:
            return
        state = replace(previous, state="loading", engine=None, runner=None, report=None, leases=0, timer=None,
                        expires_at=None)
        t0 = time.monotonic()
        try:
            await self._start(state, previous.plan)
        except Exception as exc:  # nothing to serve it with: /api/models says so
            log.error("could not reload %s after a failed load: %s", previous.name, exc)
            return
        state.loaded_at = time.monotonic()
        state.load_s = state.loaded_at - t0
        self.changes += 1
        self.models[previous.name] = state
        self.timers.idle(state, None)

    def _put_back(self, key: str, previous: ModelState | None) -> None:
        if previous is not None:
            self.models[key] = previous
        else:
            self.models.pop(key, None)

    async def _unload_state(self, st: ModelState, *, force: bool, wait_s: float | None, why: str) -> None:
        """Unload one model after its running generations (``wait_s``, then ``Busy`` and it keeps serving);
        anything still queued for it then gets 503."""
        runner, engine = st.runner, st.engine
        if runner is None or engine is None:
            st.state = "unloaded"
            return
        st.state = "unloading"
        try:
            await runner.exclusive(engine.unload, wait_s=wait_s, force=force)
        except BaseException:
            st.state = "loaded"
            raise
        runner.interrupt(NotReady(f"model '{st.name}' was unloaded ({why})", retry_after_s=1))
        runner.stop()
        if st.timer is not None:
            st.timer.cancel()
        st.state, st.report, st.engine, st.runner, st.timer, st.expires_at = "unloaded", None, None, None, None, None
        st.unloaded_why = why
        self.changes += 1
        log.info("unloaded %s (%s)", st.name, why)
        self.scheduler.kick()

    async def unload(self, name: str | None = None, *, force: bool = False, limited: bool = True) -> list[str]:
        """Unload ``name`` (every loaded model when None), after its running generations (up to ``load_wait_s``,
        then ``Busy``; ``force`` ends them). ``limited=False``: wait as long as they run (shutdown, which has its
        own limit). Returns the names unloaded."""
        async with self.load_lock:
            if name is not None:
                entry = await asyncio.to_thread(self.registry.resolve, name)
                targets = [s for s in self.loaded() if s.name == entry.name]
            else:
                targets = self.loaded()
            wait_s = self.settings.load_wait_s if limited else None
            try:
                for st in targets:
                    await self._unload_state(st, force=force, wait_s=wait_s, why="unloaded on request")
            finally:
                self.scheduler.kick()  # an unload that gave up (409) leaves the model serving: what waited for it goes on
            return [s.name for s in targets]

    # -- views (``service.residency.views``)

    def describe(self, state: ModelState | None) -> dict[str, Any] | None:
        return views.describe(self, state)

    def admission(self) -> tuple[dict[str, dict[str, Any]], list[str]]:
        return views.admission(self)

    def devices_json(self) -> list[dict[str, Any]]:
        return views.devices_json(self)

    def close(self) -> None:
        """Stop the calibration workers and the scheduler (at shutdown): requests still waiting get 503."""
        self.scheduler.close()
        self.planner.close()
        self.worker_watch.stop()

    # -- routing, load on demand, keep_alive

    def route(self, requested: str | None) -> str:
        """The model a request's ``model`` names (``service.residency.routing.route``); 404 for an unknown name."""
        return route(self.settings, self.registry, self.models, self.reloads, self.last_failed, requested)

    def start_models(self) -> list[str]:
        """The models loaded at start: the default, then the pinned ones."""
        default = [self.registry.canonical(self.settings.default_model)] if self.settings.default_model else []
        return list(dict.fromkeys([*default, *self.registry.pinned()]))

    def loads_on_demand(self, name: str) -> bool:
        """Whether a request for ``name`` loads it when it is not loaded: every model with ``GGUF_LOAD_ON_DEMAND``;
        without it, a model loaded at start (``start_models``) that did not fail. Unloaded by a client's keep_alive
        (``GGUF_KEEP_ALIVE_POLICY=ollama``), its keep_alive's end or an admin, it comes back with the next request
        instead of leaving every tenant with 503."""
        if self.settings.load_on_demand:
            return True
        st = self.models.get(name)
        return name in self.start_models() and (st is None or st.state != "failed")

    def reloading(self) -> list[str]:
        """The models a reload is replacing now (they serve again when it ends)."""
        return sorted(self.reloads)

    async def acquire(self, requested: str | None) -> Lease:
        """A lease on the loaded model a request goes to. It waits in the model's queue (``GGUF_QUEUE_SIZE``
        at most, then 429; ``GGUF_LOAD_ON_DEMAND_WAIT_S`` at most, then 503 with Retry-After) while the model
        reloads, while it yields to a swap, and, with ``load_on_demand``, while it is not loaded."""
        name = self.route(requested)
        st = self.models.get(name)
        if st is not None and st.serving and self.scheduler.admits(st):
            return Lease(st, self.timers.released)
        if not self.loads_on_demand(name) and name not in self.reloads and not (st is not None and st.serving):
            if st is not None and st.state in ("loading", "unloading"):
                raise NotReady(f"model '{name}' is {st.state}; retry shortly", param="model", retry_after_s=2,
                               state=st.state)
            raise NotReady(f"model '{name}' is not loaded; load it with POST /api/models/load", param="model")
        return await self.scheduler.wait(name)


