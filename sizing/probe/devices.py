"""The device adapters: ggml's device list, live NVML, declared inventories and host memory, read into ``Device``
values.

The ``Device`` value itself is pure and lives in ``sizing.plan.device`` (re-exported here for
callers that read both). This is the only module that imports ``pynvml``, and only
inside ``nvml_cards``. ggml's device list is read in a child process (``service.engine.devices``: llama.cpp
must not start its backends in the API process); ``ggml_devices`` turns its rows into ``Device`` values
with NVML's figures for the NVIDIA cards among them.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from ..plan.device import CUDA, Backend, Device, DeviceKind
from ..units import MIB
from ..errors import DeviceError

__all__ = ["MIB", "Device", "DeviceKind", "NvmlCard", "UNREPORTED_FREE_MARGIN_PCT", "ggml_devices", "host_memory",
           "nvml_cards", "nvml_devices", "parse_declared", "load_declared", "inventory", "measure_host_bandwidth",
           "unreported_free"]

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


@dataclass(frozen=True)
class NvmlCard:
    """One NVIDIA card as NVML reports it: what ggml's CUDA device does not say (other processes' memory is out of
    ``free_bytes``; how busy it is), matched to ggml's device by PCI bus id."""

    index: int
    name: str
    free_bytes: int
    total_bytes: int
    pci_bus_id: str = ""
    uuid: str = ""
    utilization_pct: int | None = None


def nvml_cards() -> list[NvmlCard]:
    """Live NVIDIA cards from NVML; an empty list when NVML or the driver is absent."""
    try:
        import pynvml  # type: ignore[import-untyped]
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...: no GPU here
        return []

    def text(v: object) -> str:
        return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)

    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            try:
                bus = text(pynvml.nvmlDeviceGetPciInfo(h).busId)
                uuid = text(pynvml.nvmlDeviceGetUUID(h))
            except Exception:  # an old driver: the card is matched by position then
                bus = uuid = ""
            try:
                util: int | None = int(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)
            except Exception:  # not supported on this card
                util = None
            out.append(NvmlCard(i, text(pynvml.nvmlDeviceGetName(h)), int(mem.free), int(mem.total), bus, uuid, util))
        return out
    except Exception as exc:
        raise DeviceError(f"NVML failed while listing GPUs: {exc}") from exc
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def nvml_devices() -> list[Device]:
    """Live GPU inventory from NVML (CUDA's devices, in PCI bus order); an empty list when NVML or the driver is
    absent."""
    return [Device(index=c.index, name=c.name, free_bytes=c.free_bytes, total_bytes=c.total_bytes,
                   device_id=c.pci_bus_id) for c in nvml_cards()]


UNREPORTED_FREE_MARGIN_PCT = 10.0
"""The share of a card's total kept out of a plan where its backend cannot say what is free
(``GGUF_UNREPORTED_FREE_MARGIN_PCT``): what other processes and the driver hold there is not seen, so the plan
leaves this much for them. A guess, not a measurement: a desktop's compositor and browser hold a few hundred MiB of
a consumer card."""


def unreported_free(total_bytes: int, margin_pct: float = UNREPORTED_FREE_MARGIN_PCT) -> tuple[int, int]:
    """(free, margin) bytes a plan takes for a card whose backend gives only its total."""
    margin = min(total_bytes, math.ceil(total_bytes * max(0.0, margin_pct) / 100))
    return total_bytes - margin, margin


_PCI = re.compile(r"^(?:([0-9a-fA-F]+):)?([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-7])$")


def pci_key(bus_id: str) -> tuple[int, int, int, int] | None:
    """A PCI bus id as numbers, so that ggml's ``0000:c1:00.0`` and NVML's ``00000000:C1:00.0`` compare equal."""
    m = _PCI.match(bus_id.strip())
    if m is None:
        return None
    return (int(m.group(1) or "0", 16), int(m.group(2), 16), int(m.group(3), 16), int(m.group(4)))


_GGML_NAME = re.compile(r"^(.*?)(\d+)$")


