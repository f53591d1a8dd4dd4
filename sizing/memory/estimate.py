"""Bytes per device for a model, a placement and a context configuration.

Pure: ``estimate(spec, cfg, placement, devices)`` returns a ``MemoryEstimate``
that every figure a user sees is read from (dry-run, refusal, status, page).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Sequence

from ..model import arch as archs
from . import gpu
from .compute import compute_bytes, host_compute_bytes, layers_compute_bytes
from .context import ContextConfig
from .draft import DraftModel, draft_config, draft_placement
from .mtp import MtpMemory, hidden_rows_bytes, mtp_config
from .projector import Projector, ProjectorMemory, projector_memory
from ..units import MIB, gpu_label, mib
from ..errors import FlashAttentionRequiredError
from ..model.ggml import cache_type
from .repack import EXTRA_BUFFERS, buffer_of, extra_buffer_bytes
from .kv import KvCells, check_cache_types, kv_cells, kv_split_bytes, recurrent_state_bytes
from .measured import Figures, Source
from .placement import Placement
from ..model.spec import ModelSpec, TensorInfo

DEFAULT_GPU_ALLOWANCE_BYTES = 500 * 1000 * 1000
"""Untracked per-GPU memory (CUDA context, cuBLAS workspace): the second source document's 500 MB."""


def resolve_flash_attn(cfg: ContextConfig, spec: ModelSpec | None = None) -> bool:
    """The flash-attention decision llama.cpp will act on, refusing what it would refuse.

    Mirrors ``llama_init_from_model`` (src/llama-context.cpp): a quantized V cache
    with flash attention disabled fails context creation. This service also
    refuses a quantized K with flash attention off (llama.cpp accepts it, but
    CUDA then dequantizes the whole K view every step); ``auto`` resolves to
    on, as llama.cpp's fused-op probe does on the CPU and CUDA backends, except
    for the architectures llama.cpp forces off (grok).
    """
    quantized = [f"{k}={t}" for k, t in (("type_k", cfg.type_k), ("type_v", cfg.type_v)) if cache_type(t).quantized]
    if cfg.flash_attn == "off":
        if quantized:
            raise FlashAttentionRequiredError(
                f"KV cache type_k={cfg.type_k}, type_v={cfg.type_v}: quantized {' and '.join(quantized)} "
                "needs flash attention, but flash_attn is 'off'; set flash_attn to 'on' or 'auto', or use an f16 cache"
            )
        return False
    if spec is not None and archs.traits(spec.architecture).no_flash_attn:
        if quantized and cache_type(cfg.type_v).quantized:
            raise FlashAttentionRequiredError(
                f"{spec.architecture} runs without flash attention (llama.cpp forces it off), so the quantized "
                f"V cache type_v={cfg.type_v} cannot be used; use an f16 V cache"
            )
        return False
    return True


