"""The one translation of a plan into llama.cpp parameters, used by the engine and the dry run alike.

A ``Plan`` (``sizing.plan.make``) says what to load in this project's terms (a
``ContextConfig`` and a ``Placement``); llama.cpp takes ``llama_model_params``
and ``llama_context_params`` (llama.h of the llama.cpp that llama-cpp-python
0.3.36 vendors). ``model_params`` and ``context_params`` turn the first into
plain values (``ModelParams``, ``ContextParams``: JSON-ready, so the dry-run
child receives exactly what the engine would); ``apply_model_params`` and
``apply_context_params`` write them into the ctypes structs. Nothing else in
the service builds those structs, so a plan is confirmed, calibrated and loaded
with the same parameters.

The translation (llama.cpp's rules, ``src/llama-model.cpp`` ``load_tensors``):

- ``n_gpu_layers``: the plan's slot count (0 for CPU-only);
- ``tensor_split``: one proportion for every device llama.cpp sees, in its
  order (the plan's device index: NVML order, which is CUDA's order under
  ``CUDA_DEVICE_ORDER=PCI_BUS_ID``), 0 for the cards the plan does not use,
  so llama.cpp puts nothing there; empty for CPU-only plans;
- ``main_gpu``: the first card of the placement (where a one-card plan and
  the output of a split go in ``LLAMA_SPLIT_MODE_LAYER``);
- ``tensor_buft_overrides``: the plan's host-pinned tensors (MoE experts of
  the first ``n_cpu_moe`` blocks, llama.cpp's ``--n-cpu-moe``);
- context: n_ctx, n_batch clamped as ``Llama`` clamps it (to n_ctx, at least
  one token per sequence), n_ubatch clamped to n_batch, n_seq_max, kv_unified,
  type_k/type_v, flash attention (``on``/``off``/``auto`` to llama.cpp's
  enabled/disabled/auto), swa_full, offload_kqv.
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, Sequence

from sizing.memory import ContextConfig, Placement, backend_terms, draft_config, draft_placement
from sizing.model import GGML_TYPE_IDS

from ..errors import EngineFailure

if TYPE_CHECKING:
    from sizing.plan import Device, Plan

    from .cpu import RepackChoice

# llama.h enum values (llama-cpp-python 0.3.36 mirrors them as module constants).
LLAMA_SPLIT_MODE_LAYER = 1
LLAMA_FLASH_ATTN_TYPE_AUTO = -1
LLAMA_FLASH_ATTN_TYPE_DISABLED = 0
LLAMA_FLASH_ATTN_TYPE_ENABLED = 1
_FLASH_ATTN = {"auto": LLAMA_FLASH_ATTN_TYPE_AUTO, "off": LLAMA_FLASH_ATTN_TYPE_DISABLED, "on": LLAMA_FLASH_ATTN_TYPE_ENABLED}


@dataclass(frozen=True)
class ModelParams:
    """What ``llama_model_params`` receives from a plan (the fields this service sets)."""

    n_gpu_layers: int = 0
    main_gpu: int = 0
    tensor_split: tuple[float, ...] = ()
    """One proportion per device llama.cpp sees; empty: none given (CPU-only plans)."""
    cpu_overrides: tuple[str, ...] = ()
    """Tensor-name regexes whose tensors stay in host memory (``tensor_buft_overrides``)."""
    use_extra_bufts: bool = True
    """The CPU backend's repacked weight layouts (off: batch-invariant outputs, see the engine)."""
    load_mtp: bool = False
    """Load the NextN/MTP blocks' weights too (``llama_model_params.load_mtp``): MTP drafting (``service.engine.mtp``)."""
    rpc_workers: tuple[str, ...] = ()
    """ggml-rpc workers (``host:port``) whose devices are registered before the load, in this order: llama.cpp
    lists their devices first, so ``tensor_split`` gives them the first proportions (``device_params``)."""
    host_only: bool = False
    """Load with the CPU alone (``llama_model_params.devices``: an empty, NULL-terminated list): a CPU-only plan
    where a card's backend row says so (``sizing.memory.gpu.BackendTerms.cpu_plans_host_only``: Vulkan). Without it
    llama.cpp still creates every card's backend and ``op_offload`` runs large batches' ops on the first card, in a
    compute buffer the plan did not count there (lavapipe: 18 MiB for gemma-3-270m, 126 for SmolLM2-135M)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ModelParams":
        return cls(
            n_gpu_layers=int(d["n_gpu_layers"]), main_gpu=int(d["main_gpu"]),
            tensor_split=tuple(float(x) for x in d["tensor_split"]),
            cpu_overrides=tuple(str(x) for x in d["cpu_overrides"]), use_extra_bufts=bool(d["use_extra_bufts"]),
            load_mtp=bool(d.get("load_mtp", False)), rpc_workers=tuple(str(x) for x in d.get("rpc_workers", ())),
            host_only=bool(d.get("host_only", False)),
        )


@dataclass(frozen=True)
class ContextParams:
    """What ``llama_context_params`` receives from a plan's ``ContextConfig``."""

    n_ctx: int
    n_batch: int
    n_ubatch: int
    n_seq_max: int
    kv_unified: bool
    type_k: int
    type_v: int
    flash_attn_type: int
    swa_full: bool
    offload_kqv: bool
    embeddings: bool = False
    """An embedding context (``llama_context_params.embeddings``); its pooling type is the model's (the engine)."""
    mtp: bool = False
    """An MTP context (``ctx_type`` ``LLAMA_CONTEXT_TYPE_MTP``): the model's NextN block alone, its own KV cache of
    that layer (``service.engine.mtp``)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ContextParams":
        fields: dict[str, Any] = {k: (bool(v) if isinstance(v, bool) else int(v)) for k, v in d.items()}
        return cls(**fields)


def model_params(placement: Placement, device_indexes: Sequence[int] = (), *, n_devices: int = 0,
                 use_extra_bufts: bool = True) -> ModelParams:
    """llama.cpp's model parameters for a placement.

    ``device_indexes``: llama.cpp's index of each card the placement's ``gpus`` refer to
    (``Device.index``); ``n_devices``: how many devices llama.cpp sees (at least one past the
    highest index used).
    """
    pattern = placement.expert_override_pattern()
    overrides = (pattern,) if pattern else ()
    if placement.cpu_only:
        return ModelParams(cpu_overrides=overrides, use_extra_bufts=use_extra_bufts)
    indexes = [device_indexes[i] if i < len(device_indexes) else i for i in placement.gpus]
    split = [0.0] * max(max(indexes) + 1, n_devices)
    for idx, share in zip(indexes, placement.tensor_split or (1.0,) * len(indexes)):
        split[idx] = float(share)
    return ModelParams(n_gpu_layers=placement.n_gpu_layers, main_gpu=indexes[0], tensor_split=tuple(split),
                       cpu_overrides=overrides, use_extra_bufts=use_extra_bufts)


def device_params(placement: Placement, gpus: Sequence["Device"], *, use_extra_bufts: bool = True) -> ModelParams:
    """``model_params`` over the plan's devices as llama.cpp lists them: the workers' devices first, in the order
    their workers are registered (``ModelParams.rpc_workers``), then the local cards by their index."""
    rpc = [g.label for g in gpus if g.kind == "rpc"]
    indexes = [rpc.index(g.label) if g.kind == "rpc" else len(rpc) + g.index for g in gpus]
    mp = model_params(placement, indexes, n_devices=len(gpus), use_extra_bufts=use_extra_bufts)
    workers = rpc_endpoints(gpus)
    if placement.cpu_only and any(g.kind == "gpu" and backend_terms(g.backend.prefix).cpu_plans_host_only
                                  for g in gpus):  # sizing.plan.sizer.host_only: the plan's extra buffers
        mp = replace(mp, host_only=True)
    # A plan with nothing off the host connects to no worker (each serves one client).
    return replace(mp, rpc_workers=workers) if workers and not placement.cpu_only else mp



def rpc_endpoints(gpus: Sequence[Device]) -> tuple[str, ...]:
    """The workers of these devices, in the order their devices are listed (registered)."""
    return tuple(dict.fromkeys(g.endpoint for g in gpus if g.kind == "rpc" and g.endpoint))


def context_params(cfg: ContextConfig) -> ContextParams:
    """llama.cpp's context parameters for a configuration."""
    slots = max(1, cfg.n_seq_max)
    # Llama(n_batch=...) clamps n_batch to n_ctx and n_ubatch to n_batch; a batch holds one token per sequence.
    n_batch = max(min(cfg.n_batch, cfg.n_ctx), slots)
    # llama.cpp clamps n_batch to the unpadded n_ctx and aborts when that leaves fewer outputs than sequences
    # (src/llama-context.cpp: ``GGML_ASSERT(n_outputs_max <= cparams.n_outputs_max)`` in output_reserve), so a
    # context below the slot count (n_ctx 1 with 4 slots) would kill the process. Below 256 the cache is padded
    # to 256 cells either way: raising n_ctx to the slot count allocates the same.
    n_ctx = max(cfg.n_ctx, slots)
    return ContextParams(
        n_ctx=n_ctx, n_batch=n_batch, n_ubatch=min(cfg.n_ubatch, n_batch), n_seq_max=slots,
        kv_unified=cfg.kv_unified, type_k=GGML_TYPE_IDS[cfg.type_k], type_v=GGML_TYPE_IDS[cfg.type_v],
        flash_attn_type=_FLASH_ATTN[cfg.flash_attn], swa_full=cfg.swa_full, offload_kqv=cfg.offload_kqv,
        embeddings=cfg.embeddings, mtp=cfg.mtp_context,
    )


