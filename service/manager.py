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
import math
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Literal, Sequence, Union

from sizing.errors import ProbeError, UnsupportedModelError, without_credentials
from sizing.model import ModelSpec
from sizing.plan import available, Device, held_bytes, Holding, Plan, plan_json, plan_table
from sizing.probe import host_memory, inventory, probe_path
from sizing.units import MIB, mib

from .downloads import Download, Downloads, remote_limits
from .engine.base import Engine, LoadReport
from .engine.calibrate import Calibrator
from .errors import (BadRequest, Busy, EngineFailure, InsufficientMemory, NotReady, QueueFull, ServiceError,
                     SplitNotHonoured, Upstream)
from .keepalive import keep_alive_json, parse_keep_alive
from .models import ModelEntry, Registry
from .planning import LoadOptions, Placed, Planner, SetPlan, plan_request
from .runner import Runner
from .settings import Settings

__all__ = ["Download", "EngineFactory", "Lease", "LoadOptions", "ModelManager", "ModelState", "credit_current",
           "default_engine", "plan_request", "plan_summary", "raise_refusal", "remote_limits"]

log = logging.getLogger(__name__)

State = Literal["unloaded", "loading", "loaded", "unloading", "failed"]

EngineFactory = Callable[[Settings], Engine]
"""Builds one engine per loaded model, from the settings (``parallel`` set to the model's slots)."""


def default_engine(settings: Settings) -> Engine:
    """llama.cpp through llama-cpp-python: ``parallel`` slots decoded together, each keeping its prompt's KV; in a
    runner process of its own (``GGUF_RUNNER_PROCESS``, ``service.engine.process``) or in this one."""
    kwargs: dict[str, Any] = dict(n_threads=settings.n_threads, cache_prompt=settings.cache_prompt,
                                  slot_prompt_similarity=settings.slot_prompt_similarity,
                                  chat_template=settings.chat_template(), embedding_pooling=settings.embedding_pooling,
                                  batch_invariant=settings.batch_invariant)
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
    loaded_at: float = 0.0
    """Monotonic time it began serving (its slice before it yields to a swap counts from there)."""
    load_s: float = 0.0
    """Seconds its load took, as the manager timed it (planning, llama.cpp's confirmation, the unloads it needed and
    the load with its runner's start; not a reload's wait for running generations): what a swap to it costs."""

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


PLAN_URL = "/api/dry-run"
"""Where a refused load's whole plan is: POST the load's body there (a refusal carries only a summary)."""

_RECHECK_S = 2.0
"""How often the scheduler looks again at a swap that waits for busy models, kicks aside (live memory changes)."""


@dataclass(eq=False)
class _Waiter:
    """One request waiting to be admitted to a model: its future gets the lease (or the error)."""

    fut: "asyncio.Future[Lease]"
    since: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class _Queue:
    """The requests waiting for one model to be admitted: it is not loaded (a load on demand, perhaps a swap), it
    is reloading, or it yields to a swap another model waits for. Arrival order."""

    name: str
    waiters: deque[_Waiter] = field(default_factory=deque)
    blocked_on: tuple[str, ...] = ()
    """The busy models whose memory its load needs (the forced placement's victims): they yield (admit no new
    requests once their slice passed), and the load runs once they are idle."""
    waits_for: tuple[str, ...] = ()
    """Those of them that were busy when it was placed: one of them idle or gone, and it is placed again."""
    blocked_at: float = 0.0
    residency: int = -1
    """The manager's residency count when it was found blocked: any load or unload since, and it is placed again."""
    loading: bool = False
    """The scheduler is loading it now."""

    def prune(self) -> None:
        while self.waiters and self.waiters[0].fut.done():
            self.waiters.popleft()
        if any(w.fut.done() for w in self.waiters):
            self.waiters = deque(w for w in self.waiters if not w.fut.done())

    def live(self) -> list[_Waiter]:
        return [w for w in self.waiters if not w.fut.done()]

    def head(self) -> float:
        live = self.live()
        return live[0].since if live else math.inf


