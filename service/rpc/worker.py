"""``python -m service worker``: this machine's devices for a model planned over several machines.

Two listeners. ggml-rpc's server (``ggml_backend_rpc_start_server`` of the llama.cpp that llama-cpp-python
vendors, protocol 7.0.0) on ``--listen``: it serves the devices to one client at a time, which sends it
tensors and graphs. Beside it, on ``--status-port`` (the RPC port + 1 unless told), ``GET /status``: the
devices with the memory they really have free. ggml-rpc reports a CPU device's whole RAM as free, whatever
else runs there (llama.cpp#21801); here the CPU device's free memory is MemAvailable, or ``--memory-mib`` less
what this process holds beyond its start when a budget is set; a card's is what its backend reports
(``cudaMemGetInfo``). The planner trusts this figure, never ggml-rpc's.

ggml-rpc has no authentication and no encryption: anyone who reaches the port can run graphs on the devices
and read their memory. The worker binds loopback unless ``--allow-public`` says otherwise, and says why when
it refuses.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from sizing.probe import host_memory, measure_host_bandwidth

from ..engine.rpc import parse_endpoint, RpcLibrary, rpc_library

log = logging.getLogger("service.rpc.worker")

PROTOCOL = "7.0.0"
"""ggml-rpc's protocol version in the vendored llama.cpp (``RPC_PROTO_*_VERSION`` of ggml-rpc.h)."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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


class Worker:
    """The RPC server over this machine's devices, and the figures ``/status`` reports."""

    def __init__(self, lib: RpcLibrary, endpoint: str, *, budget_bytes: int | None, threads: int,
                 cache_dir: Path | None) -> None:
        self.lib, self.endpoint, self.budget_bytes, self.threads = lib, endpoint, budget_bytes, threads
        self.cache_dir = cache_dir
        self.devices = lib.serving_devices()
        self.bandwidth = measure_host_bandwidth()
        """This machine's memory read speed (bytes/s), measured once at start: the speed model's figure for its CPU."""
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
            row["free_bytes"] = free
            out.append(row)
        return {"endpoint": self.endpoint, "protocol": PROTOCOL, "clients": rpc_clients(parse_endpoint(self.endpoint)[1]),
                "devices": out}


def _status_handler(worker: Worker) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?")[0] != "/status":
                self.send_error(404)
                return
            body = json.dumps(worker.status()).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


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
    if args.cache_dir is not None:
        args.cache_dir.mkdir(parents=True, exist_ok=True)
    lib = rpc_library()
    if lib is None:
        sys.stderr.write("gguf-worker: this llama-cpp-python was built without ggml-rpc (make setup builds it with "
                         "GGML_RPC=ON)\n")
        return 2
    budget = int(args.memory_mib * 1024 * 1024) if args.memory_mib is not None else None
    worker = Worker(lib, args.listen, budget_bytes=budget, threads=args.threads, cache_dir=args.cache_dir)
    status = ThreadingHTTPServer((host, args.status_port or port + 1), _status_handler(worker))
    # As PID 1 in a container SIGTERM has no default action: stop at once (ggml-rpc holds nothing to save).
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    worker.thread.start()
    log.info("ggml-rpc on %s, /status on %s:%d, devices: %s", args.listen, host, status.server_address[1],
             ", ".join(lib.device_name(d) for d in worker.devices))
    try:
        status.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0

