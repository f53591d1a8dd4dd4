"""Generations in order: a bounded FIFO in front of the engine's worker threads.

One worker thread per engine slot (``GGUF_PARALLEL``): that many generations
run at once (the engine's scheduler thread batches them); loads and unloads
run alone (an exclusive call waits for
running generations and holds new ones back). Requests wait in a FIFO of bounded length
(beyond it: ``QueueFull``, 429); a running generation is never interrupted
by a new request. Chunks cross back to the event loop with
``call_soon_threadsafe``; a cancelled request (client gone) is skipped if
still queued and stopped within one token if running.

``interrupt(err)`` ends every generation at once, queued or running: each is
cancelled and its consumer receives ``err`` (the drain's deadline, a forced
load or unload). An exclusive call whose caller stopped waiting (its future
cancelled: a load's wait limit) is withdrawn, even while it waits for running
generations.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterator

from ..engine.base import Cancel, Chunk, direct_delivery
from ..errors import Busy, EngineFailure, NotReady, QueueFull, ServiceError

_GATE_POLL_S = 0.1
"""How often an exclusive call waiting for running generations checks whether it was withdrawn."""

log = logging.getLogger(__name__)

_DONE = object()


@dataclass(eq=False)
class Job:
    work: Callable[[], Iterator[Chunk]]
    cancel: Cancel
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    exclusive: bool = False
    started: bool = False
    """Set by the worker, under the runner's lock, when the job's work begins: from then on it cannot be withdrawn."""
    on_done: Callable[[], None] | None = None
    """Called on the job's event loop once its work ended (or was skipped): the model's request is over."""


class Runner:
    """The workers that run engine calls in FIFO order."""

    def __init__(self, max_waiting: int, workers: int = 1, *, name: str = "engine") -> None:
        self._max_waiting = max_waiting
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0
        self._running = 0
        self._workers = max(1, workers)
        # Shared by generations, taken whole by exclusive calls (load, unload).
        self._gate = threading.Condition()
        self._active = 0
        self._exclusive = False
        self._live: set[Job] = set()
        """Generations submitted and not yet finished (for ``interrupt``)."""
        self._closed = False
        self._threads = [
            threading.Thread(target=self._loop, name=f"{name[:40]}-worker-{i}", daemon=True) for i in range(self._workers)
        ]
        for t in self._threads:
            t.start()

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def running(self) -> int:
        return self._running

    def submit(self, work: Callable[[], Iterator[Chunk]], cancel: Cancel,
               on_done: Callable[[], None] | None = None) -> Job:
        """Queue a generation; raises ``QueueFull`` when the FIFO is at its bound, ``NotReady`` once stopped.
        ``on_done`` is called on the event loop when the generation ended, however it ended."""
        with self._lock:
            if self._closed:
                raise NotReady("the model was unloaded", retry_after_s=1)
            if self._waiting >= self._max_waiting and (self._running or self._waiting):
                raise QueueFull(
                    f"{self._waiting} requests are already waiting for the model; retry shortly",
                    retry_after_s=1,
                )
            self._waiting += 1
        job = Job(work=work, cancel=cancel, loop=asyncio.get_running_loop(), on_done=on_done)
        with self._lock:
            self._live.add(job)
        self._jobs.put(job)
        return job

    def interrupt(self, err: ServiceError) -> int:
        """End every queued and running generation with ``err`` (delivered before anything it still yields);
        returns how many there were."""
        with self._lock:
            jobs = list(self._live)
        for job in jobs:
            job.cancel.set()
            try:
                job.loop.call_soon_threadsafe(job.out.put_nowait, err)
            except RuntimeError:  # the loop is closed (shutdown)
                pass
        return len(jobs)

    def call(self, fn: Callable[[], Any], *, exclusive: bool = False) -> "asyncio.Future[Any]":
        """Run an engine call (tokenize; load and unload with ``exclusive``) on a worker, in order with generations."""
        return self._call(fn, exclusive)[0]

    async def exclusive(self, fn: Callable[[], Any], *, wait_s: float | None = None, force: bool = False) -> Any:
        """Run ``fn`` alone on the engine (a load, an unload) and return its result.

        It waits for the generations ahead of it; after ``wait_s`` of waiting it is withdrawn and ``Busy``
        (409) is raised, unless it started meanwhile (then it runs to its end). ``force``: every queued and
        running generation is ended first (``interrupt``), so it starts at once.
        """
        if force:
            n = self.interrupt(NotReady("the model is being replaced or unloaded (a forced load or unload)", retry_after_s=5))
            if n:
                log.warning("forced exclusive call: ended %d generations", n)
        fut, job = self._call(fn, True)
        if wait_s is None:
            return await fut
        done, _ = await asyncio.wait({fut}, timeout=wait_s)
        if not done:
            with self._lock:
                withdrawn = not job.started
                if withdrawn:
                    job.cancel.set()
            if withdrawn:
                fut.cancel()
                raise Busy(
                    f"{self._running} generation(s) running and {self._waiting} waiting after {wait_s:g} s; retry, "
                    "or send force: true to end them"
                )
        return await fut

    def _call(self, fn: Callable[[], Any], exclusive: bool) -> "tuple[asyncio.Future[Any], Job]":
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()

        def work() -> Iterator[Chunk]:
            try:
                result = fn()
            except BaseException as exc:  # delivered to the awaiting coroutine
                loop.call_soon_threadsafe(_set_exc, fut, exc)
            else:
                loop.call_soon_threadsafe(_set_result, fut, result)
            return iter(())

        job = Job(work=work, cancel=Cancel(), loop=loop, exclusive=exclusive)
        # A caller that stops waiting (wait_for's timeout cancels the future) withdraws the call.
        fut.add_done_callback(lambda f: job.cancel.set() if f.cancelled() else None)
        with self._lock:
            self._waiting += 1
        self._jobs.put(job)
        return fut, job

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            entered = self._enter(job)
            with self._lock:
                self._waiting -= 1
                self._running += 1
                job.started = not job.cancel.cancelled  # a withdrawn job is skipped by _run
            try:
                self._run(job)
            finally:
                with self._lock:
                    self._running -= 1
                    self._live.discard(job)
                if entered:
                    self._leave(job.exclusive)
                if job.on_done is not None:
                    try:
                        job.loop.call_soon_threadsafe(job.on_done)
                    except RuntimeError:  # the loop is closed (shutdown)
                        pass

    def _enter(self, job: Job) -> bool:
        """Take the gate for ``job``; False (gate not taken) when the job was withdrawn while it waited."""
        with self._gate:
            if job.exclusive:
                self._gate.wait_for(lambda: not self._exclusive)
                if job.cancel.cancelled:
                    return False
                self._exclusive = True
                while not self._gate.wait_for(lambda: self._active == 0, timeout=_GATE_POLL_S):
                    if job.cancel.cancelled:  # withdrawn while generations ran: let them and others go on
                        self._exclusive = False
                        self._gate.notify_all()
                        return False
            else:
                self._gate.wait_for(lambda: not self._exclusive)
                self._active += 1
            return True

    def _leave(self, exclusive: bool) -> None:
        with self._gate:
            if exclusive:
                self._exclusive = False
            else:
                self._active -= 1
            self._gate.notify_all()

    def _run(self, job: Job) -> None:
        put = job.out.put_nowait
        if job.cancel.cancelled:
            try:
                job.loop.call_soon_threadsafe(put, _DONE)
            except RuntimeError:  # the loop is closed (shutdown)
                pass
            return

        def deliver(item: Any) -> None:  # from the engine's thread (engine.base.direct_delivery)
            try:
                job.loop.call_soon_threadsafe(put, item)
            except RuntimeError:  # the loop is closed (shutdown)
                pass

        try:
            with direct_delivery(deliver):
                for chunk in job.work():
                    job.loop.call_soon_threadsafe(put, chunk)
        except ServiceError as exc:
            job.loop.call_soon_threadsafe(put, exc)
        except Exception as exc:  # an engine bug must not kill the worker; it becomes ours (500 engine_error)
            log.exception("generation failed")
            err = EngineFailure(f"generation failed: {type(exc).__name__}: {exc}")
            err.__cause__ = exc
            job.loop.call_soon_threadsafe(put, err)
        finally:
            try:
                job.loop.call_soon_threadsafe(put, _DONE)
            except RuntimeError:  # the loop is closed (shutdown)
                pass

    @property
    def closed(self) -> bool:
        return self._closed

    def stop(self) -> None:
        """No more generations (``submit`` raises ``NotReady``); the workers end after what is queued."""
        with self._lock:
            self._closed = True
        for _ in self._threads:
            self._jobs.put(None)


def _set_result(fut: "asyncio.Future[Any]", value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exc(fut: "asyncio.Future[Any]", exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


async def chunks(job: Job) -> AsyncIterator[Chunk]:
    """The chunks of a job as they arrive; raises the job's error; cancels the job if abandoned."""
    try:
        while True:
            item = await job.out.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        job.cancel.set()
