"""The scheduler thread: the one thread that calls llama.cpp for a load, in a loop of steps.

Each iteration takes what arrived (generations, calls, the unload), admits waiting generations into free slots
(oldest first), ends those whose client left, runs one batch step (``BatchStep``), gives a deferred embedding
decode its turn when generations let it, and delivers the iteration's chunks. Idle, it writes a finished turn's
prompt behind to the disk (``SlotTable.write_behind``) before it waits.

**One compute thread.** Every ``llama_decode`` of an engine, its embedding batches too, runs on this thread, and
when another engine is loaded in the process the thread ends once its engine has been idle for
``SCHEDULER_IDLE_EXIT_S`` (the next request starts another). llama.cpp's CPU backend computes a graph on an OpenMP
team that belongs to the calling thread and lives as long as it; libgomp spins only briefly at its barriers once it
manages more threads than the machine has CPUs, so one idle engine's team (another model, or a runner thread that
evaluated embeddings) slowed generation on 2 cores from 62-65 to 41-50 tokens/s; when that thread ended, the speed
came back (measured, gemma-3-270m; ``bench/openmp_bench.py``).

**Embeddings yield to generation** (issue 29): an embedding decode runs only while no generation is active or
waiting, or once it has waited ``EMBEDDING_MAX_DEFER_S`` (then between two steps); an abortable whole batch is
aborted when something arrives for the scheduler (the abort callback) and run again later.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from ...errors import EngineFailure, NotReady
from .loading import abort_callback
from .state import DONE, STOP, Call, Sequence

if TYPE_CHECKING:
    from .pooling import Pooler
    from .sequences import Sequences
    from .slotting import SlotTable
    from .step import BatchStep
    from .drafting import Drafting

log = logging.getLogger(__name__)

SCHEDULER_IDLE_EXIT_S = 1.0
"""With another engine loaded in the process, an idle scheduler thread ends after this long (its OpenMP team with
it); a request starts a new one, which costs its first token about 10 ms (22 -> 33 ms for a one-token request,
measured), so an engine alone keeps its thread."""
WRITE_BEHIND_RETRY_S = 0.05
"""An idle scheduler with a slot still to write behind while the disk writes another looks again this soon."""

_engines_loaded = 0
"""Engines loaded in this process (their schedulers park when idle once there are two)."""
_engines_lock = threading.Lock()


class Scheduler:
    """One load's scheduler thread: started on the first post, parked when idle beside another engine, stopped
    at the unload."""

    def __init__(self, step: "BatchStep", seqs: "Sequences", slots: "SlotTable", pooler: "Pooler",
                 drafting: "Drafting") -> None:
        self._step, self._seqs, self._slots, self._pooler, self._drafting = step, seqs, slots, pooler, drafting
        self._inbox: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # the thread's start and end against posts to its inbox
        self._on = True
        self.running = 0
        """Sequences in the last step."""
        self._working_since: float | None = None
        """When the thread's current iteration began (None while it waits for work, or has ended): how long one
        step, one embedding decode or one call on the thread has run (``busy_for_s``)."""
        self._emb_watch: "queue.SimpleQueue[Any] | None" = None
        """While an abortable embedding decode runs: the inbox (anything in it aborts the decode)."""
        self._emb_abort_cb = abort_callback(lambda: self._emb_watch is not None and not self._emb_watch.empty())
        global _engines_loaded
        with _engines_lock:
            _engines_loaded += 1

    # -- posting

    def start(self) -> None:
        """The thread, now (at load: as a first request would start it)."""
        with self._lock:
            if self._on and self._thread is None:
                self._start()

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._run, args=(self._inbox,), name="llama-scheduler", daemon=True)
        self._thread.start()

    def post(self, item: Any) -> bool:
        """Hand ``item`` to the thread, starting one if the last ended idle; False when stopped."""
        with self._lock:
            if not self._on:
                return False
            if self._thread is None:
                self._start()
            self._inbox.put(item)
            return True

    def call(self, fn: Callable[[], Any], *, yields: bool = False, abort_ctx: Any = None) -> Any:
        """``fn()`` on the scheduler thread, between two of its steps; ``yields`` and ``abort_ctx``: ``Call``."""
        c = Call(fn, yields=yields, abort_ctx=abort_ctx)
        if not self.post(c):
            raise NotReady("the model was unloaded")
        c.done.wait()
        if c.error is not None:
            raise c.error
        return c.result

    def busy_for_s(self) -> float:
        """How long the thread has been in its current iteration (0 while it waits for work): a ``llama_decode``
        that never returns (a deadlock in llama.cpp, a ggml-rpc worker that stopped answering) shows here as a
        figure that only grows, which the runner's watchdog reads (``service.runner.process``)."""
        since = self._working_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    def stop(self) -> None:
        """End the thread (generations still queued or running fail with ``NotReady``) and wait for it."""
        global _engines_loaded
        with self._lock:
            was_on, self._on = self._on, False
            thread, self._thread = self._thread, None
            if thread is not None:
                self._inbox.put(STOP)
        if was_on:
            with _engines_lock:
                _engines_loaded -= 1
        if thread is not None:
            thread.join()

    def _park(self, inbox: "queue.SimpleQueue[Any]") -> bool:
        """Idle for ``SCHEDULER_IDLE_EXIT_S``: end this thread if another engine is loaded (its OpenMP team would
        slow theirs) and nothing arrived meanwhile."""
        with _engines_lock:
            if _engines_loaded < 2:
                return False
        with self._lock:
            if not inbox.empty() or self._thread is not threading.current_thread():
                return False
            self._thread = None
            return True

    # -- the loop

    def _take(self, inbox: "queue.SimpleQueue[Any]", idle: bool) -> list[Any] | None:
        """What arrived (blocking only when ``idle``, after a write behind); None: the thread parks."""
        items = []
        if idle and not self._slots.write_behind():
            self._working_since = None
            try:
                # A slot left unwritten while the disk was busy is tried again soon.
                items.append(inbox.get(timeout=WRITE_BEHIND_RETRY_S if self._slots.unwritten
                                       else SCHEDULER_IDLE_EXIT_S))
            except queue.Empty:
                if not self._slots.unwritten and self._park(inbox):
                    return None
                return []
            finally:
                self._working_since = time.monotonic()
        while True:
            try:
                items.append(inbox.get_nowait())
            except queue.Empty:
                return items

    def _run(self, inbox: "queue.SimpleQueue[Any]") -> None:
        waiting: collections.deque[Sequence] = collections.deque()
        active = self._seqs.active
        deferred: collections.deque[Call] = collections.deque()  # embedding decodes, behind the generations
        try:
            while True:
                self._working_since = time.monotonic()
                items = self._take(inbox, idle=not active and not waiting and not deferred)
                if items is None:
                    self._working_since = None
                    return
                if self._dispatch(items, waiting, deferred):
                    break
                for r in [r for r in waiting if r.gone]:
                    waiting.remove(r)
                    self._seqs.finish(r, "cancelled")
                while waiting:
                    head = waiting[0]
                    slot = self._slots.pick(head)
                    if slot is None or (head.followers and self._slots.spare_for(head, slot) is None):
                        break  # n > 1: a slot for every choice, or wait for them
                    self._seqs.admit(waiting.popleft(), slot)
                for r in [r for r in active if r.gone]:
                    self._seqs.finish(r, "cancelled")
                if active:
                    self._step.run(active)
                    if self._slots.unwritten:
                        self._slots.write_behind(busy=True)
                # Generations first: an embedding decode runs when none is active or waiting, or once it has
                # waited EMBEDDING_MAX_DEFER_S, after a step (a request admitted now has had its first one).
                if deferred and (not (active or waiting) or deferred[0].overdue()):
                    self._seqs.flush()  # the step's tokens go out while the embedding decodes
                    if self._embedding_turn(deferred[0], inbox):
                        deferred.popleft()
                self.running = len(active)
                self._seqs.flush()
        except BaseException as exc:  # a bug here must not leave clients waiting forever
            log.exception("llama scheduler failed")
            self._fail_all(EngineFailure(f"the batch scheduler failed: {type(exc).__name__}: {exc}"), waiting,
                           deferred)
        self._working_since = None
        self._fail_all(NotReady("the model was unloaded"), waiting, deferred)
        while True:
            try:
                it = inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(it, Sequence):
                it.out.put(NotReady("the model was unloaded"))
                it.out.put(DONE)
            elif isinstance(it, threading.Event):
                it.set()
            elif isinstance(it, Call):
                it.fail(NotReady("the model was unloaded"))

    def _dispatch(self, items: list[Any], waiting: "collections.deque[Sequence]",
                  deferred: "collections.deque[Call]") -> bool:
        """Each arrival where it goes; True: the unload asked the thread to end."""
        stop = False
        for it in items:
            if it is STOP:
                stop = True
            elif isinstance(it, threading.Event):  # ``forget``
                self._slots.forget()
                self._drafting.forget()
                it.set()
            elif isinstance(it, Call):
                if it.yields:
                    deferred.append(it)
                else:
                    it.run()
            else:
                waiting.append(it)
        return stop

    def _fail_all(self, err: Any, waiting: "collections.deque[Sequence]", deferred: "collections.deque[Call]") -> None:
        for c in deferred:
            c.fail(err)
        deferred.clear()
        for r in list(self._seqs.active):
            self._seqs.fail(r, err)
        self._seqs.flush()
        for r in waiting:
            r.out.put(err)
            r.out.put(DONE)
        waiting.clear()

    def _embedding_turn(self, call: Call, inbox: "queue.SimpleQueue[Any]") -> bool:
        """Run a deferred embedding decode now; False when something arrived for the scheduler meanwhile and
        aborted it (it stays first in line and runs again when the generations let it).

        The abort callback is set on the embedding context only for an abortable decode that is not overdue:
        ggml-cpu calls it after every graph node (``ggml_graph_compute_thread``), so a generation that arrives
        waits for the node being computed (the largest, the logits of the batch, 1.3-1.5 s for 402 tokens of
        gemma-3-270m on 2 cores), not the whole batch; ``llama_decode`` then returns 2."""
        import llama_cpp

        ctx = call.abort_ctx if call.abort_ctx is not None and not call.overdue() else None
        if ctx is not None:
            self._emb_watch = inbox
            llama_cpp.llama_set_abort_callback(ctx, self._emb_abort_cb, None)
        try:
            result = call.fn()
        except BaseException as exc:  # handed to the caller, who raises it
            call.fail(exc)
            return True
        finally:
            if ctx is not None:
                llama_cpp.llama_set_abort_callback(ctx, llama_cpp.ggml_abort_callback(), None)
                self._emb_watch = None
        if ctx is not None and result == 2:
            self._pooler.aborted += 1
            return False
        call.result = result
        call.done.set()
        return True
