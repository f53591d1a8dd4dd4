"""Grammar compilation in processes that can be stopped: what a request's grammar may cost, bounded (issue 29).

Why processes: llguidance's own limits (``LLParserLimits``: lexer fuel, Earley items, lexer states, grammar size)
do not bound every schema. Measured with llguidance 1.9.1: ``{"allOf": [{"type": "string", "pattern": ".*a0.*"},
...]}`` with N patterns is refused by ``validate_grammar`` ("Unable to determine if regex is empty") only after a
time and a memory that grow about fivefold every two patterns (N=16: 1.0 s, 124 MiB; N=18: 5.3 s, 510 MiB;
N=20: 35 s, 2.2 GiB), and setting ``initial_lexer_fuel``, ``step_lexer_fuel``, ``max_lexer_states`` or
``max_grammar_size`` to 1,000 changes none of it. A thread cannot be stopped; a process can, and the kernel
bounds its memory.

How:

- a *zygote*, ``python -m service.grammar.worker``, started with the first grammar: single-threaded, with
  llguidance and ``grammar`` imported, it forks one process per compilation (a few milliseconds). It exits when
  its parent does (the control socket's end of file, or ``PR_SET_PDEATHSIG``), killing its compilations;
- a compilation process runs ``grammar.compile_source``, the very code and ``LLParserLimits`` the engine runs at
  admission, under ``RLIMIT_AS`` (its address space at the fork plus the lane's memory: past it an allocation
  fails and the process ends), ``RLIMIT_CPU`` (a backstop should the parent's kill never come), no core file,
  ``nice`` 19 once in the slow lane (generation keeps the CPU it needs), and dies with the zygote. It answers
  ok or the refusal;
- the zygote kills a compilation when asked (the request was answered or its client left) and reports each
  process's end, so the parent can tell an answer from a death at the memory limit; only the zygote, which reaps
  its children, signals them, so a recycled pid is never killed;
- two lanes, so that a trivial schema is never refused because hostile ones are compiling. Every grammar starts
  in the *fast* lane (``FAST_SLOTS`` at once, ``FAST_BUDGET_S``, ``FAST_MEMORY_MIB``); trivial schemas take a few
  milliseconds there (the fork included), a 40 KB schema with patterns and formats about 90 ms. One that needs
  more time goes on in the *slow* lane (``GGUF_GRAMMAR_WORKERS`` at once, the rest of ``GGUF_GRAMMAR_TIMEOUT_S``,
  ``GGUF_GRAMMAR_MEMORY_MB``): the same process when a slow slot is free at once (its memory limit is raised), a
  fresh one after waiting for a slot otherwise. A grammar waits for the fast lane ``FAST_BUDGET_S`` per
  ``FAST_SLOTS`` grammars ahead of it. In all, grammar compilation holds at most
  ``FAST_SLOTS * FAST_MEMORY_MIB + workers * GGUF_GRAMMAR_MEMORY_MB`` beyond the processes' shared start
  (``memory_bound_mib``): a slot is free again only once its process has exited;
- what the worker proved is remembered (by a hash of the grammar's text): a grammar that compiled is not compiled
  again here, and one refused for what it is (an error, the memory limit, a crash) is refused at once next time.
  A time-out is not remembered: it depends on the load.

The engine compiles the grammar again at admission (in its runner process, ``compile_grammar``): only grammars
this worker compiled within the budget get there, so that compile is the same work, under the same limits, as the
one the worker finished. llguidance exposes no serialized form of a built grammar (only its JSON text, which every
``LLMatcher`` builds again), so nothing more can be handed over.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import hashlib
import json
import logging
import math
import os
import selectors
import signal
import socket
import struct
import sys
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..children import Child
from ..errors import BadRequest, EngineFailure

log = logging.getLogger(__name__)

FAST_SLOTS = 4
"""Grammars compiling at once in the fast lane."""
FAST_BUDGET_S = 0.1
"""How long a grammar may compile in the fast lane before it needs a slow slot: about 100 times a trivial schema,
about a 40 KB schema with patterns and formats (measured, idle machine). Longer costs nothing when a slow slot is
free (the same process goes on), so this only sets how long a grammar can wait for the fast lane under a flood:
``FAST_BUDGET_S`` per ``FAST_SLOTS`` grammars ahead of it."""
FAST_MEMORY_MIB = 32
"""Memory of a compilation in the fast lane, beyond its start: a 40 KB schema needs about 5 MiB. One that needs
more goes on in the slow lane with ``GGUF_GRAMMAR_MEMORY_MB``: it is not refused for this."""
FAST_NICE = 0
"""The fast lane's niceness: none. Its compilations are short by construction, and a niced one starves on a busy
machine: at nice 10 on two loaded cores a trivial schema overran ``FAST_BUDGET_S`` and queued behind the hostile
ones for the slow lane (3.3 s median in ``bench/grammar_bound_bench.py``)."""
SLOW_NICE = 19
"""The slow lane's: its compilations run for seconds, and generation keeps the CPU."""
END_WAIT_S = 2.0
"""How long a killed compilation's slot waits for the report of its end before it is released anyway."""
REMEMBERED = 1024
"""Grammars whose outcome (compiled, refused) is remembered, by hash."""

