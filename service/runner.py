"""Generations in order: a bounded FIFO in front of the engine's worker threads.

llama-cpp-python's ``Llama`` is not thread-safe, so with one slot a single
worker thread owns every call into the engine. With ``workers > 1`` (the
batched engine, which batches concurrent calls itself) that many generations
run at once; loads and unloads still run alone (an exclusive call waits for
running generations and holds new ones back). Requests wait in a FIFO of bounded length
(beyond it: ``QueueFull``, 429); a running generation is never interrupted
by a new request. Chunks cross back to the event loop with
``call_soon_threadsafe``; a cancelled request (client gone) is skipped if
still queued and stopped within one token if running.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterator

from .engine.base import Cancel, Chunk
from .errors import EngineFailure, QueueFull, ServiceError

log = logging.getLogger(__name__)

_DONE = object()


@dataclass
class Job:
    work: Callable[[], Iterator[Chunk]]
    cancel: Cancel
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    exclusive: bool = False


class Runner:
    """The single worker that runs engine calls in FIFO order."""

    def __init__(self, max_waiting: int, workers: int = 1) -> None:
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
        self._threads = [
            threading.Thread(target=self._loop, name=f"engine-worker-{i}", daemon=True) for i in range(self._workers)
        ]
        for t in self._threads:
            t.start()

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def running(self) -> int:
        return self._running

    def submit(self, work: Callable[[], Iterator[Chunk]], cancel: Cancel) -> Job:
        """Queue a generation; raises ``QueueFull`` when the FIFO is at its bound."""
        with self._lock:
            if self._waiting >= self._max_waiting and (self._running or self._waiting):
                raise QueueFull(
                    f"{self._waiting} requests are already waiting for the model; retry shortly",
                    retry_after_s=1,
                )
            self._waiting += 1
        job = Job(work=work, cancel=cancel, loop=asyncio.get_running_loop())
        self._jobs.put(job)
        return job

    def call(self, fn: Callable[[], Any], *, exclusive: bool = False) -> "asyncio.Future[Any]":
        """Run an engine call (tokenize; load and unload with ``exclusive``) on a worker, in order with generations."""
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

        with self._lock:
            self._waiting += 1
        self._jobs.put(Job(work=work, cancel=Cancel(), loop=loop, exclusive=exclusive))
        return fut

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._enter(job.exclusive)
            with self._lock:
                self._waiting -= 1
                self._running += 1
            try:
                self._run(job)
            finally:
                with self._lock:
                    self._running -= 1
                self._leave(job.exclusive)

    def _enter(self, exclusive: bool) -> None:
        with self._gate:
            if exclusive:
                self._gate.wait_for(lambda: not self._exclusive)
                self._exclusive = True
                self._gate.wait_for(lambda: self._active == 0)
            else:
                self._gate.wait_for(lambda: not self._exclusive)
                self._active += 1

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
            job.loop.call_soon_threadsafe(put, _DONE)
            return
        try:
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

    def stop(self) -> None:
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
