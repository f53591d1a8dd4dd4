"""The server's side of the workers: their devices as the planner sees them, and their registration in the
process that loads a model over them.

``worker_devices`` reads each worker's ``GET /status`` (``service.rpc.worker``) into ``Device`` values of kind
``rpc``, named as llama.cpp names their buffers (``RPC<i>[host:port]``: the device's index on its worker, then the
endpoint) and indexed in the order llama.cpp lists them: the workers' devices first, in the order they are
registered, before any local card. A worker that does not answer, answers in another protocol, or already serves
a client is left out, with the reason: registering it would abort (ggml-rpc's ``GGML_ABORT`` on a failed
connection) or wait for the other client to leave.

``register_workers`` runs in the runner's and the dry run's child processes only, never in the server: once a
process has registered a worker, a worker that dies aborts that process (ggml-rpc has no other error path), and
the service's runner-crash path takes it from there.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from sizing.plan import Device
from sizing.units import MIB

if TYPE_CHECKING:
    from sizing.plan import Plan

from ..engine.params import rpc_endpoints
from ..engine.rpc import parse_endpoint
from .worker import PROTOCOL


@dataclass(frozen=True)
class Absent:
    """A worker named in the settings that the plan cannot use now, and why."""

    endpoint: str
    why: str

    def __str__(self) -> str:
        return f"{self.endpoint}: {self.why}"


def parse_workers(value: str | None, *, runner_process: bool = True) -> list[str]:
    """``GGUF_RPC_WORKERS`` (comma-separated ``host:port``) as a list, each checked; ValueError naming the variable
    and the bad entry, or, with workers, when models load in the server's own process (``runner_process`` false:
    a worker that dies aborts the process that uses it)."""
    out: list[str] = []
    for item in (value or "").split(","):
        item = item.strip()
        if item:
            try:
                parse_endpoint(item)
            except ValueError as exc:
                raise ValueError(f"GGUF_RPC_WORKERS: {exc}") from None
            if item not in out:
                out.append(item)
    if out and not runner_process:
        raise ValueError("GGUF_RPC_WORKERS needs GGUF_RUNNER_PROCESS=true: a worker that dies aborts the process "
                         "that uses it (ggml-rpc), which must be the model's runner, not the server")
    return out


STATUS_PROBE_S = 2.0
"""How long a worker's ``/status`` may take to answer a check that the worker is there: a healthy one answers in
milliseconds from a thread of its own, whatever its ggml-rpc computes; no answer within this is a host gone, a link
down or a process stopped."""


def status_url(endpoint: str) -> str:
    host, port = parse_endpoint(endpoint)
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port + 1}/status"


def read_status(endpoint: str, timeout_s: float = STATUS_PROBE_S) -> dict[str, object]:
    """A worker's ``/status``; OSError (with the reason) when it does not answer it."""
    try:
        with urllib.request.urlopen(status_url(endpoint), timeout=timeout_s) as r:
            data = json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise OSError(f"no answer at {status_url(endpoint)} ({getattr(exc, 'reason', exc)})") from exc
    if not isinstance(data, dict) or not isinstance(data.get("devices"), list):
        raise OSError(f"{status_url(endpoint)} is not a worker's status")
    return data


def round_trip_s(endpoint: str, timeout_s: float = 2.0, tries: int = 3) -> float:
    """The network's round trip to a worker: the fastest of ``tries`` TCP connections to its status port (a
    connection's handshake is one round trip; nothing of the worker's own time is in it)."""
    host, port = parse_endpoint(endpoint)
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        try:
            socket.create_connection((host, port + 1), timeout=timeout_s).close()
        except OSError:
            continue
        best = min(best, time.perf_counter() - t0)
    return best if best != float("inf") else 0.0


PROBE_BYTES = 4 << 20
"""What ``link_bandwidth`` reads from a worker: a few of gemma-3's 1 MiB of logits a token."""


