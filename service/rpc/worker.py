"""``python -m service worker``: this machine's devices for a model planned over several machines.

Two listeners. ggml-rpc's server (``ggml_backend_rpc_start_server`` of the llama.cpp that llama-cpp-python
vendors, protocol 7.0.0) on ``--listen``: it serves the devices to one client at a time, which sends it
tensors and graphs. Beside it, on ``--status-port`` (the RPC port + 1 unless told), ``GET /status``: the
devices with the memory they really have free. ggml-rpc reports a CPU device's whole RAM as free, whatever
else runs there (llama.cpp#21801); here the CPU device's free memory is MemAvailable, or ``--memory-mib`` less
what this process holds beyond its start when a budget is set; a card's is what its backend reports
(``cudaMemGetInfo``). The planner trusts this figure, never ggml-rpc's.

ggml-rpc accepts one client and serves it until it leaves, reading with no timeout (ggml-rpc.cpp
``ggml_backend_rpc_start_server``, ``rpc_serve_client``): a client that connects and sends nothing, or half a
message, would keep every other client out for good. So the worker cuts the connection it serves when its HELLO
does not come within ``--hello-timeout-s`` or the client then sends nothing for ``--idle-timeout-s`` while the
server waits for it; a model's runner keeps its connection alive with a cheap command well within that.

ggml-rpc has no authentication and no encryption: anyone who reaches the port can run graphs on the devices
and read their memory. The worker binds loopback unless ``--allow-public`` says otherwise, and says why when
it refuses.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import signal
import socket
import struct
import sys
import termios
import threading
import time
from pathlib import Path
from typing import Any

from sizing.probe import host_memory, measure_host_bandwidth

from ..engine.rpc import LINK_TIMEOUT_S, hold_link, parse_endpoint, RpcLibrary, rpc_library
from ..hosts import is_loopback

log = logging.getLogger("service.rpc.worker")

PROTOCOL = "7.0.0"
"""ggml-rpc's protocol version in the vendored llama.cpp (``RPC_PROTO_*_VERSION`` of ggml-rpc.h)."""

HELLO_TIMEOUT_S = 10.0
"""How long a new connection may take to send its HELLO: ggml-rpc's client sends it as soon as it connects
(``rpc_dispatcher::start``, ``negotiate_hello``), so only a client that does not speak ggml-rpc takes longer."""
IDLE_TIMEOUT_S = 120.0
"""How long the served client may send nothing while the server waits for it. A loaded model's runner sends
nothing while no request comes, so it sends a cheap command (its workers' memory) at a shorter interval."""
GUARD_POLL_S = 0.25
"""How often the guard looks at the served connection: a few system calls each time."""
STATUS_MAX_CONNECTIONS = 64
"""``/status`` connections open at once; a new one beyond it closes the oldest that has not sent its request."""
STATUS_READ_TIMEOUT_S = 10.0
"""How long a ``/status`` connection may take to send its request and read the answer."""
STATUS_MAX_HEAD_BYTES = 16 * 1024
"""The longest request head ``/status`` reads (the request line and headers)."""
PROBE_MAX_BYTES = 8 << 20
"""The most ``GET /probe`` sends (the server times the link with a few MiB)."""


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rpc_clients(port: int, tables: tuple[str, ...] = ("/proc/net/tcp", "/proc/net/tcp6")) -> int:
    """Connections established to ``port`` on this machine (the kernel's socket tables): ggml-rpc serves one
    client at a time and tells nobody whom, so ``/status`` says how many are connected from these."""
    n = 0
    for table in tables:
        try:
            with open(table, encoding="ascii") as f:
                next(f, None)
                for line in f:
                    parts = line.split()
                    # sl local_address rem_address st ...: st 01 is ESTABLISHED; the port is hex after the colon
                    if len(parts) > 3 and parts[3] == "01" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                        n += 1
        except (OSError, ValueError):
            continue
    return n


@dataclasses.dataclass(frozen=True)
class TcpInfo:
    """What the kernel knows of a TCP connection (``struct tcp_info``, include/uapi/linux/tcp.h: the offsets of
    its layout, which only grows at its end)."""

    last_data_recv_ms: int
    """Since the peer's last data arrived (or the connection was established, before any)."""
    data_segs_out: int
    """Segments with data this side sent: above 0 once ggml-rpc answered the HELLO (Linux 4.6 and later; taken
    as answered before that, when only the idle bound applies)."""

    @classmethod
    def of(cls, sock: socket.socket) -> TcpInfo:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        (last_data_recv_ms,) = struct.unpack_from("=I", raw, 52)  # tcpi_last_data_recv
        (data_segs_out,) = struct.unpack_from("=I", raw, 156) if len(raw) >= 160 else (1,)  # tcpi_data_segs_out
        return cls(last_data_recv_ms, data_segs_out)


