"""The ``Device`` value: a memory pool a plan can place bytes on (a GPU or host memory).

Pure: the adapters that read NVML, declared inventories and /proc/meminfo into
these values live in ``sizing.probe.devices``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..units import MIB, gpu_label

DeviceKind = Literal["gpu", "host"]


@dataclass(frozen=True)
class Device:
    """A memory pool a plan can place bytes on."""

    index: int
    name: str
    free_bytes: int
    total_bytes: int
    kind: DeviceKind = "gpu"
    bandwidth_bytes_per_s: float | None = None

    @property
    def free_mib(self) -> float:
        return self.free_bytes / MIB

    @property
    def total_mib(self) -> float:
        return self.total_bytes / MIB

    @property
    def label(self) -> str:
        """llama.cpp's backend name for the device (CUDA0, ...) or ``CPU`` for host memory."""
        return "CPU" if self.kind == "host" else gpu_label(self.index)