@dataclass(frozen=True)
class FigureSources:
    """Where each term of an estimate came from: the pure model (``simulated``) or llama.cpp's dry run
    (``measured``, ``sizing.memory.measured``)."""

    kv: Source = "simulated"
    state: Source = "simulated"
    compute: Source = "simulated"
    output: Source = "simulated"

    def to_json(self) -> dict[str, str]:
        return {"kv": self.kv, "state": self.state, "compute": self.compute, "output": self.output}


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
    state_bytes: int = 0
    """Recurrent state of this device's state layers (``llama_memory_recurrent``)."""
    pool_bytes: int = 0
    """The bound on what llama.cpp's dry run cannot see on a GPU: its backend's (``sizing.memory.gpu.terms``): the
    CUDA pool and cuBLAS workspace (``cuda_pool_bound_bytes``), ggml-vulkan's scratch buffers (``vulkan_scratch``);
    on the host, the staging buffers a card's backend uploads weights through (``BackendTerms.stages_weights``: 0
    but beside a Vulkan card)."""
    embedding_bytes: int = 0
    """The embedding context's KV, compute and output buffers on this device (``ContextConfig.embedding_tokens``)."""
    draft_bytes: int = 0
    """Host only: the output buffer's logits rows for self-speculation's drafts (``ContextConfig.draft_rows``),
    beside ``output_bytes`` (the buffer as llama.cpp creates it, what its dry run reports)."""
    draft_model_bytes: int = 0
    """The speculative-decoding draft model's share of this device (``MemoryEstimate.draft``: its weights, KV,
    compute and output buffers as its own estimate puts them here)."""
    projector_bytes: int = 0
    """The vision projector's weights and compute buffer, where it is on this device (``MemoryEstimate.projector``)."""
    mtp_bytes: int = 0
    """The MTP context's buffers on this device and, on the host, the hidden rows it reads (``MemoryEstimate.mtp``;
    the NextN block's weights are in ``weights_bytes`` and ``extra_weights``, as the model's buffers hold them)."""
    extra_weights: tuple[tuple[str, int], ...] = ()
    """Host only: weights copied into llama.cpp's extra CPU buffer types (``AMX``, ``CPU_REPACK``: buffer, bytes),
    beside ``weights_bytes`` (the mapped file); ``sizing.memory.repack``."""

    @property
    def extra_weights_bytes(self) -> int:
        return sum(n for _, n in self.extra_weights)

    @property
    def total_bytes(self) -> int:
        return (self.weights_bytes + self.kv_bytes + self.state_bytes + self.compute_bytes + self.output_bytes
                + self.draft_bytes + self.allowance_bytes + self.pool_bytes + self.embedding_bytes
                + self.extra_weights_bytes + self.draft_model_bytes + self.projector_bytes + self.mtp_bytes)

    def to_json(self) -> dict[str, object]:
        return {
            "device": self.device,
            "layers": list(self.layers),
            "weights_mib": mib(self.weights_bytes),
            "kv_mib": mib(self.kv_bytes),
            "state_mib": mib(self.state_bytes),
            "compute_mib": mib(self.compute_bytes),
            "output_mib": mib(self.output_bytes),
            **({"draft_output_mib": mib(self.draft_bytes)} if self.draft_bytes else {}),
            "allowance_mib": mib(self.allowance_bytes),
            "gpu_pool_mib": mib(self.pool_bytes),
            "embedding_mib": mib(self.embedding_bytes),
            **({"extra_weights_mib": {b: mib(n) for b, n in self.extra_weights}} if self.extra_weights else {}),
            **({"draft_model_mib": mib(self.draft_model_bytes)} if self.draft_model_bytes else {}),
            **({"projector_mib": mib(self.projector_bytes)} if self.projector_bytes else {}),
            **({"mtp_mib": mib(self.mtp_bytes)} if self.mtp_bytes else {}),
            "total_mib": mib(self.total_bytes),
        }


@dataclass(frozen=True)
class EmbeddingMemory:
    """The embedding context's buffers, summed over devices (its share per device is ``embedding_bytes``)."""

    n_ctx: int
    n_ubatch: int
    n_seq_max: int
    kv_bytes: int
    compute_bytes: int
    output_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.compute_bytes + self.output_bytes

    def to_json(self) -> dict[str, object]:
        return {"n_ctx": self.n_ctx, "n_ubatch": self.n_ubatch, "n_seq_max": self.n_seq_max,
                "kv_mib": mib(self.kv_bytes), "compute_mib": mib(self.compute_bytes),
                "output_mib": mib(self.output_bytes), "total_mib": mib(self.total_bytes)}


@dataclass(frozen=True)
class DraftMemory:
    """The draft model's buffers: its own estimate (host first, then its card), at the main context's size."""

    name: str
    path: str
    estimate: "MemoryEstimate"

    @property
    def total_bytes(self) -> int:
        return self.estimate.total_bytes

    @property
    def device(self) -> str:
        """Where its layers are: ``CPU`` or its card's label."""
        return self.estimate.gpus[0].device if self.estimate.gpus else "CPU"

    def to_json(self) -> dict[str, object]:
        e = self.estimate
        return {"name": self.name, "path": self.path, "device": self.device, "n_ctx": e.cfg.n_ctx,
                "weights_mib": mib(sum(d.weights_bytes + d.extra_weights_bytes for d in e.devices)),
                "kv_mib": mib(e.kv_bytes + e.state_bytes),
                "compute_mib": mib(sum(d.compute_bytes for d in e.devices)),
                "output_mib": mib(sum(d.output_bytes for d in e.devices)),
                "devices": [d.to_json() for d in e.devices if d.total_bytes],
                "total_mib": mib(e.total_bytes)}


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-device prediction: host first, then each GPU of the placement."""

    cfg: ContextConfig
    flash_attn: bool
    kv_cells: KvCells
    host: DeviceMemory
    gpus: tuple[DeviceMemory, ...] = ()
    sources: FigureSources = FigureSources()
    embedding: EmbeddingMemory | None = None
    """The embedding context beside the generation context (None: no /v1/embeddings context)."""
    draft: DraftMemory | None = None
    """The speculative-decoding draft model beside this one (None: none); its bytes are in the devices'
    ``draft_model_bytes``."""
    projector: ProjectorMemory | None = None
    """The vision projector beside this model (None: none); its bytes are in its device's ``projector_bytes``."""
    mtp: MtpMemory | None = None
    """The MTP head beside this model (None: not loaded); its context's bytes are in the devices' ``mtp_bytes``."""

    @property
    def total_bytes(self) -> int:
        return self.host.total_bytes + sum(g.total_bytes for g in self.gpus)

    @property
    def kv_bytes(self) -> int:
        """Attention KV cache over every device (what ``llama_kv_cache: size`` lines sum to)."""
        return self.host.kv_bytes + sum(g.kv_bytes for g in self.gpus)

    @property
    def state_bytes(self) -> int:
        """Recurrent state over every device (the ``llama_memory_recurrent: size`` line)."""
        return self.host.state_bytes + sum(g.state_bytes for g in self.gpus)

    @property
    def devices(self) -> tuple[DeviceMemory, ...]:
        return (self.host, *self.gpus)