def link_bandwidth(endpoint: str, timeout_s: float = STATUS_PROBE_S, nbytes: int = PROBE_BYTES) -> float | None:
    """The link's transfer rate from a worker, bytes/s: ``GET /probe?bytes=N`` on its status port, timed from the
    first quarter's arrival to the last byte (past most of TCP's slow start, which a connection of ggml-rpc's has long
    left). None when the worker does not answer it (an older one has no ``/probe``)."""
    host, port = parse_endpoint(endpoint)
    try:
        with socket.create_connection((host, port + 1), timeout=timeout_s) as s:
            s.sendall(f"GET /probe?bytes={nbytes} HTTP/1.0\r\n\r\n".encode())
            buf = b""
            while b"\r\n\r\n" not in buf:
                chunk = s.recv(65536)
                if not chunk:
                    return None
                buf += chunk
            head, body = buf.split(b"\r\n\r\n", 1)
            if not head.startswith(b"HTTP/1.0 200"):
                return None
            got, mark = len(body), None
            while got < nbytes:
                chunk = s.recv(1 << 20)
                if not chunk:
                    return None
                got += len(chunk)
                if mark is None and got >= nbytes // 4:
                    mark = (time.perf_counter(), got)
            end = time.perf_counter()
    except OSError:
        return None
    if mark is None or end <= mark[0]:
        return None
    return (got - mark[1]) / (end - mark[0])


def worker_devices(endpoints: Sequence[str], timeout_s: float = 2.0, *, measure_links: bool = True
                   ) -> tuple[list[Device], list[Absent]]:
    """The workers' devices as llama.cpp will list them, and the workers left out, with why (one that serves a
    client now is: ggml-rpc serves one at a time, and a model of this server's on it is that client). With
    ``measure_links`` each worker's link is timed too: its round trip and transfer rate (the speed model's)."""
    devices: list[Device] = []
    absent: list[Absent] = []
    for ep in endpoints:
        try:
            st = read_status(ep, timeout_s)
        except OSError as exc:
            absent.append(Absent(ep, str(exc)))
            continue
        if st.get("protocol") != PROTOCOL:
            absent.append(Absent(ep, f"ggml-rpc protocol {st.get('protocol')}, this build speaks {PROTOCOL}"))
            continue
        if st.get("clients"):
            absent.append(Absent(ep, "serves a client now (a model loaded on it; a ggml-rpc worker serves one at a "
                                     "time)"))
            continue
        rtt = round_trip_s(ep, timeout_s) if measure_links else 0.0
        # The faster of two reads: a loaded machine only ever slows one down.
        rates = [r for r in (link_bandwidth(ep, timeout_s) for _ in range(2 if measure_links else 0)) if r]
        rate = max(rates) if rates else None
        listed = st["devices"]
        rows = [d for d in listed if isinstance(d, dict)] if isinstance(listed, list) else []
        for row in rows:
            i = int(row.get("index", 0))
            devices.append(Device(index=len(devices), name=f"RPC{i}[{ep}]", kind="rpc", endpoint=ep,
                                  free_bytes=max(0, int(row.get("free_bytes", 0))),
                                  total_bytes=max(0, int(row.get("total_bytes", 0))),
                                  remote_kind=str(row.get("kind", "cpu")), link_latency_s=rtt,
                                  link_bandwidth_bytes_per_s=rate,
                                  bandwidth_bytes_per_s=_rate(row, "bandwidth_bytes_per_s"),
                                  cpu_threads=int(row["threads"]) if isinstance(row.get("threads"), int) else 0,
                                  cpu_flops_per_core=_rate(row, "decode_flops_per_core")))
    return devices, absent


def _rate(row: dict[str, object], key: str) -> float | None:
    """A speed a worker's ``/status`` row gives (a positive, finite number), else None: not reported, and the speed
    model falls back to its own figure (a negative or infinite one would make a share of a token cost nothing)."""
    v = row.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
        return None
    return float(v)


def plan_workers_ready(plan: "Plan") -> str | None:
    """Whether the workers a plan uses answer and report the memory it puts on each of their devices free again
    (after a worker died its memory counts only once it says so); None: they do, else why not."""
    est = plan.estimate
    need = {d.device: d.total_bytes for d in est.gpus} if est is not None else {}
    for ep in rpc_endpoints(plan.gpus):
        devices, absent = worker_devices([ep], measure_links=False)
        if absent:
            return str(absent[0])
        for dev in devices:
            if need.get(dev.label, 0) > dev.free_bytes:
                return (f"{dev.label} reports {dev.free_bytes / MIB:.0f} MiB free, the plan puts "
                        f"{need[dev.label] / MIB:.0f} MiB there")
    return None


def silent_worker(endpoints: Sequence[str], timeout_s: float = STATUS_PROBE_S) -> str | None:
    """The first of these workers whose ``/status`` does not answer within ``timeout_s``, named with why; None when
    every one answers (busy or not: only whether its host and process are there)."""
    for ep in endpoints:
        try:
            read_status(ep, timeout_s)
        except OSError as exc:
            return f"its worker {ep} does not answer: {exc}"
    return None
