"""GGUF probing: header reader, byte sources, spec builder, fixture writer."""

from .probe import probe_path, shard_paths, spec_from_headers, tensor_nbytes

__all__ = ["probe_path", "shard_paths", "spec_from_headers", "tensor_nbytes"]
