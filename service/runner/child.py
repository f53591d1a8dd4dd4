"""The runner process: one model's ``LlamaEngine`` in a process of its own (``python -m service.runner.child FD``).

The API process (``service.runner.process.ProcessEngine``) starts it with one end of a socket pair as file
descriptor ``FD`` and talks to it in small pickled messages (``multiprocessing.connection`` framing), in the
style of vLLM's engine-core client and Ollama's runner (the house style's process boundaries):

    parent -> child   ("init", engine_kwargs, log_level, name)     first, once
                      ("call", id, method, args)                   load, check, image_tokens, embed, rerank, forget,
                                                                   set_prompt_cache_budget
                      ("gen", id, "generate", args)                a stream of chunks of token ids
                      ("cancel", id)                               the client left (``Cancel.set`` upstream)
                      ("end", id, index)                           one choice ended (a stop string, ``Cancel.end``)
                      ("stats", id)                                the gauges a metrics scrape reads
                      ("ping", id)                                 the watchdog: how long work has been stuck
                      ("exit",)                                    unload and end
    child -> parent   ("ok", id, value) | ("err", id, error)       a call's result
                      ("chunk", id, Chunk) ... ("end", id)          a generation (an "err" before its "end" ends it)
                      ("many", [message, ...])                     what was waiting to be sent, in order

Calls and generations run on a thread pool; a generation's chunks are handed over by the engine's scheduler thread
as it makes them (``base.direct_delivery``), and the scheduler writes a step's chunks of every slot in one message
before its next ``llama_decode`` (``Child._flush_step``): crossing the process costs one pickle and one write per
step, and no other thread of the runner wakes for it. A slot's tokens of one step (a drafted step's, up to
``GGUF_DRAFT_MAX`` + 1) travel as one chunk (``one_per_step``), which the API process turns into one text chunk.
A sender thread writes the rest (calls' answers, ends).
Errors cross as the service's own (``ServiceError``); anything else becomes an ``EngineFailure`` naming it. When
the parent goes away (its end of the socket closes: it exited or was killed) the child exits at once, so a runner
never outlives its server.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from ..engine.base import Cancel, Chunk, direct_delivery, joined, one_step
from ..errors import EngineFailure, ServiceError

log = logging.getLogger(__name__)

CALLS = frozenset({"load", "check", "image_tokens", "embed", "rerank", "forget", "set_prompt_cache_budget",
                   "cached_prompts"})
"""Engine methods a "call" may name (nothing else of the engine is reachable from the socket)."""
GENERATIONS = frozenset({"generate"})
CANCELLABLE = frozenset({"embed", "rerank"})
"""Calls that take a ``Cancel`` as their last argument (it is made here, set by a "cancel" message)."""
MAX_THREADS = 64
"""Calls and generations in flight at once (the API process bounds them: slots plus its queue)."""
RPC_KEEPALIVE_S = 10.0
"""How often a model placed on ggml-rpc workers sends each of them one round trip while loaded (``RpcLibrary.ping``):
well inside a worker's idle bound (``python -m service worker --idle-timeout-s``), and how a worker that stopped
answering while the model is idle is seen (the ping does not return: ``stuck_s`` grows)."""


def portable(exc: BaseException) -> ServiceError:
    """An error the parent can unpickle and map: the service's own as they are, anything else named."""
    if isinstance(exc, ServiceError):
        try:
            pickle.loads(pickle.dumps(exc))
            return exc
        except Exception:  # an unpicklable detail: keep the class's meaning through its message
            pass
    err = EngineFailure(f"{type(exc).__name__}: {exc}")
    return err


