"""Shared fixtures: the embedded model's file, and the real service over real HTTP."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED_NAME = "gemma-3-270m-q4_k_m"


@pytest.fixture(scope="session")
def embedded_model() -> str:
    """Path of the embedded gemma-3-270m GGUF (assembled from its PyPI package)."""
    from service.models import embedded_model_path

    return embedded_model_path()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServiceProcess:
    """``python -m service`` in a subprocess, reached over HTTP on loopback."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        full_env = {**os.environ, "GGUF_HOST": "127.0.0.1", "GGUF_PORT": str(self.port), **env}
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
    for svc in started:
        svc.stop()


@pytest.fixture(scope="session")
def served(service_factory: object, embedded_model: str) -> ServiceProcess:
    """The real service with the embedded model loaded (default settings: loads at start)."""
    svc = service_factory()  # type: ignore[operator]
    svc.wait_ready()
    return svc
