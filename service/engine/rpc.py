"""ggml-rpc through ctypes: llama-cpp-python binds none of it, and its ``rpc_servers`` option does nothing since
llama.cpp#11262. The calls mirror llama.cpp's own (common/arg.cpp ``add_rpc_devices``; tools/rpc): the RPC
backend's registry by name, its functions by ``ggml_backend_reg_get_proc_address``, a server's devices
registered with ``ggml_backend_register`` so that a model loaded afterwards in the same process sees them, listed
before the local cards (``service.engine.params.device_params``), each named ``RPC<i>[host:port]``.

Here, in the engine, because the runner's and the dry run's child processes register the workers of their plan
(``register_workers``) before they load it; ``service.rpc`` (the worker, the server's view of the workers) builds
on it."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from ..errors import EngineFailure
from .native import GGML_BACKEND_DEVICE_TYPES, libggml

_DEV_P = ctypes.c_void_p


LINK_TIMEOUT_S = 10.0
"""How long a ggml-rpc connection may go without a sign of life from its peer's host before the kernel drops it
(``hold_link``). ggml-rpc reads and writes with no timeout (ggml-rpc.cpp ``socket_t::recv_data``): a host that
vanished (power, cable: no FIN, no RST) would keep a runner waiting for ever; once dropped, ggml-rpc's failed call
aborts the process (``RPC_STATUS_ASSERT``), and the runner's death path answers its requests."""


def hold_link(sock: socket.socket, timeout_s: float = LINK_TIMEOUT_S) -> None:
    """Bound how long ``sock`` waits on a silent peer: TCP keepalive probes once it has been idle for a fifth of
    ``timeout_s`` (a second apart), and ``TCP_USER_TIMEOUT``, which drops the connection when what it sent, a
    probe included, stays unacknowledged for ``timeout_s`` (tcp(7); with keepalive on, the user timeout decides
    when unanswered probes end it). A peer that is slow but whose host is up acknowledges both: only a host
    that is gone, or a link that is down, trips it."""
    idle_s = max(1, int(timeout_s / 5))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, max(1, int(timeout_s) - idle_s + 1))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, int(timeout_s * 1000)))


def own_sockets() -> dict[int, int]:
    """This process's sockets: inode -> file descriptor (``/proc/self/fd``'s links read ``socket:[inode]``)."""
    out: dict[int, int] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out[int(target[8:-1])] = int(name)
    return out


def borrow_socket(fd: int, inode: int) -> socket.socket | None:
    """A socket object over a duplicate of ``fd``, which ggml-rpc owns (it closes ``fd`` itself; closing the
    duplicate leaves it open; options set on it are the socket's); None when ``fd`` is no longer the socket
    ``inode``. Needs ``socket.getdefaulttimeout()`` None: a socket object made with a default timeout sets
    O_NONBLOCK on the open file ggml-rpc's descriptor shares, and its blocking calls would fail."""
    if socket.getdefaulttimeout() is not None:
        raise RuntimeError("borrowing ggml-rpc's sockets needs socket.getdefaulttimeout() to be None")
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


def connecting(sock: socket.socket) -> bool:
    """Whether ``sock`` is a TCP connection still waiting for its handshake's answer (``tcpi_state`` SYN_SENT)."""
    try:
        return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] == _TCP_SYN_SENT
    except OSError:
        return False


_TCP_SYN_SENT = 2
"""``TCP_SYN_SENT`` of include/net/tcp_states.h."""

LINK_SCAN_S = 0.5
"""How often ``RpcLibrary.hold_links`` looks for new connections to workers (a read of ``/proc/self/fd``)."""


