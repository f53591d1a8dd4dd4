"""Residency and lifecycle: the models loaded at once, each with its own engine, plan and queue.

States per model: unloaded -> loading -> loaded | failed; a loaded model goes
back to unloaded when it is unloaded, evicted or idle past its keep_alive.

A load is planned beside the loaded models on the memory they leave
(``service.planning.Planner.place``, off the event loop). When it does not fit
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
loads it; concurrent requests for it wait on one load, within
``GGUF_LOAD_ON_DEMAND_WAIT_S``. Idle models are unloaded after their keep_alive
(the model's, or the last request's; Ollama's semantics).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Literal, Sequence, Union

from sizing.device import MIB, Device
from sizing.devices import host_memory, inventory
from sizing.errors import ProbeError, UnsupportedModelError, without_credentials
from sizing.gguf import probe_path
from sizing.plan import Plan
from sizing.report import plan_json, plan_table
from sizing.residency import Holding, available, held_bytes
from sizing.spec import ModelSpec

from .downloads import Download, Downloads, remote_limits
from .engine.base import Engine, LoadReport
from .engine.calibrate import Calibrator
from .errors import BadRequest, Busy, InsufficientMemory, NotReady, ServiceError, SplitNotHonoured, Upstream
from .keepalive import keep_alive_json, parse_keep_alive
from .models import ModelEntry, Registry
from .planning import LoadOptions, Placed, Planner, SetPlan, plan_request
from .runner import Runner
from .settings import Settings

__all__ = ["Download", "EngineFactory", "Lease", "LoadOptions", "ModelManager", "ModelState", "credit_current",
           "default_engine", "plan_request", "raise_refusal", "remote_limits"]

log = logging.getLogger(__name__)

State = Literal["unloaded", "loading", "loaded", "unloading", "failed"]

EngineFactory = Callable[[Settings], Engine]
"""Builds one engine per loaded model, from the settings (``parallel`` set to the model's slots)."""


def default_engine(settings: Settings) -> Engine:
    """llama.cpp through llama-cpp-python: ``parallel`` slots decoded together, each keeping its prompt's KV; in a
    runner process of its own (``GGUF_RUNNER_PROCESS``, ``service.engine.process``) or in this one."""
    kwargs: dict[str, Any] = dict(n_threads=settings.n_threads, cache_prompt=settings.cache_prompt,
                                  slot_prompt_similarity=settings.slot_prompt_similarity,
                                  chat_template=settings.chat_template(), embedding_pooling=settings.embedding_pooling)
    if settings.runner_process:
        from .engine.process import ProcessEngine

        return ProcessEngine(kwargs, log_level=settings.log_level, max_restarts=settings.runner_max_restarts)
    from .engine.llama import LlamaEngine

    return LlamaEngine(**kwargs)


@dataclass(eq=False)
class ModelState:
    """One model's state; while loaded, its engine, runner, plan and what llama.cpp allocated."""

    name: str
    state: State = "unloaded"
    plan: Plan | None = None
    report: LoadReport | None = None
    error: str | None = None
    since: float = field(default_factory=time.time)
    path: str | None = None
    confirmation: dict[str, Any] | None = None
    """llama.cpp's dry-run figures for the plan, beside the predicted ones."""
    entry: ModelEntry | None = None
    engine: Engine | None = None
    runner: Runner | None = None
    pinned: bool = False
    keep_alive_s: float = math.inf
    """Idle seconds before it is unloaded (the model's; ``math.inf``: never)."""
    next_keep_alive_s: float | None = None
    """The last finished request's keep_alive, for this idle period (None: the model's)."""
    last_used: float = field(default_factory=time.monotonic)
    leases: int = 0
    """Requests routed to it and not finished: while any, it is busy and never evicted."""
    expires_at: float | None = None
    """Wall-clock time its keep_alive unloads it (None: it stays)."""
    unloaded_why: str | None = None
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)

    @property
    def busy(self) -> bool:
        return self.leases > 0

    @property
    def serving(self) -> bool:
        return self.state == "loaded" and self.engine is not None and self.runner is not None and not self.runner.closed

    def holding(self) -> Holding | None:
        if self.plan is None or self.plan.estimate is None:
            return None
        return Holding(self.name, self.plan.estimate, self.last_used, self.busy, self.pinned)


