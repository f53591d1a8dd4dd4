"""What a caller asks of a plan, and the context parameters it implies: values, no behaviour."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..memory.context import ContextConfig, FlashAttn
from ..memory.draft import DraftModel
from ..memory.projector import Projector
from ..memory.estimate import DEFAULT_GPU_ALLOWANCE_BYTES
from ..memory.repack import auto_repack
from ..model.spec import ModelSpec

DEFAULT_CACHE_TYPES = ("f16", "q8_0", "q4_0")

AUTO_CACHE_TYPE = "auto"
"""The cache type that means: the most precise one whose context reaches the ceiling (``sizing.plan.auto_cache``)."""

AUTO_CACHE_TYPES = ("f16", "q8_0", "q4_0")
"""What ``auto`` chooses among, most precise first (always sized, whatever ``cache_types`` reports)."""


@dataclass(frozen=True)
class PlanRequest:
    """What the caller asks of a plan. ``n_ctx`` None means: the largest that fits."""

    n_ctx: int | None = None
    cache_types: tuple[str, ...] = DEFAULT_CACHE_TYPES
    cache_type: str = AUTO_CACHE_TYPE
    """The type to load with (reported even when not in ``cache_types``), or ``auto``: the plan chooses among
    ``AUTO_CACHE_TYPES`` (``sizing.plan.auto_cache``) and its ``cfg.type_k`` is the concrete type."""
    flash_attn: FlashAttn = "auto"
    context_length: int | None = None
    min_ctx: int = 4096
    n_ubatch: int = 512
    n_batch: int = 512
    n_seq_max: int = 1
    kv_unified: bool = False
    swa_full: bool = False
    allowance_bytes: int = DEFAULT_GPU_ALLOWANCE_BYTES
    """A CUDA card's context beside the plan (``GGUF_GPU_ALLOWANCE_MIB``); also ROCm's and MUSA's, and any backend
    without a row of its own in ``sizing.memory.gpu.BACKENDS``."""
    backend_allowance_bytes: tuple[tuple[str, int], ...] = ()
    """Per backend prefix, its device context where it is not CUDA's (``Vulkan``: ``GGUF_VULKAN_ALLOWANCE_MIB``);
    a backend not named here takes its row's (``sizing.memory.gpu``), else ``allowance_bytes``."""
    gpu: int | Literal["auto", "all"] = "auto"
    tensor_split: tuple[float, ...] | None = None
    allow_offload: bool = True
    """Whether a model the cards cannot hold may run with some layers in host memory."""
    host_bandwidth_bytes_per_s: float = 40e9
    """Host memory read bandwidth for the speed model (measured at service start, overridable)."""
    disk_bandwidth_bytes_per_s: float = 2e9
    """Model file read bandwidth for weights past MemAvailable."""
    cpu_cores: int = 8
    """CPU cores for the host's share of the work (the service passes the machine's count)."""
    cpu_flops_per_core: float | None = None
    """Decode FLOP/s per core of the host's CPU, measured (``service.engine.cpu_speed``); None:
    ``sizing.plan.speed.CPU_FLOPS_PER_CORE``."""
    embedding_tokens: int = 0
    """Tokens of one /v1/embeddings batch: the plan sizes an embedding context of this many (0: none)."""
    embedding_gpu: bool = False
    """Give plans with layers on GPUs the embedding context too (off: CPU-only plans only)."""
    draft_rows: int = 0
    """Logits rows for self-speculation's drafts beyond one per sequence (``ContextConfig.draft_rows``)."""
    draft: DraftModel | None = None
    """A speculative-decoding draft model loaded beside this one (``sizing.memory.draft``): sized on the device
    of the main model's output layer, at the main context."""
    draft_squeeze: bool = False
    """Keep the draft even where it holds the main context below the ceiling; off: the plan drops the draft then
    (``Plan.draft_refusal``) rather than give the main model less context."""
    projector: Projector | None = None
    """A vision projector (``mmproj``) loaded beside the model (``sizing.memory.projector``): its weights and compute
    buffer counted on its device, so the largest context is searched with them."""
    mtp: bool = False
    """Load the file's MTP head to draft with (``sizing.memory.mtp``): its lines are in the plan, which keeps it
    where it costs the main model nothing it is owed (as a draft model: ``Plan.mtp_refusal``). Its context's
    compute buffer is llama.cpp's figure: a plan without a calibration of it leaves the head out."""
    cpu_repack: bool | None = None
    """llama.cpp's extra CPU buffer types (repacked weight layouts: ``use_extra_bufts``). None: this host's safe
    default, decided where llama.cpp is loaded (``service.engine.cpu``: off where its AMX kernel crashes); the
    service's planner always sets it (``GGUF_CPU_REPACK``)."""
    cpu_repack_reason: str = field(default="", compare=False)
    """Why ``cpu_repack`` is what it is (the load's log line and the dry run say it)."""
    quantized_cpu_cache: bool = False
    """``auto`` on a machine without cards chooses among the quantized types only (batch-invariant outputs):
    llama.cpp's CPU flash attention over an f16 cache tiles a prompt's rows and splits a single row's keys by cell
    index (ggml-cpu/ops.cpp ``ggml_compute_forward_flash_attn_ext_f16``: ``use_tiled``, ``use_split_kv_path``), so
    a token's output depends on where its cells lie and on the other sequences' cells; over a quantized cache it
    runs one row at a time over the sequence's cells in order."""
    cpu_features: frozenset[str] = frozenset()
    """The CPU features llama.cpp reports on the host the plan runs on (``llama_print_system_info``): with the
    extra buffer types on, which weights they copy (``sizing.memory.repack``). Empty: unknown, none predicted."""

    @property
    def extra_buffers(self) -> frozenset[str] | None:
        """The features a CPU-only load's extra buffer types are predicted with; None: the load uses none."""
        on = self.cpu_repack if self.cpu_repack is not None else auto_repack(self.cpu_features)
        return self.cpu_features if on else None


def ctx_cap(spec: ModelSpec, req: PlanRequest) -> int:
    """Upper bound on n_ctx: n_ctx_train, the ceiling, and the requested n_ctx."""
    cap = spec.n_ctx_train if spec.n_ctx_train > 0 else 4096
    if req.context_length:
        cap = min(cap, req.context_length)
    if req.n_ctx:
        cap = min(cap, req.n_ctx)
    return cap


def ctx_floor(spec: ModelSpec, req: PlanRequest, cap: int) -> int:
    """The smallest context a placement must hold to count: the requested n_ctx, else the minimum."""
    if req.n_ctx:
        return cap
    return min(req.min_ctx, cap)


def context_config(req: PlanRequest, cache: str, n_ctx: int) -> ContextConfig:
    """The llama.cpp context parameters for this request at ``n_ctx``."""
    return ContextConfig(
        n_ctx=n_ctx,
        type_k=cache,
        type_v=cache,
        flash_attn=req.flash_attn,
        n_ubatch=req.n_ubatch,
        n_batch=req.n_batch,
        n_seq_max=req.n_seq_max,
        kv_unified=req.kv_unified,
        swa_full=req.swa_full,
        embedding_tokens=req.embedding_tokens,
        embedding_gpu=req.embedding_gpu,
        draft_rows=req.draft_rows,
        mtp=req.mtp,
    )


