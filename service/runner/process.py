"""One runner process per loaded model: ``ProcessEngine``, the ``Engine`` the API process holds for it.

Each loaded model's ``LlamaEngine`` (load, slots, scheduler, sampling, grammar, chat template) runs in a child
process of its own (``service.runner.child``), as Ollama runs one runner per model and vLLM its engine core:
a llama.cpp abort, a kernel bug, a GGML_ASSERT on a new architecture or the OOM killer then costs that model's
in-flight requests, never the HTTP server or the other models. The API process plans, routes, queues
(``service.residency.fifo``) and streams; this class speaks the child's small protocol (see ``child``) behind the same
``Engine`` protocol as the in-process engine, so nothing above it changes.

When the runner dies (a signal, an abort, an OOM kill):

- its requests end at once with ``RunnerDied`` (503 ``runner_died`` with Retry-After; a stream gets an error
  event then ``[DONE]``); the other models are not touched;
- the dead process is reaped first (its memory is the OS's again only then), and a new runner is started and
  loaded with the same file and plan, after a backoff; requests that arrive meanwhile wait for it (up to
  ``restart_wait_s``);
- after ``max_restarts`` deaths within ``restart_window_s`` it stops trying: the model is ``failed`` with the
  reason (``watch``'s listener tells the manager, ``/api/models`` shows it) and requests get a clear 503.

A runner that stops making progress is ended as a dead one (issue 54): a watchdog thread asks it every
``WATCH_S`` how long the work it holds has been stuck (``Child.stuck_s``: the scheduler's current ``llama_decode``,
or a keepalive round trip to a ggml-rpc worker), and kills it (SIGKILL) when that passes the bound, or when it does
not answer within the bound at all (the process is stopped, or wedged): its requests get ``runner_died`` and it
restarts. The bound (``stall_bound_s``) is ``GGUF_RUNNER_STALL_S``, raised for a slow plan to four times the
predicted time of one ubatch, so a long but moving prompt is never taken for a hang; the detection takes at most
the bound plus ``WATCH_S``. A plan over ggml-rpc workers whose work is stuck for ``RPC_SUSPECT_S`` has its workers
asked whether they answer at all: a worker that does not (stopped, its host or link gone) ends the runner within
``RPC_SUSPECT_S`` + ``STATUS_PROBE_S`` + ``WATCH_S`` (about 5 s). After such a death the restart waits, for as long
as it takes, for the workers to answer with the plan's memory free (``waiting_for_workers``); meanwhile requests are
told at once which worker the model waits for (503 ``model_not_ready``, state ``restarting``).

A death during a load (the first one too: the OOM killer, a kill) gets the same policy: the load answers
``RunnerDied`` and the runner is started again in the background, until ``max_restarts`` deaths fail the model.
``unload`` asks the runner to exit and waits until the OS has reaped it (killing it after ``EXIT_TIMEOUT_S``).
"""

from __future__ import annotations

import collections
import logging
import pickle
import queue
import signal
import socket
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable, Iterator

from sizing.plan import Plan

from ..engine.base import (Cancel, Chunk, CachedPrompt, EmbeddingResult, EngineGauges, EngineLimits, GenerationParams,
                           ImageInput, LoadReport, RerankResult, check_limits, current_delivery)
from ..children import Child
from ..engine.native import child_env
from ..errors import EngineFailure, NotReady, RunnerDied, ServiceError
from ..grammar.schema import grammar_source

log = logging.getLogger(__name__)