class Lease:
    """A request's hold on a loaded model: busy (never evicted) until ``release``, which the runner calls when the
    generation ends (or the route, when the request ends before it was queued). Idempotent."""

    def __init__(self, manager: "ModelManager", state: ModelState) -> None:
        assert state.engine is not None and state.runner is not None
        self._manager = manager
        self.state = state
        self.engine: Engine = state.engine
        self.runner: Runner = state.runner
        self.keep_alive_s: float | None = None
        """This request's keep_alive (None: the model's)."""
        self.queued = False
        """Set once the generation is queued: from then on the runner releases the lease when it ends."""
        self._released = False
        state.leases += 1
        state.last_used = time.monotonic()
        if state.timer is not None:
            state.timer.cancel()
            state.timer = None
            state.expires_at = None

    @property
    def name(self) -> str:
        return self.state.name

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._manager._released(self.state, self.keep_alive_s)


def credit_current(gpus: Sequence[Device], host: Device, current: "ModelState | None") -> tuple[list[Device], Device]:
    """Live free memory as it will be once ``current`` is unloaded (``sizing.residency.available``)."""
    if current is None or current.state != "loaded" or current.plan is None or current.plan.estimate is None:
        return list(gpus), host
    return available(gpus, host, (), [current.plan.estimate], live=True)


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
        self._load_lock = asyncio.Lock()
        self._pending: dict[str, asyncio.Task[ModelState]] = {}
        """On-demand loads in progress, one per model: concurrent requests wait on the same one."""
        self._tasks: set[asyncio.Future[Any]] = set()
        self.loads = 0
        """Engine loads done (each model load, restores included): what load-on-demand counts."""
        self.runner_events: dict[str, int] = {}
        """Runner processes' deaths, restarts and failures so far (``died``, ``restarted``, ``failed``)."""
        self.host_bandwidth_bytes_per_s: float | None = None
        if settings.host_bandwidth_gbps is None:
            from sizing.devices import measure_host_bandwidth

            self.host_bandwidth_bytes_per_s = measure_host_bandwidth()
        self.planner = Planner(settings, lambda: self._devices(), Calibrator(timeout_s=settings.calibrate_timeout_s),
                               self.host_bandwidth_bytes_per_s, live=live)
        self.downloads = Downloads(settings, registry, self.planner, self._kept_estimates)
        self.default_keep_alive_s = parse_keep_alive(settings.keep_alive, param="GGUF_KEEP_ALIVE")

    def _live_devices(self) -> tuple[list[Device], Device]:
        gpus = inventory(declared_path=self.settings.gpus_file, declared_json=self.settings.gpus_json)
        return gpus, host_memory()

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
        if any(s.state == "loading" for s in self.models.values()):
            return "loading", None
        if self.last_failed is not None and self.last_failed.state == "failed":
            return "failed", self.last_failed.error
        return "no model", None

    def _holdings(self, states: Sequence[ModelState] | None = None) -> list[Holding]:
        out = []
        for s in self.loaded() if states is None else states:
            h = s.holding()
            if h is not None:
                out.append(h)
        return out

    def _kept_estimates(self) -> list[Any]:
        return [h.estimate for h in self._holdings()]

    def inventory(self) -> tuple[list[Device], Device]:
        """The devices as read now (live or declared), before any resident is counted. Blocking (NVML)."""
        gpus, host, _ = self.planner.inventory()
        return gpus, host

    def probe(self, entry: ModelEntry) -> ModelSpec:
        try:
            return probe_path(entry.path)
        except (ProbeError, UnsupportedModelError) as exc:
            raise BadRequest(f"model '{entry.name}' cannot be read: {exc}", param="model") from exc

    def options_for(self, entry: ModelEntry, opts: LoadOptions) -> LoadOptions:
        """A request's options over the model's own (models file) over the settings'."""
        c = entry.config
        return replace(opts, cache_type=opts.cache_type or c.cache_type, n_seq_max=opts.n_seq_max or c.slots,
                       ctx_ceiling=opts.ctx_ceiling or c.context_length)

    # -- planning (off the event loop)

    async def plan(self, name: str, opts: LoadOptions) -> tuple[ModelEntry, Placed]:
        """Where a load of ``name`` would go beside the loaded models, and whom it would evict; nothing is
        loaded or unloaded. Off the event loop (probing, llama.cpp's dry runs where the plan is calibrated)."""
        holdings = self._holdings()
        return await asyncio.to_thread(self._place, name, opts, holdings, False)

    def _place(self, name: str, opts: LoadOptions, holdings: Sequence[Holding], force: bool
               ) -> tuple[ModelEntry, Placed]:
        entry = self.registry.resolve(name)
        spec = self.probe(entry)
        replacing = entry.name if any(h.name == entry.name for h in holdings) else None
        placed = self.planner.place(spec, self.options_for(entry, opts), path=entry.path, residents=holdings,
                                    replacing=replacing, max_models=self.max_models, force=force)
        return entry, placed

    async def plan_remote(self, location: str, opts: LoadOptions, run: Callable[..., Any] | None = None) -> Placed:
        """Where a model that is not here would go (an http(s) URL or ``hf://owner/repo/file.gguf``, read by its
        header only), beside the loaded models. ``run`` runs the blocking probe (the remote probes' threads)."""
        holdings = self._holdings()

        def work() -> Placed:
            from sizing.errors import RemoteError
            from sizing.gguf.remote import probe_location

            try:
                spec = probe_location(location, remote_limits(self.settings))
            except RemoteError as exc:
                raise Upstream(f"{without_credentials(location)[:300]}: {exc.reason}") from exc
            except (ProbeError, UnsupportedModelError) as exc:
                why = exc.reason if isinstance(exc, ProbeError) else str(exc)  # its source is the location again
                raise BadRequest(f"{without_credentials(location)[:300]} cannot be read: {why}", param="url") from exc
            return self.planner.place(spec, opts, residents=holdings, max_models=self.max_models)

        if run is not None:
            return await run(work)  # type: ignore[no-any-return]
        return await asyncio.to_thread(work)

    async def plan_set(self, items: Sequence[tuple[str, LoadOptions]], opts: LoadOptions, *,
                       beside_residents: bool = False) -> SetPlan:
        """Whether these models fit together (``Planner.plan_set``): on the devices as they would be with none of
        the loaded models, or beside them all (``beside_residents``)."""
        holdings = self._holdings()

        def work() -> SetPlan:
            resolved = []
            for name, o in items:
                entry = self.registry.resolve(name)
                resolved.append((entry.name, self.probe(entry), self.options_for(entry, o), entry.path))
            names = [r[0] for r in resolved]
            if len(set(names)) != len(names):
                raise BadRequest("a set dry-run names each model once", param="models")
            kept, freed = (holdings, []) if beside_residents else ([], holdings)
            return self.planner.plan_set(resolved, opts, kept=kept, freed=freed)

        return await asyncio.to_thread(work)

    # -- loading

    async def load(self, name: str, opts: LoadOptions = LoadOptions(), *, force: bool = False,
                   keep_alive_s: float | None = None) -> ModelState:
        """Plan beside the loaded models, refuse with figures if it cannot fit (evicting idle ones if it must),
        confirm with llama.cpp, then load into an engine of its own.

        Loading a model that is loaded reloads it with the new options: that waits up to ``load_wait_s`` for its
        running generations (then ``Busy``, 409, and it keeps serving); ``force`` ends them instead, and makes
        busy models eviction candidates too."""
        async with self._load_lock:
            return await self._load_locked(name, opts, force, keep_alive_s)

    async def _load_locked(self, name: str, opts: LoadOptions, force: bool, keep_alive_s: float | None) -> ModelState:
        entry = await asyncio.to_thread(self.registry.resolve, name)
        key = entry.name
        previous = self.models.get(key)
        replacing = previous if previous is not None and previous.serving else None
        placeholder = None
        if replacing is None:  # /api/models and /ready say loading from the start; planning runs in a thread
            placeholder = ModelState(name=key, state="loading", entry=entry, path=entry.path)
            self.models[key] = placeholder
        try:
            for attempt in range(3):
                holdings = self._holdings()
                _, placed = await asyncio.to_thread(self._place, key, opts, holdings, force)
                raise_refusal(placed)
                victims = [self.models[n] for n in placed.evict if n in self.models]
                if force or not any(v.busy or not v.serving for v in victims):
                    break
                if attempt == 2:  # a victim became busy while the plan was made, three times over
                    raise Busy(f"the models this load would unload became busy: "
                               f"{', '.join(v.name for v in victims if v.busy)}; retry")
        except BaseException:
            if placeholder is not None:  # a refusal changes nothing
                self._put_back(key, previous)
            raise
        plan = placed.plan
        config = entry.config
        state = ModelState(name=key, state="loading", plan=plan, path=entry.path, entry=entry, pinned=config.pinned,
                           keep_alive_s=config.keep_alive_s if config.keep_alive_s is not None
                           else self.default_keep_alive_s)
        if placeholder is not None:
            self.models[key] = state
        if opts.confirm if opts.confirm is not None else self.settings.confirm_loads:
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
        if replacing is not None:  # the one that may wait for its generations (then 409, nothing unloaded)
            await self._unload_state(replacing, force=force, wait_s=self.settings.load_wait_s, why="reloaded")
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
        self.models[key] = state
        self._idle(state, keep_alive_s)
        assert state.report is not None
        log.info("loaded %s: n_ctx %d in %.2f s; llama.cpp allocated %s", key, state.report.n_ctx,
                 state.report.load_seconds,
                 ", ".join(f"{a.device} {a.total_bytes / MIB:.1f} MiB" for a in state.report.allocations))
        return state

    async def _start(self, state: ModelState, plan: Plan) -> None:
        """A fresh engine and runner for ``state``, and the load (raises what the engine raised)."""
        assert state.path is not None
        slots = max(1, plan.cfg.n_seq_max)
        engine = self._engine_factory(self.settings.model_copy(update={"parallel": slots}))
        watch = getattr(engine, "watch", None)
        if watch is not None:  # a runner process: its deaths, restarts and final failure come back here
            loop = asyncio.get_running_loop()
            watch(state.name, lambda event, detail: loop.call_soon_threadsafe(self._runner_event, state, event, detail))
        runner = Runner(max_waiting=self.settings.queue_size, workers=slots, name=state.name)
        path = state.path
        try:
            report: LoadReport = await runner.call(lambda: engine.load(path, plan), exclusive=True)
        except BaseException:
            runner.stop()
            raise
        self.loads += 1
        state.engine, state.runner, state.report, state.plan = engine, runner, report, plan
        state.state, state.error, state.since, state.last_used = "loaded", None, time.time(), time.monotonic()
        state.unloaded_why = None

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

    async def _restore(self, previous: ModelState) -> None:
        """Reload a model that a failed load unloaded, with its plan, so the service keeps what it served."""
        if previous.path is None or previous.plan is None:
            return
        state = replace(previous, state="loading", engine=None, runner=None, report=None, leases=0, timer=None,
                        expires_at=None)
        try:
            await self._start(state, previous.plan)
        except Exception as exc:  # nothing to serve it with: /api/models says so
            log.error("could not reload %s after a failed load: %s", previous.name, exc)
            return
        self.models[previous.name] = state
        self._idle(state, None)

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
        log.info("unloaded %s (%s)", st.name, why)

    async def unload(self, name: str | None = None, *, force: bool = False, limited: bool = True) -> list[str]:
        """Unload ``name`` (every loaded model when None), after its running generations (up to ``load_wait_s``,
        then ``Busy``; ``force`` ends them). ``limited=False``: wait as long as they run (shutdown, which has its
        own limit). Returns the names unloaded."""
        async with self._load_lock:
            if name is not None:
                entry = await asyncio.to_thread(self.registry.resolve, name)
                targets = [s for s in self.loaded() if s.name == entry.name]
            else:
                targets = self.loaded()
            wait_s = self.settings.load_wait_s if limited else None
            for st in targets:
                await self._unload_state(st, force=force, wait_s=wait_s, why="unloaded on request")
            return [s.name for s in targets]

    def close(self) -> None:
        """Stop the calibration workers (at shutdown)."""
        self.planner.close()

    # -- routing, load on demand, keep_alive

    def route(self, requested: str | None) -> str:
        """The model a request's ``model`` names: an alias's model, a name; None goes to the default model when
        it is loaded (or loads on demand), else to the only loaded model. Raises 404 for an unknown name."""
        if requested is None:
            loaded = self.loaded()
            default = self.registry.canonical(self.settings.default_model) if self.settings.default_model else None
            if default is not None and any(s.name == default for s in loaded):
                return default
            if len(loaded) == 1:
                return loaded[0].name
            if loaded:
                raise BadRequest(f"model is required: {len(loaded)} models are loaded "
                                 f"({', '.join(s.name for s in loaded)[:300]})", param="model")
            if default is not None and self.settings.load_on_demand:
                return default
            state, error = self.not_ready_state()
            raise NotReady("the model is not loaded yet" if state in ("loading", "no model") else
                           f"the model is {state}", state=state)
        name = self.registry.canonical(requested)
        st = self.models.get(name)
        if st is not None and st.serving:
            return name
        return self.registry.resolve(requested).name  # 404 for an unknown name

    async def acquire(self, requested: str | None) -> Lease:
        """A lease on the loaded model a request goes to; loads it first with ``load_on_demand``."""
        for _ in range(3):
            name = self.route(requested)
            st = self.models.get(name)
            if st is not None and st.serving:
                return Lease(self, st)
            if not self.settings.load_on_demand:
                if st is not None and st.state in ("loading", "unloading"):
                    raise NotReady(f"model '{name}' is {st.state}; retry shortly", param="model", retry_after_s=2,
                                   state=st.state)
                raise NotReady(f"model '{name}' is not loaded; load it with POST /api/models/load", param="model")
            await self._on_demand(name)
        raise NotReady(f"model '{name}' was unloaded again before the request could use it; retry", retry_after_s=1)

    async def _on_demand(self, name: str) -> None:
        task = self._pending.get(name)
        if task is None:
            task = asyncio.create_task(self._ensure(name))
            self._pending[name] = task

            def done(t: "asyncio.Task[ModelState]") -> None:
                if self._pending.get(name) is t:
                    del self._pending[name]
                if not t.cancelled():
                    t.exception()  # retrieved here: every waiter may have stopped waiting

            task.add_done_callback(done)
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout=self.settings.load_on_demand_wait_s)
        except TimeoutError:
            raise NotReady(f"model '{name}' is still loading after {self.settings.load_on_demand_wait_s:g} s; "
                           "retry shortly", param="model", retry_after_s=5, state="loading") from None

    async def _ensure(self, name: str) -> ModelState:
        """Load ``name`` with its own options, unless it is loaded by the time the load lock is ours (a load that
        was running when the request came finished it)."""
        async with self._load_lock:
            st = self.resident(name)
            if st is not None:
                return st
            return await self._load_locked(name, LoadOptions(), False, None)

    def _released(self, st: ModelState, keep_alive_s: float | None) -> None:
        st.leases -= 1
        st.last_used = time.monotonic()
        if keep_alive_s is not None:
            st.next_keep_alive_s = keep_alive_s
        if st.leases == 0:
            self._idle(st, None)

    def _idle(self, st: ModelState, keep_alive_s: float | None) -> None:
        """The model went idle: start its keep_alive (the given one, the last request's, or the model's)."""
        if keep_alive_s is not None:
            st.next_keep_alive_s = keep_alive_s
        if st.timer is not None:
            st.timer.cancel()
            st.timer = None
        ka = st.next_keep_alive_s if st.next_keep_alive_s is not None else st.keep_alive_s
        st.next_keep_alive_s = None
        st.expires_at = None
        if not st.serving or st.pinned or st.busy or math.isinf(ka):
            return
        st.expires_at = time.time() + ka
        st.timer = asyncio.get_running_loop().call_later(ka, self._expire, st)

    def _expire(self, st: ModelState) -> None:
        st.timer = None
        fut = asyncio.ensure_future(self._unload_idle(st))
        self._tasks.add(fut)
        fut.add_done_callback(self._tasks.discard)

    async def _unload_idle(self, st: ModelState) -> None:
        async with self._load_lock:
            if self.models.get(st.name) is not st or not st.serving or st.busy or st.expires_at is None \
                    or st.expires_at > time.time() + 0.05:
                return
            idle_s = time.monotonic() - st.last_used
            try:
                await self._unload_state(st, force=False, wait_s=self.settings.load_wait_s,
                                         why=f"keep_alive: idle {idle_s:.1f} s")
            except ServiceError as exc:  # a request came in meanwhile: it stays
                log.info("keep_alive unload of %s skipped: %s", st.name, exc.message)

    # -- descriptions

    def describe(self, state: ModelState | None) -> dict[str, Any] | None:
        if state is None:
            return None
        out: dict[str, Any] = {"name": state.name, "state": state.state, "error": state.error}
        if state.entry is not None:
            out["origin"] = state.entry.origin
        out["aliases"] = self.registry.aliases_of(state.name)
        out["pinned"] = state.pinned
        if state.plan is not None:
            out["plan"] = plan_json(state.plan)
        if state.confirmation is not None:
            out["confirmation"] = state.confirmation
        if state.unloaded_why is not None and state.state == "unloaded":
            out["unloaded"] = state.unloaded_why
        runner_json = getattr(state.engine, "runner_json", None)
        if runner_json is not None:
            out["runner"] = runner_json()
        if state.serving and state.report is not None and state.plan is not None:
            est = state.plan.estimate
            held = held_bytes(est) if est is not None else {}
            out["n_ctx"] = state.report.n_ctx
            out["load_seconds"] = round(state.report.load_seconds, 3)
            out["devices"] = [d.device for d in est.devices if held.get(d.device)] if est is not None else []
            out["in_flight"] = state.leases
            out["busy"] = state.busy
            out["idle_s"] = round(max(0.0, time.monotonic() - state.last_used), 3)
            out["keep_alive_s"] = keep_alive_json(state.keep_alive_s)
            out["expires_in_s"] = None if state.expires_at is None else round(max(0.0, state.expires_at - time.time()), 3)
            rows = allocation_rows(est) if est is not None else {}
            out["memory"] = [
                {
                    "device": a.device,
                    "allocated_mib": round(a.total_bytes / MIB, 2),
                    "allocated": {
                        "weights_mib": round(a.weights_bytes / MIB, 2),
                        "kv_mib": round(a.kv_bytes / MIB, 2),
                        "compute_mib": round(a.compute_bytes / MIB, 2),
                        "output_mib": round(a.output_bytes / MIB, 2),
                    },
                    "predicted_mib": round(rows[a.device] / MIB, 2) if a.device in rows else None,
                    "held_mib": round(held[a.device] / MIB, 2) if a.device in held else None,
                }
                for a in state.report.allocations
            ]
        return out

    def devices_json(self) -> list[dict[str, Any]]:
        """Each device as read now, and what each loaded model holds there (its plan's bytes, its CUDA context included).
        Blocking (NVML)."""
        try:
            gpus, host = self.inventory()
        except ServiceError:
            return []
        holdings = self._holdings()
        out = []
        for dev in (*gpus, host):
            shares = [{"model": h.name, "held_mib": round(n / MIB, 2), "pinned": h.pinned, "busy": h.busy}
                      for h in holdings if (n := held_bytes(h.estimate).get(dev.label, 0))]
            out.append({"device": dev.label, "name": dev.name, "total_mib": round(dev.total_bytes / MIB, 2),
                        "free_mib": round(dev.free_bytes / MIB, 2), "live": self.planner.live or dev.kind == "host",
                        "models": shares})
        return out


