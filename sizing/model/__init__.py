"""What a model is, for sizing: the ``ModelSpec`` value a probe produces, the architecture table, ggml's types.

Pure (values, no I/O). Imports nothing else of ``sizing`` but ``units`` and ``errors``.
"""

from __future__ import annotations

from . import arch
from .ggml import CACHE_TYPES, GGML_TYPE_IDS, CacheType, cache_type
from .projector import ProjectorSpec
from .spec import LayerSpec, MlaSpec, ModelSource, ModelSpec, SsmSpec, StateSpec, TensorInfo

__all__ = ["CACHE_TYPES", "GGML_TYPE_IDS", "CacheType", "LayerSpec", "MlaSpec", "ModelSource", "ModelSpec", "ProjectorSpec", "SsmSpec",
           "StateSpec", "TensorInfo", "arch", "cache_type"]
