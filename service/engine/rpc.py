"""ggml-rpc through ctypes: llama-cpp-python binds none of it, and its ``rpc_servers`` option does nothing since
llama.cpp#11262. The calls mirror llama.cpp's own (common/arg.cpp ``add_rpc_devices``; tools/rpc): the RPC
backend's registry by name, its functions by ``ggml_backend_reg_get_proc_address``, a server's devices
registered with ``ggml_backend_register`` so that a model loaded afterwards in the same process sees them, listed
before the local cards (``service.engine.params.device_params``), each named ``RPC<i>[host:port]``.

Here, in the engine, because the runner's and the dry run's child processes register the workers of their plan
(``register_workers``) before they load it; ``service.rpc`` (the worker, the server's view of the workers) builds
on it."""

from __future__ import annotations

import ctypes
import functools
import socket
import threading
from pathlib import Path
from typing import Any, Sequence

from ..errors import EngineFailure
from .native import GGML_BACKEND_DEVICE_TYPES, libggml

_DEV_P = ctypes.c_void_p


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


def register_workers(endpoints: Sequence[str], timeout_s: float = 5.0) -> list[str]:
    """Register the workers' devices in this (child) process, in order; their llama.cpp names. ``EngineFailure``
    when ggml-rpc is not built in or a worker's port does not accept a connection (checked first: ggml-rpc
    aborts the process on a failed one)."""
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
    return names
