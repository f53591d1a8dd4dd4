"""GPU terms: what a CPU dry run cannot show, and the bound every GPU plan carries for what no dry run shows.

From the ggml-cuda sources vendored by llama-cpp-python 0.3.36 (``ggml/src/ggml-cuda/``):

In the compute buffer, so a dry run **on a CUDA build** measures them (the plan
then uses the measurement); added to the simulated GPU compute buffer otherwise
(``unseen_compute_bytes``):

- flash attention with a quantized K/V: ``ggml_backend_cuda_buffer_type_get_alloc_size``
  sizes the ``FLASH_ATTN_EXT`` tensor with ``ggml_cuda_flash_attn_ext_get_alloc_size``
  (``fattn.cu``), which appends F16 copies of K and V (``fattn-common.cuh``,
  ``ggml_cuda_flash_attn_ext_get_f16_extra_data``: ``ggml_nelements(K) * 2`` bytes, 128-aligned)
  for the tile / MMA kernels;
- ``op_offload``: under partial offload, batches of 32+ tokens run host-resident
  weights' ops on the GPU and copy the weights into its compute buffer
  (``ggml_backend_sched``, ``src/llama-context.cpp`` ``op_offload``);
- pipeline parallelism (layer split over several GPUs, everything offloaded):
  ``GGML_SCHED_MAX_COPIES = 4`` copies of the split inputs (``ggml-backend.cpp``).

Outside every buffer, so no dry run sees them: the **CUDA pool** and the **cuBLAS
workspace**. ``cuda_pool_bound_bytes`` bounds them per device and every GPU plan
adds it (``sizing.memory.estimate.DeviceMemory.pool_bytes``), beside the CUDA context
allowance:

- cuBLAS workspace: 32 MiB per stream on Hopper and newer, 4 MiB before
  (``ggml_backend_cuda_context::cublas_handle``, ``common.cuh``); the bound takes 32 MiB;
- the legacy pool rounds each request up by 5% and to 256 bytes (``ggml_cuda_pool_leg::alloc``,
  ``look_ahead_size = 1.05 * size``) and keeps freed buffers for reuse, so a bound is the sum
  of the largest temporaries of each kind, each times 1.05;
- ``ggml_cuda_mul_mat_batched_cublas`` / ``ggml_cuda_op_mul_mat_cublas``: the F16 copy of
  ``src1`` (``src1_alloc``): ``n_ubatch x widest input x 2`` bytes (MMQ's q8_1 copy of the
  same rows is smaller); weights are read by MMQ/MMVQ without an F16 copy for the quantized
  types of this project (cards without int8 MMQ are not bounded here);
- ``ggml_cuda_mul_mat_id`` (MoE): ``src1_sorted`` and ``dst_sorted``,
  ``n_ubatch x n_expert_used x (n_embd + n_ff_exp) x 4`` bytes;
- flash attention's ``dst_tmp`` / ``dst_tmp_meta`` for split-K decoding: bounded by the
  attention output of the ubatch in F32 times 2.

A bound from reading the source, not a measurement: ``bench/offload_gpu.py`` measures it on a
GPU machine (NVML peak against llama.cpp's figures).
"""

from __future__ import annotations

from .context import ContextConfig
from ..model.ggml import cache_type
from .kv import kv_cells, kv_layers
from .placement import Placement
from ..model.spec import ModelSpec

F32 = 4
F16 = 2
MIB = 1 << 20

CUBLAS_WORKSPACE_BYTES = 32 * MIB
"""``cublas_workspace_sizes``: 32 MiB on compute capability >= Hopper, else 4 MiB (``common.cuh``)."""
POOL_LOOK_AHEAD = 1.05
"""``ggml_cuda_pool_leg::alloc``: ``look_ahead_size = 1.05 * size``, rounded to 256 bytes."""
PIPELINE_PARALLEL_COPIES = 4
"""``GGML_SCHED_MAX_COPIES`` (ggml/src/ggml-backend.cpp)."""
OP_OFFLOAD_MIN_BATCH = 32
"""The CUDA backend's ``offload_op`` threshold: ops on host weights move to the GPU for batches of 32+."""