_ROOT = str(Path(__file__).resolve().parents[2])
_JOB, _RAISE, _KILL = b"J", b"R", b"K"
_ANSWER, _EXIT = b"A", b"X"
_CTRL = struct.Struct("!QQQI")  # job id, soft and hard address-space limits (bytes), CPU seconds
_ID = struct.Struct("!Q")
_LEN = struct.Struct("!I")
_STATUS = struct.Struct("!i")
PR_SET_PDEATHSIG = 1


def memory_bound_mib(workers: int, memory_mib: int) -> int:
    """The most memory compilations may hold at once beyond their processes' start, MiB."""
    return FAST_SLOTS * min(FAST_MEMORY_MIB, memory_mib) + workers * memory_mib


# -- the zygote and its compilation processes (``python -m service.grammar.worker FD``) -------------------

def _die_with_parent() -> None:
    """SIGKILL when the parent ends (Linux); the caller checks ``getppid`` after, for a parent already gone."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the control socket's end still ends the zygote
        pass


def _vm_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 256 << 20  # no /proc: a generous start for an interpreter with llguidance


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise EOFError
        buf += part
    return buf


def _compile_here(sock: socket.socket) -> None:
    """In a compilation process: read the job, compile it, answer."""
    from . import schema as grammar

    from ..errors import BadRequest as Refusal

    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    job = json.loads(_recv_exact(sock, n))
    try:
        grammar.compile_source(job["kind"], job["text"])
        answer: dict[str, Any] = {"ok": True}
    except Refusal as exc:
        answer = {"ok": False, "message": exc.message, "param": exc.param}
    except MemoryError:
        answer = {"ok": False, "memory": True}
    except Exception as exc:  # the grammar's doing (it is the only input): a refusal naming the error
        answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    body = json.dumps(answer).encode()
    sock.sendall(_ANSWER + _LEN.pack(len(body)) + body)


def _child(sock: socket.socket, zygote: int, soft: int, hard: int, cpu_s: int) -> None:
    import resource

    _die_with_parent()
    if os.getppid() != zygote:
        os._exit(1)
    try:
        # Rust's "memory allocation of N bytes failed" and its backtrace, once per hostile request, would flood the
        # server's log; the parent tells what ended the process from its status.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
        os.nice(FAST_NICE if soft < hard else SLOW_NICE)  # moved to the slow lane: reniced by the zygote
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a death at the memory limit writes no core file
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        _compile_here(sock)
        code = 0
    except BaseException:  # noqa: BLE001 (the parent learns of it from the exit status)
        code = 1
    os._exit(code)


@dataclass
class _Forked:
    pid: int
    sock: socket.socket
    hard: int


def _reap(jobs: dict[int, _Forked], by_pid: dict[int, int]) -> None:
    """Every compilation that has ended: reaped, and its end (its wait status) reported on its socket."""
    while by_pid:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        jid = by_pid.pop(pid, None)
        job = jobs.pop(jid, None) if jid is not None else None
        if job is not None:
            try:
                job.sock.send(_EXIT + _STATUS.pack(status))
            except OSError:  # the parent has closed its end: it no longer waits
                pass
            job.sock.close()


def _signal(op: bytes, target: _Forked | None) -> None:
    """Kill a compilation (``_KILL``), or raise its memory limit to its hard one and lower its priority
    (``_RAISE``: it moved to the slow lane)."""
    import resource

    if target is None:  # ended already (reaped): nothing to signal, and its pid may be another's now
        return
    try:
        if op == _KILL:
            os.kill(target.pid, signal.SIGKILL)
        else:
            resource.prlimit(target.pid, resource.RLIMIT_AS, (target.hard, target.hard))
            os.setpriority(os.PRIO_PROCESS, target.pid, SLOW_NICE)
    except OSError:
        pass


def serve(ctrl: socket.socket) -> None:
    """The zygote's loop: fork a compilation per job, raise or kill on request, report every end."""
    me = os.getpid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the server's to handle; EOF ends us
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(ctrl, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    jobs: dict[int, _Forked] = {}
    by_pid: dict[int, int] = {}

    while True:
        for key, _ in sel.select(timeout=5.0):
            if key.fileobj == wake_r:
                try:
                    os.read(wake_r, 4096)
                except BlockingIOError:
                    pass
                continue
            try:
                msg, fds, _flags, _addr = socket.recv_fds(ctrl, 64, 1)
            except OSError:
                msg, fds = b"", []
            if not msg:  # the parent is gone: so are its compilations
                for job in jobs.values():
                    try:
                        os.kill(job.pid, signal.SIGKILL)
                    except OSError:
                        pass
                os._exit(0)
            op = msg[:1]
            if op == _JOB and fds:
                jid, soft_extra, hard_extra, cpu_s = _CTRL.unpack(msg[1:1 + _CTRL.size])
                sock = socket.socket(fileno=fds[0])
                base = _vm_bytes()
                soft, hard = base + soft_extra, base + hard_extra
                try:
                    pid = os.fork()
                except OSError as exc:  # out of processes: the parent sees an end with no status
                    log.warning("grammar worker: fork failed: %s", exc)
                    sock.close()
                    continue
                if pid == 0:
                    try:
                        sel.close()
                        ctrl.close()
                        signal.set_wakeup_fd(-1)
                        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                        os.close(wake_r)
                        os.close(wake_w)
                        for other in jobs.values():  # other jobs' ends: their parents' waits are not ours
                            other.sock.close()
                    finally:
                        _child(sock, me, soft, hard, cpu_s)
                jobs[jid] = _Forked(pid, sock, hard)
                by_pid[pid] = jid
            elif op in (_RAISE, _KILL):
                for fd in fds:
                    os.close(fd)
                (jid,) = _ID.unpack(msg[1:1 + _ID.size])
                _signal(op, jobs.get(jid))
        _reap(jobs, by_pid)


def main(argv: list[str]) -> None:
    ctrl = socket.socket(fileno=int(argv[0]))
    _die_with_parent()
    if os.getppid() != int(argv[1]):  # the parent ended before the death signal was armed
        os._exit(0)
    from . import schema  # noqa: F401  (imported once here, so that every fork starts with it)

    import llguidance  # noqa: F401
    from llguidance import gbnf_to_lark  # noqa: F401

    serve(ctrl)


# -- the parent (the API process): the zygote, the lanes, the remembered outcomes ---------------------------------

class _Zygote:
    """The zygote process and its control socket, started on first use and again if it died."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: Child | None = None
        self._ctrl: socket.socket | None = None
        self._next = 0

    def _start(self) -> socket.socket:
        if self._ctrl is not None:
            self._ctrl.close()
        if self._proc is not None:
            self._proc.kill()
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ)
        env["PYTHONPATH"] = _ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        try:
            self._proc = Child("service.grammar.worker", [str(child.fileno()), str(os.getpid())], name="grammar worker",
                               env=env, pass_fds=(child.fileno(),), forward_stderr=True)
        finally:
            child.close()
        parent.settimeout(5.0)  # messages are a few bytes and the zygote reads them at once
        self._ctrl = parent
        log.info("grammar worker started (pid %d)", self._proc.pid)
        return parent

    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.alive() else None

    def submit(self, soft: int, hard: int, cpu_s: int) -> tuple[int, socket.socket]:
        """A new job's id and the parent's end of its socket (the compilation process holds the other)."""
        mine, theirs = socket.socketpair()
        try:
            with self._lock:
                self._next += 1
                jid = self._next
                msg = _JOB + _CTRL.pack(jid, soft, hard, cpu_s)
                for attempt in (0, 1):
                    ctrl = self._ctrl
                    if ctrl is None or self._proc is None or not self._proc.alive():
                        ctrl = self._start()
                    try:
                        socket.send_fds(ctrl, [msg], [theirs.fileno()])
                        break
                    except OSError:
                        if attempt:
                            raise EngineFailure("the grammar compiler could not be reached") from None
                        self._ctrl = None
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        mine.setblocking(False)
        return jid, mine

    def tell(self, op: bytes, jid: int) -> None:
        """Ask the zygote to raise a job's memory limit (``_RAISE``) or to kill it (``_KILL``)."""
        with self._lock:
            if self._ctrl is None:
                return
            try:
                self._ctrl.send(op + _ID.pack(jid))
            except OSError:  # the zygote is gone, and its compilations with it
                pass

    def stop(self) -> None:
        with self._lock:
            if self._ctrl is not None:
                self._ctrl.close()  # the zygote's end of file: it kills its compilations and exits
                self._ctrl = None
            if self._proc is not None:
                self._proc.end(5.0)
                self._proc = None


class _Job:
    """One compilation process, seen from the parent. It holds one lane slot for as long as the process lives:
    the slot is released when the zygote reports the process's end (a killed process keeps its memory until it
    has exited), or after ``END_WAIT_S`` should that report never come."""

    def __init__(self, zygote: _Zygote, jid: int, sock: socket.socket, payload: bytes, slot: asyncio.Semaphore) -> None:
        loop = asyncio.get_running_loop()
        self.zygote, self.jid, self.sock, self.slot = zygote, jid, sock, slot
        self.moved = False
        self.first: "asyncio.Future[tuple[str, Any]]" = loop.create_future()
        """What came first: ("answer", dict), ("exit", wait status) or ("lost", None): the zygote ended."""
        self.task = asyncio.ensure_future(self._talk(payload))
        self._finished = False
        self._released = False

    async def _talk(self, payload: bytes) -> None:
        """Send the job, then read until the process's end is reported."""
        loop = asyncio.get_running_loop()
        try:
            await loop.sock_sendall(self.sock, payload)
        except OSError:
            pass  # the process ended before reading it all: its end follows
        buf = b""
        try:
            while True:
                part = await loop.sock_recv(self.sock, 65536)
                if not part:
                    self._first(("lost", None))
                    return
                buf += part
                while buf:
                    if buf[:1] == _EXIT and len(buf) >= 1 + _STATUS.size:
                        self._first(("exit", _STATUS.unpack(buf[1:1 + _STATUS.size])[0]))
                        return
                    if buf[:1] == _ANSWER and len(buf) >= 1 + _LEN.size:
                        (n,) = _LEN.unpack(buf[1:1 + _LEN.size])
                        if len(buf) < 1 + _LEN.size + n:
                            break
                        self._first(("answer", json.loads(buf[1 + _LEN.size:1 + _LEN.size + n])))
                        buf = buf[1 + _LEN.size + n:]
                        continue
                    if buf[:1] not in (_EXIT, _ANSWER):
                        self._first(("lost", None))  # not our protocol: treat the process as gone
                        return
                    break
        except OSError:
            self._first(("lost", None))

    def _first(self, what: tuple[str, Any]) -> None:
        if not self.first.done():
            self.first.set_result(what)

    def move(self, slot: asyncio.Semaphore) -> None:
        """Into the slow lane (``slot`` acquired): the fast slot is free at once, the memory limit raised."""
        old, self.slot, self.moved = self.slot, slot, True
        old.release()
        self.zygote.tell(_RAISE, self.jid)

    def finish(self) -> None:
        """Kill the process unless it has ended; its slot is released once it has. Idempotent."""
        if self._finished:
            return
        self._finished = True
        if self.task.done():
            self._release()
            return
        self.zygote.tell(_KILL, self.jid)  # harmless after an answer: the process is exiting anyway
        loop = asyncio.get_running_loop()
        timer = loop.call_later(END_WAIT_S, self.task.cancel)

        def ended(_: Any) -> None:
            timer.cancel()
            self._release()

        self.task.add_done_callback(ended)

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self.slot.release()
            self.sock.close()


@dataclass
class _Lanes:
    fast: asyncio.Semaphore
    slow: asyncio.Semaphore


@dataclass
class GrammarCompiler:
    """Bounded compilation for one process's requests (``compiler()``); ``compile`` is its one entry."""

    workers: int
    memory_mib: int
    zygote: _Zygote = field(default_factory=_Zygote)
    _lanes: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Lanes]" = field(
        default_factory=weakref.WeakKeyDictionary)
    _known: "collections.OrderedDict[bytes, tuple[str, str | None] | None]" = field(
        default_factory=collections.OrderedDict)
    stats: dict[str, int] = field(default_factory=lambda: collections.Counter())

    def lanes(self) -> _Lanes:
        loop = asyncio.get_running_loop()
        lanes = self._lanes.get(loop)
        if lanes is None:  # semaphores belong to one event loop (an in-process test may run several)
            lanes = self._lanes[loop] = _Lanes(asyncio.Semaphore(FAST_SLOTS), asyncio.Semaphore(self.workers))
        return lanes

    def _remember(self, key: bytes, outcome: tuple[str, str | None] | None) -> None:
        self._known[key] = outcome
        self._known.move_to_end(key)
        while len(self._known) > REMEMBERED:
            self._known.popitem(last=False)

    async def compile(self, kind: str, text: str, timeout_s: float, gone: "asyncio.Future[Any] | None" = None) -> bool:
        """Compile ``text`` (a ``grammar`` kind) in a worker within ``timeout_s``: True when it compiled, False
        when ``gone`` completed first (the client left; the work is killed), ``BadRequest`` when it cannot be used
        or did not compile in time or within its memory."""
        key = hashlib.sha256(kind.encode() + b"\0" + text.encode("utf-8", "surrogatepass")).digest()
        if key in self._known:
            outcome = self._known[key]
            self._known.move_to_end(key)
            self.stats["remembered"] += 1
            if outcome is None:
                return True
            raise BadRequest(outcome[0], param=outcome[1])
        gone = gone if gone is not None else asyncio.get_running_loop().create_future()
        payload = json.dumps({"kind": kind, "text": text}).encode("utf-8", "surrogatepass")
        payload = _LEN.pack(len(payload)) + payload
        outcome = await self._run(kind, payload, timeout_s, gone)
        if outcome == "gone":
            return False
        if outcome == "time":
            self.stats["timed_out"] += 1
            what = "tools: the tools' parameters" if kind == "lark" else "response_format: the grammar"
            raise BadRequest(f"{what} did not compile within {timeout_s:g} s",
                             param="tools" if kind == "lark" else "response_format")
        self._remember(key, outcome)
        if outcome is None:
            self.stats["compiled"] += 1
            return True
        self.stats["refused"] += 1
        raise BadRequest(outcome[0], param=outcome[1])

    async def _run(self, kind: str, payload: bytes, timeout_s: float, gone: "asyncio.Future[Any]") -> Any:
        """None (compiled), (message, param) (refused), "time" or "gone"."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        lanes = self.lanes()
        cpu_s = math.ceil(timeout_s) + 1
        hard = self.memory_mib << 20
        fast = min(FAST_MEMORY_MIB, self.memory_mib) << 20
        job: _Job | None = None
        try:
            got = await _acquire(lanes.fast, deadline, gone)
            if got != "ok":
                return got
            job = self._start(payload, fast, hard, cpu_s, lanes.fast)
            got, what = await _wait(job, min(deadline, loop.time() + FAST_BUDGET_S), gone)
            if got == "done" and what[0] == "answer" and not what[1].get("memory"):
                return self._outcome(kind, what)
            if got == "gone":
                return "gone"
            # Past the fast lane's time or memory: on in the slow lane. The same process when a slot is free now
            # (``locked`` counts the waiters, so none is overtaken) and it is still running, else a fresh one after
            # waiting for a slot.
            if got == "time" and not lanes.slow.locked():
                await lanes.slow.acquire()  # free: no suspension
                job.move(lanes.slow)
            else:
                job.finish()
                job = None
            self.stats["slow"] += 1
            while True:
                if job is None:
                    got = await _acquire(lanes.slow, deadline, gone)
                    if got != "ok":
                        return got
                    job = self._start(payload, hard, hard, cpu_s, lanes.slow)
                got, what = await _wait(job, deadline, gone)
                if got != "done":
                    return got
                if job.moved and _signal_of(what) == signal.SIGABRT:
                    # It may have met the fast lane's limit just before the raise: once more, at full memory.
                    job.finish()
                    job = None
                    continue
                return self._outcome(kind, what)
        finally:
            if job is not None:
                job.finish()

    def _start(self, payload: bytes, soft: int, hard: int, cpu_s: int, slot: asyncio.Semaphore) -> _Job:
        """A compilation process for ``payload``, holding ``slot`` (acquired) from now on."""
        try:
            jid, sock = self.zygote.submit(soft, hard, cpu_s)
        except BaseException:
            slot.release()
            raise
        return _Job(self.zygote, jid, sock, payload, slot)

    def _outcome(self, kind: str, what: tuple[str, Any]) -> tuple[str, str | None] | None:
        """None when it compiled, else the refusal's (message, param)."""
        param = "tools" if kind == "lark" else "response_format"
        subject = "the tools' parameters need" if kind == "lark" else "the grammar needs"
        memory = (f"{param}: {subject} more than {self.memory_mib} MiB to compile", param)
        got, value = what
        if got == "answer":
            if value.get("ok"):
                return None
            if value.get("memory"):
                return memory
            if value.get("message"):  # grammar.compile_source's own refusal, already naming its field
                return (str(value["message"]), value.get("param") or param)
            return (f"{param}: the grammar cannot be compiled: {value.get('error')}", param)
        if got == "exit":
            sig = _signal_of(what)
            log.debug("grammar worker: job ended without an answer (%s)", _ended(value))
            if sig in (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS):
                # An allocation past RLIMIT_AS ends the process (Rust aborts); a crash is the grammar's doing too.
                return memory
            if sig == signal.SIGXCPU:
                return (f"{param}: {subject} more CPU time than the time limit allows", param)
            return (f"{param}: the grammar could not be compiled (the compiler {_ended(value)})", param)
        # "lost": no answer and no status, so the zygote itself ended (killed from outside); the next job starts another
        log.warning("grammar worker: the zygote ended during a compilation")
        raise EngineFailure("the grammar compiler ended unexpectedly; retry the request")


