"""Which of ``GGUF_RPC_WORKERS`` answer, and since when one does not: what ``/ready``, ``/api/models`` and the
metrics say about the workers.

A thread of the server's asks each worker's ``GET /status`` every ``WATCH_S`` with ``STATUS_PROBE_S`` to answer
(``service.rpc.client.read_status``): a worker whose host is gone, whose link is down or whose process is stopped
answers nothing within it and is ``missing`` from the first check that found it so, with why. It never connects
to ggml-rpc's own port (a worker serves one client there: a model's runner), so it costs a worker one small HTTP
answer every few seconds. What a model's runner does about a missing worker is its own (``service.runner.process``:
the watchdog ends a runner stuck on it, the restart waits for it); this is the view.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .client import STATUS_PROBE_S, read_status

WATCH_S = 5.0
"""How often each worker is asked: a missing one is named within this plus ``STATUS_PROBE_S``."""


@dataclass(frozen=True)
class WorkerHealth:
    """One worker as last checked."""

    endpoint: str
    up: bool
    since_unix_s: float
    """When the checks first found it in this state (up or missing)."""
    checked_unix_s: float
    why: str | None = None
    """Why it is missing (no answer, not a worker's status)."""
    clients: int = 0
    """Clients its ggml-rpc serves (1: a model's runner is on it)."""

    def json(self, now_unix_s: float) -> dict[str, Any]:
        out: dict[str, Any] = {"endpoint": self.endpoint, "state": "up" if self.up else "missing",
                               "since_unix_s": round(self.since_unix_s, 3),
                               "for_s": round(max(0.0, now_unix_s - self.since_unix_s), 1)}
        if self.up:
            out["serving"] = self.clients > 0
        else:
            out["why"] = self.why
        return out


class WorkerWatch:
    """Each worker's health, checked every ``interval_s`` on a thread of its own (``start``; ``stop`` ends it)."""

    def __init__(self, endpoints: Sequence[str], *, interval_s: float = WATCH_S, timeout_s: float = STATUS_PROBE_S,
                 read: Callable[[str, float], dict[str, object]] = read_status,
                 clock: Callable[[], float] = time.time) -> None:
        self.endpoints = list(endpoints)
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self._read, self._clock = read, clock
        self._health: dict[str, WorkerHealth] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> None:
        """Ask every worker once, and record what each answered."""
        for ep in self.endpoints:
            try:
                st = self._read(ep, self.timeout_s)
                up, why = True, None
                clients = st.get("clients")
                n = clients if isinstance(clients, int) else 0
            except OSError as exc:
                up, why, n = False, str(exc), 0
            now = self._clock()
            with self._lock:
                last = self._health.get(ep)
                since = last.since_unix_s if last is not None and last.up == up else now
                self._health[ep] = WorkerHealth(ep, up, since, now, why, n)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.check()
            self._stop.wait(self.interval_s)

    def start(self) -> None:
        if self.endpoints and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rpc-worker-watch", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def health(self) -> list[WorkerHealth]:
        """Every worker checked so far, in ``GGUF_RPC_WORKERS``'s order."""
        with self._lock:
            return [self._health[ep] for ep in self.endpoints if ep in self._health]

    def missing(self) -> list[WorkerHealth]:
        return [h for h in self.health() if not h.up]

    def json(self) -> list[dict[str, Any]]:
        """``GGUF_RPC_WORKERS``, each with its state (``unknown`` before its first check)."""
        now = self._clock()
        with self._lock:
            return [self._health[ep].json(now) if ep in self._health else {"endpoint": ep, "state": "unknown"}
                    for ep in self.endpoints]
