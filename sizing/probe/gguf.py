"""From GGUF bytes to a ``ModelSpec``: local files, split shards, remote URLs.

The hyperparameter rules mirror llama.cpp's ``llama_model_base::load_hparams``
(``src/llama-model.cpp``) and the per-architecture ``load_arch_hparams``
(``src/models/*.cpp``) of the llama.cpp vendored by llama-cpp-python 0.3.36.
"""

from __future__ import annotations

import os
import re
from typing import Sequence

import gguf

from ..errors import LayerArrayError, MalformedError, ShardError, TruncatedError, UnsupportedModelError
from ..model import arch as archs
from ..model.spec import LayerSpec, MlaSpec, ModelSource, ModelSpec, SsmSpec, StateSpec, TensorInfo
from .reader import MIN_WINDOW_BYTES, ArraySummary, ByteSource, GGUFHeader, RawTensor, parse_header
from .sources import BytesSource, FileSource

_QUANT_SIZES: dict[int, tuple[int, int]] = {int(k): v for k, v in gguf.GGML_QUANT_SIZES.items()}
_TYPE_NAMES: dict[int, str] = {int(t): t.name for t in gguf.GGMLQuantizationType}
_FILE_TYPE_NAMES: dict[int, str] = {
    int(t): t.name.removeprefix("MOSTLY_") for t in gguf.LlamaFileType
}

SPLIT_RE = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def type_name(ggml_type: int) -> str:
    """The ggml type's name (``Q4_K``), or ``TYPE_<n>`` for an unknown one."""
    return _TYPE_NAMES.get(ggml_type, f"TYPE_{ggml_type}")


def tensor_nbytes(name: str, shape: Sequence[int], ggml_type: int) -> int:
    """Exact bytes of a tensor, as ``ggml_nbytes`` computes for a contiguous tensor.

    Block sizes and type sizes come from the gguf package's ``GGML_QUANT_SIZES``
    (``ggml_blck_size`` / ``ggml_type_size``); ggml's parser refuses the same
    unknown types and ragged rows (``gguf_init_from_file_impl``).
    """
    if ggml_type not in _QUANT_SIZES:
        raise MalformedError(f"tensor {name!r} has unknown ggml type {ggml_type}")
    block, type_size = _QUANT_SIZES[ggml_type]
    if type_size == 0 or block == 0:
        raise MalformedError(f"tensor {name!r} has removed ggml type {type_name(ggml_type)}")
    if not shape or shape[0] % block:
        raise MalformedError(f"tensor {name!r} row of {shape[0] if shape else 0} is not a multiple of block size {block}")
    n = 1
    for d in shape[1:]:
        n *= d
    return shape[0] // block * type_size * n


def _keep_array(key: str) -> bool:
    # Per-layer arrays are short; decode them in full whatever their length.
    return not key.startswith("tokenizer.")


def read_header(source: ByteSource, *, whole: bool = False) -> GGUFHeader:
    """Parse one file's header.

    A source with ``view()`` (local file, bytes) is walked in place; a windowed
    one (HTTP) is fetched from a first window of ``MIN_WINDOW_BYTES``, or the
    whole of it with ``whole``.
    """
    return parse_header(source, initial_bytes=source.size if whole else MIN_WINDOW_BYTES, keep_array=_keep_array)