def embedding_context_params(cfg: ContextConfig) -> ContextParams | None:
    """The embedding context beside a plan's generation context (``ContextConfig.embedding_config``); None: none."""
    ecfg = cfg.embedding_config()
    return None if ecfg is None else context_params(ecfg)


def plan_params(plan: "Plan", *, use_extra_bufts: bool = True) -> tuple[ModelParams, ContextParams]:
    """Both parameter sets for a plan: its placement over its devices, its context configuration. The extra CPU
    buffer types are the plan's choice (``PlanRequest.cpu_repack``); ``use_extra_bufts=False`` turns them off
    whatever it says (the engine's batch-invariant mode)."""
    mp = device_params(plan.placement, plan.gpus, use_extra_bufts=use_extra_bufts and repack_of(plan).on)
    if plan.cfg.mtp:
        mp = replace(mp, load_mtp=True)
    return mp, context_params(plan.cfg)


def draft_params(plan: "Plan", *, use_extra_bufts: bool) -> tuple[ModelParams, ContextParams]:
    """Both parameter sets for the plan's draft model (``sizing.memory.draft``): whole on the card of the main
    model's output layer or the host, at the main context's size and sequences; the extra CPU buffer types as the
    main model's load has them (``use_extra_bufts``, ``plan_params``)."""
    draft = plan.draft
    assert draft is not None
    dpl, _ = draft_placement(plan.placement, draft.spec.n_layer_all, plan.model.n_layer_all)
    mp = device_params(dpl, plan.gpus, use_extra_bufts=use_extra_bufts)
    return mp, context_params(draft_config(plan.cfg))


