"""The ``Device`` value: a memory pool a plan can place bytes on (a GPU or host memory).

Pure: the adapters that read NVML, declared inventories and /proc/meminfo into
these values live in ``sizing.probe.devices``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..units import MIB, gpu_label

DeviceKind = Literal["gpu", "host", "rpc"]


@dataclass(frozen=True)
class Device:
    """A memory pool a plan can place bytes on."""

    index: int
    name: str
    free_bytes: int
    total_bytes: int
    kind: DeviceKind = "gpu"
    bandwidth_bytes_per_s: float | None = None
    endpoint: str | None = None
    """A worker's device (``kind`` ``rpc``): the worker's ``host:port``; ``index`` is llama.cpp's place for it among
    the workers' devices (they come before the local cards), ``name`` its buffer name (``RPC0[host:port]``)."""
    remote_kind: str = ""
    """A worker's device: what it is on its machine (``cpu``, ``gpu``), as its ``/status`` says."""
    link_latency_s: float = 0.0
    """A worker's device: the network's round trip to its worker (``service.rpc.client.round_trip_s``); a decoded
    token waits for about two per worker it crosses (the activations in, the graph's result out), and for
    ``sizing.plan.speed.RPC_TOKEN_OVERHEAD_S``, on top of the memory it reads."""
    cpu_threads: int = 0
    """A worker's CPU device: the threads its graphs run on (its ``/status``); its share of a token is computed at
    the CPU's speed per thread, as the host's is (0: not reported, only its memory bandwidth counts)."""

    @property
    def free_mib(self) -> float:
        return self.free_bytes / MIB

    @property
    def total_mib(self) -> float:
        return self.total_bytes / MIB

    @property
    def label(self) -> str:
        """llama.cpp's backend name for the device (CUDA0, ..., a worker's ``RPC0[host:port]``) or ``CPU`` for host
        memory."""
        if self.kind == "rpc":
            return self.name
        return "CPU" if self.kind == "host" else gpu_label(self.index)