def _unread_bytes(sock: socket.socket) -> int:
    """Bytes arrived that the server has not read yet (FIONREAD, SIOCINQ for TCP)."""
    return int(struct.unpack("=i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0])


def _address(addr: Any) -> str:
    host, port = addr[0], addr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def cut_reason(*, connected_s: float, idle_s: float, answered: bool, unread_bytes: int, hello_timeout_s: float,
               idle_timeout_s: float) -> str | None:
    """Why the served connection is to be cut now, or None. ``connected_s``: since the guard first saw it
    accepted; ``idle_s``: since its last data arrived (never more than ``connected_s``: a client kept waiting in
    the accept queue sent its HELLO long before it was accepted); ``answered``: ggml-rpc answered its HELLO.
    Never while data waits unread: the server is busy (computing a graph) and will read it."""
    if unread_bytes > 0:
        return None
    if not answered and hello_timeout_s > 0:
        if connected_s >= hello_timeout_s:
            return f"no HELLO within {hello_timeout_s:g} s"
        return None
    if idle_timeout_s > 0 and idle_s >= idle_timeout_s:
        return f"idle for {idle_s:.1f} s (--idle-timeout-s {idle_timeout_s:g})"
    return None


@dataclasses.dataclass(frozen=True)
class Cut:
    peer: str
    reason: str
    at_unix_s: float


@dataclasses.dataclass
class _Served:
    """The guard's record of one accepted connection (by its socket's inode)."""

    fd: int
    peer: str
    seen_at: float
    answered: bool = False
    idle_s: float = 0.0
    cut: bool = False


def _socket_fds() -> dict[int, int]:
    """This process's sockets: inode -> fd (``/proc/self/fd``'s links read ``socket:[inode]``)."""
    out: dict[int, int] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out[int(target[8:-1])] = int(name)
    return out


def _borrow(fd: int, inode: int) -> socket.socket | None:
    """A socket object over a duplicate of ``fd``, which ggml-rpc owns (it closes ``fd`` itself; closing the
    duplicate leaves it open); None when ``fd`` is no longer the socket ``inode``."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        if os.fstat(dup).st_ino != inode:
            os.close(dup)
            return None
        return socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None


class ConnectionGuard:
    """Cuts the connection ggml-rpc serves when its client keeps it without speaking.

    ggml-rpc runs in this process (``Worker._serve``), so its accepted socket is one of this process's file
    descriptors: the one whose local port is the RPC port and that has a peer. The guard reads the kernel's view
    of it (``TCP_INFO``) and, past a bound, ``shutdown``s it: ggml-rpc's blocked ``recv`` returns 0, it drops
    the client (``rpc_server::~rpc_server`` frees the client's buffers), closes the socket and accepts the
    next. It never closes the descriptor, which ggml-rpc owns. Nothing is added to a served command's path."""

    def __init__(self, port: int, *, hello_timeout_s: float, idle_timeout_s: float,
                 link_timeout_s: float = 0.0) -> None:
        """``link_timeout_s``: ``hold_link`` on each accepted connection (0: not), so that a client whose host
        vanished (no FIN, no RST) is dropped by the kernel within it and its buffers freed, even while idle."""
        if socket.getdefaulttimeout() is not None:
            # A socket object made with a default timeout sets O_NONBLOCK on the descriptor's open file, which
            # ggml-rpc's duplicate shares: its blocking recv would fail and drop every client.
            raise RuntimeError("the guard needs socket.getdefaulttimeout() to be None")
        self.port, self.hello_timeout_s, self.idle_timeout_s = port, hello_timeout_s, idle_timeout_s
        self.link_timeout_s = link_timeout_s
        self._served: dict[int, _Served] = {}
        self._others: set[int] = set()
        self._cuts: collections.deque[Cut] = collections.deque(maxlen=10)
        self._cut_count = 0
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="rpc-guard", daemon=True)

    def _run(self) -> None:
        while True:
            try:
                self.check()
            except Exception:  # a bad pass must not end the guard; the next one looks again
                log.exception("the RPC connection guard failed a pass")
            time.sleep(GUARD_POLL_S)

    def _accepted(self, fd: int, inode: int) -> str | None:
        """The peer when ``fd`` is a connection accepted on the RPC port, else None."""
        sock = _borrow(fd, inode)
        if sock is None:
            return None
        with sock:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                return None
            try:
                if sock.getsockname()[1] != self.port:
                    return None
                peer = _address(sock.getpeername())
            except OSError:  # the listening socket has no peer
                return None
            if self.link_timeout_s > 0:
                with contextlib.suppress(OSError):
                    hold_link(sock, self.link_timeout_s)
            return peer

    def check(self) -> None:
        """One look at this process's sockets: the served connection's idle time, cut past its bound."""
        fds = _socket_fds()
        now = time.monotonic()
        with self._lock:
            for gone in set(self._served) - set(fds):
                del self._served[gone]
            self._others &= set(fds)
            for inode, fd in fds.items():
                if inode in self._others or inode in self._served:
                    continue
                peer = self._accepted(fd, inode)
                if peer is None:
                    self._others.add(inode)
                else:
                    self._served[inode] = _Served(fd=fd, peer=peer, seen_at=now)
            served = [(inode, s) for inode, s in self._served.items() if not s.cut]
        for inode, s in served:
            sock = _borrow(s.fd, inode)
            if sock is None:
                continue
            with sock:
                try:
                    info = TcpInfo.of(sock)
                    unread = _unread_bytes(sock)
                except OSError:
                    continue
                connected_s = now - s.seen_at
                s.answered = s.answered or info.data_segs_out > 0
                s.idle_s = min(info.last_data_recv_ms / 1000, connected_s)
                reason = cut_reason(connected_s=connected_s, idle_s=s.idle_s, answered=s.answered,
                                    unread_bytes=unread, hello_timeout_s=self.hello_timeout_s,
                                    idle_timeout_s=self.idle_timeout_s)
                if reason is None:
                    continue
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    continue  # already gone
            s.cut = True
            log.warning("cut the RPC connection from %s: %s", s.peer, reason)
            with self._lock:
                self._cut_count += 1
                self._cuts.append(Cut(s.peer, reason, time.time()))

    def view(self) -> dict[str, Any]:
        """For ``/status``: the bounds, the connection served now (as of the last look) and the cuts."""
        now = time.monotonic()
        with self._lock:
            live = [s for s in self._served.values() if not s.cut]
            served = None
            if live:
                s = max(live, key=lambda x: x.seen_at)
                served = {"peer": s.peer, "connected_s": round(now - s.seen_at, 1), "idle_s": round(s.idle_s, 1),
                          "hello": s.answered}
            return {"hello_timeout_s": self.hello_timeout_s, "idle_timeout_s": self.idle_timeout_s,
                    "link_timeout_s": self.link_timeout_s,
                    "served": served, "cut_connections": self._cut_count,
                    "recent_cuts": [dataclasses.asdict(c) for c in self._cuts]}


class Worker:
    """The RPC server over this machine's devices, and the figures ``/status`` reports."""

    def __init__(self, lib: RpcLibrary, endpoint: str, *, budget_bytes: int | None, threads: int,
                 cache_dir: Path | None, guard: ConnectionGuard | None = None) -> None:
        self.lib, self.endpoint, self.budget_bytes, self.threads = lib, endpoint, budget_bytes, threads
        self.cache_dir, self.guard = cache_dir, guard
        self.devices = lib.serving_devices()
        self.bandwidth = measure_host_bandwidth()
        """This machine's memory read speed (bytes/s), measured once at start: the speed model's figure for its CPU."""
        from service.engine.cpu import host_repack
        from service.engine.cpu_speed import decode_flops_per_core

        self.flops_per_core = decode_flops_per_core(threads, host_repack("auto").on)
        """This machine's decode FLOP/s per thread (``service.engine.cpu_speed``, measured once per machine)."""
        self._rss_at_start = _rss_bytes()
        self.thread = threading.Thread(target=self._serve, name="ggml-rpc", daemon=True)

    def _serve(self) -> None:
        # Blocks for the life of the process: ggml-rpc accepts one client, serves it until it leaves, then the next.
        self.lib.start_server(self.endpoint, self.cache_dir, self.threads, self.devices)
        log.error("ggml-rpc's server returned (it could not bind %s or start a backend)", self.endpoint)
        os._exit(1)

    def status(self) -> dict[str, Any]:
        out = []
        for i, dev in enumerate(self.devices):
            name, kind = self.lib.device_name(dev), self.lib.device_kind(dev)
            free, total = self.lib.device_memory(dev)
            row: dict[str, Any] = {"index": i, "name": name, "kind": kind, "total_bytes": total}
            if kind == "cpu":
                held = max(0, _rss_bytes() - self._rss_at_start)
                free = host_memory().free_bytes  # MemAvailable
                if self.budget_bytes is not None:
                    free = min(free, max(0, self.budget_bytes - held))
                    row["budget_bytes"] = self.budget_bytes
                row["held_bytes"] = held
                row["bandwidth_bytes_per_s"] = self.bandwidth
                row["threads"] = self.threads  # the CPU threads a graph runs on here (--threads)
                if self.flops_per_core:
                    row["decode_flops_per_core"] = self.flops_per_core
            row["free_bytes"] = free
            out.append(row)
        st: dict[str, Any] = {"endpoint": self.endpoint, "protocol": PROTOCOL,
                              "clients": rpc_clients(parse_endpoint(self.endpoint)[1]), "devices": out}
        if self.guard is not None:
            st["connection"] = self.guard.view()
        return st


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large"}


class StatusServer:
    """``GET /status`` on asyncio: a connection holds no thread, at most ``max_connections`` are open (a new one
    beyond them closes the oldest still waiting for its request), and each has ``read_timeout_s`` to send its
    request and read the answer. The one client input parsed here is the request line: a path."""

    def __init__(self, worker: Worker, *, max_connections: int = STATUS_MAX_CONNECTIONS,
                 read_timeout_s: float = STATUS_READ_TIMEOUT_S) -> None:
        self.worker, self.max_connections, self.read_timeout_s = worker, max_connections, read_timeout_s
        self._waiting: dict[asyncio.StreamWriter, None] = {}  # open, request not read yet: oldest first
        self._open = 0

    def _answer(self, head: bytes) -> tuple[int, bytes]:
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return 400, b'{"error": "malformed request line"}'
        if parts[0] != b"GET":
            return 405, b'{"error": "only GET"}'
        path, _, query = parts[1].partition(b"?")
        if path == b"/probe":
            return self._probe(query)
        if path != b"/status":
            return 404, b'{"error": "not found: only /status and /probe"}'
        return 200, json.dumps(self.worker.status()).encode()

    @staticmethod
    def _probe(query: bytes) -> tuple[int, bytes]:
        """``GET /probe?bytes=N``: N bytes (at most ``PROBE_MAX_BYTES``), for the server to time the link's transfer
        rate with (``service.rpc.client.link_bandwidth``): a token's logits cross it every token."""
        fields = dict(kv.partition(b"=")[::2] for kv in query.split(b"&"))
        n = fields.get(b"bytes", b"")
        if not n.isdigit() or not 0 < int(n) <= PROBE_MAX_BYTES:
            return 400, b'{"error": "bytes: 1 to %d"}' % PROBE_MAX_BYTES
        return 200, bytes(int(n))  # zeros: the answer's Content-Type says what they are

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._open >= self.max_connections:
            oldest = next(iter(self._waiting), None)
            if oldest is None:  # all are being answered: this one waits for none of them
                writer.transport.abort()
                return
            del self._waiting[oldest]
            oldest.transport.abort()
        self._open += 1
        self._waiting[writer] = None
        try:
            async with asyncio.timeout(self.read_timeout_s):
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.LimitOverrunError:
                    code, body = 431, b'{"error": "request head too large"}'
                else:
                    code, body = self._answer(head)
                probe = code == 200 and head.split(b" ", 2)[1].startswith(b"/probe")
                self._waiting.pop(writer, None)
                ctype = "application/octet-stream" if probe else "application/json"
                writer.write(f"HTTP/1.0 {code} {_REASONS[code]}\r\nContent-Type: {ctype}\r\n"
                             f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
                await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._open -= 1
            self._waiting.pop(writer, None)
            writer.close()

    async def serve(self, sock: socket.socket) -> None:
        server = await asyncio.start_server(self._connection, sock=sock, limit=STATUS_MAX_HEAD_BYTES)
        async with server:
            await server.serve_forever()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m service worker", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--listen", default="127.0.0.1:50052", help="ggml-rpc's HOST:PORT (default 127.0.0.1:50052)")
    ap.add_argument("--status-port", type=int, default=None, help="/status's port on the same host (default: the "
                    "RPC port + 1)")
    ap.add_argument("--memory-mib", type=float, default=None, help="the most host memory the models placed here may "
                    "hold (default: MemAvailable, as it changes)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads for the graphs run here")
    ap.add_argument("--cache-dir", type=Path, default=None, help="ggml-rpc's tensor cache (its -c): a folder of its "
                    "own; default none")
    ap.add_argument("--allow-public", action="store_true", help="listen on a non-loopback address: ggml-rpc has no "
                    "authentication, so only on a network that only trusted hosts reach")
    ap.add_argument("--hello-timeout-s", type=float, default=HELLO_TIMEOUT_S, help="cut a new RPC connection that "
                    f"has not sent ggml-rpc's HELLO within this (default {HELLO_TIMEOUT_S:g}; 0: never)")
    ap.add_argument("--idle-timeout-s", type=float, default=IDLE_TIMEOUT_S, help="cut the served RPC connection "
                    "when its client sends nothing for this long while the server waits for it (default "
                    f"{IDLE_TIMEOUT_S:g}; 0: never); a loaded model's runner sends a command well within it")
    ap.add_argument("--link-timeout-s", type=float, default=LINK_TIMEOUT_S, help="drop the served RPC connection "
                    "when its client's host stops acknowledging anything (TCP keepalive and user timeout: a host "
                    f"that vanished sends no FIN) for this long, freeing its buffers (default {LINK_TIMEOUT_S:g}; 0: "
                    "never)")
    ap.add_argument("--status-timeout-s", type=float, default=STATUS_READ_TIMEOUT_S, help="how long a /status "
                    f"connection may take to send its request (default {STATUS_READ_TIMEOUT_S:g})")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        host, port = parse_endpoint(args.listen)
    except ValueError as exc:
        sys.stderr.write(f"gguf-worker: --listen {exc}\n")
        return 2
    if not is_loopback(host) and not args.allow_public:
        sys.stderr.write(f"gguf-worker: refusing to listen on {host}: ggml-rpc has no authentication or encryption, "
                         "anyone who reaches the port can run graphs on this machine's devices and read their memory. "
                         "Put the workers on a private network and pass --allow-public to say so.\n")
        return 2
    if min(args.hello_timeout_s, args.idle_timeout_s, args.link_timeout_s) < 0 or args.status_timeout_s <= 0:
        sys.stderr.write("gguf-worker: --hello-timeout-s, --idle-timeout-s and --link-timeout-s take 0 or more seconds, "
                         "--status-timeout-s more than 0\n")
        return 2
    if args.cache_dir is not None:
        args.cache_dir.mkdir(parents=True, exist_ok=True)
    lib = rpc_library()
    if lib is None:
        sys.stderr.write("gguf-worker: this llama-cpp-python was built without ggml-rpc (make setup builds it with "
                         "GGML_RPC=ON)\n")
        return 2
    budget = int(args.memory_mib * 1024 * 1024) if args.memory_mib is not None else None
    guard = ConnectionGuard(port, hello_timeout_s=args.hello_timeout_s, idle_timeout_s=args.idle_timeout_s,
                            link_timeout_s=args.link_timeout_s)
    worker = Worker(lib, args.listen, budget_bytes=budget, threads=args.threads, cache_dir=args.cache_dir,
                    guard=guard)
    status_sock = socket.create_server((host, args.status_port or port + 1),
                                       family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    status = StatusServer(worker, read_timeout_s=args.status_timeout_s)
    # As PID 1 in a container SIGTERM has no default action: stop at once (ggml-rpc holds nothing to save).
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    worker.thread.start()
    if args.hello_timeout_s or args.idle_timeout_s or args.link_timeout_s:
        guard.thread.start()
    log.info("ggml-rpc on %s, /status on %s:%d, devices: %s; a connection is cut without its HELLO in %g s, idle "
             "for %g s, its host silent for %g s (0: never)", args.listen, host, status_sock.getsockname()[1],
             ", ".join(lib.device_name(d) for d in worker.devices), args.hello_timeout_s, args.idle_timeout_s,
             args.link_timeout_s)
    try:
        asyncio.run(status.serve(status_sock))
    except KeyboardInterrupt:
        pass
    return 0
