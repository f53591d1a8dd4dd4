"""llama.cpp's ``llama-server``, built from the llama.cpp that llama-cpp-python 0.3.36 vendors, for benchmarks.

``find_or_build()`` returns ``~/.cache/gguf-bench/llama-server``, building it once when it is missing: the
llama-cpp-python sdist comes from pip's cache or PyPI (``pip download llama-cpp-python==0.3.36 --no-binary
:all: --no-deps``), is unpacked under ``~/.cache/gguf-bench/src`` and built with cmake (``-DGGML_NATIVE=ON``,
as pip builds the wheel here; many minutes on two cores). ``serve(binary, model, *args)`` starts it on a free
port and yields its URL once ``/health`` answers. Also what the benches share: ``stop(proc)``, ``together(n, one)``
(clients released at once) and ``request(client, route, body)`` (one timed OpenAI request, streamed or not).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
    import httpx

CACHE = Path.home() / ".cache" / "gguf-bench"
VERSION = "0.3.36"


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 30 s."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vendored_source() -> Path:
    """The vendored llama.cpp of the llama-cpp-python sdist, unpacked under the cache (downloaded once)."""
    src = CACHE / "src" / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if src.exists():
        return src
    CACHE.mkdir(parents=True, exist_ok=True)
    sdist = CACHE / f"llama_cpp_python-{VERSION}.tar.gz"
    if not sdist.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={VERSION}", "--no-binary", ":all:",
                        "--no-deps", "-d", str(CACHE)], check=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(CACHE / "src", filter="data")
    return src


def find_or_build(binary: str | None = None, src: str | None = None, jobs: int | None = None) -> Path:
    """``binary`` if given, else the cached build (built now if missing)."""
    if binary:
        return Path(binary)
    out = CACHE / "llama-server"
    if out.exists():
        return out
    source = Path(src) if src else vendored_source()
    build = CACHE / "build"
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_SERVER=ON",
                    "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF"], check=True)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs or os.cpu_count() or 1)],
                   check=True)
    shutil.copy2(build / "bin" / "llama-server", out)
    return out


def wait_until_answers(proc: "subprocess.Popen[bytes]", url: str, timeout_s: float, what: str) -> None:
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
def serve(binary: Path, model: str, *args: str, log_name: str = "llama-server.log") -> Iterator[str]:
    """llama-server on a free loopback port with ``args`` (none: its defaults, but for the host's safe CPU default);
    yields the base URL."""
    from service.engine.cpu import host_repack

    port = free_port()
    # The service's safe CPU default applies to llama-server too: off where llama.cpp's AMX kernel crashes
    # (service.engine.cpu), so that both run, and run alike.
    same_cpu = [] if host_repack("auto").on or "--repack" in args or "--no-repack" in args else ["--no-repack"]
    cmd = [str(binary), "-m", model, "--host", "127.0.0.1", "--port", str(port), "--no-webui", *same_cpu, *args]
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / log_name, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until_answers(proc, f"http://127.0.0.1:{port}/health", 180,
                               f"llama-server ({' '.join(cmd)}; log: {CACHE / log_name})")
            yield f"http://127.0.0.1:{port}"
        finally:
            stop(proc)


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
