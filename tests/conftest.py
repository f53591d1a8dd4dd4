"""Shared fixtures: the embedded model's file, and the real service over real HTTP."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Mapping

os.environ.setdefault("GOMP_SPINCOUNT", "2000")
"""Read by libgomp when llama.cpp loads, here and in every process the tests start. Two pytest workers each run
llama.cpp's OpenMP team on the same 2 cores, and by default each team's idle threads spin (300,000 rounds) through
the other's work: two engine tests run side by side took 152 s against 15 s one after the other (AMX host,
2026-12-05; a whole 2-worker suite 52 minutes in CI). With 2,000 rounds the pair takes 23 s, and one test alone
5.2 s against 4.7 s (OMP_WAIT_POLICY=PASSIVE: 18 s, but 9.0 s alone)."""

import httpx
import pytest

from service.testing.ports import free_port
from tests import figures

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED_NAME = "gemma-3-270m-q4_k_m"
"""The model the tests' services serve by default: gemma-3-270m, the embedded base model, which the suite was written
against. The service's own default is the embedded instruct model (``service.settings.EMBEDDED_MODEL_NAME``,
tests/test_first_chat.py); GGUF_DEFAULT_MODEL below keeps every ``Settings()`` here and every service the tests start
on gemma."""
INSTRUCT_NAME = "smollm2-135m-instruct-q4_1"

os.environ["GGUF_DEFAULT_MODEL"] = EMBEDDED_NAME
"""Read by ``Settings()`` in this process and in every process the tests start (they inherit the environment); a
test passes its own GGUF_DEFAULT_MODEL, or removes it (``ServiceProcess`` with None) for the service's default."""


def _marked_processes(marker: str) -> list[str]:
    """Processes (other than this one) whose environment carries ``marker``: every server, runner and dry-run
    worker the tests started inherits it, even one that outlived its parent and was reparented."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker.encode() not in f.read():
                    continue
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                if f.read().rsplit(")", 1)[-1].split()[0] == "Z":
                    continue  # ended, waiting for its parent to reap it
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{entry}: {cmd[:200]}")
        except OSError:
            continue
    return found


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind() -> Iterator[None]:
    """After the whole session (every other fixture finalized first), no process the tests started survives:
    the session fails with the list of them, and they are killed."""
    marker = f"GGUF_TEST_SESSION={os.getpid()}-{time.time_ns()}"
    os.environ["GGUF_TEST_SESSION"] = marker.split("=", 1)[1]
    yield
    if not os.path.isdir("/proc"):
        return
    deadline = time.monotonic() + 15  # runners exit when their server's socket closes: give them a moment
    left = _marked_processes(marker)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _marked_processes(marker)
    for line in left:
        try:
            os.kill(int(line.split(":", 1)[0]), 9)
        except OSError:
            pass
    assert not left, "processes started by the tests outlived them:\n" + "\n".join(left)


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: its figures go to the controller
        workeroutput["figures"] = figures.state()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    figures.merge(getattr(node, "workeroutput", {}).get("figures"))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    figures.summary(terminalreporter)


@pytest.fixture(scope="session")
def embedded_model() -> str:
    """Path of the embedded gemma-3-270m GGUF (assembled from its PyPI package)."""
    from service.catalog.embedded import embedded_model_path

    return embedded_model_path()


@pytest.fixture(scope="session")
def instruct_model() -> str:
    """Path of the embedded SmolLM2-135M-Instruct GGUF, where ``make setup`` put it (tools/fetch-instruct-model);
    the tests never fetch it themselves."""
    from service.catalog.embedded import EmbeddedModelError, instruct_model_path

    try:
        return instruct_model_path()
    except EmbeddedModelError as exc:
        pytest.fail(exc.message)


def stream_events(url: str, body: dict[str, Any], first: threading.Event, out: dict[str, Any],
                  timeout: float = 120) -> None:
    """POST a streamed request to ``url``; ``out`` gets its status and every SSE ``data:`` payload, ``first`` is set
    at the first event (or on a failure, reported as ``out["error"]``). Meant to run in a thread."""
    try:
        with httpx.Client(timeout=timeout) as c, c.stream("POST", url, json=body) as r:
            out["status"] = r.status_code
            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()
            out["events"] = events
    except Exception as exc:  # reported to the test thread
        out["error"] = repr(exc)
        first.set()


@contextlib.contextmanager
def in_process_service(settings: Any, ready_timeout_s: float = 180) -> Iterator[tuple[str, Any]]:
    """The real app (``create_app(settings)``) served by uvicorn on loopback in this process, once ``/ready``;
    yields its URL and the app, so a test can read the engine's state beside what the HTTP API says."""
    import uvicorn

    from service.api.app import create_app

    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=settings.port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{settings.port}"
    try:
        deadline = time.monotonic() + ready_timeout_s
        with httpx.Client(base_url=url, timeout=10) as c:
            while time.monotonic() < deadline:
                try:
                    if c.get("/ready").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
            else:
                raise TimeoutError(f"the in-process service did not become ready in {ready_timeout_s:.0f} s")
        yield url, app
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def loaded_model(client: httpx.Client, **kw: Any) -> dict[str, Any]:
    """The one loaded model of ``/api/models`` (the listing names both embedded models, loaded or not)."""
    loaded = [m for m in client.get("/api/models", **kw).json()["models"] if m.get("state") == "loaded"]
    assert len(loaded) == 1, [m.get("name") for m in loaded]
    return loaded[0]  # type: ignore[no-any-return]