def shard_paths(path: str) -> list[str]:
    """All shards of a split GGUF given any one of them, or ``[path]``."""
    m = SPLIT_RE.match(os.path.basename(path))
    if not m:
        return [path]
    count = int(m.group("count"))
    if count < 1 or not 1 <= int(m.group("no")) <= count:
        raise ShardError(f"shard number {m.group('no')} of {count} is out of range", source=path)
    d = os.path.dirname(path)
    return [os.path.join(d, f"{m.group('prefix')}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def probe_path(path: str) -> ModelSpec:
    """Probe a local GGUF file (any shard of a split model names the whole model)."""
    paths = shard_paths(path)
    headers: list[GGUFHeader] = []
    for p in paths:
        if not os.path.exists(p):
            raise ShardError(f"shard {os.path.basename(p)} is missing", source=path)
        with FileSource(p) as src:
            headers.append(read_header(src, whole=True))
    return spec_from_headers(headers, ModelSource(path=paths[0], shards=tuple(paths) if len(paths) > 1 else ()))


def probe_bytes(data: bytes, name: str = "<bytes>") -> ModelSpec:
    """Probe a whole GGUF held in memory (tests, fuzzing, uploads)."""
    return spec_from_headers([read_header(BytesSource(data, name))], ModelSource(path=name))


def spec_from_headers(headers: Sequence[GGUFHeader], source: ModelSource) -> ModelSpec:
    """Combine one header per shard into one model spec."""
    if not headers:
        raise ShardError("no header to build a spec from", source=source.display)
    first = headers[0]
    _check_split(headers)
    tensors: list[TensorInfo] = []
    seen: dict[str, int] = {}
    for i, h in enumerate(headers):
        spans: list[tuple[int, int, RawTensor]] = []
        for t in h.tensors:
            if t.name in seen:
                raise ShardError(
                    f"tensor {t.name!r} is in shard {seen[t.name] + 1} and shard {i + 1}", source=h.source_name
                )
            seen[t.name] = i
            nbytes = _checked_nbytes(h, t)
            end = h.data_offset + t.offset + nbytes
            if end > h.file_size:
                raise TruncatedError(
                    f"tensor {t.name!r} data ends at {end}, past the file's {h.file_size} bytes",
                    offset=t.info_offset, source=h.source_name,
                )
            spans.append((t.offset, t.offset + nbytes, t))
            tensors.append(TensorInfo(t.name, t.shape, t.ggml_type, type_name(t.ggml_type), nbytes, t.offset, i))
        _check_overlaps(h, spans)
    return build_spec(first, tensors, source, file_size=sum(h.file_size for h in headers))


def _check_overlaps(h: GGUFHeader, spans: list[tuple[int, int, RawTensor]]) -> None:
    """Two tensors may not share bytes (ggml requires them laid out in order, padded)."""
    spans.sort(key=lambda s: s[0])
    for (_, prev_end, prev), (start, end, t) in zip(spans, spans[1:]):
        if start < prev_end and end > start:
            raise MalformedError(
                f"tensor {t.name!r} data at {start} overlaps tensor {prev.name!r} (ends at {prev_end})",
                offset=t.info_offset, source=h.source_name,
            )


def _check_split(headers: Sequence[GGUFHeader]) -> None:
    """``split.no`` / ``split.count`` / ``split.tensors.count`` agree with the shards read
    (llama.cpp ``llama_model_loader``: LLM_KV_SPLIT_*)."""
    n = len(headers)
    total = sum(len(h.tensors) for h in headers)
    for i, h in enumerate(headers):
        md = h.metadata
        count = md.get("split.count")
        if count is None:
            if n > 1:
                raise ShardError(f"shard {i + 1} of {n} has no split.count", source=h.source_name)
            continue
        if count != n:
            raise ShardError(
                f"split.count is {count} but {n} shards were read",
                offset=h.key_offsets.get("split.count"), source=h.source_name,
            )
        no = md.get("split.no")
        if no is not None and no != i:
            raise ShardError(
                f"split.no is {no}, expected {i}", offset=h.key_offsets.get("split.no"), source=h.source_name
            )
        declared = md.get("split.tensors.count")
        if declared is not None and declared != total:
            raise ShardError(
                f"split.tensors.count is {declared} but the shards hold {total} tensors",
                offset=h.key_offsets.get("split.tensors.count"), source=h.source_name,
            )


def _checked_nbytes(h: GGUFHeader, t: RawTensor) -> int:
    try:
        return tensor_nbytes(t.name, t.shape, t.ggml_type)
    except MalformedError as exc:
        raise MalformedError(exc.reason, offset=t.info_offset, source=h.source_name) from exc


def _get_int(md: dict[str, object], key: str, default: int | None = None, *, src: str) -> int:
    v = md.get(key, default)
    if v is None:
        raise UnsupportedModelError(f"{src}: missing required key {key!r}")
    if isinstance(v, bool) or not isinstance(v, int):
        raise UnsupportedModelError(f"{src}: key {key!r} should be an integer, got {type(v).__name__}")
    if v < 0:
        raise UnsupportedModelError(f"{src}: key {key!r} is negative ({v})")
    return v


def _per_layer(
    md: dict[str, object], key: str, n: int, default: int, *, src: str, offsets: dict[str, int] | None = None
) -> list[int]:
    """A scalar-or-array key as a per-layer list (``get_key_or_arr``: an array must have n_layer entries)."""
    v = md.get(key)
    if v is None:
        return [default] * n
    where = (offsets or {}).get(key)
    if isinstance(v, ArraySummary):
        raise LayerArrayError(f"per-layer array {key!r} has {v.count} entries, expected {n}", offset=where, source=src)
    if isinstance(v, list):
        if len(v) != n:
            raise LayerArrayError(f"per-layer array {key!r} has {len(v)} entries, expected {n}", offset=where, source=src)
        if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in v):
            raise LayerArrayError(f"per-layer array {key!r} holds non-integers", offset=where, source=src)
        return [int(x) for x in v]
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise UnsupportedModelError(f"{src}: key {key!r} should be an integer")
    return [v] * n


def _layer_flags(md: dict[str, object], key: str, n: int, *, src: str,
                 offsets: dict[str, int] | None = None) -> object:
    """A per-layer bool array (``get_arr`` / ``get_key_or_arr``) as a list, a scalar as itself, or None."""
    v = md.get(key)
    where = (offsets or {}).get(key)
    if isinstance(v, ArraySummary):
        raise LayerArrayError(f"per-layer array {key!r} has {v.count} entries, expected {n}", offset=where, source=src)
    if isinstance(v, list):
        if len(v) > n:
            raise LayerArrayError(f"per-layer array {key!r} has {len(v)} entries, expected {n}", offset=where, source=src)
        return [bool(x) for x in v]
    return v


def build_spec(header: GGUFHeader, tensors: Sequence[TensorInfo], source: ModelSource, *, file_size: int) -> ModelSpec:
    """The model spec for a parsed header (first shard) and every shard's tensors."""
    md = header.metadata
    src = header.source_name
    arch = md.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise UnsupportedModelError(f"{src}: general.architecture is missing")
    a = arch
    n_ctx_train = _get_int(md, f"{a}.context_length", src=src)
    n_embd = _get_int(md, f"{a}.embedding_length", src=src)
    n_layer_all = _get_int(md, f"{a}.block_count", src=src)
    if n_layer_all == 0 or n_layer_all > 512:  # LLAMA_MAX_LAYERS
        raise UnsupportedModelError(f"{src}: block_count {n_layer_all} is out of range (1..512)")
    n_nextn = _get_int(md, f"{a}.nextn_predict_layers", 0, src=src)
    if n_nextn > n_layer_all:
        raise UnsupportedModelError(f"{src}: nextn_predict_layers {n_nextn} exceeds block_count {n_layer_all}")
    n_layer = n_layer_all - n_nextn
    ko = header.key_offsets
    n_head = _per_layer(md, f"{a}.attention.head_count", n_layer_all, 0, src=src, offsets=ko)
    n_head_kv = n_head
    if f"{a}.attention.head_count_kv" in md:
        n_head_kv = _per_layer(md, f"{a}.attention.head_count_kv", n_layer_all, 0, src=src, offsets=ko)
    head0 = n_head[0] if n_head else 0
    k_len = _get_int(md, f"{a}.attention.key_length", n_embd // head0 if head0 else 0, src=src)
    v_len = _get_int(md, f"{a}.attention.value_length", n_embd // head0 if head0 else 0, src=src)
    k_len_swa = _get_int(md, f"{a}.attention.key_length_swa", k_len, src=src)
    v_len_swa = _get_int(md, f"{a}.attention.value_length_swa", v_len, src=src)
    t = archs.traits(a)
    n_ff = _per_layer(md, f"{a}.feed_forward_length", n_layer_all, 0, src=src, offsets=ko)
    window_key = md.get(f"{a}.attention.sliding_window")
    window_key = window_key if isinstance(window_key, int) and not isinstance(window_key, bool) else None
    recurrent = archs.recurrent_layers(
        t, n_layer, n_layer_all, n_head_kv, n_ff,
        _layer_flags(md, f"{a}.attention.recurrent_layers", n_layer_all, src=src, offsets=ko),
        _get_int(md, f"{a}.full_attention_interval", 0, src=src) or None,
    )
    swa_key = f"{a}.attention.sliding_window_pattern"
    pattern = _layer_flags(md, swa_key, n_layer_all, src=src, offsets=ko)
    if t.swa is not None and t.swa.period is None and not t.swa.attention_layers and not isinstance(pattern, list):
        raise UnsupportedModelError(f"{src}: {a} needs the per-layer array {swa_key!r}")
    swa = archs.swa_layers(t, n_layer, n_layer_all, window_key, pattern, recurrent)
    n_swa = archs.swa_window(t, window_key) if any(swa) else 0
    kv_from_start: int | None = None
    if t.kv_from_start == "fixed_20":
        kv_from_start = 20
    elif t.kv_from_start == "shared_kv_layers":
        kv_from_start = n_layer_all - _get_int(md, f"{a}.attention.shared_kv_layers", 0, src=src)
    has_kv, has_state = archs.memory_layers(t, n_layer, n_layer_all, recurrent, n_ff, kv_from_start)

    mla = None
    k_mla = _get_int(md, f"{a}.attention.key_length_mla", 0, src=src)
    v_mla = _get_int(md, f"{a}.attention.value_length_mla", 0, src=src)
    if k_mla and v_mla:  # llama_hparams::is_mla
        mla = MlaSpec(
            kv_lora_rank=_get_int(md, f"{a}.attention.kv_lora_rank", 0, src=src),
            n_embd_head_k_mla=k_mla,
            n_embd_head_v_mla=v_mla,
            n_rot=_get_int(md, f"{a}.rope.dimension_count", k_len, src=src),
        )
    ssm = None
    if f"{a}.ssm.state_size" in md or f"{a}.ssm.inner_size" in md or f"{a}.ssm.conv_kernel" in md:
        ssm = SsmSpec(
            d_conv=_get_int(md, f"{a}.ssm.conv_kernel", 0, src=src),
            d_inner=_get_int(md, f"{a}.ssm.inner_size", 0, src=src),
            d_state=_get_int(md, f"{a}.ssm.state_size", 0, src=src),
            n_group=_get_int(md, f"{a}.ssm.group_count", 0, src=src),
            dt_rank=_get_int(md, f"{a}.ssm.time_step_rank", 0, src=src),
        )
    state = None
    if any(has_state):
        w = archs.state_widths(
            n_embd, head0, k_len,
            wkv_head_size=_get_int(md, f"{a}.wkv.head_size", 0, src=src),
            token_shift_count=_get_int(md, f"{a}.token_shift_count", 2, src=src),
            shortconv_l_cache=_get_int(md, f"{a}.shortconv.l_cache", 0, src=src),
            kda_head_dim=_get_int(md, f"{a}.kda.head_dim", 0, src=src),
            linear_attn=a == "minimax-01",
            d_conv=ssm.d_conv if ssm else 0, d_inner=ssm.d_inner if ssm else 0,
            d_state=ssm.d_state if ssm else 0, n_group=ssm.n_group if ssm else 0,
        )
        state = StateSpec(kind=w.kind, n_embd_r=w.n_embd_r, n_embd_s=w.n_embd_s)

    per_layer_bytes = [0] * n_layer_all
    per_layer_experts = [0] * n_layer_all
    for tensor in tensors:
        il = tensor.layer
        if il is not None:
            if il >= n_layer_all:
                raise MalformedError(f"tensor {tensor.name!r} names block {il} of {n_layer_all}", source=src)
            per_layer_bytes[il] += tensor.n_bytes
            if "_exps" in tensor.name:
                per_layer_experts[il] += tensor.n_bytes

    layers = tuple(
        LayerSpec(
            index=il,
            n_head=n_head[il],
            n_head_kv=n_head_kv[il],
            n_embd_head_k=k_len_swa if swa[il] else k_len,
            n_embd_head_v=v_len_swa if swa[il] else v_len,
            is_swa=swa[il],
            is_recurrent=recurrent[il],
            weights_bytes=per_layer_bytes[il],
            expert_bytes=per_layer_experts[il],
            n_ff=n_ff[il],
            attention=has_kv[il],
            state=has_state[il],
        )
        for il in range(n_layer_all)
    )

    tokens = header.array_lengths.get("tokenizer.ggml.tokens")
    n_vocab = tokens if tokens is not None else _get_int(md, f"{a}.vocab_size", 0, src=src)
    ft = md.get("general.file_type")
    file_type = ft if isinstance(ft, int) and not isinstance(ft, bool) else None
    name = md.get("general.name")
    return ModelSpec(
        architecture=a,
        name=name if isinstance(name, str) else os.path.basename(source.display),
        n_ctx_train=n_ctx_train,
        n_embd=n_embd,
        n_layer=n_layer,
        n_layer_all=n_layer_all,
        n_vocab=n_vocab,
        layers=layers,
        tensors=tuple(tensors),
        file_size_bytes=file_size,
        n_swa=n_swa,
        n_expert=_get_int(md, f"{a}.expert_count", 0, src=src),
        n_expert_used=_expert_used(md, a, src),
        mla=mla,
        ssm=ssm,
        state=state,
        arch_known=archs.known(a),
        file_type=file_type,
        file_type_name=_FILE_TYPE_NAMES.get(file_type) if file_type is not None else None,
        alignment=header.alignment,
        data_offset=header.data_offset,
        version=header.version,
        source=source,
        metadata={k: (v.to_json() if isinstance(v, ArraySummary) else v) for k, v in md.items()},
    )


def _expert_used(md: dict[str, object], a: str, src: str) -> int:
    v = md.get(f"{a}.expert_used_count", 0)
    if isinstance(v, list):
        return max((int(x) for x in v), default=0)
    return _get_int(md, f"{a}.expert_used_count", 0, src=src)