class RpcLibrary:
    """libggml with its RPC backend."""

    def __init__(self, lib: ctypes.CDLL, reg: int) -> None:
        self.lib, self.reg = lib, reg
        lib.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
        lib.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.ggml_backend_register.restype = None
        lib.ggml_backend_register.argtypes = [ctypes.c_void_p]
        lib.ggml_backend_dev_memory.restype = None
        lib.ggml_backend_dev_memory.argtypes = [_DEV_P, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
        lib.ggml_backend_reg_dev_count.restype = ctypes.c_size_t
        lib.ggml_backend_reg_dev_count.argtypes = [ctypes.c_void_p]
        lib.ggml_backend_reg_dev_get.restype = ctypes.c_void_p
        lib.ggml_backend_reg_dev_get.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self._add_server = self._proc("ggml_backend_rpc_add_server", ctypes.c_void_p, ctypes.c_char_p)
        self._start_server = self._proc("ggml_backend_rpc_start_server", None, ctypes.c_char_p, ctypes.c_char_p,
                                        ctypes.c_size_t, ctypes.c_size_t, ctypes.POINTER(_DEV_P))
        self._added: dict[str, list[int]] = {}
        self._lock = threading.Lock()
        self._links: threading.Thread | None = None
        self._link_timeout_s = LINK_TIMEOUT_S

    def _proc(self, name: str, restype: Any, *argtypes: Any) -> Any:
        addr = self.lib.ggml_backend_reg_get_proc_address(self.reg, name.encode())
        if not addr:
            raise OSError(f"ggml's RPC backend has no {name}")
        return ctypes.CFUNCTYPE(restype, *argtypes)(addr)

    def serving_devices(self) -> list[int]:
        """This machine's devices a worker serves: the cards first, then the CPU (ggml-rpc's own order)."""
        lib = self.lib
        devs = [lib.ggml_backend_dev_get(i) for i in range(lib.ggml_backend_dev_count())]
        own = [d for d in devs if self.device_kind(d) != "cpu" and not self.device_name(d).startswith("RPC")]
        return own + [d for d in devs if self.device_kind(d) == "cpu"][:1]

    def device_name(self, dev: int) -> str:
        return str(self.lib.ggml_backend_dev_name(dev).decode())

    def device_kind(self, dev: int) -> str:
        return GGML_BACKEND_DEVICE_TYPES.get(int(self.lib.ggml_backend_dev_type(dev)), "other")

    def device_memory(self, dev: int) -> tuple[int, int]:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self.lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        return int(free.value), int(total.value)

    def start_server(self, endpoint: str, cache_dir: Path | None, threads: int, devices: list[int]) -> None:
        arr = (_DEV_P * len(devices))(*devices)
        self._start_server(endpoint.encode(), str(cache_dir).encode() if cache_dir else None, threads, len(devices),
                           arr)

    def add_server(self, endpoint: str) -> list[str]:
        """Register a worker's devices in this process (once per endpoint, as ggml-rpc itself keeps them): the
        names llama.cpp gives them (``RPC<n>``). OSError when the worker cannot be reached."""
        with self._lock:
            if endpoint not in self._added:
                reg = self._add_server(endpoint.encode())
                if not reg:
                    raise OSError(f"the worker at {endpoint} has no device or could not be reached")
                self.lib.ggml_backend_register(reg)
                self._added[endpoint] = [self.lib.ggml_backend_reg_dev_get(reg, i)
                                         for i in range(self.lib.ggml_backend_reg_dev_count(reg))]
            return [self.device_name(d) for d in self._added[endpoint]]


    def hold_links(self, timeout_s: float = LINK_TIMEOUT_S) -> None:
        """Start, once per process, the thread that gives every connection to a registered worker ``hold_link``.

        ggml-rpc connects without any option (``socket_t::connect`` sets only TCP_NODELAY) and keeps a
        connection only while something holds its dispatcher (``get_dispatcher`` keeps a weak pointer: the
        registration's own connection closes at once, a loaded model's buffers keep theirs), so there is no
        one moment to set them: the thread looks at this process's sockets every ``LINK_SCAN_S`` and sets them
        on each new connection to a worker, one already blocked in a read included (the options apply from
        then on)."""
        with self._lock:
            self._link_timeout_s = timeout_s
            if self._links is not None:
                return
            self._links = threading.Thread(target=self._hold_links, name="rpc-links", daemon=True)
            self._links.start()

    def _hold_links(self) -> None:
        held: set[int] = set()
        others: set[int] = set()
        peers: dict[str, set[tuple[str, int]]] = {}
        while True:
            with self._lock:
                endpoints, timeout_s = list(self._added), self._link_timeout_s
            for ep in endpoints:
                if ep not in peers:
                    host, port = parse_endpoint(ep)
                    try:
                        peers[ep] = {(str(i[4][0]), port) for i in socket.getaddrinfo(host, port,
                                                                                       type=socket.SOCK_STREAM)}
                    except OSError:
                        continue
            wanted = set().union(*peers.values()) if peers else set()
            sockets = own_sockets()
            held &= set(sockets)
            others &= set(sockets)
            for inode, fd in sockets.items():
                if inode in held or inode in others:
                    continue
                sock = borrow_socket(fd, inode)
                if sock is None:
                    continue
                with sock:
                    try:
                        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                            others.add(inode)
                            continue
                        peer = sock.getpeername()
                    except OSError:  # not connected: a listener, or a connection being made
                        if connecting(sock):
                            # Its peer is not known yet, but these processes connect to nothing but workers: bound
                            # its handshake (the kernel retries a SYN for over two minutes; TCP_USER_TIMEOUT
                            # bounds that too), and look again once it is connected.
                            with contextlib.suppress(OSError):
                                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT,
                                                max(1, int(timeout_s * 1000)))
                        continue
                    if (str(peer[0]), int(peer[1])) in wanted:
                        try:
                            hold_link(sock, timeout_s)
                        except OSError:
                            continue
                        held.add(inode)
                    else:
                        others.add(inode)
            time.sleep(LINK_SCAN_S)

    def ping(self, endpoint: str) -> None:
        """One round trip to a registered worker over the connection its buffers use (``RPC_CMD_GET_DEVICE_MEMORY``
        through ggml-rpc's per-endpoint dispatcher, which serializes it with the model's own commands): a loaded
        model's keepalive against the worker's idle bound, and a probe that never returns when the worker stalls."""
        with self._lock:
            devs = self._added.get(endpoint)
        if devs:
            self.device_memory(devs[0])


