"""What llama.cpp allocates for a model, a context and a placement: KV cache and recurrent state, the mirrored compute
graph and its allocator, GPU terms, repacked weights, llama.cpp's measured figures as values, and the estimate
per device that sums them.

Pure (values, no I/O). Imports ``sizing.model`` (and ``units``, ``errors``), nothing of ``plan`` or ``probe``.
"""

from __future__ import annotations

from .compute import compute_mirrored
from .context import ContextConfig, FlashAttn, pad
from .draft import DraftModel, draft_config, draft_placement
from .mtp import MTP_ARCHITECTURES, MtpMemory, mtp_config, mtp_supported
from .estimate import DEFAULT_GPU_ALLOWANCE_BYTES, DeviceMemory, DraftMemory, MemoryEstimate, estimate, resolve_flash_attn
from .gpu import BackendTerms, Card, VulkanScratch, terms as backend_terms, vulkan_scratch
from .kv import kv_cells
from .measured import Calibrated, Calibration, ConfigKey, Sample, mib_to_bytes, placement_key
from .placement import Placement
from .projector import Projector, ProjectorMemory, compute_bound_bytes, projector_memory
from .repack import EXTRA_BUFFERS, auto_reason, auto_repack, extra_buffer_bytes

__all__ = ["BackendTerms", "Card", "VulkanScratch", "backend_terms", "vulkan_scratch", "DEFAULT_GPU_ALLOWANCE_BYTES", "EXTRA_BUFFERS", "Calibrated", "Calibration", "ConfigKey", "ContextConfig",
           "DeviceMemory", "DraftMemory", "DraftModel", "draft_config", "draft_placement", "MTP_ARCHITECTURES", "MtpMemory",
           "mtp_config", "mtp_supported", "FlashAttn", "MemoryEstimate", "Placement", "Projector", "ProjectorMemory", "Sample", "auto_reason", "auto_repack",
           "compute_bound_bytes", "compute_mirrored", "estimate", "extra_buffer_bytes", "kv_cells", "mib_to_bytes", "pad", "placement_key",
           "projector_memory", "resolve_flash_attn"]
