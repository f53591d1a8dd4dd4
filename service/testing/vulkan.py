"""A model placed on Vulkan cards by the service's plan, against what llama.cpp and ggml-vulkan allocated there: the
rows of the accuracy table (``bench/vulkan_accuracy.py``) and of the Vulkan tests (``tests/vulkan``).

llama.cpp's buffers (weights, KV, compute, output) are its load log's, as the service reports them (``GET
/api/models``: ``memory`` beside the plan's ``estimate``). What ggml-vulkan allocates outside them, its scratch
buffers (``sizing.memory.gpu.vulkan_scratch``), only ``GGML_VK_MEMORY_LOGGER=1`` shows: every
``ggml_vk_preallocate_buffers(<kind>_size: <bytes>)`` line is followed by the device's ``+<size>`` line of the
buffer that replaces the old one (``ggml-vulkan.cpp``, ``ggml-vulkan-buffers.cpp``, ``ggml-vulkan-debug.cpp``);
``scratch_of`` reads them back per device and kind, the largest of each.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

MIB = 1 << 20
LOG_RESOLUTION_MIB = 0.01
"""llama.cpp logs each buffer rounded to 0.01 MiB."""

MODELS = {"gemma": "gemma-3-270m-q4_k_m", "smollm2": "smollm2-135m-instruct-q4_1"}
PAIRS = (("f16", "on"), ("f16", "off"), ("q8_0", "on"))
SCENARIOS: dict[str, dict[str, Any]] = {
    "one": {"env": {"GGML_VK_VISIBLE_DEVICES": "0"}, "body": {"gpu": 0}},
    "one-partial": {"env": {"GGML_VK_VISIBLE_DEVICES": "0", "GGUF_UNREPORTED_FREE_MARGIN_PCT": "90"},
                    "allowance_mib": {"gemma": 120, "smollm2": 40}, "body": {"gpu": 0}},
    "two": {"env": {"GGML_VK_VISIBLE_DEVICES": "0,0"}, "body": {"gpu": "all"}},
    "two-partial": {"env": {"GGML_VK_VISIBLE_DEVICES": "0,0", "GGUF_UNREPORTED_FREE_MARGIN_PCT": "90"},
                    "allowance_mib": {"gemma": 120, "gemma f16/off": 155, "smollm2": 125},
                    "per_model": {"smollm2": {"GGUF_N_UBATCH": "128"}}, "body": {}},
}
"""Each scenario's devices (GGML_VK_VISIBLE_DEVICES), settings and load options. Where layers are to stay on the
host, each card is planned on 10 % of lavapipe's 2 GiB heap (204.8 MiB) less a Vulkan allowance
(GGUF_VULKAN_ALLOWANCE_MIB, per model and, where given, per cache/flash-attention pair) that leaves the model room
for some of its layers but not all: gemma-3-270m needs about 110 MiB on one card whole, SmolLM2-135M-Instruct 220
(100 of them its logits' compute buffer: over two cards it takes 128-token batches, GGUF_N_UBATCH, so that its
output card leaves room for layers)."""


def scenario_env(scenario: dict[str, Any], model: str, cache: str, fa: str) -> dict[str, str]:
    """The settings a scenario runs one model and cache/flash-attention pair with."""
    env = {**scenario["env"], **scenario.get("per_model", {}).get(model, {})}
    allowance = scenario.get("allowance_mib", {})
    got = allowance.get(f"{model} {cache}/{fa}", allowance.get(model))
    if got is not None:
        env["GGUF_VULKAN_ALLOWANCE_MIB"] = str(got)
    return env


PREALLOC = re.compile(r"ggml_vulkan memory: ggml_vk_preallocate_buffers\((\w+?)_size: (\d+)\)")
ALLOCATED = re.compile(r"ggml_vulkan memory: (\S+): \+[\d.]+ \S+ (device|host) at ")
STAGING = re.compile(r"ggml_vulkan memory: ggml_vk_ensure_sync_staging_buffer\((\d+)\)")
SCRATCH_KINDS = ("x", "y", "split_k", "add_partials")
"""ggml-vulkan's scratch buffers, as its log names them (``prealloc_x``, ``_y``, ``_split_k``,
``_add_rms_partials``)."""
ADD_PARTIALS_BYTES = 1024
"""``prealloc_size_add_rms_partials``: its log line prints the buffer's handle, not its size (fixed at 1 KiB)."""