def output_buffer_bytes(spec: ModelSpec, cfg: ContextConfig) -> int:
    """Host output buffer at context creation: F32 logits for n_seq_max outputs.

    ``llama_context::output_reserve(n_seq_max)`` (src/llama-context.cpp) sizes it
    ``n_vocab * max(n_outputs, n_seq_max) * 4``; it grows on demand when a batch
    asks for more outputs (up to ``n_vocab * n_batch * 4`` when every token is an output).

    An embedding context outputs every token of a batch (``decode``: ``output_all = cparams.embeddings``)
    and keeps logits beside the embeddings (``has_logits`` is always true in ``output_reserve``): its buffer
    grows to ``(n_vocab + n_embd) * n_batch * 4`` with the first full batch, so that is what it is sized at.
    """
    if cfg.embeddings:
        return (spec.n_vocab + spec.n_embd) * cfg.n_batch_effective * 4
    return spec.n_vocab * max(1, cfg.n_seq_max) * 4


def draft_output_bytes(spec: ModelSpec, cfg: ContextConfig) -> int:
    """What the output buffer grows by for self-speculation's drafts: ``draft_rows`` more F32 logits rows
    (``output_reserve``: ``n_vocab * max(n_outputs, n_seq_max) * 4`` once a batch asks for
    ``n_seq_max + draft_rows`` outputs). llama.cpp logs the growth only in debug builds; the engine asks for it
    at load (``LlamaEngine.load``), so it is held from then on. 0 for an embedding context."""
    if cfg.embeddings or cfg.draft_rows <= 0:
        return 0
    return spec.n_vocab * cfg.draft_rows * 4


def pooling_bytes(spec: ModelSpec, cfg: ContextConfig) -> int:
    """What pooling adds to an embedding context's compute buffer (``build_pooling``, src/llama-graph.cpp): the
    ``inp_mean`` matrix ``[n_tokens, n_tokens]`` F32 and the pooled copies of the last hidden states, bounded
    by two ``[n_embd, n_tokens]`` F32 tensors. Measured on gemma-3-270m (CPU, 8 sequences): the generation
    graph's figure plus 0.44 MiB at 128 tokens and 2.29 MiB at 512; this bound gives 0.69 and 3.5 MiB."""
    n = cfg.n_ubatch_effective
    return 4 * (n * n + 2 * spec.n_embd * n)


_LOG_RESOLUTION_BYTES = int(0.01 * MIB)


