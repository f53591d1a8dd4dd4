"""An idle RPC client: ggml-rpc serves one client at a time and reads with no timeout (ggml-rpc.cpp
``rpc_serve_client``), so a client that connects and says nothing, or half a message, kept every other client out
for good. The worker cuts such a connection (no HELLO within ``--hello-timeout-s``, nothing for
``--idle-timeout-s`` while the server waits), frees what its client held, serves the next and says so in
``/status``; a client that keeps talking is never cut. ``/status`` itself holds no thread per connection and gives
each a read timeout. Real workers, real ggml-rpc clients (a child process through ``service.engine.rpc``) and raw
sockets speaking ggml-rpc's protocol 7.0.0 byte by byte."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import struct
import subprocess
import sys
import time
from typing import Any, Iterator

import httpx

from service.testing.ports import worker_ports
from service.testing.rpc import worker_process
from tests.conftest import ROOT

MIB = 1 << 20

# ggml-rpc.cpp's ``enum rpc_cmd`` and packed messages: | cmd (1 byte) | size (u64) | payload |
CMD_ALLOC_BUFFER, CMD_BUFFER_CLEAR, CMD_GET_DEVICE_MEMORY, CMD_HELLO = 0, 5, 11, 14
CONN_CAPS_BYTES = 24  # RPC_CONN_CAPS_SIZE (transport.h): rpc_msg_hello_req is only these


def message(cmd: int, payload: bytes = b"") -> bytes:
    return bytes([cmd]) + struct.pack("<Q", len(payload)) + payload


HELLO = message(CMD_HELLO, bytes(CONN_CAPS_BYTES))


def recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, "the worker closed the connection"
        out += chunk
    return out


def answer(sock: socket.socket) -> bytes:
    (size,) = struct.unpack("<Q", recv_exact(sock, 8))
    return recv_exact(sock, size)


def hello(sock: socket.socket) -> None:
    sock.sendall(HELLO)
    major, minor, _patch = answer(sock)[:3]  # rpc_msg_hello_rsp
    assert (major, minor) == (7, 0)


def closed_after_s(sock: socket.socket, within_s: float) -> float:
    """Seconds until the worker closes ``sock`` (what it answered before, a HELLO's answer, is read past);
    ``socket.timeout`` when it stays open ``within_s``."""
    t0 = time.monotonic()
    sock.settimeout(within_s)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - t0


def status(port: int) -> dict[str, Any]:
    r = httpx.get(f"http://127.0.0.1:{port + 1}/status", timeout=5)
    assert r.status_code == 200
    return r.json()  # type: ignore[no-any-return]


def cpu(st: dict[str, Any]) -> dict[str, Any]:
    return next(d for d in st["devices"] if d["kind"] == "cpu")


@contextlib.contextmanager
def worker(*args: str) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    (port,) = worker_ports(1)
    with worker_process(port, *args, cwd=str(ROOT)) as proc:
        yield port, proc


CLIENT = r"""
# python -c CLIENT ENDPOINT HOLD_S EVERY_S: register the worker, read its last device's memory, every EVERY_S over
# one connection for HOLD_S when HOLD_S > 0; print what it saw as one JSON line.
import ctypes, json, sys, time
from service.engine.rpc import register_workers, rpc_library
ep, hold_s, every_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
names = register_workers([ep])
lib = rpc_library()
g = lib.lib
devs = [g.ggml_backend_dev_get(i) for i in range(g.ggml_backend_dev_count())]
dev = [d for d in devs if lib.device_name(d) == names[-1]][0]
backend = None
if hold_s:  # a backend holds ggml-rpc's connection to the worker, as a loaded model's buffers do
    g.ggml_backend_dev_init.restype = ctypes.c_void_p
    g.ggml_backend_dev_init.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    backend = g.ggml_backend_dev_init(dev, None)
t0 = time.monotonic()
queries = 0
while True:
    free, total = lib.device_memory(dev)  # RPC_CMD_GET_DEVICE_MEMORY, on that connection while it is held
    queries += 1
    if time.monotonic() - t0 >= hold_s:
        break
    time.sleep(every_s)
if backend:
    g.ggml_backend_free.argtypes = [ctypes.c_void_p]
    g.ggml_backend_free(backend)
print(json.dumps({"devices": names, "total_bytes": total, "queries": queries}), flush=True)
"""


def rpc_client(port: int, timeout_s: float = 60) -> dict[str, Any]:
    """A real ggml-rpc client in a child process (ggml-rpc aborts its process on a lost connection): registers
    the worker and reads its last device's memory once (``CLIENT`` with ``hold_s`` 0)."""
    r = subprocess.run([sys.executable, "-c", CLIENT, f"127.0.0.1:{port}", "0", "0"], cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout_s)
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_an_idle_rpc_client_is_cut_and_the_next_client_served() -> None:
    """A client that connects and sends nothing: on its own ggml-rpc would wait for its HELLO for ever, and a real
    client behind it would never be served. The worker cuts it at the HELLO bound; the real client is served."""
    with worker("--hello-timeout-s", "1", "--idle-timeout-s", "60") as (port, proc):
        idle = socket.create_connection(("127.0.0.1", port))
        time.sleep(0.5)  # accepted: ggml-rpc serves it now
        out = rpc_client(port, timeout_s=30)
        assert out["devices"] and out["total_bytes"] > 0
        assert closed_after_s(idle, 10) < 10
        conn = status(port)["connection"]
        assert proc.poll() is None
    assert conn["cut_connections"] == 1 and conn["hello_timeout_s"] == 1
    (cut,) = conn["recent_cuts"]
    assert cut["peer"] == "127.0.0.1:%d" % idle.getsockname()[1] and "no HELLO within 1 s" in cut["reason"]
    idle.close()


def test_a_silent_client_is_cut_whatever_it_sent_and_what_it_held_is_freed() -> None:
    """Four clients at once, each silent after: nothing, half a HELLO, a HELLO and a buffer it filled, a HELLO
    and half a command. ggml-rpc takes them one by one from its queue; each is cut, by the HELLO bound before its
    HELLO and by the idle bound after it (counted from when it was taken, not from when it connected), what it
    held is freed (``rpc_server::~rpc_server``), nothing crashes and a real client is served after them."""
    with worker("--hello-timeout-s", "1", "--idle-timeout-s", "2") as (port, proc):
        before = cpu(status(port))
        nothing = socket.create_connection(("127.0.0.1", port))
        half_hello = socket.create_connection(("127.0.0.1", port))
        half_hello.sendall(HELLO[:5])
        holder = socket.create_connection(("127.0.0.1", port))
        half_command = socket.create_connection(("127.0.0.1", port))
        half_command.sendall(HELLO + message(CMD_GET_DEVICE_MEMORY, struct.pack("<I", 0))[:6])
        # Served third: its HELLO is answered once the two before it are cut (about 1 s each).
        holder.settimeout(30)
        hello(holder)
        holder.sendall(message(CMD_ALLOC_BUFFER, struct.pack("<IQ", before["index"], 256 * MIB)))
        ptr, size = struct.unpack("<QQ", answer(holder))  # rpc_msg_alloc_buffer_rsp
        assert ptr and size >= 256 * MIB
        holder.sendall(message(CMD_BUFFER_CLEAR, struct.pack("<QB", ptr, 1)))  # touches every page
        last_sent = time.monotonic()
        holder.sendall(message(CMD_GET_DEVICE_MEMORY, struct.pack("<I", before["index"])))
        answer(holder)  # the clear is done
        held = cpu(status(port))["held_bytes"]
        closed_after_s(holder, 30)
        cut_after_s = time.monotonic() - last_sent
        for sock in (nothing, half_hello, half_command):
            closed_after_s(sock, 30)
        out = rpc_client(port, timeout_s=30)
        after = status(port)
        assert proc.poll() is None
    assert held - before["held_bytes"] >= 256 * MIB
    assert cpu(after)["held_bytes"] - before["held_bytes"] < 64 * MIB  # the cut client's buffer is freed
    assert cut_after_s >= 1.9  # never before the idle bound (the kernel counts it in jiffies, 4 ms at HZ=250)
    assert out["devices"]
    reasons = {c["peer"]: c["reason"] for c in after["connection"]["recent_cuts"]}
    peer = {s: "127.0.0.1:%d" % s.getsockname()[1] for s in (nothing, half_hello, holder, half_command)}
    assert after["connection"]["cut_connections"] == 4
    assert "no HELLO within 1 s" in reasons[peer[nothing]] and "no HELLO" in reasons[peer[half_hello]]
    for sock in (holder, half_command):  # cut by the idle bound, never before it (how late depends on the load)
        idle_s = re.search(r"idle for ([0-9.]+) s \(--idle-timeout-s 2\)", reasons[peer[sock]])
        assert idle_s and float(idle_s.group(1)) >= 2, reasons[peer[sock]]
    for sock in (nothing, half_hello, holder, half_command):
        sock.close()


def test_a_client_that_keeps_talking_is_never_cut() -> None:
    """A real ggml-rpc client holding its connection (a backend open on the worker's device, as a loaded model's
    buffers hold it) and reading the device's memory every 0.5 s for over twice the idle bound: never cut (a
    cut would abort it: ggml-rpc's client has no other error path); ``/status`` shows it served, not idle."""
    with worker("--hello-timeout-s", "1", "--idle-timeout-s", "3") as (port, proc):
        child = subprocess.Popen([sys.executable, "-c", CLIENT, f"127.0.0.1:{port}", "8", "0.5"], cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            seen = []
            while child.poll() is None:
                served = status(port)["connection"]["served"]
                if served:
                    seen.append(served)
                time.sleep(0.5)
            out, err = child.communicate(timeout=30)
        finally:
            child.kill()
            child.wait()
        conn = status(port)["connection"]
        assert proc.poll() is None
    assert child.returncode == 0, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["queries"] >= 12
    assert conn["cut_connections"] == 0
    assert any(s["hello"] and s["connected_s"] >= 6 for s in seen)  # one connection, held throughout
    assert all(s["idle_s"] < 3 for s in seen)


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def test_status_holds_no_thread_per_connection_and_answers_past_idle_ones() -> None:
    """300 connections to ``/status`` that send nothing: the worker's threads stay as they were (one thread per
    connection before: 303), at most ``STATUS_MAX_CONNECTIONS`` stay open (a new one closes the oldest idle one), a
    new client is answered at once, and an idle connection is closed after ``--status-timeout-s``."""
    from service.rpc.worker import STATUS_MAX_CONNECTIONS

    with worker("--status-timeout-s", "1") as (port, proc):
        threads, fds = _threads(proc.pid), len(os.listdir(f"/proc/{proc.pid}/fd"))
        idle = [socket.create_connection(("127.0.0.1", port + 1)) for _ in range(300)]
        try:
            time.sleep(0.3)
            threads_during, fds_during = _threads(proc.pid), len(os.listdir(f"/proc/{proc.pid}/fd"))
            st = status(port)
            evicted_s = closed_after_s(idle[0], 5)
            timed_out_s = closed_after_s(idle[-1], 10)
        finally:
            for s in idle:
                s.close()
        assert proc.poll() is None
    assert threads_during <= threads + 1, (threads, threads_during)
    assert fds_during - fds <= STATUS_MAX_CONNECTIONS + 1, (fds, fds_during)
    assert st["devices"]
    assert evicted_s < 5 and timed_out_s < 10


def test_the_cut_rule() -> None:
    """The rule the guard applies at each look: data waiting unread is never idle (the server is busy, with a
    graph, and will read it), before its HELLO only the HELLO bound counts, 0 turns a bound off."""
    from service.rpc.worker import cut_reason

    def rule(**kw: Any) -> str | None:
        base: dict[str, Any] = {"connected_s": 0.0, "idle_s": 0.0, "answered": True, "unread_bytes": 0,
                                "hello_timeout_s": 10.0, "idle_timeout_s": 120.0}
        return cut_reason(**{**base, **kw})

    assert rule(connected_s=9.9, idle_s=9.9, answered=False) is None
    assert rule(connected_s=10, idle_s=10, answered=False) == "no HELLO within 10 s"
    assert rule(connected_s=600, idle_s=600, answered=False, unread_bytes=1) is None
    assert rule(connected_s=600, idle_s=119.9) is None
    assert rule(connected_s=600, idle_s=120) == "idle for 120.0 s (--idle-timeout-s 120)"
    assert rule(connected_s=600, idle_s=600, unread_bytes=9) is None
    assert rule(connected_s=600, idle_s=600, idle_timeout_s=0) is None
    assert rule(connected_s=600, idle_s=600, answered=False, hello_timeout_s=0, idle_timeout_s=0) is None
    # Without a HELLO bound, the idle bound counts from the start.
    assert rule(connected_s=130, idle_s=130, answered=False, hello_timeout_s=0) is not None