def scratch_of(lines: Iterable[str]) -> dict[str, dict[str, int]]:
    """Per device (``Vulkan0``), the largest buffer of each scratch kind ggml-vulkan allocated (bytes), and
    ``staging``: the largest synchronous staging buffer (host memory, shared by the device's contexts)."""
    out: dict[str, dict[str, int]] = {}
    pending: tuple[str, int] | None = None
    staging: int | None = None
    for line in lines:
        if m := PREALLOC.search(line):
            kind = m.group(1)
            size = ADD_PARTIALS_BYTES if kind == "add_partials" else int(m.group(2))
            pending = (kind, size) if size > 0 else None
            continue
        if m := STAGING.search(line):
            staging = int(m.group(1))
            continue
        if m := ALLOCATED.search(line):
            dev = m.group(1)
            if pending is not None:
                kind, size = pending
                got = out.setdefault(dev, {})
                got[kind] = max(got.get(kind, 0), size)
                pending = None
            elif staging is not None:
                got = out.setdefault(dev, {})
                got["staging"] = max(got.get("staging", 0), staging)
            staging = None
    return out


@dataclass(frozen=True)
class Row:
    """One figure of one device: what the plan predicted and what was allocated, in MiB."""

    device: str
    part: str
    predicted_mib: float
    allocated_mib: float
    bound: bool = False
    """The prediction is a bound (the scratch), not a figure to meet."""

    @property
    def error_mib(self) -> float:
        return round(self.allocated_mib - self.predicted_mib, 2)

    @property
    def status(self) -> str:
        """``exact``: within llama.cpp's 0.01 MiB; ``rounded up``: 0.02 over, a dry run's figure taken at the top of
        its 0.01 MiB (``sizing.memory.measured.mib_to_bytes``) where the load's own fell at the bottom of the next
        one down; ``bound``: a bound not exceeded; else ``over`` (predicted too much) or ``UNDER``."""
        if self.bound:
            return "bound" if self.allocated_mib <= self.predicted_mib + LOG_RESOLUTION_MIB else "UNDER"
        if abs(self.error_mib) <= LOG_RESOLUTION_MIB + 1e-9:
            return "exact"
        if -2 * LOG_RESOLUTION_MIB - 1e-9 <= self.error_mib < 0 and self.part == "compute":
            return "rounded up"
        return "over" if self.error_mib < 0 else "UNDER"

    @property
    def ok(self) -> bool:
        return self.status in ("exact", "rounded up", "bound")


PARTS = ("weights", "kv", "compute", "output")


def rows_of(model: Mapping[str, Any], scratch: Mapping[str, Mapping[str, int]] | None = None) -> list[Row]:
    """A loaded model's rows (``GET /api/models``' entry): per device llama.cpp's buffers against the plan's estimate,
    part by part, and where ``scratch`` (``scratch_of``) is given, each card's scratch against its bound
    (``gpu_pool_mib``). A device llama.cpp allocated on that the plan does not name has its rows at 0 predicted."""
    est = {d["device"]: d for d in model["plan"]["estimate"]["devices"]}
    out: list[Row] = []
    extra = {b: n for d in est.values() for b, n in (d.get("extra_weights_mib") or {}).items()}
    for got in model["memory"]:
        dev = got["device"]
        # The host's extra buffer types (CPU_REPACK, AMX) are rows of the log and of the host's estimate; a device
        # llama.cpp allocated on that the plan left out is predicted 0.
        want = est.get(dev, {"weights_mib": extra[dev]} if dev in extra else {})
        for part in PARTS:
            out.append(Row(dev, part, float(want.get(f"{part}_mib", 0.0)), float(got["allocated"].get(f"{part}_mib", 0.0))))
        if scratch is not None and dev != "CPU":
            used = scratch.get(dev, {})
            out.append(Row(dev, "scratch", float(want.get("gpu_pool_mib", 0.0)),
                           round(sum(v for k, v in used.items() if k in SCRATCH_KINDS) / MIB, 2), bound=True))
        elif scratch is not None:  # the host's: the cards' staging buffers (host memory)
            out.append(Row(dev, "staging", float(want.get("gpu_pool_mib", 0.0)),
                           round(sum(u.get("staging", 0) for u in scratch.values()) / MIB, 2), bound=True))
    return out


__all__ = ["ADD_PARTIALS_BYTES", "MODELS", "PAIRS", "PARTS", "Row", "SCENARIOS", "SCRATCH_KINDS", "rows_of",
           "scenario_env", "scratch_of"]