def repack_of(plan: "Plan") -> "RepackChoice":
    """The plan's choice of extra CPU buffer types; a plan that leaves it open gets this host's safe default
    (``service.engine.cpu``: off where llama.cpp's AMX kernel crashes)."""
    from .cpu import RepackChoice, host_repack

    req = plan.request
    if req.cpu_repack is None:
        return host_repack("auto")
    return RepackChoice(req.cpu_repack, req.cpu_repack_reason or ("on" if req.cpu_repack else "off"))


def physical_cores() -> int:
    """CPU cores without SMT siblings, as llama.cpp's ``cpu_get_num_physical_cores`` counts them (common/common.cpp):
    distinct ``thread_siblings`` sets under /sys; the logical count where that cannot be read."""
    seen: set[str] = set()
    try:
        base = "/sys/devices/system/cpu"
        for name in os.listdir(base):
            if not (name.startswith("cpu") and name[3:].isdigit()):
                continue
            try:
                with open(f"{base}/{name}/topology/thread_siblings", encoding="ascii") as f:
                    seen.add(f.read().strip())
            except OSError:
                continue
    except OSError:
        pass
    return len(seen) or os.cpu_count() or 1


# ---- applying them (llama_cpp is imported here only, lazily) ----------------------------------


class _BuftOverride(ctypes.Structure):
    # struct llama_model_tensor_buft_override { const char * pattern; ggml_backend_buffer_type_t buft; } (llama.h)
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