EXIT_TIMEOUT_S = 30.0
"""How long an unload waits for the runner to free its model and exit before it is killed."""
STATS_TIMEOUT_S = 2.0
"""How long a gauge waits for the runner's answer (it is answered on the runner's socket thread, at once)."""
STDERR_TAIL_LINES = 40
BACKOFF_S = (0.5, 2.0, 8.0)
"""Seconds before each restart after a death, by how many deaths the window holds (the last repeats)."""
WORKER_LOG_S = 60.0
"""While a restart waits for the plan's workers to come back (for as long as it takes: a worker's absence is not a
death of the runner), how often it logs that it still waits."""
RPC_SUSPECT_S = 2.0
"""Work stuck this long on a plan over ggml-rpc workers has the watchdog ask each worker's ``/status``
(``service.rpc.client.silent_worker``): one that does not answer (its host gone, its link down, its process
stopped) ends the runner at once, without waiting for the stall bound."""
WATCH_S = 1.0
"""How often the watchdog asks a loaded runner how long its work has been stuck."""
UBATCHES_PER_BOUND = 4.0
"""The stall bound is at least this many ubatches at the plan's predicted prompt speed."""


def stall_bound_s(floor_s: float, plan: Plan | None) -> float:
    """How long a runner's work may make no progress before the watchdog ends it: ``floor_s``
    (``GGUF_RUNNER_STALL_S``), or four of the plan's ubatches at its predicted prompt speed when that is longer (one
    ``llama_decode`` evaluates a ubatch; a 70B model partly on a CPU takes tens of seconds for one)."""
    if plan is None:
        return floor_s
    speed = plan.predicted_prompt_tokens_per_s
    n_ubatch = plan.cfg.n_ubatch
    if not speed or speed <= 0 or n_ubatch <= 0:
        return floor_s
    return max(floor_s, UBATCHES_PER_BOUND * n_ubatch / speed)
_END = object()

Listener = Callable[[str, str], None]
"""``(event, detail)`` from a supervisor thread: ``died``, ``restarted`` or ``failed``."""