class ServiceProcess:
    """``python -m service`` in a subprocess, reached over HTTP on loopback. ``env`` over this process's environment;
    a None value removes that variable."""

    def __init__(self, env: Mapping[str, str | None], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        merged = {**os.environ, "GGUF_HOST": "127.0.0.1", "GGUF_PORT": str(self.port), **env}
        full_env = {k: v for k, v in merged.items() if v is not None}
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "service"], cwd=ROOT, env=full_env, stdout=self._log, stderr=subprocess.STDOUT
        )
        self.client = httpx.Client(base_url=self.url, timeout=120)

    def wait_healthy(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"service exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if self.client.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"service not healthy in {timeout_s} s:\n{self.log()}")

    def wait_ready(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.client.get("/ready").status_code == 200:
                return
            time.sleep(0.1)
        raise TimeoutError(f"service not ready in {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-5000:]

    def terminate(self) -> None:
        """Ask it to stop (SIGTERM: it drains and exits); ``stop`` waits for it."""
        if self.proc.poll() is None:
            self.proc.terminate()

    @contextlib.contextmanager
    def running(self, ready: bool = True) -> Iterator["ServiceProcess"]:
        """The service healthy (and, with ``ready``, its default model loaded) for the block; stopped after it,
        whatever happened."""
        try:
            self.wait_healthy()
            if ready:
                self.wait_ready()
            yield self
        finally:
            self.stop()

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="session")
def service_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """Start services with given settings; all are stopped at the end of the session."""
    started: list[ServiceProcess] = []

    def start(**env: str) -> ServiceProcess:
        d = tmp_path_factory.mktemp("service")
        env.setdefault("GGUF_MODELS_DIR", str(d / "models"))
        (d / "models").mkdir(exist_ok=True)
        svc = ServiceProcess(env, d / "service.log")
        started.append(svc)
        svc.wait_healthy()
        return svc

    yield start
    for svc in started:  # all asked at once: each drains for a moment, and one after another took 30 s
        svc.terminate()
    for svc in started:
        svc.stop()


@pytest.fixture(scope="session")
def served(service_factory: object, embedded_model: str) -> ServiceProcess:
    """The real service with the embedded model loaded (default settings: loads at start)."""
    svc = service_factory()  # type: ignore[operator]
    svc.wait_ready()
    return svc
