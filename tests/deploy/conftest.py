"""Deployment files: paths, YAML loading, and running a healthcheck command against a local server."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

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