def _signal_of(what: tuple[str, Any]) -> int | None:
    if what[0] != "exit":
        return None
    code = os.waitstatus_to_exitcode(what[1])
    return -code if code < 0 else None


def _ended(status: int) -> str:
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


async def _acquire(sem: asyncio.Semaphore, deadline: float, gone: "asyncio.Future[Any]") -> str:
    """"ok" (``sem`` acquired), "gone" or "time"."""
    loop = asyncio.get_running_loop()
    if gone.done():
        return "gone"
    if not sem.locked():
        await sem.acquire()  # free: no suspension
        return "ok"
    task = asyncio.ensure_future(sem.acquire())
    try:
        await asyncio.wait({task, gone}, timeout=max(0.0, deadline - loop.time()),
                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
    if task.cancelled():
        return "gone" if gone.done() else "time"
    if gone.done():
        sem.release()
        return "gone"
    return "ok"


async def _wait(job: _Job, until: float, gone: "asyncio.Future[Any]") -> tuple[str, Any]:
    """("done", what came first) when the job answered or ended by ``until``, else ("time", None) or ("gone", None)."""
    loop = asyncio.get_running_loop()
    if not job.first.done():
        await asyncio.wait({job.first, gone}, timeout=max(0.0, until - loop.time()),
                           return_when=asyncio.FIRST_COMPLETED)
    if job.first.done():
        return ("done", job.first.result())
    return ("gone", None) if gone.done() else ("time", None)


_compiler: GrammarCompiler | None = None
_compiler_lock = threading.Lock()


def compiler(workers: int, memory_mib: int) -> GrammarCompiler:
    """This process's compiler (one zygote); its lanes and limits follow the latest settings given."""
    global _compiler
    with _compiler_lock:
        if _compiler is None:
            _compiler = GrammarCompiler(workers, memory_mib)
        elif (_compiler.workers, _compiler.memory_mib) != (workers, memory_mib):
            _compiler.workers, _compiler.memory_mib = workers, memory_mib
            _compiler._lanes = weakref.WeakKeyDictionary()
        return _compiler


def worker_pid() -> int | None:
    """The zygote's pid while it runs (tests, benchmarks)."""
    return _compiler.zygote.pid() if _compiler is not None else None


def shutdown() -> None:
    """Stop the zygote and its compilations (it also stops by itself when this process ends)."""
    if _compiler is not None:
        _compiler.zygote.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
