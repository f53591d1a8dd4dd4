"""``python -m service worker``: ggml-rpc over this machine's devices, its real free memory beside it, loopback
unless told otherwise; a llama.cpp process that registers workers runs a model on them and answers as on one host.
Real processes on loopback, killed at the end."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys

import httpx
import pytest

from service.testing.ports import worker_ports
from service.testing.rpc import worker_process
from sizing.probe import host_memory
from tests.conftest import ROOT, free_port

MIB = 1 << 20


def worker(port: int, *args: str) -> contextlib.AbstractContextManager[subprocess.Popen[bytes]]:
    return worker_process(port, *args, cwd=str(ROOT))


def status(port: int) -> dict:  # type: ignore[type-arg]
    r = httpx.get(f"http://127.0.0.1:{port + 1}/status", timeout=5)
    assert r.status_code == 200
    return r.json()  # type: ignore[no-any-return]


def two_ports() -> tuple[int, int]:
    """Two RPC ports whose next port (/status) is free too."""
    a, b = worker_ports(2)
    return a, b


def test_the_build_has_ggml_rpc() -> None:
    """make setup builds llama-cpp-python with GGML_RPC=ON (tools/llama-wheel): a cached wheel without it is not
    reused."""
    import llama_cpp

    from service.engine.rpc import rpc_library

    assert llama_cpp.llama_supports_rpc()
    assert rpc_library() is not None


def test_status_reports_the_budget_not_the_whole_ram() -> None:
    port, _ = two_ports()
    with worker(port, "--memory-mib", "64"):
        s = status(port)
    assert s["endpoint"] == f"127.0.0.1:{port}" and s["protocol"] == "7.0.0"
    (cpu,) = [d for d in s["devices"] if d["kind"] == "cpu"]
    assert cpu["budget_bytes"] == 64 * MIB
    assert 0 < cpu["free_bytes"] <= 64 * MIB
    assert cpu["free_bytes"] + cpu["held_bytes"] == 64 * MIB
    assert cpu["total_bytes"] > 64 * MIB  # ggml-rpc's own figure: the whole RAM, which the planner must not trust
    assert cpu["threads"] == 1  # worker_process's --threads: what the planner computes its share of a token with
    assert 1e9 < cpu["decode_flops_per_core"] < 1e12  # measured once per machine (service.engine.cpu_speed)
    with worker(port):
        unbounded = [d for d in status(port)["devices"] if d["kind"] == "cpu"][0]
    assert "budget_bytes" not in unbounded
    assert abs(unbounded["free_bytes"] - host_memory().free_bytes) < 512 * MIB  # MemAvailable, as it is now


@pytest.mark.parametrize("address", ["0.0.0.0", "192.0.2.7", "[::]"])
def test_a_public_address_is_refused_without_allow_public(address: str) -> None:
    r = subprocess.run([sys.executable, "-m", "service", "worker", "--listen", f"{address}:{free_port()}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "no authentication" in r.stderr and "--allow-public" in r.stderr


@pytest.mark.parametrize("listen", ["50052", "host:", "host:port", "127.0.0.1:70000"])
def test_a_malformed_listen_address_is_refused(listen: str) -> None:
    r = subprocess.run([sys.executable, "-m", "service", "worker", "--listen", listen], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "HOST:PORT" in r.stderr


def test_a_model_over_two_workers_answers_as_on_one_host(embedded_model: str) -> None:
    """The embedded model with every layer on two workers' CPU devices (service.testing.rpc, a child process):
    the greedy text equals the host's, llama.cpp placed buffers on both workers, and each worker's held memory
    grew by at least what llama.cpp put there."""
    a, b = two_ports()

    def run(*endpoints: str) -> dict:  # type: ignore[type-arg]
        r = subprocess.run([sys.executable, "-m", "service.testing.rpc", embedded_model, *endpoints], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]

    alone = run()
    with worker(a), worker(b):
        before = {p: status(p)["devices"][-1]["held_bytes"] for p in (a, b)}
        child = subprocess.Popen([sys.executable, "-m", "service.testing.rpc", "--hold", embedded_model,
                                  f"127.0.0.1:{a}", f"127.0.0.1:{b}"], cwd=ROOT, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None and child.stdin is not None
            line = child.stdout.readline()
            assert line, child.stderr.read()[-3000:] if child.stderr else ""
            split = json.loads(line)
            held = {p: status(p)["devices"][-1]["held_bytes"] for p in (a, b)}
            child.stdin.write("\n")
            child.stdin.flush()
            assert child.wait(120) == 0
        finally:
            child.kill()
            child.wait()
    assert split["devices"] == ["RPC0", "RPC1"]
    assert split["text"] == alone["text"] and split["tokens"] == alone["tokens"] > 0
    for p in (a, b):
        placed = split["buffers"][f"RPC0[127.0.0.1:{p}]"]
        assert placed["weights"] > 0 and placed["kv"] > 0
        # What the model placed there is memory the worker no longer reports free (its figure, not ggml-rpc's).
        assert held[p] - before[p] >= placed["weights"] + placed["kv"]
    assert split["buffers"]["CPU"]["weights"] < alone["buffers"]["CPU"]["weights"]


def test_the_status_listener_answers_only_status() -> None:
    """The one client input the worker parses: a path. Anything else is a 404, and the worker goes on."""
    port, _ = two_ports()
    with worker(port) as proc:
        for path in ("/", "/status/../etc", "/x" * 2000, "/status%00"):
            assert httpx.get(f"http://127.0.0.1:{port + 1}{path}", timeout=5).status_code == 404
        assert status(port)["devices"] and proc.poll() is None


def test_a_worker_killed_under_a_loaded_model_ends_that_process_not_hangs_it(embedded_model: str) -> None:
    """SIGKILL to a worker while a llama.cpp process holds a model on it: the next call to the worker aborts that
    process (ggml-rpc's GGML_ABORT, SIGABRT) within seconds instead of leaving it waiting: the runner-crash path the
    service already has, once it places models on workers, is what a user will see."""
    import signal

    port, _ = two_ports()
    with worker(port) as proc:
        child = subprocess.Popen([sys.executable, "-m", "service.testing.rpc", "--hold", embedded_model,
                                  f"127.0.0.1:{port}"], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True)
        try:
            assert child.stdout is not None and child.stdin is not None
            assert json.loads(child.stdout.readline())["devices"] == ["RPC0"]
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            child.stdin.write("\n")  # the child frees its buffers: a call to the dead worker
            child.stdin.flush()
            assert child.wait(60) == -signal.SIGABRT
        finally:
            child.kill()
            child.wait()


def test_probe_gives_the_bytes_the_server_times_the_link_with() -> None:
    from service.rpc.client import link_bandwidth
    from service.rpc.worker import PROBE_MAX_BYTES

    port, _ = two_ports()
    with worker(port):
        r = httpx.get(f"http://127.0.0.1:{port + 1}/probe?bytes=100000", timeout=5)
        assert r.status_code == 200 and r.content == bytes(100000)
        assert r.headers["content-type"] == "application/octet-stream"
        for bad in ("0", str(PROBE_MAX_BYTES + 1), "x", ""):
            assert httpx.get(f"http://127.0.0.1:{port + 1}/probe?bytes={bad}", timeout=5).status_code == 400
        rate = link_bandwidth(f"127.0.0.1:{port}")
        assert rate is not None and rate > 50e6, rate  # loopback: hundreds of MB/s at least
        assert status(port)["devices"]  # /status as before
