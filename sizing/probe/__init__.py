"""The adapters that read the world into the pure core's values: a GGUF file's header into a ``ModelSpec`` (local
files and split shards, or HTTP range requests: ``remote``), and the machine's GPUs (ggml's device list, NVML or a declared inventory)
and host memory into ``Device`` values (``devices``); a vision projector's header into a ``ProjectorSpec``
(``projector``) and mtmd's own figures for it (``mtmd``: a child process loads it).

``probe_url``, ``probe_hf``, ``probe_location``, ``ProbeLimits`` and ``parse_allow_hosts`` live in
``sizing.probe.remote`` and are imported on first use, so a local probe never imports httpx.
"""

from __future__ import annotations

from typing import Any

from .devices import (UNREPORTED_FREE_MARGIN_PCT, NvmlCard, cpu_features, ggml_devices, ggml_features, host_memory,
                      inventory, measure_host_bandwidth, nvml_cards, parse_declared, parse_system_info, unreported_free)
from .gguf import build_spec, probe_bytes, probe_path, shard_paths, spec_from_headers, tensor_nbytes
from .mtmd import ProjectorFigures, measure_projector, parse_mtmd_log
from .projector import probe_projector

__all__ = [
    "NvmlCard",
    "ProbeLimits",
    "UNREPORTED_FREE_MARGIN_PCT",
    "ProjectorFigures",
    "build_spec",
    "cpu_features",
    "ggml_devices",
    "ggml_features",
    "parse_system_info",
    "host_memory",
    "inventory",
    "measure_host_bandwidth",
    "measure_projector",
    "nvml_cards",
    "parse_allow_hosts",
    "parse_declared",
    "parse_mtmd_log",
    "probe_bytes",
    "probe_hf",
    "probe_location",
    "probe_path",
    "probe_projector",
    "probe_url",
    "shard_paths",
    "spec_from_headers",
    "tensor_nbytes",
    "unreported_free",
]

_REMOTE = ("probe_url", "probe_hf", "probe_location", "ProbeLimits", "parse_allow_hosts")


def __getattr__(name: str) -> Any:
    if name in _REMOTE:
        from . import remote

        return getattr(remote, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
