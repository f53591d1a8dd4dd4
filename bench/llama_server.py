"""llama.cpp's ``llama-server``, built from the llama.cpp that llama-cpp-python 0.3.36 vendors, for benchmarks.

``find_or_build()`` returns ``~/.cache/gguf-bench/llama-server``, building it once when it is missing: the
llama-cpp-python sdist comes from pip's cache or PyPI (``pip download llama-cpp-python==0.3.36 --no-binary
:all: --no-deps``), is unpacked under ``~/.cache/gguf-bench/src`` and built with cmake (``-DGGML_NATIVE=ON``,
as pip builds the wheel here; many minutes on two cores). ``serve(binary, model, *args)`` starts it on a free
port and yields its URL once ``/health`` answers (what the benches share beside it is ``harness``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Iterator

from harness import free_port, stop, wait_until_answers

CACHE = Path.home() / ".cache" / "gguf-bench"
VERSION = "0.3.36"


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