_buft_lock = threading.Lock()
_cpu_buft: int | None = None


def _cpu_buffer_type() -> int:
    """ggml's CPU buffer type, from the libggml that llama-cpp-python ships."""
    global _cpu_buft
    with _buft_lock:
        if _cpu_buft is not None:
            return _cpu_buft
        from .native import libggml

        lib = libggml()
        if lib is None:
            raise EngineFailure("cannot find llama-cpp-python's libggml for tensor buffer overrides")
        buft = lib.ggml_backend_dev_buffer_type(lib.ggml_backend_dev_by_type(0))  # GGML_BACKEND_DEVICE_TYPE_CPU
        if not buft:
            raise EngineFailure("ggml has no CPU buffer type")
        _cpu_buft = int(buft)
        return _cpu_buft


def apply_model_params(mp: Any, params: ModelParams) -> list[Any]:
    """Write ``params`` into a ``llama_model_params`` struct; returns the ctypes objects it points to,
    which the caller keeps alive as long as the model (llama.cpp reads them during the load)."""
    import llama_cpp

    keep: list[Any] = []
    if params.rpc_workers:
        from .rpc import register_workers

        register_workers(params.rpc_workers)
    mp.n_gpu_layers = params.n_gpu_layers
    mp.split_mode = LLAMA_SPLIT_MODE_LAYER
    mp.main_gpu = params.main_gpu
    mp.use_extra_bufts = params.use_extra_bufts
    mp.load_mtp = params.load_mtp
    if params.host_only:
        none = (ctypes.c_void_p * 1)(None)  # NULL-terminated: no device but the CPU
        keep.append(none)
        mp.devices = ctypes.cast(none, ctypes.c_void_p)
    if params.tensor_split:
        n = max(len(params.tensor_split), llama_cpp.LLAMA_MAX_DEVICES)
        split = (ctypes.c_float * n)(*params.tensor_split)
        keep.append(split)
        mp.tensor_split = split
    if params.cpu_overrides:
        buft = _cpu_buffer_type()
        arr = (_BuftOverride * (len(params.cpu_overrides) + 1))()
        encoded = [p.encode("utf-8") for p in params.cpu_overrides]
        for i, pat in enumerate(encoded):
            arr[i].pattern = pat
            arr[i].buft = buft
        arr[len(encoded)].pattern = None  # NULL-terminated
        arr[len(encoded)].buft = None
        keep.extend((arr, encoded))
        mp.tensor_buft_overrides = ctypes.cast(arr, ctypes.c_void_p)
    return keep


def apply_context_params(cp: Any, params: ContextParams, *, n_threads: int | None = None,
                         n_threads_batch: int | None = None) -> None:
    """Write ``params`` (and the thread counts, default: the physical cores) into a ``llama_context_params``."""
    cp.n_ctx = params.n_ctx
    cp.n_batch = params.n_batch
    cp.n_ubatch = params.n_ubatch
    cp.n_seq_max = params.n_seq_max
    cp.kv_unified = params.kv_unified
    cp.type_k = params.type_k
    cp.type_v = params.type_v
    cp.flash_attn_type = params.flash_attn_type
    cp.swa_full = params.swa_full
    cp.offload_kqv = params.offload_kqv
    cp.embeddings = params.embeddings
    cp.ctx_type = 1 if params.mtp else 0  # LLAMA_CONTEXT_TYPE_MTP / _DEFAULT
    cores = physical_cores()
    cp.n_threads = n_threads or cores
    cp.n_threads_batch = n_threads_batch or n_threads or cores