def killed_from_outside(returncode: int | None) -> bool:
    """Whether a runner's end came from outside it (SIGKILL: the OOM killer, an operator, the watchdog; SIGTERM,
    SIGINT, SIGHUP), not from llama.cpp itself (SIGABRT, SIGSEGV, an exit code), which the same load would repeat."""
    return returncode is not None and -returncode in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def exit_reason(returncode: int | None) -> str:
    """A runner's end in words: the signal that killed it (SIGSEGV, SIGKILL: often the OOM killer) or its code."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


class _Pending:
    """A call or generation waiting for the runner: what arrives goes to its queue (chunks to ``deliver``)."""

    __slots__ = ("q", "stream", "deliver")

    def __init__(self, stream: bool, deliver: Callable[[Any], None] | None = None) -> None:
        self.q: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self.stream = stream
        self.deliver = deliver


class _Channel:
    """One runner process and the socket to it; a reader thread routes its messages to the waiting callers."""

    def __init__(self, name: str, engine_kwargs: dict[str, Any], log_level: str,
                 on_end: Callable[["_Channel"], None]) -> None:
        parent, child = socket.socketpair()
        try:
            self.child = Child("service.runner.child", [str(child.fileno())], name=f"runner of {name}",
                               env=child_env(), pass_fds=(child.fileno(),), forward_stderr=True,
                               tail_lines=STDERR_TAIL_LINES)
        finally:
            child.close()
        self.pid = self.child.pid
        self.conn = Connection(parent.detach())
        self.name = name
        self._on_end = on_end
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._next = 0
        self.dead: ServiceError | None = None
        """Set once the runner is gone: what callers get from now on."""
        self.stalled: str | None = None
        """Why the watchdog killed it (no progress within the bound), once it did."""
        self.stopping = False
        self.noticed = threading.Event()
        """Set once its end was handled (``ProcessEngine._ended``)."""
        self.try_send(("init", engine_kwargs, log_level, name))  # a runner dead already: the reader sees its end
        self._reader = threading.Thread(target=self._read, name=f"runner-{name[:32]}-reader", daemon=True)
        self._reader.start()

    # -- calls

    def open(self, stream: bool, deliver: Callable[[Any], None] | None = None) -> tuple[int, _Pending]:
        with self._lock:
            if self.dead is not None:
                raise self.dead
            self._next += 1
            cid = self._next
            p = self._pending[cid] = _Pending(stream, deliver)
        return cid, p

    def forget(self, cid: int) -> None:
        with self._lock:
            self._pending.pop(cid, None)

    def send(self, msg: tuple[Any, ...]) -> None:
        """Send, or raise the runner's end (``RunnerDied``) if it is gone."""
        try:
            self._send(msg)
        except OSError:
            raise self.dead or RunnerDied(f"model '{self.name}': its runner process is gone") from None

    def try_send(self, msg: tuple[Any, ...]) -> None:
        try:
            self._send(msg)
        except OSError:  # gone: nothing to tell it
            pass

    def _send(self, msg: tuple[Any, ...]) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self.conn.send_bytes(data)

    def call(self, method: str, args: tuple[Any, ...], cancel: Cancel | None = None,
             timeout_s: float | None = None) -> Any:
        cid, p = self.open(stream=False)
        kind = "stats" if method == "stats" else "call"
        try:
            self.send((kind, cid) if kind == "stats" else (kind, cid, method, args))
            if cancel is not None:
                cancel.on_set(lambda: self.try_send(("cancel", cid)))
            try:
                item = p.q.get(timeout=timeout_s)
            except queue.Empty:
                raise EngineFailure(f"model '{self.name}': its runner did not answer {method} within "
                                    f"{timeout_s:g} s") from None
        finally:
            self.forget(cid)
        if isinstance(item, BaseException):
            raise item
        return item

    def generate(self, args: tuple[Any, ...], cancel: Cancel) -> Iterator[Chunk]:
        cid, p = self.open(stream=True, deliver=current_delivery())
        try:
            self.send(("gen", cid, "generate", args))
        except BaseException:
            self.forget(cid)
            raise
        cancel.on_set(lambda: self.try_send(("cancel", cid)))
        cancel.on_end(lambda index: self.try_send(("end", cid, index)))
        return self._chunks(cid, p)

    def _chunks(self, cid: int, p: _Pending) -> Iterator[Chunk]:
        ended = False
        try:
            while True:
                item = p.q.get()
                if item is _END:
                    ended = True
                    return
                if isinstance(item, BaseException):
                    ended = True  # the runner ended it (an "end" follows)
                    raise item
                yield item
        finally:
            if not ended:  # the consumer stopped iterating: the generation stops within a token
                self.try_send(("cancel", cid))
            self.forget(cid)

    # -- the runner's side

    def _read(self) -> None:
        conn = self.conn
        while True:
            try:
                msg = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                break
            for m in msg[1] if msg[0] == "many" else (msg,):
                self._route(m)
        self._on_end(self)

    def _route(self, msg: tuple[Any, ...]) -> None:
        """One message of the runner to the caller waiting for it."""
        kind, cid = msg[0], msg[1]
        with self._lock:
            p = self._pending.get(cid)
            if p is not None and (kind in ("ok", "end") or (kind == "err" and not p.stream)):
                del self._pending[cid]
        if p is None:
            return  # a caller that stopped waiting
        if kind == "chunk":
            if p.deliver is not None:
                p.deliver(msg[2])
            else:
                p.q.put(msg[2])
        elif kind == "end":
            p.q.put(_END)
        else:  # "ok" (a call's value) or "err"
            p.q.put(msg[2])

    def end(self, err: ServiceError) -> None:
        """Fail everything still waiting with ``err`` (the runner is gone)."""
        with self._lock:
            self.dead = err
            pending, self._pending = self._pending, {}
        for p in pending.values():
            p.q.put(err)
            if p.stream:
                p.q.put(_END)

    def stuck_s(self, timeout_s: float) -> float | None:
        """How long the runner's work has made no progress (its own answer), or None when it did not answer within
        ``timeout_s`` (stopped, wedged, or gone)."""
        try:
            cid, p = self.open(stream=False)
        except ServiceError:
            return None
        try:
            self._send(("ping", cid))
            item = p.q.get(timeout=timeout_s)
        except (OSError, queue.Empty):
            return None
        finally:
            self.forget(cid)
        return float(item) if isinstance(item, (int, float)) else None

    def kill_stalled(self, why: str) -> None:
        """End a runner that stopped making progress (SIGKILL: a stopped process too): its reader sees the end and
        the death path runs, with ``why`` as the reason."""
        self.stalled = why
        self.child.kill()

    def exited(self) -> bool:
        """Whether the runner has ended (a zombie not reaped yet counts: ``Popen.poll`` cannot tell while another
        thread is in ``wait``)."""
        return self.dead is not None or self.noticed.is_set() or self.child.exited()

    def reap(self) -> int:
        """Wait until the OS has reaped the runner; its exit status."""
        return self.child.reap()

    def last_lines(self, n: int = 3) -> str:
        """The end of the runner's log (where llama.cpp wrote why it aborted)."""
        return self.child.last_lines(n)

    def stop(self) -> None:
        """Ask the runner to unload and exit; kill it after ``EXIT_TIMEOUT_S``; return once it is reaped."""
        self.stopping = True
        self.try_send(("exit",))
        self.child.end(EXIT_TIMEOUT_S)
        self.child.reap()
        try:
            self.conn.close()
        except OSError:
            pass
        self._reader.join(timeout=5)