def _share(total: int, parts: Sequence[int]) -> list[int]:
    """``total`` split in proportion to ``parts`` (equal shares when they are all 0); the shares sum to it."""
    n = len(parts)
    if n == 0:
        return []
    weight = sum(parts)
    raw = [total * p // weight for p in parts] if weight else [total // n] * n
    raw[-1] += total - sum(raw)
    return raw


def estimate(
    spec: ModelSpec,
    cfg: ContextConfig,
    placement: Placement = Placement(),
    *,
    gpu_labels: Sequence[str] = (),
    allowance_bytes: int = DEFAULT_GPU_ALLOWANCE_BYTES,
    figures: Figures | None = None,
    measured_on: str = "CPU",
    cpu_extra: frozenset[str] | None = None,
    draft: DraftModel | None = None,
    draft_figures: Figures | None = None,
    projector: Projector | None = None,
    mtp_figures: Figures | None = None,
    remote: Mapping[str, str] = {},
    cards: Sequence[gpu.Card] = (),
    host_features: frozenset[str] | None = None,
) -> MemoryEstimate:
    """Predict what llama.cpp allocates on each device for this placement and context.

    ``cards``: what each card of the placement is beyond its label (its backend's row of ``sizing.memory.gpu``, its
    allowance, ggml's alignment and largest tensor for it); without them every card is CUDA's with
    ``allowance_bytes``. ``host_features``: the CPU features of a load with llama.cpp's extra CPU buffer types on,
    where a weight no card takes (``gpu.vulkan_refuses``) may be repacked on the host; None: off.

    ``remote``: the labels of workers' devices (``RPC0[host:port]``) and what each is on its machine (``cpu``,
    ``gpu``): no runner's CUDA context there (the worker's own is in the free memory it reports), and a CUDA pool
    only on a card.

    ``cpu_extra``: the CPU features of a host without GPUs (ggml-rpc workers' devices aside: they have no pinned
    host buffer) whose load uses llama.cpp's extra CPU buffer types (``use_extra_bufts``): the weights they copy
    from the host's share are predicted per buffer (``sizing.memory.repack``); None: off.

    ``figures`` are llama.cpp's own (a calibration, ``sizing.memory.measured``) for this configuration, measured on
    ``measured_on`` (``CPU``: a CPU build, where the whole graph runs on the CPU; else a GPU backend whose
    per-device compute buffers are the placement's). Without them every term is simulated.

    ``draft``: a speculative-decoding draft model loaded beside this one (``sizing.memory.draft``), estimated as a
    model of its own on its device at ``draft_config(cfg)`` (``draft_figures``: llama.cpp's for that), its bytes
    added to the devices it uses.

    ``projector``: a vision projector loaded beside this model (``sizing.memory.projector``): its weights and
    compute buffer on the card of the output layer (or the host), with the main context's flash attention.

    ``cfg.mtp``: the MTP head is loaded too (``sizing.memory.mtp``): the NextN block's weights where its slot is,
    and its context's buffers from ``mtp_figures`` (llama.cpp's dry run of ``mtp_config(cfg)``; without them the
    context cannot be sized and no device holds it).
    """
    main = _estimate(spec, cfg, placement, gpu_labels=gpu_labels, allowance_bytes=allowance_bytes, figures=figures,
                     measured_on=measured_on, cpu_extra=cpu_extra, remote=remote, cards=cards,
                     host_features=host_features)
    if cfg.mtp:
        main = _with_mtp(main, spec, cfg, placement, gpu_labels, mtp_figures, cpu_extra, measured_on)
    if projector is not None:
        main = _with_projector(main, spec, placement, gpu_labels, projector)
    if draft is None:
        return main
    dpl, pos = draft_placement(placement, draft.spec.n_layer_all, spec.n_layer_all)
    labels = list(gpu_labels) or [gpu_label(g) for g in placement.gpus]
    dest = _estimate(draft.spec, draft_config(cfg), dpl, gpu_labels=[labels[pos]] if pos is not None else [],
                     allowance_bytes=0, figures=draft_figures, measured_on=measured_on, cpu_extra=cpu_extra,
                     cards=[replace(cards[pos], allowance_bytes=0)] if pos is not None and cards else (),
                     host_features=host_features)
    gpus = list(main.gpus)
    if pos is not None:
        gpus[pos] = replace(gpus[pos], draft_model_bytes=dest.gpus[0].total_bytes)
    return replace(main, host=replace(main.host, draft_model_bytes=dest.host.total_bytes), gpus=tuple(gpus),
                   draft=DraftMemory(draft.label, draft.path, dest))


_NEVER = 1 << 60
"""Bytes no device has: a head whose context llama.cpp did not measure."""


def _with_mtp(main: MemoryEstimate, spec: ModelSpec, cfg: ContextConfig, placement: Placement,
              gpu_labels: Sequence[str], figures: Figures | None, cpu_extra: frozenset[str] | None,
              measured_on: str) -> MemoryEstimate:
    """``main`` (whose weights already hold the NextN block: ``_estimate``) with the MTP context's buffers: its KV
    with the NextN layer (``offload_kqv``), its compute buffers where llama.cpp measured them (a CPU build's
    figure on the NextN layer's device: the whole graph runs there), its output buffer and the hidden rows on the
    host, and on a card the bound on its own backend's CUDA pool."""
    n_all = spec.n_layer_all
    slots = placement.slots(n_all)
    labels = list(gpu_labels) or [gpu_label(g) for g in placement.gpus]

    def label(pos: int | None) -> str:
        return "CPU" if pos is None else labels[pos]

    nextn = range(spec.n_layer, n_all)
    weights: dict[str, int] = {}
    for il in nextn:
        dev = label(slots[il])
        weights[dev] = weights.get(dev, 0) + spec.layers[il].weights_bytes
    if cpu_extra is not None and placement.cpu_only:
        with_head = extra_buffer_bytes(spec, cpu_extra, nextn=True)
        without = extra_buffer_bytes(spec, cpu_extra)
        for b in EXTRA_BUFFERS:
            if with_head.get(b, 0) > without.get(b, 0):
                weights[b] = with_head[b] - without.get(b, 0)
    context: dict[str, int] = {}
    if figures is None:
        kv = compute = output = _NEVER
        context["CPU"] = _NEVER
    else:
        kv = figures.kv_bytes or 0
        head_dev = label(slots[spec.n_layer])
        context[head_dev if cfg.offload_kqv else "CPU"] = kv
        compute = 0
        for dev, n in figures.compute_bytes.items():
            if measured_on == "CPU":
                row = head_dev
            else:
                row = "CPU" if dev == "CPU" or dev.endswith("_Host") or dev not in labels else dev
            context[row] = context.get(row, 0) + n
            compute += n
        output = figures.output_bytes or 0
        context["CPU"] = context.get("CPU", 0) + output
    cards = sorted({d for d in context if d in labels})
    pool = tuple((d, gpu.cuda_pool_bound_bytes(spec, mtp_config(cfg), main.flash_attn)) for d in cards)
    mm = MtpMemory(weights=tuple(weights.items()), context=tuple(context.items()), kv_bytes=kv,
                   compute_bytes=compute, output_bytes=output, rows_bytes=hidden_rows_bytes(spec, cfg), pool=pool)
    return replace(main, host=replace(main.host, mtp_bytes=mm.context_on("CPU")),
                   gpus=tuple(replace(g, mtp_bytes=mm.context_on(g.device)) for g in main.gpus), mtp=mm)


def _with_projector(main: MemoryEstimate, spec: ModelSpec, placement: Placement, gpu_labels: Sequence[str],
                    projector: Projector) -> MemoryEstimate:
    pos = placement.slots(spec.n_layer_all)[spec.n_layer_all] if projector.offload else None
    labels = list(gpu_labels) or [gpu_label(g) for g in placement.gpus]
    pm = projector_memory(projector, labels[pos] if pos is not None else "CPU", main.flash_attn)
    if pos is None:
        return replace(main, host=replace(main.host, projector_bytes=pm.total_bytes), projector=pm)
    gpus = list(main.gpus)
    gpus[pos] = replace(gpus[pos], projector_bytes=pm.total_bytes)
    return replace(main, gpus=tuple(gpus), projector=pm)


def _mapped_span(spec: ModelSpec, host_layers: Sequence[int], output: bool, loaded: int, pinned: Sequence[int],
                 n_moe_host: int, extra: Sequence[TensorInfo]) -> int | None:
    """What the host's ``CPU_Mapped`` buffer spans with layers on cards: llama.cpp maps, per file, the range from the
    first to the last byte of the tensors the CPU buffer keeps (``llama_model_loader::get_mapping_range``,
    ``ggml_backend_dev_buffer_from_host_ptr``), so a card's tensors lying between two of the host's in file order
    are in it too (SmolLM2's blocks are in the file in name order: blk.2 after blk.19; its first 28 blocks on the host
    span blocks 28 and 29, 4.23 MiB more). The tensors: the input layer, the host's blocks, the experts ``n_cpu_moe``
    keeps on the host, the output layer when it stays, and ``extra`` (weights a card's backend refused). None where
    the tensors do not say where they are (a spec built by hand: overlapping offsets)."""
    if not spec.tensors or max(t.offset + t.n_bytes for t in spec.tensors) < sum(t.n_bytes for t in spec.tensors if t.shard == 0):
        return None
    on_host = set(il for il in host_layers if il < loaded)
    experts = set(pinned)
    ranges: dict[int, tuple[int, int]] = {}

    def add(t: TensorInfo) -> None:
        lo, hi = ranges.get(t.shard, (t.offset, t.offset + t.n_bytes))
        ranges[t.shard] = (min(lo, t.offset), max(hi, t.offset + t.n_bytes))

    for t in spec.tensors:
        if t.layer is None:
            if t.name.startswith(_INPUT_TENSORS) or output:
                add(t)
        elif t.layer in on_host or (t.layer in experts and t.layer < n_moe_host and "_exps." in t.name):
            add(t)
    for t in extra:
        add(t)
    return sum(hi - lo for lo, hi in ranges.values())


_INPUT_TENSORS = ("token_embd.", "pos_embd.", "token_types.", "per_layer_token_embd.")
"""The input layer's tensors (``LLM_TENSOR_LAYER_INPUT``, read by GET_ROWS): always in host memory."""


def _card_weights(spec: ModelSpec, layers: Sequence[int], has_output: bool, loaded: int, n_moe_host: int,
                  card: gpu.Card, row: gpu.BackendTerms) -> tuple[int, list[tuple[TensorInfo, str | None]], int]:
    """The weights a card's buffers hold, tensor by tensor (``ggml_backend_alloc_ctx_tensors_from_buft``: each padded
    to the buffer type's alignment), and the tensors (with the op they were tried with) its backend refuses
    (``select_weight_buft``: ``gpu.vulkan_refuses``): its blocks' tensors (less experts kept on the host by
    ``n_cpu_moe``) and, with the output layer, every tensor outside the blocks but the token embedding, and the head
    (a tied one is a second use of the embedding, by MUL_MAT); and the largest weight the card holds."""
    on = set(il for il in layers if il < loaded)
    align = card.alignment_bytes if row.weights_padded and card.alignment_bytes > 0 else 1
    total = largest = 0
    moved: list[tuple[TensorInfo, str | None]] = []

    def place(t: TensorInfo, op: str | None = None) -> None:
        nonlocal total, largest
        if row.refuses_large_tensors and gpu.vulkan_refuses(t, card.max_tensor_bytes, spec.n_expert_used, op, spec.ssm):
            moved.append((t, op))
        else:
            total += -(-t.n_bytes // align) * align
            largest = max(largest, t.n_bytes)

    for t in spec.tensors:
        if t.layer is None:
            if has_output and not t.name.startswith(_INPUT_TENSORS):
                place(t)
        elif t.layer in on and not (t.layer < n_moe_host and "_exps." in t.name):
            place(t)
    if has_output and spec.output_tied:
        for t in spec.tensors:
            if t.name == "token_embd.weight":
                place(t, "MUL_MAT")
    return total, moved, largest


def _estimate(
    spec: ModelSpec,
    cfg: ContextConfig,
    placement: Placement,
    *,
    gpu_labels: Sequence[str],
    allowance_bytes: int,
    figures: Figures | None,
    measured_on: str,
    cpu_extra: frozenset[str] | None,
    remote: Mapping[str, str] = {},
    cards: Sequence[gpu.Card] = (),
    host_features: frozenset[str] | None = None,
) -> MemoryEstimate:
    flash = resolve_flash_attn(cfg, spec)
    check_cache_types(spec, cfg, flash)
    n_all = spec.n_layer_all
    slots = placement.slots(n_all)
    labels = list(gpu_labels) or [gpu_label(g) for g in placement.gpus]
    per_gpu_layers: list[list[int]] = [[] for _ in placement.gpus]
    host_layers: list[int] = []
    for il in range(n_all):
        d = slots[il]
        (host_layers if d is None else per_gpu_layers[d]).append(il)
    out_dev = slots[n_all]

    loaded = n_all if cfg.mtp else spec.n_layer

    def layer_weights(layers: Sequence[int]) -> int:
        # a NextN/MTP block (il >= n_layer) keeps its slot in the placement but is loaded only with its MTP head
        # (nextn_weights_bytes, sizing.memory.mtp)
        return sum(spec.layers[il].weights_bytes for il in layers if il < loaded)

    # KV and state per device (host first): each layer's cache lives with its layer (offload_kqv), else on the host.
    groups = [host_layers, *per_gpu_layers] if cfg.offload_kqv else [list(range(n_all)), *([] for _ in per_gpu_layers)]
    kv = [sum(kv_split_bytes(spec, cfg, flash, g)) if g else 0 for g in groups]
    state = [recurrent_state_bytes(spec, cfg, g) if g else 0 for g in groups]
    sizes = [len(g) for g in groups]
    sources = FigureSources()
    out_bytes = output_buffer_bytes(spec, cfg)
    measured_cpu = figures is not None and measured_on == "CPU" and "CPU" in figures.compute_bytes
    graph = figures.compute_bytes["CPU"] if figures is not None and measured_cpu else compute_bytes(spec, cfg, flash)
    if cfg.embeddings:
        graph += pooling_bytes(spec, cfg)
    host_graph = host_compute_bytes(spec, cfg)
    gpu_measured: dict[str, int] = {}
    gpu_host_measured = False
    """A GPU backend's dry run measured the host's compute buffers (a CPU-only placement on a GPU build too)."""
    if figures is not None:
        src_kv: Source = "simulated"
        if figures.kv_bytes is not None:
            full_p, swa_p = kv_split_bytes(spec, cfg, flash)
            exact = (abs(full_p - (figures.kv_full_bytes or 0)) <= _LOG_RESOLUTION_BYTES
                     and abs(swa_p - (figures.kv_swa_bytes or 0)) <= _LOG_RESOLUTION_BYTES)
            if not exact:
                kv = _share(figures.kv_bytes, kv if any(kv) else sizes)
            src_kv = "measured"
        src_state: Source = "simulated"
        if figures.state_bytes is not None:
            if abs(sum(state) - figures.state_bytes) > _LOG_RESOLUTION_BYTES:
                state = _share(figures.state_bytes, state if any(state) else sizes)
            src_state = "measured"
        src_out: Source = "simulated"
        if figures.output_bytes is not None:
            if abs(out_bytes - figures.output_bytes) > _LOG_RESOLUTION_BYTES:
                out_bytes = max(out_bytes, figures.output_bytes)
            src_out = "measured"
        src_compute: Source = "simulated"
        if measured_cpu:
            src_compute = "measured"
        elif measured_on != "CPU" and figures.compute_bytes:
            gpu_measured = {k: v for k, v in figures.compute_bytes.items() if k in labels}
            host_graph = sum(v for k, v in figures.compute_bytes.items() if k == "CPU" or k.endswith("_Host"))
            gpu_host_measured = bool(labels) or any(k == "CPU" or k.endswith("_Host") for k in figures.compute_bytes)
            src_compute = "measured"
        sources = FigureSources(src_kv, src_state, src_compute, src_out)

    # Host: token embedding always, host layers, the output layer when not offloaded (a span of the file where the
    # tensors say where they are: _mapped_span).
    host_w = spec.token_embd_bytes + layer_weights(host_layers)
    other = ((spec.weights_bytes if cfg.mtp else spec.loaded_weights_bytes) - spec.token_embd_bytes
             - spec.output_bytes - layer_weights(range(n_all)))
    if out_dev is None:
        host_w += spec.output_bytes + max(other, 0)
    cells = kv_cells(spec, cfg)
    # MoE experts of blocks below n_cpu_moe stay in host memory (tensor_buft_overrides), wherever their block runs;
    # a NextN block's are nowhere when its MTP head is not loaded, however far n_cpu_moe reaches.
    n_moe_host = min(placement.n_cpu_moe, loaded)
    pinned = [il for il in range(n_moe_host) if slots[il] is not None]
    host_w += sum(spec.layers[il].expert_bytes for il in pinned)
    gpus: list[DeviceMemory] = []
    refused: list[tuple[TensorInfo, str | None]] = []
    host_runs_head = False
    """A card's backend refused the output head: the logits are computed on the host (simulated: the whole graph)."""
    staging = 0
    """Host memory a card's backend keeps to upload weights through (``gpu.BackendTerms.stages_weights``)."""
    for pos, layers in enumerate(per_gpu_layers):
        card = cards[pos] if pos < len(cards) else gpu.Card()
        row = gpu.terms(card.backend)
        head_refused = False
        if row.refuses_large_tensors or (row.weights_padded and card.alignment_bytes > 0):
            # Tensor by tensor: what the backend's ops refuse stays on the host, the rest padded as its buffers are.
            w, moved, largest = _card_weights(spec, layers, out_dev == pos, loaded, n_moe_host, card, row)
            refused.extend(moved)
            if row.stages_weights:
                staging += largest
            head_refused = any(t.name in ("output.weight", "token_embd.weight") for t, _ in moved)
            host_runs_head = host_runs_head or head_refused
        else:
            w = layer_weights(layers) - sum(spec.layers[il].expert_bytes for il in layers if il < n_moe_host)
            if out_dev == pos:
                w += spec.output_layer_bytes if spec.output_tied else spec.output_bytes + max(other, 0)
        if labels[pos] in gpu_measured:
            dev_compute = gpu_measured[labels[pos]]
        elif labels[pos] in remote and out_dev != pos:
            # A worker's device without the output layer: its layers' phases, until llama.cpp's dry run (every
            # plan over workers is calibrated and confirmed by one) measures it.
            dev_compute = layers_compute_bytes(spec, cfg, flash)
        elif head_refused or (row.layer_phases_off_head and out_dev != pos):
            # A card without the logits (its backend left the head on the host, or it holds no head): its layers'
            # phases and what the backend adds, until the dry run (a GPU backend's plans are calibrated) measures it.
            dev_compute = layers_compute_bytes(spec, cfg, flash) + gpu.unseen_compute_for(
                row, spec, cfg, flash, placement, pos, bool(host_layers))
        else:
            # Simulated, or measured on a CPU build: what the CPU dry run cannot show is added (sizing.memory.gpu).
            dev_compute = graph + gpu.unseen_compute_for(row, spec, cfg, flash, placement, pos, bool(host_layers))
        allowance = card.allowance_bytes if card.allowance_bytes is not None else (
            row.allowance_bytes if row.allowance_bytes is not None else allowance_bytes)
        gpus.append(
            DeviceMemory(
                device=labels[pos],
                weights_bytes=w,
                kv_bytes=kv[pos + 1],
                state_bytes=state[pos + 1],
                compute_bytes=dev_compute,
                allowance_bytes=0 if labels[pos] in remote else allowance,
                pool_bytes=0 if remote.get(labels[pos]) == "cpu" else row.pool(spec, cfg, flash, tuple(layers)),
                layers=tuple(layers),
            )
        )
    # The host's own weights: its blocks, and the output layer when it stays (sizing.memory.repack).
    repacked = (extra_buffer_bytes(spec, cpu_extra, nextn=cfg.mtp, layers=host_layers, output=out_dev is None)
                if cpu_extra is not None else {})
    # Weights a card's backend refused (select_weight_buft goes down the card's list: its host buffer, refused by
    # the same op; the CPU's extra buffer types where they take it; the CPU, i.e. the mapped file).
    mapped_extra: list[TensorInfo] = []
    for t, op in refused:
        got = buffer_of(t, host_features, op) if host_features is not None else None
        if got is not None:
            repacked[got[0]] = repacked.get(got[0], 0) + got[1]
        elif not (op == "MUL_MAT" and t.name.startswith("token_embd.")):  # a tied head: the embedding's mapping
            host_w += t.n_bytes
            mapped_extra.append(t)
    if cpu_extra is None and any(gpu.terms(c.backend).maps_span for c in cards[:len(gpus)]):
        span = _mapped_span(spec, host_layers, out_dev is None, loaded, pinned, n_moe_host, mapped_extra)
        if span is not None:
            host_w = max(host_w, span)
    host = DeviceMemory(
        device="CPU",
        extra_weights=tuple((b, repacked[b]) for b in EXTRA_BUFFERS if b in repacked),
        weights_bytes=host_w,
        kv_bytes=kv[0],
        state_bytes=state[0],
        compute_bytes=(graph if (placement.cpu_only or host_runs_head) and not gpu_host_measured else host_graph),
        pool_bytes=staging,
        output_bytes=out_bytes,
        draft_bytes=draft_output_bytes(spec, cfg),
        layers=tuple(host_layers),
    )
    main = MemoryEstimate(cfg=cfg, flash_attn=flash, kv_cells=cells, host=host, gpus=tuple(gpus), sources=sources)
    ecfg = cfg.embedding_config() if cfg.applies_embedding(placement.cpu_only) else None
    if ecfg is None:
        return main
    # The embedding context shares the model's weights; its own buffers go where the generation context's go.
    emb = _estimate(spec, ecfg, placement, gpu_labels=labels, allowance_bytes=0, figures=None, measured_on="CPU",
                    cpu_extra=None, cards=[replace(c, allowance_bytes=0) for c in cards])

    def extra(d: DeviceMemory) -> int:
        return d.kv_bytes + d.state_bytes + d.compute_bytes + d.output_bytes

    return replace(
        main,
        host=replace(main.host, embedding_bytes=extra(emb.host)),
        gpus=tuple(replace(g, embedding_bytes=extra(e)) for g, e in zip(main.gpus, emb.gpus)),
        embedding=EmbeddingMemory(
            n_ctx=ecfg.n_ctx_padded, n_ubatch=ecfg.n_ubatch_effective, n_seq_max=ecfg.n_seq_max,
            kv_bytes=emb.kv_bytes + emb.state_bytes, compute_bytes=sum(d.compute_bytes for d in emb.devices),
            output_bytes=sum(d.output_bytes for d in emb.devices)),
    )