class _Blocked(Exception):
    """A load on demand needs the memory of models that are busy: it waits for them. ``victims``: the models it
    would unload; ``busy``: those of them that were busy when it was placed."""

    def __init__(self, victims: Sequence[str], busy: Sequence[str]) -> None:
        super().__init__(", ".join(victims))
        self.victims = tuple(victims)
        self.busy = tuple(busy)


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
    """Live free memory as it will be once ``current`` is unloaded (``sizing.plan.residency.available``)."""
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
        self._queues: dict[str, _Queue] = {}
        """Per model, the requests waiting to be admitted to it (not loaded, reloading, or yielding to a swap)."""
        self._scheduler: asyncio.Task[None] | None = None
        """The one task that loads what requests wait for (``_schedule``), while any wait."""
        self._wake: asyncio.Event | None = None
        self._reloading: set[str] = set()
        """Models a reload is replacing now: their new requests wait for it; /ready and routing still name them."""
        self._holding_back: set[str] = set()
        """Idle models a swap is about to unload: no new request is admitted to them meanwhile."""
        self._residency = 0
        """Counts loads and unloads: a swap that waits is placed again when it changed."""
        self._closed = False
        self._tasks: set[asyncio.Future[Any]] = set()
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
                       ctx_ceiling=opts.ctx_ceiling or c.context_length,
                       batch_invariant=opts.batch_invariant if opts.batch_invariant is not None else c.batch_invariant)

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
            from sizing.probe import probe_location

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
        busy models eviction candidates too. New requests for it meanwhile wait for the reload."""
        try:
            async with self._load_lock:
                return await self._load_locked(name, opts, force, keep_alive_s)
        finally:
            self._kick()

    async def _load_locked(self, name: str, opts: LoadOptions, force: bool, keep_alive_s: float | None,
                           swap: _Queue | None = None) -> ModelState:
        """The load, with the load lock held. ``swap``: a load on demand for the requests of that queue, which
        raises ``_Blocked`` instead of ``Busy`` when it needs the memory of busy models, and admits no new request
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
        try:
            for attempt in range(3):
                holdings = self._holdings()
                _, placed = await asyncio.to_thread(self._place, key, opts, holdings, force)
                if swap is not None and placed.busy:  # wait for the fewest of them that make room
                    _, forced = await asyncio.to_thread(self._place, key, opts, holdings, True)
                    victims_ = forced.evict or placed.busy
                    raise _Blocked(victims_, [h.name for h in holdings if h.busy and h.name in victims_])
                raise_refusal(placed)
                victims = [self.models[n] for n in placed.evict if n in self.models]
                if force or not any(v.busy or not v.serving for v in victims):
                    break
                if swap is not None:  # a victim became busy while the plan was made: wait for it
                    late = [v.name for v in victims if v.busy or not v.serving]
                    raise _Blocked(late, late)
                if attempt == 2:  # a victim became busy while the plan was made, three times over
                    raise Busy(f"the models this load would unload became busy: "
                               f"{', '.join(v.name for v in victims if v.busy)}; retry")
        except BaseException:
            if placeholder is not None:  # a refusal changes nothing
                self._put_back(key, previous)
            raise
        held = {v.name for v in victims} - self._holding_back if swap is not None else set()
        self._holding_back |= held
        try:
            state = await self._load_placed(entry, placed, victims, replacing, placeholder, previous, opts, force,
                                            keep_alive_s, t0)
        finally:
            self._holding_back -= held
            self._reloading.discard(key)
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
        waited = 0.0
        if replacing is not None:  # the one that may wait for its generations (then 409, nothing unloaded)
            # Its new requests wait for the reload (routing and /ready still name it), not "no model".
            self._reloading.add(key)
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
        self._residency += 1
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
        own = state.entry.config.batch_invariant if state.entry is not None else None
        engine = self._engine_factory(self.settings.model_copy(update={
            "parallel": slots, "batch_invariant": self.settings.batch_invariant if own is None else own}))
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
        t0 = time.monotonic()
        try:
            await self._start(state, previous.plan)
        except Exception as exc:  # nothing to serve it with: /api/models says so
            log.error("could not reload %s after a failed load: %s", previous.name, exc)
            return
        state.loaded_at = time.monotonic()
        state.load_s = state.loaded_at - t0
        self._residency += 1
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
        self._residency += 1
        log.info("unloaded %s (%s)", st.name, why)
        self._kick()

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
            try:
                for st in targets:
                    await self._unload_state(st, force=force, wait_s=wait_s, why="unloaded on request")
            finally:
                self._kick()  # an unload that gave up (409) leaves the model serving: what waited for it goes on
            return [s.name for s in targets]

    def close(self) -> None:
        """Stop the calibration workers and the scheduler (at shutdown): requests still waiting get 503."""
        self._closed = True
        if self._scheduler is not None and not self._scheduler.done():
            self._scheduler.cancel()
        for q in list(self._queues.values()):
            self._fail(q, NotReady("the server is shutting down", state="draining", retry_after_s=1))
        self.planner.close()

    # -- routing, load on demand, keep_alive

    def route(self, requested: str | None) -> str:
        """The model a request's ``model`` names: an alias's model, a name; None goes to the default model when
        it is loaded (or loads on demand), else to the only loaded model. A model that is reloading counts as
        loaded (its requests wait for the reload). Raises 404 for an unknown name."""
        if requested is None:
            loaded = [s.name for s in self.models.values() if s.serving or s.name in self._reloading]
            default = self.registry.canonical(self.settings.default_model) if self.settings.default_model else None
            if default is not None and default in loaded:
                return default
            if len(loaded) == 1:
                return loaded[0]
            if loaded:
                raise BadRequest(f"model is required: {len(loaded)} models are loaded "
                                 f"({', '.join(loaded)[:300]})", param="model")
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

    def reloading(self) -> list[str]:
        """The models a reload is replacing now (they serve again when it ends)."""
        return sorted(self._reloading)

    async def acquire(self, requested: str | None) -> Lease:
        """A lease on the loaded model a request goes to. It waits in the model's queue (``GGUF_QUEUE_SIZE``
        at most, then 429; ``GGUF_LOAD_ON_DEMAND_WAIT_S`` at most, then 503 with Retry-After) while the model
        reloads, while it yields to a swap, and, with ``load_on_demand``, while it is not loaded."""
        name = self.route(requested)
        st = self.models.get(name)
        if st is not None and st.serving and self._admits(st):
            return Lease(self, st)
        if not self.settings.load_on_demand and name not in self._reloading and not (st is not None and st.serving):
            if st is not None and st.state in ("loading", "unloading"):
                raise NotReady(f"model '{name}' is {st.state}; retry shortly", param="model", retry_after_s=2,
                               state=st.state)
            raise NotReady(f"model '{name}' is not loaded; load it with POST /api/models/load", param="model")
        return await self._wait(name)

    # -- admission: the queues, the swaps, the scheduler

    def _slice_s(self, st: ModelState) -> float:
        """How long a model admits new requests after its load even while a swap waits for its memory: as long
        as its load took (a swap is paid for by at least as much serving: two models that both have work alternate
        with at most half the time spent swapping), at most a quarter of the wait limit."""
        return min(st.load_s, self.settings.load_on_demand_wait_s / 4)

    def _asked_by(self, name: str) -> list[str]:
        """The models whose waiting requests need ``name``'s memory (their swap waits for it to be idle)."""
        return [q.name for q in self._queues.values() if q.name != name and name in q.blocked_on and q.live()]

    def _yields(self, st: ModelState) -> bool:
        """A swap waits for ``st``'s memory and its slice has passed: it finishes what it admitted, and new
        requests for it wait behind the swap."""
        return bool(self._asked_by(st.name)) and time.monotonic() >= st.loaded_at + self._slice_s(st)

    def _admits(self, st: ModelState) -> bool:
        """Whether a new request for this serving model gets its lease now (nothing of it waits ahead)."""
        if st.name in self._reloading or st.name in self._holding_back or self._yields(st):
            return False
        q = self._queues.get(st.name)
        return q is None or not q.live()

    async def _wait(self, name: str) -> Lease:
        q = self._queues.get(name)
        if q is None:
            q = self._queues[name] = _Queue(name)
        waiting = len(q.live())
        if waiting >= max(1, self.settings.queue_size):
            if not waiting:
                self._queues.pop(name, None)
            raise QueueFull(f"{waiting} requests are already waiting for model '{name}' to be loaded; retry shortly",
                            retry_after_s=5)
        w = _Waiter(asyncio.get_running_loop().create_future())
        q.waiters.append(w)
        self._kick()
        wait_s = self.settings.load_on_demand_wait_s
        try:
            done, _ = await asyncio.wait({w.fut}, timeout=wait_s)
        except asyncio.CancelledError:  # the request went away
            self._withdraw(w)
            raise
        if not done:
            err = self._timed_out(q, w, wait_s)
            self._withdraw(w)
            raise err
        return w.fut.result()

    def _withdraw(self, w: _Waiter) -> None:
        """A waiter that stopped waiting: its future cancelled (a lease granted meanwhile is given back)."""
        if w.fut.done():
            if not w.fut.cancelled() and w.fut.exception() is None:
                w.fut.result().release()
        else:
            w.fut.cancel()
        self._kick()

    def _timed_out(self, q: _Queue, w: _Waiter, wait_s: float) -> NotReady:
        live = q.live()
        position = live.index(w) + 1 if w in live else 1
        extra: dict[str, Any] = dict(param="model", retry_after_s=5, position=position, waiting=len(live))
        st = self.models.get(q.name)
        if q.loading or (st is not None and st.state == "loading" and q.name not in self._reloading):
            return NotReady(f"model '{q.name}' is still loading after {wait_s:g} s; retry shortly", state="loading",
                            **extra)
        if q.name in self._reloading:
            return NotReady(f"model '{q.name}' is still reloading after {wait_s:g} s; retry shortly",
                            state="reloading", **extra)
        if q.blocked_on:
            held = ", ".join(f"{n} ({b.leases} in flight)" if (b := self.models.get(n)) is not None else n
                             for n in q.blocked_on)
            return NotReady(f"model '{q.name}' waited {wait_s:g} s for a swap: the memory it needs is held by "
                            f"{held}, finishing what they admitted; retry shortly", state="waiting",
                            blocked_on=list(q.blocked_on), **extra)
        if st is not None and st.serving and (asked := self._asked_by(q.name)):
            return NotReady(f"model '{q.name}' waited {wait_s:g} s behind a swap to {', '.join(asked)}; retry shortly",
                            state="waiting", **extra)
        return NotReady(f"model '{q.name}' waited {wait_s:g} s to be loaded; retry shortly", state="waiting", **extra)

    def _kick(self) -> None:
        """Something changed (a load, an unload, a model went idle, a waiter left): admit what can be admitted
        now, and wake the scheduler for the rest."""
        if not self._queues:
            return
        self._admit()
        if not self._queues or self._closed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (shutdown): nothing to schedule
            return
        if self._wake is None:
            self._wake = asyncio.Event()
        if self._scheduler is None or self._scheduler.done():
            self._scheduler = loop.create_task(self._schedule())
        self._wake.set()

    def _admit(self) -> None:
        """Every queue whose model serves and admits gets its leases, all at once."""
        for name, q in list(self._queues.items()):
            q.prune()
            if not q.waiters:
                if self._queues.get(name) is q:
                    del self._queues[name]
                continue
            st = self.models.get(name)
            if st is None or not st.serving or name in self._reloading or name in self._holding_back \
                    or self._yields(st):
                continue
            self._grant(q, st)

    def _grant(self, q: _Queue, st: ModelState) -> None:
        for w in q.waiters:
            if not w.fut.done():
                w.fut.set_result(Lease(self, st))
        q.waiters.clear()
        if self._queues.get(q.name) is q:
            del self._queues[q.name]

    def _fail(self, q: _Queue, exc: BaseException) -> None:
        for w in q.waiters:
            if not w.fut.done():
                w.fut.set_exception(exc)
        q.waiters.clear()
        if self._queues.get(q.name) is q:
            del self._queues[q.name]

    def _unblocked(self, q: _Queue) -> bool:
        """A swap that waits for busy models is placed again once one of them is idle or gone, once anything was
        loaded or unloaded since, and every ``_RECHECK_S``."""
        if self._residency != q.residency or time.monotonic() - q.blocked_at >= _RECHECK_S:
            return True
        return any((b := self.models.get(n)) is None or not b.serving or not b.busy for n in q.waits_for)

    async def _schedule(self) -> None:
        """Load what requests wait for, the queue whose oldest request came first first; one load at a time
        (the load lock); a load that needs busy models' memory waits for them while they yield."""
        assert self._wake is not None
        wake = self._wake
        while not self._closed:
            wake.clear()
            self._admit()
            if not self._queues:
                return
            try:
                progressed = await self._schedule_once()
            except Exception:  # a bug here must not leave the waiters hanging: they still have their limit
                log.exception("the load scheduler failed; it looks again in %g s", _RECHECK_S)
                progressed = False
            if progressed:
                continue
            try:
                await asyncio.wait_for(wake.wait(), timeout=_RECHECK_S)
            except TimeoutError:
                pass

    async def _schedule_once(self) -> bool:
        """One pass over the queues, oldest waiting request first; True when something changed (look again)."""
        for q in sorted(self._queues.values(), key=lambda x: x.head()):
            if self._queues.get(q.name) is not q or not q.live():
                continue
            st = self.models.get(q.name)
            if q.name in self._reloading or (st is not None and st.state in ("loading", "unloading")):
                continue  # an explicit load, reload or unload runs: its end kicks
            if st is not None and st.serving:
                continue  # it yields to a swap (or a swap unloads it): admitted when that ends, or loaded after
            if not self.settings.load_on_demand:
                self._fail(q, NotReady(f"model '{q.name}' is not loaded; load it with POST /api/models/load",
                                       param="model"))
                return True
            if q.blocked_on and not self._unblocked(q):
                continue
            if await self._swap_in(q):
                return True  # the residents changed: look at every queue again
        return False

    async def _swap_in(self, q: _Queue) -> bool:
        """Load ``q``'s model for its requests (evicting idle models if it must) and grant them their leases
        before the lock is released; False when it must wait for busy models (``q.blocked_on``)."""
        async with self._load_lock:
            if self.resident(q.name) is not None:
                return True  # an explicit load got there first: the next ``_admit`` grants
            if not q.live():
                return True
            q.loading = True
            try:
                state = await self._load_locked(q.name, LoadOptions(), False, None, swap=q)
            except _Blocked as b:
                if b.victims != q.blocked_on:
                    log.info("load of %s on demand waits for %s (busy) to finish what they admitted", q.name,
                             ", ".join(b.victims))
                q.blocked_on, q.blocked_at, q.residency = b.victims, time.monotonic(), self._residency
                q.waits_for = b.busy
                return False
            except ServiceError as exc:  # a refusal reaches every waiting request
                self._fail(q, exc)
                return True
            except Exception as exc:
                log.exception("load of %s on demand failed", q.name)
                self._fail(q, EngineFailure(f"loading '{q.name}' failed: {type(exc).__name__}: {exc}"))
                return True
            finally:
                q.loading = False
            q.blocked_on = q.waits_for = ()
            # Before the lock is released: nothing may unload it before its requests hold it.
            self._grant(q, state)
            later = self._queues.get(q.name)
            if later is not None:  # its waiters all left during the load, and others came since
                self._grant(later, state)
            return True

    def _released(self, st: ModelState, keep_alive_s: float | None) -> None:
        st.leases -= 1
        st.last_used = time.monotonic()
        if keep_alive_s is not None:
            st.next_keep_alive_s = keep_alive_s
        if st.leases == 0:
            self._idle(st, None)
            self._kick()

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
        q = self._queues.get(state.name)
        if q is not None and (waiting := len(q.live())):
            out["waiting"] = waiting
        if state.name in self._reloading:
            out["reloading"] = True
        if state.serving and self._yields(state):
            out["yields_to"] = self._asked_by(state.name)
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
                    "allocated_mib": mib(a.total_bytes),
                    "allocated": {
                        "weights_mib": mib(a.weights_bytes),
                        "kv_mib": mib(a.kv_bytes),
                        "compute_mib": mib(a.compute_bytes),
                        "output_mib": mib(a.output_bytes),
                    },
                    "predicted_mib": mib(rows[a.device]) if a.device in rows else None,
                    "held_mib": mib(held[a.device]) if a.device in held else None,
                }
                for a in state.report.allocations
            ]
        return out

    def admission(self) -> tuple[dict[str, dict[str, Any]], list[str]]:
        """Per model with requests waiting to be admitted: how many (``waiting``), the oldest one's wait
        (``oldest_s``), the busy models its swap waits for (``blocked_on``); and the loaded models that yield
        (admit no new request until a swap that waits for their memory has run)."""
        now = time.monotonic()
        waiting: dict[str, dict[str, Any]] = {}
        for q in list(self._queues.values()):
            live = q.live()
            if live:
                waiting[q.name] = {"waiting": len(live), "oldest_s": now - live[0].since,
                                   "blocked_on": list(q.blocked_on), "loading": q.loading}
        return waiting, [s.name for s in self.loaded() if self._yields(s)]

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
            shares = [{"model": h.name, "held_mib": mib(n), "pinned": h.pinned, "busy": h.busy}
                      for h in holdings if (n := held_bytes(h.estimate).get(dev.label, 0))]
            out.append({"device": dev.label, "name": dev.name, "total_mib": mib(dev.total_bytes),
                        "free_mib": mib(dev.free_bytes), "live": self.planner.live or dev.kind == "host",
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
    raise InsufficientMemory(_refusal_message(plan, p), **details)