def ggml_devices(rows: Sequence[Mapping[str, Any]], nvml: Sequence[NvmlCard] = (),
                 margin_pct: float = UNREPORTED_FREE_MARGIN_PCT) -> tuple[list[Device], list[str]]:
    """The cards llama.cpp will place layers on, from ggml's device list (``service.engine.devices``: one row per
    ``ggml_backend_dev_get(i)``), each ``index`` llama.cpp's position for it; and why each other device is left
    out.

    llama.cpp's choice, mirrored (``llama_model_load`` in src/llama.cpp of the llama.cpp llama-cpp-python 0.3.36
    vendors, with no ``devices`` given): CPU and accelerator devices never hold layers; ggml-rpc's devices are a
    plan's workers (``service.rpc``), registered by the process that loads it; of the GPUs the first device
    with a given device id (the same card through two backends); integrated GPUs (of one backend) only where
    there is no other GPU.

    A card whose free memory ggml gives as its total (ggml-vulkan without ``VK_EXT_memory_budget``: every heap's
    size, for ever) is planned on ``unreported_free``'s figure, marked so (``Backend.reports_free``). An NVIDIA
    card NVML also lists (matched by PCI bus id) takes NVML's name and figures, as before ggml's list was read.
    """
    gpus: list[dict[str, Any]] = []
    igpus: list[dict[str, Any]] = []
    skipped: list[str] = []
    seen_ids: dict[str, str] = {}
    for row in rows:
        name, kind = str(row.get("name", "")), str(row.get("type", ""))
        reg = str(row.get("backend", ""))
        if kind in ("cpu", "accel") or reg == "RPC" or kind not in ("gpu", "igpu"):
            skipped.append(f"{name}: a {kind or 'typeless'} device of {reg or 'no'} backend holds no layers")
            continue
        device_id = str(row.get("device_id") or "")
        if kind == "gpu":
            if device_id and device_id in seen_ids:
                skipped.append(f"{name}: the same device ({device_id}) as {seen_ids[device_id]}")
                continue
            if device_id:
                seen_ids[device_id] = name
            gpus.append(dict(row))
        elif not igpus or igpus[-1].get("backend") == reg:
            igpus.append(dict(row))
        else:
            skipped.append(f"{name}: an integrated GPU of another backend than {igpus[0].get('name')}")
    if gpus and igpus:
        skipped.extend(f"{r.get('name')}: an integrated GPU, left out beside a discrete one" for r in igpus)
    chosen = gpus or igpus
    by_bus = {k: c for c in nvml if (k := pci_key(c.pci_bus_id)) is not None}
    out: list[Device] = []
    for i, row in enumerate(chosen):
        name = str(row.get("name", ""))
        m = _GGML_NAME.match(name)
        prefix, ordinal = (m.group(1), int(m.group(2))) if m else (name, None)
        total = max(0, int(row.get("total_bytes", 0)))
        free = max(0, min(total, int(row.get("free_bytes", 0))))
        reports = free < total
        margin = 0
        if not reports:
            free, margin = unreported_free(total, margin_pct)
        dev = Device(index=i, name=str(row.get("description") or name), free_bytes=free, total_bytes=total,
                     backend=Backend(prefix, reports_free=reports, host_buffer=str(row.get("host_buffer") or "")),
                     ordinal=ordinal, gpu_type="igpu" if row.get("type") == "igpu" else "gpu",
                     device_id=str(row.get("device_id") or ""), free_margin_bytes=margin,
                     alignment_bytes=int(row.get("alignment", 0) or 0), max_buffer_bytes=int(row.get("max_size", 0) or 0),
                     max_tensor_bytes=int(row.get("max_tensor", 0) or 0))
        key = pci_key(dev.device_id)
        card = by_bus.get(key) if key is not None and prefix == CUDA.prefix else None
        if card is not None:
            dev = replace(dev, name=card.name, free_bytes=card.free_bytes, total_bytes=card.total_bytes,
                          backend=replace(dev.backend, reports_free=True), free_margin_bytes=0)
        out.append(dev)
    return out, skipped


def parse_declared(items: Sequence[object]) -> list[Device]:
    """Devices from a declared inventory: ``[{"name", "free_mib", "total_mib"}, ...]``, each optionally with
    ``bandwidth_gbps`` and ``backend`` (ggml's name for its devices less the number: ``Vulkan`` labels the first
    card ``Vulkan0``; default ``CUDA``)."""
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
        backend = item.get("backend", CUDA.prefix)
        if not isinstance(backend, str) or not re.fullmatch(r"[A-Za-z][A-Za-z_]*", backend):
            raise DeviceError(f"GPU {i}: backend must be ggml's name for it (CUDA, ROCm, Vulkan, SYCL, MTL), "
                              f"got {backend!r}")
        out.append(
            Device(
                index=i,
                name=str(name),
                free_bytes=int(free * MIB),
                total_bytes=int(total * MIB),
                bandwidth_bytes_per_s=float(bw) * 1e9 if isinstance(bw, (int, float)) else None,
                backend=CUDA if backend == CUDA.prefix else Backend(backend, host_buffer=f"{backend}_Host"),
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
