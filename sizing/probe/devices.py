"""The device adapters: live NVML, declared inventories and host memory, read into ``Device`` values.

The ``Device`` value itself is pure and lives in ``sizing.plan.device`` (re-exported here for
callers that read both). This is the only module that imports ``pynvml``, and only
inside ``nvml_devices``.
"""

from __future__ import annotations

import json
import os
import re
from typing import Sequence

from ..plan.device import Device, DeviceKind
from ..units import MIB
from ..errors import DeviceError

__all__ = ["MIB", "Device", "DeviceKind", "host_memory", "nvml_devices", "parse_declared", "load_declared", "inventory",
           "measure_host_bandwidth"]


def host_memory(meminfo_path: str = "/proc/meminfo") -> Device:
    """Host memory as a device: MemAvailable free of MemTotal."""
    try:
        with open(meminfo_path, encoding="ascii") as f:
            fields = {}
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    fields[key] = int(parts[0]) * 1024
    except (OSError, ValueError) as exc:
        raise DeviceError(f"cannot read {meminfo_path}: {exc}") from exc
    total = fields.get("MemTotal", 0)
    free = fields.get("MemAvailable", fields.get("MemFree", 0))
    return Device(index=0, name="host memory", free_bytes=free, total_bytes=total, kind="host")


_CPUINFO_FEATURES = {"avx": "AVX", "avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "avx512f": "AVX512",
                     "avx512_vnni": "AVX512_VNNI", "amx_int8": "AMX_INT8", "asimd": "NEON", "asimddp": "DOTPROD",
                     "i8mm": "MATMUL_INT8", "sve": "SVE"}
"""/proc/cpuinfo flags under the names llama.cpp's ``llama_print_system_info`` gives the features."""


def cpu_features(cpuinfo_path: str = "/proc/cpuinfo") -> frozenset[str]:
    """This host's CPU features as llama.cpp names them, from /proc/cpuinfo (empty where it cannot be read), and
    ``REPACK`` (llama-cpp-python's CPU builds have it: ``GGML_CPU_REPACK`` is on by default): what
    ``ggml_features`` answers where llama-cpp-python cannot be loaded."""
    try:
        with open(cpuinfo_path, encoding="ascii", errors="replace") as f:
            flags: set[str] = set()
            for line in f:
                key, _, rest = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    flags.update(rest.split())
    except OSError:
        return frozenset()
    found = {name for flag, name in _CPUINFO_FEATURES.items() if flag in flags}
    return frozenset(found | {"REPACK"}) if found else frozenset()


_SYSTEM_FEATURE = re.compile(r"([A-Z0-9_]+) = 1\b")


def parse_system_info(text: str) -> frozenset[str]:
    """The features ``llama_print_system_info`` reports as present (``AVX2 = 1 | AMX_INT8 = 1 | ...``)."""
    return frozenset(_SYSTEM_FEATURE.findall(text))


def ggml_features() -> frozenset[str]:
    """The CPU features of the ggml that llama-cpp-python was built with here (``llama_print_system_info``): the
    ones a load uses, and on a host whose wheel was built without some (AMX, AVX-512: a portable build) not all
    the CPU has. /proc/cpuinfo's (``cpu_features``) where llama-cpp-python cannot be loaded."""
    try:
        import llama_cpp

        raw = llama_cpp.llama_print_system_info()
    except Exception:  # not installed, or its library cannot be loaded here
        return cpu_features()
    return parse_system_info(raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw))


def nvml_devices() -> list[Device]:
    """Live GPU inventory from NVML; an empty list when NVML or the driver is absent."""
    try:
        import pynvml  # type: ignore[import-untyped]
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...: no GPU here
        return []
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            name = pynvml.nvmlDeviceGetName(h)
            if isinstance(name, bytes):
                name = name.decode("utf-8", "replace")
            out.append(Device(index=i, name=str(name), free_bytes=int(mem.free), total_bytes=int(mem.total)))
        return out
    except Exception as exc:
        raise DeviceError(f"NVML failed while listing GPUs: {exc}") from exc
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def parse_declared(items: Sequence[object]) -> list[Device]:
    """Devices from a declared inventory: ``[{"name", "free_mib", "total_mib"}, ...]``."""
    if not isinstance(items, (list, tuple)):
        raise DeviceError("a GPU inventory is a JSON list of {name, free_mib, total_mib}")
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise DeviceError(f"GPU {i}: expected an object with name, free_mib, total_mib")
        name = item.get("name", f"GPU {i}")
        free = item.get("free_mib")
        if free is None:
            raise DeviceError(f"GPU {i}: free_mib is required (MiB free on the card)")
        total = item.get("total_mib")
        if total is None:  # absent or null: a card whose total is not known is taken as wholly free
            total = free
        for label, v in (("free_mib", free), ("total_mib", total)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise DeviceError(f"GPU {i}: {label} must be a non-negative number, got {v!r}")
        assert isinstance(free, (int, float)) and isinstance(total, (int, float))
        if free > total:
            raise DeviceError(f"GPU {i}: free_mib {free} exceeds total_mib {total}")
        bw = item.get("bandwidth_gbps")
        out.append(
            Device(
                index=i,
                name=str(name),
                free_bytes=int(free * MIB),
                total_bytes=int(total * MIB),
                bandwidth_bytes_per_s=float(bw) * 1e9 if isinstance(bw, (int, float)) else None,
            )
        )
    return out


def load_declared(path: str) -> list[Device]:
    """A declared inventory from a JSON file."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise DeviceError(f"cannot read GPU inventory {path}: {exc}") from exc
    return parse_declared(data)


def inventory(declared_path: str | None = None, declared_json: str | None = None) -> list[Device]:
    """GPUs to plan for: declared (file or JSON text) first, else live NVML. May be empty."""
    if declared_path:
        return load_declared(declared_path)
    if declared_json:
        try:
            return parse_declared(json.loads(declared_json))
        except ValueError as exc:
            raise DeviceError(f"GPU inventory is not valid JSON: {exc}") from exc
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return []
    return nvml_devices()


def measure_host_bandwidth(size_bytes: int = 64 << 20, repeat: int = 3) -> float:
    """Host memory copy bandwidth in bytes/s (best of ``repeat`` copies of ``size_bytes``): the host tier's
    read speed for the offload speed model. About 30 ms; run once at start."""
    import time

    src = bytearray(b"\x01") * size_bytes  # touched, so no page faults are timed
    dst = bytearray(size_bytes)
    dst[:] = src
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        dst[:] = src
        best = min(best, time.perf_counter() - t)
    # A copy reads and writes every byte: report the read side.
    return 2 * size_bytes / best if best > 0 else 40e9