def one_per_step(msgs: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """A step's messages with each generation's run of token chunks as one (``base.one_step``), in order."""
    out: list[tuple[Any, ...]] = []
    run: list[Chunk] = []
    for m in msgs:
        if run and m[0] == "chunk" and m[1] == out[-1][1] and one_step(run[-1], m[2]):
            run.append(m[2])
            continue
        if len(run) > 1:
            out[-1] = ("chunk", out[-1][1], joined(run))
        out.append(m)
        run = [m[2]] if m[0] == "chunk" else []
    if len(run) > 1:
        out[-1] = ("chunk", out[-1][1], joined(run))
    return out


class Child:
    """The child's side of the socket: dispatches messages to the engine, sends results back."""

    def __init__(self, conn: Connection, engine: Any) -> None:
        self.conn = conn
        self.engine = engine
        self._outbox: "queue.SimpleQueue[tuple[Any, ...]]" = queue.SimpleQueue()
        self._write_lock = threading.Lock()
        threading.Thread(target=self._sender, name="runner-sender", daemon=True).start()
        self._cancels: dict[int, Cancel] = {}
        self._cancels_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=MAX_THREADS, thread_name_prefix="runner")
        self._rpc_since: float | None = None
        """While a keepalive round trip to a worker is in flight: when it began (``_keep_workers``)."""
        self._step: list[tuple[Any, ...]] = []
        """The chunks the engine's scheduler delivered since its last flush, of every generation."""
        self._step_lock = threading.Lock()

    def send(self, msg: tuple[Any, ...]) -> None:
        """Queue ``msg`` for the sender thread (a call's answer, a generation's end)."""
        self._outbox.put(msg)

    def _flush_step(self) -> None:
        """Write what the scheduler delivered, in one message, from the calling thread: the scheduler's own, just
        before its next ``llama_decode`` (``LlamaEngine._flush``), and a generation's thread before its end.

        Handed to the sender thread instead, the chunks waited for its wake-up, which came while the next step's
        compute held both cores; the sender's wake-up also took a core from that compute every step. Written here,
        a step costs one pickle and one write on the scheduler's thread (tens of microseconds)."""
        with self._step_lock:
            msgs, self._step = self._step, []
            if msgs:
                self._write_all(one_per_step(msgs))

    def _write_all(self, msgs: list[tuple[Any, ...]]) -> None:
        """``msgs`` in one message, in order."""
        self._write(pickle.dumps(msgs[0] if len(msgs) == 1 else ("many", msgs), protocol=pickle.HIGHEST_PROTOCOL))

    def _write(self, data: bytes) -> None:
        try:
            with self._write_lock:
                self.conn.send_bytes(data)
        except OSError:  # the parent is gone: the reader loop sees it and exits
            pass

    def _sender(self) -> None:
        """Sends what was queued (calls' answers, generations' ends), everything waiting at once in one message."""
        outbox = self._outbox
        while True:
            msgs = [outbox.get()]
            while True:
                try:
                    msgs.append(outbox.get_nowait())
                except queue.Empty:
                    break
            self._write_all(msgs)

    def _cancel_for(self, cid: int) -> Cancel:
        cancel = Cancel()
        with self._cancels_lock:
            self._cancels[cid] = cancel
        return cancel

    def _done(self, cid: int) -> None:
        with self._cancels_lock:
            self._cancels.pop(cid, None)

    def serve(self) -> None:
        """Read messages until the parent goes away or says exit."""
        while True:
            try:
                msg = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                log.info("the API process went away: exiting")
                os._exit(0)
            kind = msg[0]
            if kind in ("cancel", "end"):
                with self._cancels_lock:
                    cancel = self._cancels.get(msg[1])
                if cancel is not None:
                    if kind == "cancel":
                        cancel.set()
                    else:
                        cancel.end(msg[2])
            elif kind == "stats":
                self.send(("ok", msg[1], self.engine.gauges()))
            elif kind == "ping":
                self.send(("ok", msg[1], self.stuck_s()))
            elif kind == "call":
                _, cid, method, args = msg
                cancel = self._cancel_for(cid) if method in CANCELLABLE else None
                self._pool.submit(self._call, cid, method, args, cancel)
            elif kind == "gen":
                _, cid, method, args = msg
                self._pool.submit(self._generate, cid, method, args, self._cancel_for(cid))
            elif kind == "exit":
                self._exit()
            else:
                log.error("unknown message %r", kind)

    def _call(self, cid: int, method: str, args: tuple[Any, ...], cancel: Cancel | None) -> None:
        try:
            if method not in CALLS:
                raise EngineFailure(f"the runner has no call {method!r}")
            if method == "load":
                value: Any = self._load(*args)
            else:
                value = getattr(self.engine, method)(*args, *((cancel,) if cancel is not None else ()))
            self.send(("ok", cid, value))
        except BaseException as exc:  # every failure goes back to the caller
            self.send(("err", cid, portable(exc)))
        finally:
            self._done(cid)

    def _load(self, path: str, plan: Any) -> Any:
        """The load's report (its ``limits``: what the API process reads without asking again). A plan over ggml-rpc
        workers starts their keepalive (``_keep_workers``)."""
        report = self.engine.load(path, plan)
        from ..engine.params import rpc_endpoints

        endpoints = rpc_endpoints(plan.gpus)
        if endpoints:
            threading.Thread(target=self._keep_workers, args=(endpoints,), name="runner-rpc-keepalive",
                             daemon=True).start()
        return report

    def stuck_s(self) -> float:
        """How long work this runner holds has made no progress: the scheduler's current step (a ``llama_decode``
        that does not return), or a keepalive round trip to a worker that does not come back."""
        since = self._rpc_since
        rpc = 0.0 if since is None else time.monotonic() - since
        busy = getattr(self.engine, "busy_for_s", None)
        return max(rpc, float(busy()) if busy is not None else 0.0)

    def _keep_workers(self, endpoints: tuple[str, ...]) -> None:
        """One round trip to each worker every ``RPC_KEEPALIVE_S`` for the runner's life (a runner loads once)."""
        from ..engine.rpc import rpc_library

        lib = rpc_library()
        if lib is None:
            return
        while True:
            time.sleep(RPC_KEEPALIVE_S)
            for ep in endpoints:
                self._rpc_since = time.monotonic()
                try:
                    lib.ping(ep)
                finally:
                    self._rpc_since = None

    def _generate(self, cid: int, method: str, args: tuple[Any, ...], cancel: Cancel) -> None:
        def deliver(item: Any) -> None:  # from the engine's scheduler thread; written at its flush
            msg = ("chunk", cid, item) if isinstance(item, Chunk) else ("err", cid, portable(item))
            with self._step_lock:
                self._step.append(msg)

        deliver.flush = self._flush_step  # type: ignore[attr-defined]

        try:
            if method not in GENERATIONS:
                raise EngineFailure(f"the runner has no generation {method!r}")
            with direct_delivery(deliver):
                for chunk in self.engine.generate(*args, cancel):
                    self.send(("chunk", cid, chunk))
        except BaseException as exc:  # the request's error; the runner goes on
            self._flush_step()  # what was delivered goes first
            self.send(("err", cid, portable(exc)))
        finally:
            self._flush_step()
            self._done(cid)
            self.send(("end", cid))

    def _exit(self) -> None:
        try:
            self.engine.unload()
        except Exception:  # ending anyway: the OS frees what llama.cpp held
            log.exception("unload before exit failed")
        deadline = time.monotonic() + 5
        while not self._outbox.empty() and time.monotonic() < deadline:  # the last answers go out first
            time.sleep(0.01)
        try:
            self.conn.close()
        finally:
            os._exit(0)


def main(argv: list[str]) -> None:
    fd = int(argv[1])
    conn = Connection(fd)
    try:
        kind, engine_kwargs, log_level, name = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return
    assert kind == "init"
    logging.basicConfig(level=log_level.upper() if isinstance(log_level, str) else log_level,
                        format=f"%(levelname)s runner {name} (pid {os.getpid()}): %(name)s: %(message)s",
                        stream=sys.stderr)
    from ..engine.llama import LlamaEngine

    Child(conn, LlamaEngine(**engine_kwargs)).serve()


if __name__ == "__main__":
    main(sys.argv)
