"""Where a model goes and at what context: devices as values, the request, the largest context that fits, one
card or a split or a partial offload (with predicted speeds), the cache type ``auto`` chooses, the plan,
residency beside other models, and the plan's renderings (JSON and the table).

Pure (values, no I/O). Imports ``sizing.memory`` and ``sizing.model``, nothing of ``probe``.
"""

from __future__ import annotations

from .auto_cache import choose_cache_type
from .device import CUDA, Backend, Device, DeviceKind, free_memory_note
from .make import DRAFT_REFUSAL, CacheTypeOption, Candidate, Plan, make_plan
from .offload import cpu_flops_for_step
from .report import device_json, plan_json, plan_table, spec_json
from .request import AUTO_CACHE_TYPE, AUTO_CACHE_TYPES, PlanRequest, context_config, ctx_cap, ctx_floor
from .residency import (Decision, Holding, available, choose_eviction, decide_placement, decision_request, held_bytes,
                        held_summary, lru)

__all__ = ["CUDA", "DRAFT_REFUSAL", "AUTO_CACHE_TYPE", "AUTO_CACHE_TYPES", "Backend", "CacheTypeOption", "Candidate", "Decision", "Device", "DeviceKind",
           "cpu_flops_for_step",
           "Holding", "Plan", "PlanRequest", "available", "choose_cache_type", "choose_eviction", "context_config",
           "ctx_cap", "ctx_floor", "decide_placement", "decision_request", "device_json", "free_memory_note", "held_bytes", "held_summary", "lru",
           "make_plan", "plan_json", "plan_table", "spec_json"]