@functools.lru_cache(maxsize=1)
def rpc_library() -> RpcLibrary | None:
    """The RPC backend of the libggml llama-cpp-python loads; None when it was built without GGML_RPC."""
    import llama_cpp

    lib = libggml()
    if lib is None or not llama_cpp.llama_supports_rpc():
        return None
    lib.ggml_backend_reg_by_name.restype = ctypes.c_void_p
    lib.ggml_backend_reg_by_name.argtypes = [ctypes.c_char_p]
    reg = lib.ggml_backend_reg_by_name(b"RPC")
    return RpcLibrary(lib, reg) if reg else None


def parse_endpoint(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (an IPv6 host in brackets) into its parts; ValueError when malformed."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{value!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def register_workers(endpoints: Sequence[str], timeout_s: float = 5.0,
                     link_timeout_s: float = LINK_TIMEOUT_S) -> list[str]:
    """Register the workers' devices in this (child) process, in order; their llama.cpp names. ``EngineFailure``
    when ggml-rpc is not built in or a worker's port does not accept a connection (checked first: ggml-rpc
    aborts the process on a failed one). Each worker's connection then gets ``hold_link``: a worker whose host
    vanishes later ends this process within ``link_timeout_s`` instead of never (``RpcLibrary.hold_links``)."""
    lib = rpc_library()
    if lib is None:
        raise EngineFailure("this llama-cpp-python was built without ggml-rpc: the plan's workers cannot be used")
    names: list[str] = []
    for ep in endpoints:
        host, port = parse_endpoint(ep)
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
        except OSError as exc:
            raise EngineFailure(f"the worker at {ep} cannot be reached: {exc}") from exc
        try:
            names.extend(lib.add_server(ep))
        except OSError as exc:
            raise EngineFailure(str(exc)) from exc
    lib.hold_links(link_timeout_s)
    return names