def allocation_rows(est: Any) -> dict[str, int]:
    """The plan's bytes per row of llama.cpp's allocation log (what ``parse_allocations`` reports): each device's
    buffers without what the log does not show (the allowance, the CUDA pool bound, the embedding context),
    the host's weights in the extra CPU buffer types (CPU_REPACK, AMX) as rows of their own."""
    out: dict[str, int] = {}
    for d in est.devices:
        out[d.device] = (d.total_bytes - d.allowance_bytes - d.pool_bytes - d.embedding_bytes
                         - d.extra_weights_bytes)
        for buffer, n in d.extra_weights:
            out[buffer] = out.get(buffer, 0) + n
    return out


def _refusal_message(plan: Plan, placed: Placed | None = None) -> str:
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
    return "; ".join(parts)


def raise_refusal(placed: Placed | Plan) -> None:
    """A placement that cannot be loaded becomes the domain error its refusal names (one place decides the
    status): 409 when busy models hold the memory, 507 with every card's figures and the residents holding them."""
    p = placed if isinstance(placed, Placed) else Placed(placed)
    plan = p.plan
    details: dict[str, Any] = {"residents": p.to_json()} if p.beside or p.busy else {}
    if p.busy:
        raise Busy(f"the memory '{plan.model.name}' needs is held by models generating now: {', '.join(p.busy)}; "
                   "retry when they finish, or send force: true to end them", plan=plan_json(plan), **details)
    if plan.fits and p.count_limited:
        raise InsufficientMemory(
            f"{len(p.beside)} models are loaded (GGUF_MAX_LOADED_MODELS) and none of them may be unloaded "
            f"(pinned: {', '.join(p.pinned) or 'none'}; the others are busy)", plan=plan_json(plan), **details)
    if plan.fits:
        return
    reason = "; ".join(plan.reasons) or "the model does not fit"
    if plan.refusal == "SPLIT_NOT_HONOURED":
        raise SplitNotHonoured(reason, param="gpu", plan=plan_json(plan))
    if plan.refusal == "INVALID_CONFIG":
        param = "gpu" if "gpu" in reason or "tensor_split" in reason else "cache_type"
        raise BadRequest(reason, param=param)
    raise InsufficientMemory(_refusal_message(plan, p), plan=plan_json(plan), **details)
