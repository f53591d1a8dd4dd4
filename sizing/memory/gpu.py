"""GPU terms per backend: what a CPU dry run cannot show, and the bound every GPU plan carries for what no dry run
shows. A backend is a row of ``BACKENDS`` (``terms``): CUDA's (and ROCm's and MUSA's: ggml-cuda built for HIP and
MUSA), and Vulkan's; a backend without a row of its own (SYCL, Metal, CANN) is planned with CUDA's, the largest.

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

From ``ggml/src/ggml-vulkan/`` of the same llama.cpp, for a Vulkan card (``vulkan_scratch``):

- every device allocation goes through ``ggml_vk_create_buffer`` (``ggml-vulkan-buffers.cpp``, the one place
  ``GGML_VK_MEMORY_LOGGER=1`` logs): llama.cpp's buffers (weights, KV, compute, the ``Vulkan_Host`` output and
  compute copies: the dry run measures them) and four scratch buffers per backend context that no dry run sees,
  grown to the largest request of any graph run so far (``ggml_vk_preallocate_buffers``): ``prealloc_x`` (F16 copies
  of a quantized K and V for flash attention over 64+ query rows, ``ggml_vk_flash_attn``'s ``use_dequant_kv``;
  contiguous copies of a non-contiguous matmul input: K and V views without flash attention), ``prealloc_y`` (matmul
  inputs converted to F16 or Q8_1; flash attention's mask and sparse-index scratch), ``prealloc_split_k`` (split-K
  partial results of matmuls and flash attention) and ``prealloc_add_rms_partials`` (1 KiB, fixed). They grow with
  the cells in use (a K/V view spans the cells used so far, padded to 256), so a card full after the first prompt
  can fail at a later, longer one: ``vulkan_scratch`` bounds each at the context's full size;
- a weight whose op ggml-vulkan refuses stays in host memory (``vulkan_refuses``): ``supports_op`` rejects every
  op with a source or result larger than the device's ``maxStorageBufferRange`` (without
  ``VK_EXT_shader_64bit_indexing``) or ``maxBufferSize``, and ``select_weight_buft`` (src/llama-model-loader.cpp)
  then goes down the buffer list to the CPU (measured on lavapipe, a 128 MiB range: gemma-3-270m's tied q8_0
  output, 170 MiB, and its 512-row test result, 512 MiB, stay in ``CPU_Mapped``). The limit is ggml's own answer,
  read in the device child (``service.engine.devices``: the largest tensor ``ggml_backend_dev_supports_op`` takes),
  as are the buffer alignment and largest buffer;
- the device context itself (instance, pipelines, descriptor pools, command buffers) is the driver's, outside
  ggml's allocations: ``VULKAN_ALLOWANCE_BYTES``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .context import ContextConfig
from ..model.ggml import cache_type
from .kv import kv_cells, kv_layers
from .placement import Placement
from ..model.spec import ModelSpec, SsmSpec, TensorInfo

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


# ---- Vulkan (ggml/src/ggml-vulkan/ggml-vulkan.cpp) -----------------------------------------------------------------

VULKAN_ALLOWANCE_BYTES = 64 * MIB
"""What a Vulkan device context holds outside ggml's buffers (``GGUF_VULKAN_ALLOWANCE_MIB``): the driver's
pipelines, descriptor pools and command buffers (ggml-vulkan's own device memory all goes through
``ggml_vk_create_buffer``: llama.cpp's buffers and ``vulkan_scratch``). Not a CUDA context: no runtime, no cuBLAS."""
VK_ADD_RMS_PARTIALS_BYTES = 1024
"""``prealloc_size_add_rms_partials``: fixed at 1 KiB (``ggml_vk_init``), used only where the partials fit."""
VK_SPLIT_K_MAX = 8
"""``ggml_vk_guess_split_k``: a matmul is split in at most 8 along K, and only where K >= 2048."""
VK_SPLIT_K_MIN_K = 2048
VK_FA_DEQUANT_MIN_ROWS = 64
"""``ggml_vk_flash_attn``: quantized K and V are dequantized to F16 once per graph for 64+ query rows."""
VK_FA_ROWS_MAX = 64
"""The most query rows a flash-attention workgroup takes (``Br`` of the scalar and coopmat shapes)."""
VK_CORES_BOUND = 256
"""``shader_core_count`` times Intel's 2, bounded: flash attention splits K into at most ``2 x cores / workgroups``
parts (16 cores where the driver reports none, as lavapipe). Above any card's (an RX 7900 XTX has 96 compute units,
an RTX 5090 170 SMs, an Arc A770 32 Xe cores, counted twice); ggml does not report the figure."""
VK_SOFTMAX_LARGE_COLS = 16384
"""``ggml_vk_soft_max``: rows longer than this run in two passes with an F32 scratch in ``prealloc_x`` and ``_y``."""
VK_TEST_ROWS = 512
"""``weight_buft_supported`` (src/llama-model-loader.cpp) tries each weight's op on 512 rows of F32 activations."""


@dataclass(frozen=True)
class VulkanScratch:
    """The bound on ggml-vulkan's scratch buffers of one backend context (one card, one llama.cpp context), each at
    the largest request any graph of this configuration makes (bytes)."""

    x_bytes: int
    y_bytes: int
    split_k_bytes: int
    partials_bytes: int = VK_ADD_RMS_PARTIALS_BYTES

    @property
    def total_bytes(self) -> int:
        return self.x_bytes + self.y_bytes + self.split_k_bytes + self.partials_bytes


def vulkan_scratch(spec: ModelSpec, cfg: ContextConfig, flash: bool, layers: tuple[int, ...] | None = None
                   ) -> VulkanScratch:
    """Bound each of ggml-vulkan's four scratch buffers for a context of ``cfg`` on one card holding ``layers``
    (None: every block), mirroring what each op asks ``ggml_vk_preallocate_buffers`` for:

    - ``prealloc_x``: flash attention over quantized K and V with 64+ query rows dequantizes the views to F16
      (``k_f16_sz + v_f16_sz``: every cell in use, of every stream in the batch); without flash attention the K and V
      views are not contiguous and ``ggml_vk_mul_mat_q_f16`` copies them (``x_non_contig``: F16, the larger view);
      soft_max over rows longer than 16,384 cells keeps one F32 per 512 columns per row;
    - ``prealloc_y``: a matmul's activations converted for the shader (``y_non_contig`` or ``quantize_y``: at most
      F16 of the widest input of a ubatch; MoE's ``mul_mat_id`` per used expert); without flash attention the
      ``kq`` rows ``kqv`` reads (cells x rows x heads in F16); flash attention's mask and sparse-index scratch (an
      int per cell and row);
    - ``prealloc_split_k``: matmuls with K >= 2048 split in at most 8 (``d_sz * split_k``, F32 results of the
      ubatch); flash attention's split-K partials (``(HSV + 2) x rows x heads`` F32 per split, the splits at most
      ``2 x cores`` workgroups' worth);
    - ``prealloc_add_rms_partials``: 1 KiB.
    """
    layer_set = set(range(spec.n_layer)) if layers is None else {il for il in layers if il < spec.n_layer}
    cells = kv_cells(spec, cfg)
    n_kv = max(cells.full, cells.swa) * cfg.n_stream
    n_ub = cfg.n_ubatch_effective
    att = [l for l in kv_layers(spec) if l.index in layer_set]
    kw = max((l.n_head_kv * l.n_embd_head_k for l in att), default=0)
    vw = max((l.n_head_kv * l.n_embd_head_v for l in att), default=0)
    n_head = max((l.n_head for l in att), default=0)
    hsv = max((l.n_embd_head_v for l in att), default=0)
    tk, tv = cache_type(cfg.type_k), cache_type(cfg.type_v)
    x = y = split = 0
    if att:
        if flash:
            if tk.quantized and tv.quantized and n_ub >= VK_FA_DEQUANT_MIN_ROWS:
                x = F16 * n_kv * (kw + vw)
            y = F32 * n_kv * n_ub  # mask_opt (smaller) or the sparse indexes: an int per cell and row
            rows = max(min(n_ub, VK_FA_ROWS_MAX), max(1, n_head // max(1, min(l.n_head_kv for l in att))))
            split = (hsv + 2) * F32 * rows * 2 * VK_CORES_BOUND
        else:
            x = F16 * n_kv * max(kw, vw)
            y = F16 * n_kv * n_ub * n_head
            if n_kv > VK_SOFTMAX_LARGE_COLS:
                big = F32 * -(-n_kv // 512) * n_ub * n_head
                x, y = max(x, big), max(y, big)
    widest = 0
    split_rows = 0
    for t in spec.tensors:
        if t.layer is None or t.layer not in layer_set or len(t.shape) < 2 or t.name.startswith("token_embd."):
            continue
        widest = max(widest, t.shape[0])
        if t.shape[0] >= VK_SPLIT_K_MIN_K:
            split_rows = max(split_rows, t.shape[1])
    y = max(y, F16 * n_ub * widest)
    if spec.n_expert_used:
        y = max(y, F16 * n_ub * spec.n_expert_used * widest)
    split = max(split, F32 * VK_SPLIT_K_MAX * n_ub * split_rows)
    return VulkanScratch(x, y, split)


def vulkan_scratch_bytes(spec: ModelSpec, cfg: ContextConfig, flash: bool, layers: tuple[int, ...] | None = None) -> int:
    return vulkan_scratch(spec, cfg, flash, layers).total_bytes


def vulkan_test_op_bytes(t: TensorInfo, n_expert_used: int = 0, op: str | None = None) -> int:
    """The largest tensor of the op llama.cpp tries ``t`` with (``weight_buft_supported``): MUL_MAT against F32
    ``[ne0, 512, ne2, ne3]`` (result ``[ne1, 512, ...]``), MUL_MAT_ID for experts (``[ne0, n_used, 512]``), ADD for a
    bias and MUL for a norm (an F32 operand of the weight's shape), GET_ROWS for an embedding (512 rows gathered);
    ``op`` names it where the tensor does not say (``MUL_MAT``: a tied head's second use of the embedding)."""
    shape = tuple(t.shape) + (1,) * (4 - len(t.shape))
    n = 1
    for d in t.shape:
        n *= d
    if op is None:
        if t.name.endswith(".bias") or len(t.shape) < 2:
            op = "ELEMENTWISE"
        elif "_exps." in t.name and len(t.shape) == 3:
            op = "MUL_MAT_ID"
        else:
            op = "MUL_MAT"
    if op == "ELEMENTWISE":
        return max(t.n_bytes, F32 * n)
    if op == "GET_ROWS":  # 512 rows of the weight gathered, F32
        return max(t.n_bytes, F32 * shape[0] * VK_TEST_ROWS)
    if op == "MUL_MAT_ID":
        used = max(n_expert_used, 1)
        return max(t.n_bytes, F32 * shape[0] * used * VK_TEST_ROWS, F32 * shape[1] * used * VK_TEST_ROWS)
    return max(t.n_bytes, F32 * shape[0] * VK_TEST_ROWS * shape[2] * shape[3],
               F32 * shape[1] * VK_TEST_ROWS * shape[2] * shape[3])


VK_SSM_SCAN_STATES = (128, 256)
"""``ggml_backend_vk_device_supports_op``'s SSM_SCAN: Mamba-2's scan only (``src[3]``, the weight ``ssm_a``, one float
a head), with d_state 128 or 256 and a head size that is a multiple of 16."""


def vulkan_refuses(t: TensorInfo, max_tensor_bytes: int, n_expert_used: int = 0, op: str | None = None,
                   ssm: SsmSpec | None = None) -> bool:
    """Whether ggml-vulkan's ``supports_op`` refuses ``t``'s op on a card whose largest tensor is
    ``max_tensor_bytes`` (0: not known, nothing refused): a source or result past it, or (``ssm``: the model's
    recurrent shape) a scan ggml-vulkan has no shader for, Mamba-1's (``ssm_a`` of ``d_state x d_inner``): that weight
    stays on the host (measured: Mamba-1.4B's 48 ``ssm_a`` beside a lavapipe card)."""
    if max_tensor_bytes <= 0:
        return False
    if ssm is not None and op is None and t.name.endswith(".ssm_a") and _vulkan_scan_refused(t, ssm):
        return True
    return vulkan_test_op_bytes(t, n_expert_used, op) > max_tensor_bytes


def _vulkan_scan_refused(t: TensorInfo, ssm: SsmSpec) -> bool:
    """SSM_SCAN as ``weight_buft_supported`` tries it: ``d_state`` is ``ssm_a``'s first dimension unless that is 1
    (Mamba-2: ``ssm.state_size``), the head size ``d_inner / n_head`` (``ssm_a``'s second dimension)."""
    mamba2 = t.shape[0] == 1 or len(t.shape) == 1
    if not mamba2:
        return True
    n_head = t.shape[-1] if t.shape[-1] > 1 else 1
    return ssm.d_state not in VK_SSM_SCAN_STATES or (ssm.d_inner // max(n_head, 1)) % 16 != 0


# ---- the table -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BackendTerms:
    """One GPU backend's row: what a card of it holds beyond the buffers llama.cpp's dry run measures."""

    prefix: str
    """ggml's name for its devices less the number (``CUDA``, ``Vulkan``)."""
    allowance_bytes: int | None
    """The device context outside every buffer; None: the request's (``GGUF_GPU_ALLOWANCE_MIB``, CUDA's)."""
    pool: Callable[[ModelSpec, ContextConfig, bool, "tuple[int, ...] | None"], int]
    """The bound on what the backend allocates outside llama.cpp's buffers (CUDA's pool and cuBLAS workspace,
    Vulkan's scratch), for a card holding these layers."""
    fa_dequant_in_compute: bool
    """Flash attention's F16 copies of a quantized K/V are in the compute buffer (CUDA's ``get_alloc_size``), so a
    CPU dry run misses them; Vulkan's are in its scratch (``pool``)."""
    refuses_large_tensors: bool = False
    """``supports_op`` refuses ops on tensors past the card's largest (``Device.max_tensor_bytes``)."""
    layer_phases_off_head: bool = False
    """Before llama.cpp's dry run measures it, a card without the output head is given its layers' phases
    (``layers_compute_bytes``: the logits are not there) rather than the whole graph's peak, which would keep the
    plan's search from ever trying it (a GPU backend's plans are all calibrated). CUDA's keeps the whole graph, the
    figures its tests hold."""
    stages_weights: bool = False
    """The host keeps a staging buffer per card as large as the largest weight loaded there, for the card's lifetime
    (ggml-vulkan's ``device->sync_staging``: ``ggml_backend_tensor_set`` from the mapped file, where the card's
    memory is not host-visible: ``ggml_vk_buffer_write_2d``), counted in the host's ``pool_bytes`` (a bound: a card
    whose memory the host maps, as lavapipe's, allocates none)."""
    maps_span: bool = False
    """The host's mapped weights are predicted as llama.cpp logs them, the span of the file from the first to the last
    tensor the CPU buffer keeps (``sizing.memory.estimate._mapped_span``); without it, their sum. The span is
    llama.cpp's for every backend; CUDA's plans keep the sum, the figures its tests hold (equal where the host's
    tensors lie together in the file)."""
    cpu_plans_host_only: bool = False
    """A plan with no layer on the cards loads with the CPU alone (``service.engine.params.ModelParams.host_only``):
    llama.cpp would otherwise run large batches' ops on the first card (``op_offload``) in a compute buffer the plan
    does not hold there. Vulkan's: its free memory is often not reported, so what a plan does not count there is
    not seen at all. CUDA's plans keep op_offload, as before."""
    weights_padded: bool = False
    """A weight takes ``ggml_nbytes`` padded to the buffer type's alignment (``get_alloc_size`` is ``ggml_nbytes``:
    Vulkan); CUDA's pads quantized rows its own way, in the figures its tests hold."""
    source: str = ""


@dataclass(frozen=True)
class Card:
    """What an estimate needs of one card of a placement beyond its label: its backend's row, and ggml's figures
    for it (``sizing.plan.device.Device``)."""

    backend: str = "CUDA"
    allowance_bytes: int | None = None
    """The device context to keep free there; None: the backend row's, else the estimate's ``allowance_bytes``."""
    alignment_bytes: int = 0
    """``ggml_backend_buft_get_alignment`` of its buffer type; 0: not read."""
    max_tensor_bytes: int = 0
    """The largest tensor its backend's ops take (``ggml_backend_dev_supports_op``); 0: not read, no limit."""


def _cuda_pool(spec: ModelSpec, cfg: ContextConfig, flash: bool, layers: tuple[int, ...] | None = None) -> int:
    return cuda_pool_bound_bytes(spec, cfg, flash)


CUDA_TERMS = BackendTerms("CUDA", None, _cuda_pool, fa_dequant_in_compute=True,
                          source="ggml/src/ggml-cuda: the CUDA context (GGUF_GPU_ALLOWANCE_MIB), the pool bound")
VULKAN_TERMS = BackendTerms("Vulkan", VULKAN_ALLOWANCE_BYTES, vulkan_scratch_bytes, fa_dequant_in_compute=False,
                            refuses_large_tensors=True, weights_padded=True, cpu_plans_host_only=True,
                            layer_phases_off_head=True, maps_span=True, stages_weights=True,
                            source="ggml/src/ggml-vulkan: its scratch buffers bounded, large tensors refused")
BACKENDS: dict[str, BackendTerms] = {
    "CUDA": CUDA_TERMS,
    "ROCm": BackendTerms("ROCm", None, _cuda_pool, True, source="ggml-cuda built for HIP: CUDA's terms"),
    "MUSA": BackendTerms("MUSA", None, _cuda_pool, True, source="ggml-cuda built for MUSA: CUDA's terms"),
    "Vulkan": VULKAN_TERMS,
}


def terms(prefix: str) -> BackendTerms:
    """The row of a backend by its devices' name prefix (``Vulkan`` of ``Vulkan0``); CUDA's where it has none of
    its own (SYCL, Metal, CANN: planned with the largest terms, an allowance and a pool)."""
    return BACKENDS.get(prefix, CUDA_TERMS)


def unseen_compute_for(row: BackendTerms, spec: ModelSpec, cfg: ContextConfig, flash: bool, placement: Placement,
                       pos: int, has_host_layers: bool) -> int:
    """``unseen_compute_bytes`` for a card of ``row``'s backend: Vulkan's compute buffer has no F16 K/V copies."""
    extra = unseen_compute_bytes(spec, cfg, flash, placement, pos, has_host_layers)
    if not row.fa_dequant_in_compute:
        extra -= fa_dequant_bytes(spec, cfg, flash)
    return extra