def _pool(n: int) -> int:
    return 256 * ((int(n * POOL_LOOK_AHEAD) + 255) // 256)


def _widest_input(spec: ModelSpec) -> int:
    """The widest matmul input row (n_embd, n_ff, the attention output, the expert FFN)."""
    widths = [spec.n_embd]
    for layer in spec.layers[: spec.n_layer]:
        widths.append(layer.n_ff)
        widths.append(layer.n_head * layer.n_embd_head_v)
    md = spec.metadata.get(f"{spec.architecture}.expert_feed_forward_length")
    if isinstance(md, int) and not isinstance(md, bool):
        widths.append(md)
    return max(widths)


def fa_dequant_bytes(spec: ModelSpec, cfg: ContextConfig, flash: bool) -> int:
    """The F16 copies of a quantized K and V that one ``FLASH_ATTN_EXT`` tensor's allocation carries on CUDA
    (``ggml_cuda_flash_attn_ext_get_f16_extra_data``): K and V views of the largest cache, 128-aligned."""
    if not flash:
        return 0
    tk, tv = cache_type(cfg.type_k), cache_type(cfg.type_v)
    if not (tk.quantized or tv.quantized):
        return 0
    cells = kv_cells(spec, cfg)
    n_kv = max(cells.full, cells.swa)
    layers = kv_layers(spec)
    k = max((l.n_head_kv * l.n_embd_head_k for l in layers), default=0)
    v = max((l.n_head_kv * l.n_embd_head_v for l in layers), default=0)
    n = (F16 * n_kv * k if tk.quantized else 0) + (F16 * n_kv * v if tv.quantized else 0)
    return 256 + n if n else 0


def op_offload_bytes(spec: ModelSpec, cfg: ContextConfig) -> int:
    """With host-resident layers, a batch of 32+ tokens copies the largest host layer's weights to the GPU."""
    if cfg.n_ubatch_effective < OP_OFFLOAD_MIN_BATCH:
        return 0
    return max((l.weights_bytes for l in spec.layers[: spec.n_layer]), default=0)


def pipeline_parallel_bytes(spec: ModelSpec, cfg: ContextConfig) -> int:
    """Extra input copies with pipeline parallelism: ``(GGML_SCHED_MAX_COPIES - 1)`` copies of the F32
    ``[n_embd, n_ubatch]`` input each device's split receives."""
    return (PIPELINE_PARALLEL_COPIES - 1) * F32 * spec.n_embd * cfg.n_ubatch_effective


def unseen_compute_bytes(spec: ModelSpec, cfg: ContextConfig, flash: bool, placement: Placement, pos: int,
                         has_host_layers: bool) -> int:
    """What the CUDA compute buffer of the placement's ``pos``-th GPU holds beyond the CPU graph's peak."""
    extra = fa_dequant_bytes(spec, cfg, flash)
    if has_host_layers and pos == 0:
        extra += op_offload_bytes(spec, cfg)
    if len(placement.gpus) > 1 and not has_host_layers:
        extra += pipeline_parallel_bytes(spec, cfg)
    return extra


def cuda_pool_bound_bytes(spec: ModelSpec, cfg: ContextConfig, flash: bool) -> int:
    """A per-device bound on the CUDA pool and the cuBLAS workspace (outside every llama.cpp buffer)."""
    n_ub = cfg.n_ubatch_effective
    total = CUBLAS_WORKSPACE_BYTES
    total += _pool(F16 * n_ub * _widest_input(spec))
    if spec.n_expert and spec.n_expert_used:
        ff_exp = spec.metadata.get(f"{spec.architecture}.expert_feed_forward_length")
        f = ff_exp if isinstance(ff_exp, int) and not isinstance(ff_exp, bool) else _widest_input(spec)
        total += _pool(F32 * n_ub * spec.n_expert_used * (spec.n_embd + f))
    if flash:
        layers = kv_layers(spec)
        out = max((l.n_head * l.n_embd_head_v for l in layers), default=0)
        total += _pool(2 * F32 * n_ub * out)
    return total
