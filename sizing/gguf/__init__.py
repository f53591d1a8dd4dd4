"""GGUF probing: header reader, byte sources, spec builder, remote (HTTP range) probe.

``probe_url``, ``probe_hf`` and ``probe_location`` live in ``sizing.gguf.remote``
and are imported on first use, so a local probe never imports httpx.
"""

from __future__ import annotations

from typing import Any

from .probe import build_spec, probe_bytes, probe_path, shard_paths, spec_from_headers, tensor_nbytes

__all__ = [
    "build_spec",
    "probe_bytes",
    "probe_hf",
    "probe_location",
    "probe_path",
    "probe_url",
    "shard_paths",
    "spec_from_headers",
    "tensor_nbytes",
]

_REMOTE = ("probe_url", "probe_hf", "probe_location")


def __getattr__(name: str) -> Any:
    if name in _REMOTE:
        from . import remote

        return getattr(remote, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
