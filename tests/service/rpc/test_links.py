"""A link no one answers on: ggml-rpc reads and writes with no timeout, so a worker host that vanished (no FIN, no
RST) kept its client waiting for ever. Each connection to a worker gets TCP keepalive and a user timeout
(``service.engine.rpc.hold_link``), set from outside ggml-rpc on its own sockets in a real ggml-rpc client (a child
process); the worker sets them on the connection it serves; ``WorkerWatch`` tells which worker is missing, since
when. The namespaced tests (``test_netns.py``) pull real links; these check the parts where no namespace is needed."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from typing import Any

import httpx

from service.engine.rpc import LINK_TIMEOUT_S, hold_link
from service.rpc.health import WorkerWatch
from service.testing.ports import worker_ports
from service.testing.rpc import worker_process
from tests.conftest import ROOT


def options(sock: socket.socket) -> dict[str, int]:
    return {"keepalive": sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
            "idle_s": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
            "interval_s": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
            "probes": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
            "user_timeout_ms": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)}


def test_hold_link_bounds_a_silent_peer_by_keepalive_and_the_user_timeout() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server, \
            socket.create_connection(server.getsockname()) as client:
        assert options(client)["user_timeout_ms"] == 0 and options(client)["keepalive"] == 0  # the kernel's default
        hold_link(client, 10.0)
        # Probes after 2 s idle, a second apart; unanswered for 10 s in all (probes included), the kernel drops it.
        assert options(client) == {"keepalive": 1, "idle_s": 2, "interval_s": 1, "probes": 9, "user_timeout_ms": 10000}


HOLDER = r"""
# python -c HOLDER ENDPOINT: register the worker, hold a backend (its connection stays open, as a loaded model's
# buffers keep it), wait past the link thread's look, print the options of every connection to the worker.
import ctypes, json, socket, sys, time
from service.engine.rpc import LINK_SCAN_S, borrow_socket, own_sockets, register_workers, rpc_library
ep = sys.argv[1]
host, port = ep.rsplit(":", 1)
names = register_workers([ep])
lib = rpc_library()
g = lib.lib
devs = [g.ggml_backend_dev_get(i) for i in range(g.ggml_backend_dev_count())]
dev = [d for d in devs if lib.device_name(d) == names[-1]][0]
g.ggml_backend_dev_init.restype = ctypes.c_void_p
g.ggml_backend_dev_init.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
backend = g.ggml_backend_dev_init(dev, None)
lib.device_memory(dev)  # a round trip on that connection
time.sleep(3 * LINK_SCAN_S)
seen = []
for inode, fd in own_sockets().items():
    s = borrow_socket(fd, inode)
    if s is None:
        continue
    with s:
        try:
            peer = s.getpeername()
        except OSError:
            continue
        if s.family == socket.AF_INET and peer[1] == int(port):
            seen.append({"keepalive": s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                         "user_timeout_ms": s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)})
print(json.dumps(seen), flush=True)
"""


def test_a_registered_workers_connection_is_held_and_so_is_the_one_the_worker_serves() -> None:
    """ggml-rpc opens its connections itself, with no option: the runner's link thread finds them among its own
    sockets and sets them; the worker's guard sets them on the connection it serves (its peer's host may vanish
    too, and then only they free its buffers before the idle bound)."""
    (port,) = worker_ports(1)
    with worker_process(port, "--link-timeout-s", "7", cwd=str(ROOT)):
        r = subprocess.run([sys.executable, "-c", HOLDER, f"127.0.0.1:{port}"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr[-3000:]
        seen: list[dict[str, Any]] = json.loads(r.stdout.strip().splitlines()[-1])
        assert seen and all(s == {"keepalive": 1, "user_timeout_ms": int(LINK_TIMEOUT_S * 1000)} for s in seen), seen
        conn = httpx.get(f"http://127.0.0.1:{port + 1}/status", timeout=5).json()["connection"]
        assert conn["link_timeout_s"] == 7


def test_the_worker_watch_names_a_missing_worker_since_its_first_silent_check() -> None:
    now = [1000.0]
    answers: dict[str, Any] = {"a:1": {"clients": 1}, "b:2": OSError("no answer at http://b:3/status (timed out)")}

    def read(ep: str, timeout_s: float) -> dict[str, object]:
        got = answers[ep]
        if isinstance(got, OSError):
            raise got
        return got  # type: ignore[no-any-return]

    watch = WorkerWatch(["a:1", "b:2"], read=read, clock=lambda: now[0])
    assert watch.json() == [{"endpoint": "a:1", "state": "unknown"}, {"endpoint": "b:2", "state": "unknown"}]
    watch.check()
    now[0] = 1005.0
    watch.check()  # still missing: since its first silent check
    now[0] = 1007.0
    assert watch.json() == [
        {"endpoint": "a:1", "state": "up", "since_unix_s": 1000.0, "for_s": 7.0, "serving": True},
        {"endpoint": "b:2", "state": "missing", "since_unix_s": 1000.0, "for_s": 7.0,
         "why": "no answer at http://b:3/status (timed out)"}]
    answers["b:2"] = {"clients": 0}
    watch.check()
    assert [h.endpoint for h in watch.missing()] == []
    assert watch.json()[1] == {"endpoint": "b:2", "state": "up", "since_unix_s": 1007.0, "for_s": 0.0,
                               "serving": False}
