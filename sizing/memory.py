"""Bytes per device for a model, a placement and a context configuration.

Pure: ``estimate(spec, cfg, placement, devices)`` returns a ``MemoryEstimate``
that every figure a user sees is read from (dry-run, refusal, status, page).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .compute import compute_bytes, host_compute_bytes
from .config import ContextConfig
from .devices import MIB, Device
from .errors import FlashAttentionRequiredError
from .ggml import cache_type
from .kv import KvCells, check_cache_types, kv_bytes, kv_cells
from .placement import Placement
from .spec import ModelSpec

DEFAULT_GPU_ALLOWANCE_BYTES = 500 * 1000 * 1000
"""Untracked per-GPU memory (CUDA context, cuBLAS workspace): the second source document's 500 MB."""


def resolve_flash_attn(cfg: ContextConfig) -> bool:
    """The flash-attention decision llama.cpp will act on, refusing what it would refuse.

    Mirrors ``llama_init_from_model`` (src/llama-context.cpp): a quantized V cache
    with flash attention disabled fails context creation. This service also
    refuses a quantized K with flash attention off (llama.cpp accepts it, but
    CUDA then dequantizes the whole K view every step); ``auto`` resolves to
    on, as llama.cpp's fused-op probe does on the CPU and CUDA backends.
    """
    quantized = [f"{k}={t}" for k, t in (("type_k", cfg.type_k), ("type_v", cfg.type_v)) if cache_type(t).quantized]
    if cfg.flash_attn == "off":
        if quantized:
            raise FlashAttentionRequiredError(
                f"KV cache type_k={cfg.type_k}, type_v={cfg.type_v}: quantized {' and '.join(quantized)} "
                "needs flash attention, but flash_attn is 'off'; set flash_attn to 'on' or 'auto', or use an f16 cache"
            )
        return False
    return True


@dataclass(frozen=True)
class DeviceMemory:
    """Predicted bytes on one device."""

    device: str
    """llama.cpp's name for it: ``CPU`` or ``CUDA<n>``."""
    weights_bytes: int = 0
    kv_bytes: int = 0
    compute_bytes: int = 0
    output_bytes: int = 0
    allowance_bytes: int = 0
    layers: tuple[int, ...] = ()

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.compute_bytes + self.output_bytes + self.allowance_bytes

    def to_json(self) -> dict[str, object]:
        return {
            "device": self.device,
            "layers": list(self.layers),
            "weights_mib": round(self.weights_bytes / MIB, 2),
            "kv_mib": round(self.kv_bytes / MIB, 2),
            "compute_mib": round(self.compute_bytes / MIB, 2),
            "output_mib": round(self.output_bytes / MIB, 2),
            "allowance_mib": round(self.allowance_bytes / MIB, 2),
            "total_mib": round(self.total_bytes / MIB, 2),
        }


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-device prediction: host first, then each GPU of the placement."""

    cfg: ContextConfig
    flash_attn: bool
    kv_cells: KvCells
    host: DeviceMemory
    gpus: tuple[DeviceMemory, ...] = ()

    @property
    def total_bytes(self) -> int:
        return self.host.total_bytes + sum(g.total_bytes for g in self.gpus)

    @property
    def kv_bytes(self) -> int:
        return self.host.kv_bytes + sum(g.kv_bytes for g in self.gpus)

    @property
    def devices(self) -> tuple[DeviceMemory, ...]:
        return (self.host, *self.gpus)


def output_buffer_bytes(spec: ModelSpec, cfg: ContextConfig) -> int:
    """Host output buffer at context creation: F32 logits for n_seq_max outputs.

    ``llama_context::output_reserve(n_seq_max)`` (src/llama-context.cpp) sizes it
    ``n_vocab * max(n_outputs, n_seq_max) * 4``; it grows on demand when a batch
    asks for more outputs (up to ``n_vocab * n_batch * 4`` when every token is an output).
    """
    return spec.n_vocab * max(1, cfg.n_seq_max) * 4


def estimate(
    spec: ModelSpec,
    cfg: ContextConfig,
    placement: Placement = Placement(),
    *,
    gpu_labels: Sequence[str] = (),
    allowance_bytes: int = DEFAULT_GPU_ALLOWANCE_BYTES,
) -> MemoryEstimate:
    """Predict what llama.cpp allocates on each device for this placement and context."""
    flash = resolve_flash_attn(cfg)
    check_cache_types(spec, cfg, flash)
    n_all = spec.n_layer_all
    slots = placement.slots(n_all)
    labels = list(gpu_labels) or [f"CUDA{g}" for g in placement.gpus]
    per_gpu_layers: list[list[int]] = [[] for _ in placement.gpus]
    host_layers: list[int] = []
    for il in range(n_all):
        d = slots[il]
        (host_layers if d is None else per_gpu_layers[d]).append(il)
    out_dev = slots[n_all]

    def layer_weights(layers: Sequence[int]) -> int:
        return sum(spec.layers[il].weights_bytes for il in layers)

    # Host: token embedding always, host layers, the output layer when not offloaded.
    host_w = spec.token_embd_bytes + layer_weights(host_layers)
    other = spec.weights_bytes - spec.token_embd_bytes - spec.output_bytes - layer_weights(range(n_all))
    if out_dev is None:
        host_w += spec.output_bytes + max(other, 0)
    kv_host = kv_bytes(spec, cfg, flash, host_layers) if (host_layers or placement.cpu_only) else 0
    if not cfg.offload_kqv:
        kv_host = kv_bytes(spec, cfg, flash)
    cells = kv_cells(spec, cfg)
    graph = compute_bytes(spec, cfg, flash)
    # MoE experts of blocks below n_cpu_moe stay in host memory (tensor_buft_overrides), wherever their block runs.
    pinned = [il for il in range(min(placement.n_cpu_moe, n_all)) if slots[il] is not None]
    host_w += sum(spec.layers[il].expert_bytes for il in pinned)
    gpus: list[DeviceMemory] = []
    for pos, layers in enumerate(per_gpu_layers):
        w = layer_weights(layers) - sum(spec.layers[il].expert_bytes for il in layers if il < placement.n_cpu_moe)
        if out_dev == pos:
            w += spec.output_layer_bytes if spec.output_tied else spec.output_bytes + max(other, 0)
        gpus.append(
            DeviceMemory(
                device=labels[pos],
                weights_bytes=w,
                kv_bytes=kv_bytes(spec, cfg, flash, layers) if cfg.offload_kqv and layers else 0,
                compute_bytes=graph,
                allowance_bytes=allowance_bytes,
                layers=tuple(layers),
            )
        )
    host = DeviceMemory(
        device="CPU",
        weights_bytes=host_w,
        kv_bytes=kv_host,
        compute_bytes=graph if placement.cpu_only else host_compute_bytes(spec, cfg),
        output_bytes=output_buffer_bytes(spec, cfg),
        layers=tuple(host_layers),
    )
    return MemoryEstimate(cfg=cfg, flash_attn=flash, kv_cells=cells, host=host, gpus=tuple(gpus))


def fits(est: MemoryEstimate, gpus: Sequence[Device], host: Device | None) -> bool:
    """Every GPU's need within its free memory, and the host's within MemAvailable when given."""
    for need, dev in zip(est.gpus, gpus):
        if need.total_bytes > dev.free_bytes:
            return False
    if host is not None and est.host.total_bytes > host.free_bytes:
        return False
    return True
