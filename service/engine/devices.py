"""This machine's cards as llama.cpp will use them: ggml's device list, read in a child process.

Every backend the installed llama-cpp-python was built with (CUDA, ROCm, Vulkan, SYCL, Metal...) registers its
devices in ggml's registry; ``ggml_backend_dev_count/get`` list them, each with its name (``CUDA0``, ``Vulkan0``:
the name llama.cpp gives its buffers), description, type (GPU, integrated GPU, accelerator, CPU), free and total
memory (``ggml_backend_dev_memory``), device id (``ggml_backend_dev_get_props``: the PCI bus id), host buffer type,
buffer alignment and largest buffer (``ggml_backend_buft_get_alignment/max_size``) and the largest tensor its ops
take (``max_tensor_bytes``: ``ggml_backend_dev_supports_op`` asked). Reading them starts the
backends (a CUDA context on every card, a Vulkan instance), which the API process must not hold: the list is read
by ``python -m service.engine.devices`` (this module's ``main``), which prints one JSON line and exits, as the
dry runs are (``service.engine.dryrun``). ``sizing.probe.devices.ggml_devices`` turns the rows into ``Device``
values the way llama.cpp chooses among them, with NVML's figures for NVIDIA cards.

A build with no GPU backend (the CPU wheel ``make setup`` builds: its lib folder has no ``libggml-<gpu>``) starts no
child: its cards are NVML's, as before ggml's list was read, and the planner's inventory costs nothing more.

Run it to see what llama.cpp sees here: ``python -m service.engine.devices`` (with ``--plan``: the ``Device``
values a plan gets).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import pathlib
import sys
import threading
import time
from typing import Any, Sequence

from sizing.errors import DeviceError
from sizing.plan import Device
from sizing.probe import NvmlCard, ggml_devices, inventory, nvml_cards, UNREPORTED_FREE_MARGIN_PCT

from ..children import Child
from .native import child_env

log = logging.getLogger(__name__)

MODULE = "service.engine.devices"
READ_TIMEOUT_S = 60.0
"""How long the child may take (CUDA's initialisation of several cards takes seconds)."""
REREAD_S = 2.0
"""A list whose free figures are ggml's own (ROCm, Vulkan with ``VK_EXT_memory_budget``: no NVML to ask) is read
again when older than this: fresh for each plan, without a child per device of one plan."""

_NOT_GPU_LIBS = ("base", "cpu", "rpc", "blas")
"""``libggml-<name>`` libraries that are not a GPU backend (the CPU variants are ``libggml-cpu-<arch>``)."""


def gpu_backends(libdir: pathlib.Path | None = None) -> tuple[str, ...]:
    """The GPU backends the installed llama-cpp-python ships (``vulkan``, ``cuda``, ``hip``...), read from its lib
    folder (or ``libdir``) without loading it; empty for a CPU build or where it is not installed."""
    if libdir is None:
        try:
            spec = importlib.util.find_spec("llama_cpp")
        except (ImportError, ValueError):
            return ()
        if spec is None or spec.origin is None:
            return ()
        libdir = pathlib.Path(spec.origin).parent / "lib"
    found: set[str] = set()
    for p in libdir.glob("*ggml-*"):
        name = p.name.split("ggml-", 1)[1].split(".", 1)[0]
        if name and not any(name == n or name.startswith(n + "-") for n in _NOT_GPU_LIBS):
            found.add(name)
    return tuple(sorted(found))


def read_rows(timeout_s: float = READ_TIMEOUT_S) -> list[dict[str, Any]]:
    """ggml's device list from a child process; ``DeviceError`` when it cannot be read."""
    try:
        child = Child(MODULE, name="device list", env=child_env(), stdout=True, text=True)
    except OSError as exc:
        raise DeviceError(f"cannot start the device reader: {exc}") from exc
    out: list[str] = []

    def pump() -> None:
        assert child.stdout is not None
        out.extend(child.stdout)

    reader = threading.Thread(target=pump, name="device-list-out", daemon=True)
    reader.start()
    reader.join(timeout_s)
    if reader.is_alive():
        child.kill()
        raise DeviceError(f"ggml's device list took more than {timeout_s:g} s: {child.last_lines()}")
    rc = child.reap()
    line = next((ln for ln in reversed(out) if ln.startswith("{")), "")
    try:
        rows = json.loads(line)["devices"] if rc == 0 else None
    except (ValueError, KeyError, TypeError):
        rows = None
    if not isinstance(rows, list):
        raise DeviceError(f"ggml's device list could not be read (exit {rc}): {child.last_lines()}")
    return [r for r in rows if isinstance(r, dict)]


def _live_rows(rows: Sequence[dict[str, Any]], nvml: Sequence[NvmlCard]) -> bool:
    """Whether some card's free figure is ggml's own measurement (not NVML's, not its total repeated)."""
    for r in rows:
        if r.get("type") not in ("gpu", "igpu") or r.get("backend") == "RPC":
            continue
        if int(r.get("free_bytes", 0)) >= int(r.get("total_bytes", 0)):
            continue  # free not reported: a fixed figure
        if str(r.get("name", "")).startswith("CUDA") and nvml:
            continue  # NVML's figures, read in this process
        return True
    return False


class LocalDevices:
    """This machine's cards for the planner: declared ones (``GGUF_GPUS_FILE`` / ``GGUF_GPUS_JSON``) as given;
    else ggml's list where the build has a GPU backend (read once, and again per plan where its free figures are
    ggml's own), with NVML's figures for NVIDIA cards; else NVML's cards. Thread-safe."""

    def __init__(self, *, declared_path: str | None = None, declared_json: str | None = None,
                 margin_pct: float = UNREPORTED_FREE_MARGIN_PCT, reread_s: float = REREAD_S) -> None:
        self.declared_path, self.declared_json = declared_path, declared_json
        self.margin_pct = margin_pct
        self.reread_s = reread_s
        self._rows: list[dict[str, Any]] | None = None
        self._read_at = 0.0
        self._lock = threading.Lock()
        self.error: str | None = None
        """Why ggml's list could not be read (the cards are NVML's then); None: it was, or was not needed."""
        self.skipped: tuple[str, ...] = ()
        """ggml's devices llama.cpp will not place layers on, and why (the last read)."""

    def rows(self, nvml: Sequence[NvmlCard] = ()) -> list[dict[str, Any]] | None:
        """ggml's rows (cached; read again when their free figures are ggml's own and older than ``reread_s``);
        None where the list could not be read (``error``)."""
        with self._lock:
            if self.error is not None:
                return None
            stale = time.monotonic() - self._read_at > self.reread_s
            if self._rows is None or (stale and _live_rows(self._rows, nvml)):
                try:
                    self._rows = read_rows()
                except DeviceError as exc:
                    self.error = str(exc)
                    log.warning("ggml's device list could not be read; planning on NVML's cards: %s", exc)
                    return None
                self._read_at = time.monotonic()
            return list(self._rows)

    def cards(self) -> list[Device]:
        """The cards to plan for now, in llama.cpp's order (``Device.index``)."""
        if self.declared_path or self.declared_json:
            return inventory(declared_path=self.declared_path, declared_json=self.declared_json)
        backends = gpu_backends()
        if not backends:
            return inventory()
        nvml = nvml_cards() if "cuda" in backends else []
        rows = self.rows(nvml)
        if rows is None:
            return inventory()
        devices, skipped = ggml_devices(rows, nvml, self.margin_pct)
        if tuple(skipped) != self.skipped:
            self.skipped = tuple(skipped)
            for why in skipped:
                log.info("not planned on: %s", why)
        return devices


# ---- the child process -----------------------------------------------------------------------


def _text(raw: bytes | None) -> str:
    return raw.decode("utf-8", "replace") if raw else ""


PROBE_LIMIT_BYTES = 1 << 50
"""The largest tensor ``max_tensor_bytes`` asks a device about: one it takes is taken as no limit (0)."""


def max_tensor_bytes(lib: Any, dev: int) -> int:  # pragma: no cover - runs in the child
    """The largest tensor ``dev``'s backend runs an op on, by its own ``supports_op``: a 1-D I8 tensor of no data
    and no sources (``GGML_OP_NONE``, which every backend takes unless its size is refused), bisected in bytes.
    ggml-vulkan refuses past ``maxBufferSize`` and, without ``VK_EXT_shader_64bit_indexing``,
    ``maxStorageBufferRange`` (``ggml_backend_vk_device_supports_op``'s ``tensor_size_supported``): the limit that
    keeps a weight in host memory (``sizing.memory.gpu.vulkan_refuses``). 0: no limit below ``PROBE_LIMIT_BYTES``."""
    from .native import GGML_TYPE_I8, InitParams

    ctx = lib.ggml_init(InitParams(lib.ggml_tensor_overhead() * 64, None, True))
    if not ctx:
        return 0
    try:
        def takes(n: int) -> bool:
            return bool(lib.ggml_backend_dev_supports_op(dev, lib.ggml_new_tensor_1d(ctx, GGML_TYPE_I8, n)))

        if takes(PROBE_LIMIT_BYTES) or not takes(1):
            return 0
        lo, hi = 1, PROBE_LIMIT_BYTES  # takes(lo), not takes(hi): 50 steps
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if takes(mid) else (lo, mid)
        return lo
    finally:
        lib.ggml_free(ctx)


def list_devices() -> list[dict[str, Any]]:  # pragma: no cover - runs in the child
    """Every device of every backend in this process's ggml (``ggml_backend_dev_get(i)``, in ggml's order)."""
    import ctypes

    from .native import GGML_BACKEND_DEVICE_TYPES, DevProps, libggml

    lib = libggml()
    if lib is None:
        return []
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        d = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        lib.ggml_backend_dev_memory(d, ctypes.byref(free), ctypes.byref(total))
        props = DevProps()
        lib.ggml_backend_dev_get_props(d, ctypes.byref(props))
        reg = lib.ggml_backend_dev_backend_reg(d)
        buft = lib.ggml_backend_dev_buffer_type(d)
        host = lib.ggml_backend_dev_host_buffer_type(d)
        out.append({
            "name": _text(lib.ggml_backend_dev_name(d)),
            "description": _text(lib.ggml_backend_dev_description(d)),
            "type": GGML_BACKEND_DEVICE_TYPES.get(int(lib.ggml_backend_dev_type(d)), "other"),
            "backend": _text(lib.ggml_backend_reg_name(reg)) if reg else "",
            "free_bytes": int(free.value), "total_bytes": int(total.value),
            "device_id": _text(props.device_id) or None,
            "host_buffer": _text(lib.ggml_backend_buft_name(host)) if host else None,
            "alignment": int(lib.ggml_backend_buft_get_alignment(buft)) if buft else 0,
            "max_size": int(lib.ggml_backend_buft_get_max_size(buft)) if buft else 0,
            "max_tensor": max_tensor_bytes(lib, d) if int(lib.ggml_backend_dev_type(d)) != 0 else 0,
            "caps": {"async": bool(props.caps.async_), "host_buffer": bool(props.caps.host_buffer),
                     "buffer_from_host_ptr": bool(props.caps.buffer_from_host_ptr),
                     "events": bool(props.caps.events), "mmap": bool(props.caps.mmap_support)},
        })
    return out


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - runs in the child
    ap = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--plan", action="store_true", help="the Device values a plan gets (run from the API's side)")
    args = ap.parse_args(argv)
    if args.plan:
        from sizing.plan import device_json

        cards = LocalDevices().cards()
        print(json.dumps({"devices": [device_json(d) for d in cards]}, indent=1))
        return 0
    print(json.dumps({"devices": list_devices()}))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
