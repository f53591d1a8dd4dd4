"""Fair admission to models that are not loaded: the queues of requests waiting for a model, and the one scheduler
that loads them (see ``service.residency.manager``'s docstring: swaps, yields, slices).

``SwapScheduler`` is an object the manager owns, given the manager as its ``SwapHost``: it reads the host's models,
the models a reload or a swap holds back, its count of loads and unloads, and its load lock, and asks it to load a
model for the requests waiting for it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from ..errors import EngineFailure, NotReady, QueueFull, ServiceError
from ..settings import Settings
from .state import Lease, ModelState
from .timers import KeepAliveTimers

log = logging.getLogger(__name__)

RECHECK_S = 2.0
"""How often the scheduler looks again at a swap that waits for busy models, kicks aside (live memory changes)."""


@dataclass(eq=False)
class Waiter:
    """One request waiting to be admitted to a model: its future gets the lease (or the error)."""

    fut: "asyncio.Future[Lease]"
    since: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class WaitQueue:
    """The requests waiting for one model to be admitted: it is not loaded (a load on demand, perhaps a swap), it
    is reloading, or it yields to a swap another model waits for. Arrival order."""

    name: str
    waiters: deque[Waiter] = field(default_factory=deque)
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

    def live(self) -> list[Waiter]:
        return [w for w in self.waiters if not w.fut.done()]

    def head(self) -> float:
        live = self.live()
        return live[0].since if live else math.inf


class Blocked(Exception):
    """A load on demand needs the memory of models that are busy: it waits for them. ``victims``: the models it
    would unload; ``busy``: those of them that were busy when it was placed."""

    def __init__(self, victims: Sequence[str], busy: Sequence[str]) -> None:
        super().__init__(", ".join(victims))
        self.victims = tuple(victims)
        self.busy = tuple(busy)


class SwapHost(Protocol):
    """What the scheduler reads of the residency it admits to, and the one load it asks of it (``ModelManager``)."""

    settings: Settings
    models: dict[str, ModelState]
    reloads: set[str]
    """Models a reload is replacing now: their new requests wait for it."""
    held_back: set[str]
    """Idle models a swap is about to unload: no new request is admitted to them meanwhile."""
    changes: int
    """Counts loads and unloads: a swap that waits is placed again when it changed."""
    load_lock: asyncio.Lock
    timers: KeepAliveTimers

    def resident(self, name: str) -> ModelState | None: ...

    def loads_on_demand(self, name: str) -> bool:
        """Whether a request for ``name`` may load it (``GGUF_LOAD_ON_DEMAND``, or a model loaded at start)."""
        ...

    async def load_for(self, q: WaitQueue) -> ModelState:
        """Load ``q``'s model with the default options, under the load lock; ``Blocked`` while busy models hold its
        memory."""
        ...


class SwapScheduler:
    """Requests waiting for a model to be admitted, and the scheduler task that loads the models they wait for."""

    def __init__(self, host: SwapHost) -> None:
        self.host = host
        self.settings = host.settings
        self._queues: dict[str, WaitQueue] = {}
        """Per model, the requests waiting to be admitted to it (not loaded, reloading, or yielding to a swap)."""
        self._task: asyncio.Task[None] | None = None
        """The one task that loads what requests wait for (``_schedule``), while any wait."""
        self._wake: asyncio.Event | None = None
        self.closed = False

    def _slice_s(self, st: ModelState) -> float:
        """How long a model admits new requests after its load even while a swap waits for its memory: as long
        as its load took (a swap is paid for by at least as much serving: two models that both have work alternate
        with at most half the time spent swapping), at most a quarter of the wait limit."""
        return min(st.load_s, self.settings.load_on_demand_wait_s / 4)

    def queues(self) -> list["WaitQueue"]:
        """The queues of requests waiting to be admitted, a model each (a copy)."""
        return list(self._queues.values())

    def queue_of(self, name: str) -> "WaitQueue | None":
        return self._queues.get(name)

    def is_reloading(self, name: str) -> bool:
        """A reload is replacing ``name`` now."""
        return name in self.host.reloads

    def asked_by(self, name: str) -> list[str]:
        """The models whose waiting requests need ``name``'s memory (their swap waits for it to be idle)."""
        return [q.name for q in self._queues.values() if q.name != name and name in q.blocked_on and q.live()]

    def yields(self, st: ModelState) -> bool:
        """A swap waits for ``st``'s memory and its slice has passed: it finishes what it admitted, and new
        requests for it wait behind the swap."""
        return bool(self.asked_by(st.name)) and time.monotonic() >= st.loaded_at + self._slice_s(st)

    def admits(self, st: ModelState) -> bool:
        """Whether a new request for this serving model gets its lease now (nothing of it waits ahead)."""
        if st.name in self.host.reloads or st.name in self.host.held_back or self.yields(st):
            return False
        q = self._queues.get(st.name)
        return q is None or not q.live()

    async def wait(self, name: str) -> Lease:
        q = self._queues.get(name)
        if q is None:
            q = self._queues[name] = WaitQueue(name)
        waiting = len(q.live())
        if waiting >= max(1, self.settings.queue_size):
            if not waiting:
                self._queues.pop(name, None)
            raise QueueFull(f"{waiting} requests are already waiting for model '{name}' to be loaded; retry shortly",
                            retry_after_s=5)
        w = Waiter(asyncio.get_running_loop().create_future())
        q.waiters.append(w)
        self.kick()
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

    def _withdraw(self, w: Waiter) -> None:
        """A waiter that stopped waiting: its future cancelled (a lease granted meanwhile is given back)."""
        if w.fut.done():
            if not w.fut.cancelled() and w.fut.exception() is None:
                w.fut.result().release()
        else:
            w.fut.cancel()
        self.kick()

    def _timed_out(self, q: WaitQueue, w: Waiter, wait_s: float) -> NotReady:
        live = q.live()
        position = live.index(w) + 1 if w in live else 1
        extra: dict[str, Any] = dict(param="model", retry_after_s=5, position=position, waiting=len(live))
        st = self.host.models.get(q.name)
        if q.loading or (st is not None and st.state == "loading" and q.name not in self.host.reloads):
            return NotReady(f"model '{q.name}' is still loading after {wait_s:g} s; retry shortly", state="loading",
                            **extra)
        if q.name in self.host.reloads:
            return NotReady(f"model '{q.name}' is still reloading after {wait_s:g} s; retry shortly",
                            state="reloading", **extra)
        if q.blocked_on:
            held = ", ".join(f"{n} ({b.leases} in flight)" if (b := self.host.models.get(n)) is not None else n
                             for n in q.blocked_on)
            return NotReady(f"model '{q.name}' waited {wait_s:g} s for a swap: the memory it needs is held by "
                            f"{held}, finishing what they admitted; retry shortly", state="waiting",
                            blocked_on=list(q.blocked_on), **extra)
        if st is not None and st.serving and (asked := self.asked_by(q.name)):
            return NotReady(f"model '{q.name}' waited {wait_s:g} s behind a swap to {', '.join(asked)}; retry shortly",
                            state="waiting", **extra)
        return NotReady(f"model '{q.name}' waited {wait_s:g} s to be loaded; retry shortly", state="waiting", **extra)

    def kick(self) -> None:
        """Something changed (a load, an unload, a model went idle, a waiter left): admit what can be admitted
        now, and wake the scheduler for the rest."""
        if not self._queues:
            return
        self._admit()
        if not self._queues or self.closed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (shutdown): nothing to schedule
            return
        if self._wake is None:
            self._wake = asyncio.Event()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._schedule())
        self._wake.set()

    def _admit(self) -> None:
        """Every queue whose model serves and admits gets its leases, all at once."""
        for name, q in list(self._queues.items()):
            q.prune()
            if not q.waiters:
                if self._queues.get(name) is q:
                    del self._queues[name]
                continue
            st = self.host.models.get(name)
            if st is None or not st.serving or name in self.host.reloads or name in self.host.held_back \
                    or self.yields(st):
                continue
            self._grant(q, st)

    def _grant(self, q: WaitQueue, st: ModelState) -> None:
        for w in q.waiters:
            if not w.fut.done():
                w.fut.set_result(Lease(st, self.host.timers.released))
        q.waiters.clear()
        if self._queues.get(q.name) is q:
            del self._queues[q.name]

    def fail(self, q: WaitQueue, exc: BaseException) -> None:
        for w in q.waiters:
            if not w.fut.done():
                w.fut.set_exception(exc)
        q.waiters.clear()
        if self._queues.get(q.name) is q:
            del self._queues[q.name]

    def _unblocked(self, q: WaitQueue) -> bool:
        """A swap that waits for busy models is placed again once one of them is idle or gone, once anything was
        loaded or unloaded since, and every ``RECHECK_S``."""
        if self.host.changes != q.residency or time.monotonic() - q.blocked_at >= RECHECK_S:
            return True
        return any((b := self.host.models.get(n)) is None or not b.serving or not b.busy for n in q.waits_for)

    async def _schedule(self) -> None:
        """Load what requests wait for, the queue whose oldest request came first first; one load at a time
        (the load lock); a load that needs busy models' memory waits for them while they yield."""
        assert self._wake is not None
        wake = self._wake
        while not self.closed:
            wake.clear()
            self._admit()
            if not self._queues:
                return
            try:
                progressed = await self._schedule_once()
            except Exception:  # a bug here must not leave the waiters hanging: they still have their limit
                log.exception("the load scheduler failed; it looks again in %g s", RECHECK_S)
                progressed = False
            if progressed:
                continue
            try:
                await asyncio.wait_for(wake.wait(), timeout=RECHECK_S)
            except TimeoutError:
                pass

    async def _schedule_once(self) -> bool:
        """One pass over the queues, oldest waiting request first; True when something changed (look again)."""
        for q in sorted(self._queues.values(), key=lambda x: x.head()):
            if self._queues.get(q.name) is not q or not q.live():
                continue
            st = self.host.models.get(q.name)
            if q.name in self.host.reloads or (st is not None and st.state in ("loading", "unloading")):
                continue  # an explicit load, reload or unload runs: its end kicks
            if st is not None and st.serving:
                continue  # it yields to a swap (or a swap unloads it): admitted when that ends, or loaded after
            if not self.host.loads_on_demand(q.name):
                self.fail(q, NotReady(f"model '{q.name}' is not loaded; load it with POST /api/models/load",
                                       param="model"))
                return True
            if q.blocked_on and not self._unblocked(q):
                continue
            if await self._swap_in(q):
                return True  # the residents changed: look at every queue again
        return False

    async def _swap_in(self, q: WaitQueue) -> bool:
        """Load ``q``'s model for its requests (evicting idle models if it must) and grant them their leases
        before the lock is released; False when it must wait for busy models (``q.blocked_on``)."""
        async with self.host.load_lock:
            if self.host.resident(q.name) is not None:
                return True  # an explicit load got there first: the next ``_admit`` grants
            if not q.live():
                return True
            q.loading = True
            try:
                state = await self.host.load_for(q)
            except Blocked as b:
                if b.victims != q.blocked_on:
                    log.info("load of %s on demand waits for %s (busy) to finish what they admitted", q.name,
                             ", ".join(b.victims))
                q.blocked_on, q.blocked_at, q.residency = b.victims, time.monotonic(), self.host.changes
                q.waits_for = b.busy
                return False
            except ServiceError as exc:  # a refusal reaches every waiting request
                self.fail(q, exc)
                return True
            except Exception as exc:
                log.exception("load of %s on demand failed", q.name)
                self.fail(q, EngineFailure(f"loading '{q.name}' failed: {type(exc).__name__}: {exc}"))
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

    def close(self) -> None:
        """Stop scheduling; every request still waiting is answered 503 (the server is draining)."""
        self.closed = True
        if self._task is not None and not self._task.done():
            self._task.cancel()
        for q in list(self._queues.values()):
            self.fail(q, NotReady("the server is shutting down", state="draining", retry_after_s=1))
