"""What the benches share: the service started as ``make run`` starts it, processes stopped, clients released at
once, one timed OpenAI request.

A bench runs as a script (``.venv/bin/python bench/NAME.py``): Python puts bench/ first on the path, so the
benches import this module and ``llama_server`` by name, and ``service`` and ``sizing`` come from the project's
editable install. None of them edits ``sys.path`` (tests/test_layout.py checks it).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
    import httpx

from service.testing.ports import free_port

__all__ = ["free_port"]  # the benches take it from here with the rest of the harness

ROOT = Path(__file__).resolve().parents[1]
"""The checkout the benches belong to (the service runs from it unless a bench names another)."""


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 30 s."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_until_answers(proc: subprocess.Popen[bytes], url: str, timeout_s: float, what: str) -> None:
    """Poll ``url`` until it answers 200; SystemExit when ``proc`` exits first or ``timeout_s`` passes."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        time.sleep(0.2)
    raise SystemExit(f"{what} did not answer {url} within {timeout_s:.0f} s")


@contextlib.contextmanager
def run_service(model: str | None = None, *, beside: tuple[str, ...] = (), **settings: str) -> Iterator[str]:
    """``python -m service`` on its defaults (but ``settings``, GGUF_* names); yields its URL once ``/ready``
    answers. See ``service_process``."""
    with service_process(model, beside=beside, **settings) as (url, _):
        yield url


@contextlib.contextmanager
def service_process(model: str | None = None, *, beside: tuple[str, ...] = (), root: Path = ROOT, **settings: str
                    ) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """The service, and its process (to kill it). It serves ``model`` as its default (``bench``) from a models
    directory of its own, with the files ``beside`` under their own names (a draft model); ``model`` None: the
    embedded default, as ``make run`` serves it. ``root``: the checkout it runs from (another commit's, to
    compare). Its log is the models directory's service.log, named when it fails to start."""
    models = Path(tempfile.mkdtemp(prefix="bench-service-"))
    links = [(model, models / "bench.gguf")] if model else []
    for src, dst in [*links, *((b, models / Path(b).name) for b in beside)]:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copyfile(src, dst)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGUF_")}
    env.update(GGUF_PORT=str(port), GGUF_MODELS_DIR=str(models), GGUF_LOG_LEVEL="warning")
    if model:
        env["GGUF_DEFAULT_MODEL"] = "bench"
    env.update(settings)
    log = open(models / "service.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "service"], cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_answers(proc, f"{url}/ready", 300, f"the service (log: {models / 'service.log'})")
        yield url, proc
    finally:
        stop(proc)
        log.close()
        shutil.rmtree(models, ignore_errors=True)


def together(n: int, one: Callable[[int], Any]) -> tuple[float, list[Any]]:
    """``one(0) ... one(n - 1)`` on ``n`` threads released at once: the wall time and their results."""
    results: list[Any] = [None] * n
    barrier = threading.Barrier(n)

    def go(i: int) -> None:
        barrier.wait()
        results[i] = one(i)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, results


@dataclass
class Run:
    tokens: int
    ttft_s: float
    total_s: float
    text: str = ""

    @property
    def decode_tokens_per_s(self) -> float:
        return (self.tokens - 1) / (self.total_s - self.ttft_s) if self.tokens > 1 and self.total_s > self.ttft_s else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total_s


def request(client: httpx.Client, route: str, body: dict[str, Any]) -> Run:
    """One OpenAI completion or chat request; streaming: time to the first content, the token count from the usage
    chunk (else the pieces) and the text."""
    t0 = time.perf_counter()
    if not body.get("stream"):
        r = client.post(route, json=body)
        r.raise_for_status()
        return Run(int(r.json()["usage"]["completion_tokens"]), 0.0, time.perf_counter() - t0)
    first = None
    usage = None
    pieces: list[str] = []
    with client.stream("POST", route, json={**body, "stream_options": {"include_usage": True}}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = int(ev["usage"]["completion_tokens"])
            for ch in ev.get("choices") or ():
                piece = ch.get("text") or (ch.get("delta") or {}).get("content")
                if piece:
                    pieces.append(piece)
                    if first is None:
                        first = time.perf_counter()
    t1 = time.perf_counter()
    return Run(usage if usage is not None else len(pieces), (first or t1) - t0, t1 - t0, "".join(pieces))


def med(xs: list[float]) -> float:
    """The median, NaN for none."""
    return statistics.median(xs) if xs else float("nan")
