"""Deployment files: paths, YAML loading, and running a healthcheck command against a local server."""

from __future__ import annotations

import contextlib
import http.server
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from service.testing.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def load_yaml(path: Path) -> Any:
    with path.open(encoding="utf-8") as fh:
        return yaml.safe_load(fh)


class _ReadyServer:
    """A loopback HTTP server whose ``/ready`` answers ``status``; records the paths asked for."""

    def __init__(self) -> None:
        self.status = 200
        self.paths: list[str] = []
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                owner.paths.append(self.path)
                code = owner.status if self.path == "/ready" else 404
                body = b'{"status": "x"}'
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.httpd.server_address[1])
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def run_check(self, argv: list[str]) -> int:
        """Run a healthcheck command (``python`` = this interpreter) with GGUF_PORT = this server."""
        argv = [sys.executable if a == "python" else a for a in argv]
        env = {**os.environ, "GGUF_PORT": str(self.port)}
        return subprocess.run(argv, env=env, capture_output=True, timeout=30).returncode


@pytest.fixture
def ready_server() -> Iterator[_ReadyServer]:
    server = _ReadyServer()
    server.thread.start()
    try:
        yield server
    finally:
        server.httpd.shutdown()
        server.httpd.server_close()


INSTALL_HAPROXY = "bash tests/deploy/install_haproxy.sh"


@pytest.fixture(scope="session")
def haproxy_bin() -> str:
    """Debian's HAProxy; without it the router tests fail with the command that installs it (not skipped)."""
    import shutil

    found = shutil.which("haproxy")
    if found is None:
        pytest.fail(f"the router tests need HAProxy (Debian's haproxy package); run: {INSTALL_HAPROXY}", pytrace=False)
    return found


# ``python -m service worker``'s options (service/rpc/worker.py): those that take a value, and the switch.
WORKER_OPTIONS = {"--listen", "--status-port", "--memory-mib", "--threads", "--cache-dir"}
WORKER_SWITCHES = {"--allow-public"}


def worker_args(argv: list[str]) -> dict[str, Any]:
    """The options of a worker command line (``python -m service worker ...``); fails on anything else."""
    assert argv[:4] == ["python", "-m", "service", "worker"], f"not the worker module: {argv[:4]}"
    out: dict[str, Any] = {}
    rest = list(argv[4:])
    while rest:
        arg = rest.pop(0)
        name, eq, value = arg.partition("=")
        if name in WORKER_SWITCHES and not eq:
            out[name] = True
        elif name in WORKER_OPTIONS:
            assert eq or rest, f"{name} without a value"
            out[name] = value if eq else rest.pop(0)
        else:
            raise AssertionError(f"{arg!r} is not an option of python -m service worker")
    return out


def worker_ports(args: dict[str, Any]) -> tuple[int, int]:
    """(RPC port, /status port) of a worker's options: /status is on the RPC port + 1 unless --status-port."""
    _, _, port = str(args["--listen"]).rpartition(":")
    rpc = int(port)
    return rpc, int(args.get("--status-port", rpc + 1))


@contextlib.contextmanager
def running_worker(argv: list[str], cache_dir: Path) -> Iterator[tuple[int, int]]:
    """Run a manifest's worker command for real, on loopback: its own options, with --listen moved to
    127.0.0.1 on free ports (and --status-port, when given, to the next), --cache-dir to ``cache_dir`` and one
    thread unless --threads says otherwise. Yields (RPC port, /status port) once /status answers; killed after."""
    args = worker_args(argv)
    rpc = free_port(span=2)
    status = rpc + 1
    args["--listen"] = f"127.0.0.1:{rpc}"
    if "--status-port" in args:
        args["--status-port"] = str(status)
    if "--cache-dir" in args:
        args["--cache-dir"] = str(cache_dir)
    args.setdefault("--threads", "1")
    cmd = [sys.executable, "-m", "service", "worker"]
    for name, value in args.items():
        cmd += [name] if value is True else [name, str(value)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{status}/status", timeout=2).close()
                break
            except (urllib.error.URLError, OSError):
                if proc.poll() is not None:
                    err = proc.stderr.read().decode() if proc.stderr else ""
                    pytest.fail(f"{cmd} exited with {proc.returncode}: {err}", pytrace=False)
                if time.monotonic() > deadline:
                    pytest.fail(f"{cmd}: no /status within 60 s", pytrace=False)
                time.sleep(0.1)
        yield rpc, status
    finally:
        proc.kill()
        proc.wait()