class ProcessEngine:
    """The ``Engine`` protocol over a runner process (see the module docstring)."""

    def __init__(self, engine_kwargs: dict[str, Any], *, name: str = "model", log_level: str = "info",
                 max_restarts: int = 3, restart_window_s: float = 300.0, restart_wait_s: float = 60.0,
                 stall_s: float = 30.0) -> None:
        """``stall_s``: the watchdog's bound (``stall_bound_s``'s floor; 0 turns the watchdog off)."""
        self._kwargs = dict(engine_kwargs)
        self.stall_s = stall_s
        self._watching = False
        self.stalls = 0
        """Runners the watchdog ended."""
        self.name = name
        self._log_level = log_level
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.restart_wait_s = restart_wait_s
        self._ch: _Channel | None = None
        self._path: str | None = None
        self._plan: Plan | None = None
        self._limits = EngineLimits()
        self._state = "unloaded"
        """unloaded, loading, loaded, restarting, failed."""
        self._ready = threading.Event()
        self._ready.set()
        self._lock = threading.Lock()
        self._deaths: "collections.deque[float]" = collections.deque()
        self.restarts = 0
        self.last_exit: str | None = None
        self.failure: str | None = None
        self._listener: Listener | None = None
        self._stats = EngineGauges()
        self._waiting: tuple[str, float] | None = None
        """While a restart waits for the plan's workers: why (the first that is not back, and why), since when (Unix
        time)."""

    def watch(self, name: str, listener: Listener) -> None:
        """Name the model (in errors and logs) and tell ``listener`` of deaths, restarts and the final failure."""
        self.name = name
        self._listener = listener

    def _notify(self, event: str, detail: str) -> None:
        if self._listener is not None:
            try:
                self._listener(event, detail)
            except Exception:  # a listener's bug must not stop the supervisor
                log.exception("runner listener failed")

    # -- what the manager reads

    @property
    def pid(self) -> int | None:
        ch = self._ch
        return ch.pid if ch is not None and ch.dead is None else None

    @property
    def state(self) -> str:
        return self._state

    def runner_json(self) -> dict[str, Any]:
        waiting = self._waiting
        return {"pid": self.pid, "state": self._state, "restarts": self.restarts, "last_exit": self.last_exit,
                "failure": self.failure, "stall_bound_s": round(self.stall_bound(), 1) if self.stall_s > 0 else None,
                "stalls": self.stalls,
                "waiting_for_workers": None if waiting is None else {
                    "why": waiting[0], "since_unix_s": round(waiting[1], 3),
                    "for_s": round(max(0.0, time.time() - waiting[1]), 1)}}

    def stall_bound(self) -> float:
        """The watchdog's bound for the loaded plan (``stall_bound_s``)."""
        return stall_bound_s(self.stall_s, self._plan)

    # -- the watchdog

    def _watch(self) -> None:
        """Started at the first load, for the engine's life: each ``WATCH_S``, the loaded runner's stuck time; a
        runner past the bound (or silent that long) is killed and restarted as a dead one."""
        while True:
            time.sleep(WATCH_S)
            with self._lock:
                ch = self._ch if self._state == "loaded" else None
            if ch is None or ch.dead is not None or ch.stopping:
                continue
            bound = self.stall_bound()
            stuck = ch.stuck_s(bound)
            if ch is not self._ch or ch.stopping or ch.dead is not None:
                continue  # unloaded or replaced while it was asked
            if stuck is None:
                why = f"its runner process did not answer for {bound:.0f} s (stopped or wedged)"
            elif stuck > bound:
                why = f"its work made no progress for {stuck:.0f} s (bound {bound:.0f} s)"
            elif stuck > RPC_SUSPECT_S and (silent := self._silent_worker(self._plan)) is not None:
                why = f"its work made no progress for {stuck:.0f} s and {silent}"
            else:
                continue
            log.error("model %s: %s; killing runner %d to restart it", self.name, why, ch.pid)
            self.stalls += 1
            ch.kill_stalled(why)

    @staticmethod
    def _silent_worker(plan: Plan | None) -> str | None:
        """A worker of ``plan`` that does not answer its ``/status`` now, with why (None: all answer, or none)."""
        from ..engine.params import rpc_endpoints
        from ..rpc.client import silent_worker

        endpoints = rpc_endpoints(plan.gpus) if plan is not None else ()
        return silent_worker(endpoints) if endpoints else None

    def _start_watch(self) -> None:
        with self._lock:
            if self._watching or self.stall_s <= 0:
                return
            self._watching = True
        threading.Thread(target=self._watch, name=f"runner-{self.name[:32]}-watchdog", daemon=True).start()

    # -- lifecycle

    def _spawn(self) -> _Channel:
        return _Channel(self.name, self._kwargs, self._log_level, self._ended)

    def _load_on(self, ch: _Channel, path: str, plan: Plan) -> LoadReport:
        try:
            report: LoadReport = ch.call("load", (path, plan))
        except RunnerDied:
            rc = ch.reap()
            tail = ch.last_lines()
            why = f"({exit_reason(rc)})" + (f": {tail}" if tail else "")
            if killed_from_outside(rc):
                raise RunnerDied(f"model '{self.name}': its runner process was killed loading "
                                 f"{Path(path).name} {why}", retry_after_s=5) from None
            silent = self._silent_worker(plan)
            if silent is not None:  # ggml-rpc aborted on a worker that went away: not this file's or plan's doing
                raise NotReady(f"model '{self.name}': its runner process died loading {Path(path).name} {why}: "
                               f"{silent}; load it again once the worker answers", retry_after_s=5) from None
            raise EngineFailure(f"model '{self.name}': the runner process died loading {Path(path).name} "
                                f"{why}") from None
        except BaseException:
            ch.stop()
            raise
        return report

    def load(self, path: str, plan: Plan) -> LoadReport:
        """Start a runner and load ``path`` with ``plan`` in it (a loaded one is replaced). A runner killed from
        outside during the load (the OOM killer, an operator: ``killed_from_outside``) gets the restart policy: a
        new one loads after the backoff, until ``max_restarts`` deaths, then ``RunnerDied`` (503 ``runner_died``).
        One that llama.cpp ended itself (an abort, a crash: the same file and plan would end it again) is the load's
        ``EngineFailure`` with the end of its log."""
        self.unload()
        with self._lock:
            self._state, self.failure = "loading", None
            self._ready.clear()
        deaths = 0
        try:
            while True:
                ch = self._spawn()
                try:
                    report = self._load_on(ch, path, plan)
                    break
                except RunnerDied as exc:
                    deaths += 1
                    if deaths > self.max_restarts:
                        raise RunnerDied(f"{exc.message}; {deaths} runners were killed loading it, the last one "
                                         "given up on", retry_after_s=exc.retry_after_s) from None
                    log.error("%s; starting another runner (%d of %d)", exc.message, deaths, self.max_restarts)
                    self._notify("died", exc.message)
                    time.sleep(BACKOFF_S[min(deaths, len(BACKOFF_S)) - 1])
        except BaseException:
            with self._lock:
                self._state = "unloaded"
                self._ready.set()
            raise
        with self._lock:
            self._ch, self._limits, self._path, self._plan = ch, report.limits, path, plan
            self._state = "loaded"
            self._deaths.clear()
            self._ready.set()
            self.restarts += deaths
        log.info("model %s runs in runner process %d", self.name, ch.pid)
        self._start_watch()
        return report

    def unload(self) -> None:
        """Stop the runner (its requests end with ``NotReady``) and return once the OS has reaped it."""
        with self._lock:
            ch, self._ch = self._ch, None
            self._state = "unloaded"
            self._limits = EngineLimits()
            self._ready.set()
        if ch is not None:
            ch.stop()

    def _ended(self, ch: _Channel) -> None:
        """The reader of ``ch`` saw its socket close: an unload, or a death (then a restart, or the failure)."""
        if ch.stopping:
            ch.noticed.set()
            ch.end(NotReady(f"model '{self.name}' was unloaded", retry_after_s=1))
            return
        rc = ch.reap()
        reason = f"stalled: {ch.stalled}; killed" if ch.stalled is not None else exit_reason(rc)
        with self._lock:
            current = ch is self._ch and self._state == "loaded"
            if current:
                self._state = "restarting"
                self._ready.clear()
                self.last_exit = reason
        ch.noticed.set()
        ch.end(RunnerDied(f"model '{self.name}': its runner process died ({reason}) during this request; it is "
                          "being restarted, retry shortly"))
        if not current:
            return
        log.error("runner of %s (pid %d) died: %s", self.name, ch.pid, reason)
        self._notify("died", reason)
        threading.Thread(target=self._restart, args=(reason,), name=f"runner-{self.name[:32]}-restart",
                         daemon=True).start()

    def _restart(self, reason: str) -> None:
        """Start and load a new runner with the same file and plan, after a backoff; give up after too many deaths."""
        while True:
            now = time.monotonic()
            with self._lock:
                self._deaths.append(now)
                while self._deaths and now - self._deaths[0] > self.restart_window_s:
                    self._deaths.popleft()
                deaths = len(self._deaths)
            if deaths > self.max_restarts:
                self._give_up(f"the runner process died {deaths} times within {self.restart_window_s:g} s; "
                              f"last: {reason}")
                return
            time.sleep(BACKOFF_S[min(deaths, len(BACKOFF_S)) - 1])
            with self._lock:
                if self._state != "restarting" or self._path is None or self._plan is None:
                    return  # unloaded meanwhile
                path, plan = self._path, self._plan
            if not self._wait_for_workers(plan):
                return  # unloaded meanwhile
            try:
                ch = self._spawn()
                limits = self._load_on(ch, path, plan).limits
            except Exception as exc:
                reason = exc.message if isinstance(exc, ServiceError) else f"{type(exc).__name__}: {exc}"
                log.error("restarting the runner of %s failed: %s", self.name, reason)
                continue
            with self._lock:
                if self._state != "restarting":  # unloaded while it loaded
                    stale = ch
                else:
                    stale = None
                    self._ch, self._limits = ch, limits
                    self._state = "loaded"
                    self.restarts += 1
                    self._ready.set()
            if stale is not None:
                stale.stop()
                return
            log.warning("runner of %s restarted (pid %d; restart %d)", self.name, ch.pid, self.restarts)
            self._notify("restarted", f"pid {ch.pid}")
            return

    def _wait_for_workers(self, plan: Plan) -> bool:
        """Wait until the plan's workers answer with its memory free again, for as long as it takes (a runner over
        a worker that died or vanished died with it: ggml-rpc aborts, or the watchdog ended it); meanwhile
        ``waiting_for_workers`` says which and since when. False when the model was unloaded meanwhile."""
        from ..engine.params import rpc_endpoints
        from ..rpc.client import plan_workers_ready

        if not rpc_endpoints(plan.gpus):
            return True
        logged = 0.0
        try:
            while True:
                why = plan_workers_ready(plan)
                if why is None:
                    return True
                with self._lock:
                    if self._state != "restarting":
                        return False
                    since = self._waiting[1] if self._waiting is not None else time.time()
                    self._waiting = (why, since)
                if time.monotonic() - logged >= WORKER_LOG_S:
                    logged = time.monotonic()
                    log.error("model %s waits for its workers to restart its runner: %s", self.name, why)
                time.sleep(1.0)
        finally:
            with self._lock:
                self._waiting = None

    def _give_up(self, why: str) -> None:
        with self._lock:
            self._state, self.failure = "failed", why
            self._ready.set()
        log.error("model %s failed: %s", self.name, why)
        self._notify("failed", why)

    def _channel(self) -> _Channel:
        """The runner to send a request to: waits for a restart in progress; raises when there is none. A runner
        already dead whose end its reader has not handled yet is waited for too: a request that comes after a
        death is served by the next runner, not failed with the requests that were in the dead one."""
        deadline = time.monotonic() + self.restart_wait_s
        while True:
            while not self._ready.wait(min(0.5, max(0.0, deadline - time.monotonic()))):
                waiting = self._waiting
                if waiting is not None:  # not a moment's wait: say so now
                    raise NotReady(f"model '{self.name}' waits for its workers to restart its runner process: "
                                   f"{waiting[0]}", retry_after_s=5, state="restarting")
                if time.monotonic() >= deadline:
                    raise NotReady(f"model '{self.name}' is restarting its runner process; retry shortly",
                                   retry_after_s=5, state="restarting")
            with self._lock:
                state, ch = self._state, self._ch
            if state != "loaded" or ch is None or not ch.exited():
                break
            ch.noticed.wait(5)
        if state == "loaded" and ch is not None:
            return ch
        if state == "failed":
            raise NotReady(f"model '{self.name}' failed: {self.failure}", state="failed")
        raise NotReady("no model is loaded")

    # -- the Engine protocol

    @property
    def limits(self) -> EngineLimits:
        return self._limits

    def gauges(self) -> EngineGauges:
        """The runner's gauges now (one round trip); the last ones read while it is restarting."""
        ch = self._ch
        if ch is not None and ch.dead is None and self._state == "loaded":
            try:
                self._stats = ch.call("stats", (), timeout_s=STATS_TIMEOUT_S)
            except ServiceError:  # the runner is busy dying or restarting: the last figures stand
                pass
        return self._stats

    def check(self, params: GenerationParams) -> None:
        """Here without a grammar (the vocabulary's size and the slots are known since the load): one round trip
        to the runner less before a plain request's first token; a grammar compiles in the runner, which keeps it
        for the sampling."""
        if grammar_source(params) is not None:
            self._channel().call("check", (params,))
        else:
            self._channel()  # a runner that is not serving raises here, as its call would
            check_limits(params, self._limits.n_vocab, self._limits.slots)

    def image_tokens(self, image: ImageInput, param: str) -> tuple[list[int], list[int], list[int]]:
        return self._channel().call("image_tokens", (image, param))  # type: ignore[no-any-return]

    def embed(self, inputs: list[list[int]], cancel: Cancel) -> EmbeddingResult:
        return self._channel().call("embed", (inputs,), cancel)  # type: ignore[no-any-return]

    def rerank(self, inputs: list[list[int]], cancel: Cancel) -> RerankResult:
        return self._channel().call("rerank", (inputs,), cancel)  # type: ignore[no-any-return]

    def set_prompt_cache_budget(self, budget_bytes: int) -> None:
        if self._state == "loaded":
            self._channel().call("set_prompt_cache_budget", (budget_bytes,))

    def forget(self) -> None:
        self._channel().call("forget", ())

    def cached_prompts(self) -> tuple[CachedPrompt, ...]:
        got: tuple[CachedPrompt, ...] = self._channel().call("cached_prompts", ())
        return got

    def generate(self, tokens: list[int], params: GenerationParams, cancel: Cancel) -> Iterator[Chunk]:
        return self._channel().generate((tokens, params), cancel)
