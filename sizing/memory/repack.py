"""Weights llama.cpp's CPU backend copies into its extra buffer types (AMX, CPU_REPACK): which, and their bytes.

Pure: a ``ModelSpec`` and the CPU features llama.cpp reports (``llama_print_system_info``: ``AVX2``, ``AVX512``,
``AMX_INT8``, ``NEON``, ``DOTPROD``, ``MATMUL_INT8``, ``REPACK``...) in, bytes per buffer out. Mirrors the
llama.cpp that llama-cpp-python 0.3.36 vendors:

- ``src/llama-model.cpp`` ``make_cpu_buft_list``: with ``use_extra_bufts`` and no device with a host buffer type
  (no local GPU: a ggml-rpc worker's device has none) the host buffer types are, in order, AMX, CPU_REPACK, CPU
  (with a local GPU its pinned host buffer comes first and takes every weight kept on the host);
  ``select_weight_buft`` gives a weight the first whose buffer supports the op the weight is used by
  (``llm_tensor_info_for``: MUL_MAT for every 2-D weight matrix, MUL_MAT_ID for 3-D expert tensors, GET_ROWS for
  the token embedding), tried with an F32 activation of 512 rows;
- ``ggml/src/ggml-cpu/repack.cpp`` ``ggml_repack_get_optimal_repack_type``: Q4_0, Q4_K, IQ4_NL and MXFP4 with
  AVX2 (rows a multiple of 8), Q2_K with AVX512 (8), and NEON's dotprod/i8mm layouts of Q4_0, Q4_K, Q5_K, Q6_K,
  IQ4_NL, MXFP4 and Q8_0 (rows a multiple of 4 or 8); the repacked tensor keeps its size
  (``ggml_nbytes``), each padded to the buffer's 32-byte alignment;
- ``ggml/src/ggml-cpu/amx/amx.cpp`` ``supports_op`` and ``amx/mmq.cpp`` ``ggml_backend_amx_get_alloc_size``:
  MUL_MAT only; Q4_0, Q4_1, Q8_0 (in_features a multiple of 32), Q4_K, Q5_K, Q6_K, IQ4_XS (of 256) and F16 (of
  16), out_features a multiple of 32; packed rows of ``K / block`` blocks plus an int32 per block for Q8_0, 4 bytes
  per block for Q4_K and Q5_K, 2 for IQ4_XS (F16 is not packed).

A tied output head (no ``output.weight``) is a second use of ``token_embd.weight`` by MUL_MAT in the output
layer: llama.cpp gives it a buffer of its own, so a repackable embedding is copied once more. The file's mapped
buffer still spans every tensor the plain CPU buffer keeps, from the first to the last in file order
(``llama_model_loader::get_mapping_range``), so the repacked bytes come on top of the mapping: measured, the
embedded gemma-3-270m maps 235.16 MiB either way and repacks 12.66 MiB on AVX2 (its Q4_K matrices).
"""

from __future__ import annotations

from typing import Collection, Iterable, Literal

from ..model.spec import ModelSpec, TensorInfo

Buffer = Literal["AMX", "CPU_REPACK"]
EXTRA_BUFFERS: tuple[Buffer, ...] = ("AMX", "CPU_REPACK")
"""In llama.cpp's order of preference (``ggml_backend_cpu_get_extra_buffer_types``)."""
ALIGNMENT = 32
"""``TENSOR_ALIGNMENT``: each tensor of an extra buffer starts at a multiple of it."""
_GET_ROWS = ("token_embd.", "pos_embd.", "token_types.", "per_layer_token_embd.")
"""Weights read by GET_ROWS (``LLM_TENSOR_INFOS``): never in an extra buffer."""
_EXPERTS = ("_exps.",)

# (type name, required features, rows multiple) for ggml_repack_get_optimal_repack_type, per MUL_MAT weight.
_REPACK_RULES: dict[str, tuple[tuple[frozenset[str], int], ...]] = {
    "Q4_0": ((frozenset({"AVX2"}), 8), (frozenset({"NEON", "MATMUL_INT8"}), 4), (frozenset({"NEON", "DOTPROD"}), 4)),
    "Q4_K": ((frozenset({"AVX2"}), 8), (frozenset({"NEON", "MATMUL_INT8"}), 8), (frozenset({"NEON", "DOTPROD"}), 8)),
    "Q2_K": ((frozenset({"AVX512"}), 8),),
    "Q5_K": ((frozenset({"NEON", "MATMUL_INT8"}), 8), (frozenset({"NEON", "DOTPROD"}), 8)),
    "Q6_K": ((frozenset({"NEON", "MATMUL_INT8"}), 8), (frozenset({"NEON", "DOTPROD"}), 8)),
    "IQ4_NL": ((frozenset({"AVX2"}), 8), (frozenset({"NEON", "DOTPROD"}), 4)),
    "MXFP4": ((frozenset({"AVX2"}), 8), (frozenset({"NEON", "DOTPROD"}), 4)),
    "Q8_0": ((frozenset({"NEON", "MATMUL_INT8"}), 4), (frozenset({"NEON", "DOTPROD"}), 4)),
}

# AMX: type -> (elements per block, bytes per block, extra bytes per block in the packed row, in_features multiple)
_AMX_TYPES: dict[str, tuple[int, int, int, int]] = {
    "Q4_0": (32, 18, 0, 32),
    "Q4_1": (32, 20, 0, 32),
    "Q8_0": (32, 34, 4, 32),
    "Q4_K": (256, 144, 4, 256),
    "Q5_K": (256, 176, 4, 256),
    "Q6_K": (256, 210, 0, 256),
    "IQ4_XS": (256, 136, 2, 256),
}
_AMX_TILE_N2 = 32
"""``TILE_N * 2``: AMX takes a matrix only when its out_features are a multiple of it."""


AMX_CRASH = "llama.cpp#20824"
"""The llama.cpp issue of the AMX kernel's crash, cited where the choice is explained."""


def auto_repack(features: frozenset[str]) -> bool:
    """The safe default: the extra buffer types off where llama.cpp reports ``AMX_INT8``, whose AMX kernel for
    repacked weights crashes this llama.cpp at the first decode (``ggml_backend_amx_mul_mat``, llama.cpp#20824);
    on elsewhere (CPU_REPACK: measured faster decode, docs/memory.md)."""
    return "AMX_INT8" not in features


def auto_reason(features: frozenset[str]) -> str:
    """Why ``auto_repack`` chose what it did, in the words the plan and the load's log line use."""
    if not auto_repack(features):
        return (f"auto: the CPU reports AMX_INT8, and llama.cpp's AMX kernel for repacked weights crashes "
                f"({AMX_CRASH}); weights stay as the file lays them out")
    return "auto: no AMX_INT8; repacked layouts (CPU_REPACK) where ggml has them"


def _pad(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _op(t: TensorInfo) -> str:
    """The op llama.cpp sizes a weight for: MUL_MAT (2-D matrices), MUL_MAT_ID (3-D experts), else other."""
    if t.name.startswith(_GET_ROWS):
        return "GET_ROWS"
    if len(t.shape) == 3 and any(x in t.name for x in _EXPERTS):
        return "MUL_MAT_ID"
    if len(t.shape) == 2:
        return "MUL_MAT"
    return "other"


def _repacks(t: TensorInfo, op: str, features: frozenset[str]) -> bool:
    if op not in ("MUL_MAT", "MUL_MAT_ID") or "REPACK" not in features:
        return False
    rows = t.shape[1]
    return any(need <= features and rows % mult == 0 for need, mult in _REPACK_RULES.get(t.type_name, ()))


def _amx_bytes(t: TensorInfo, op: str, features: frozenset[str]) -> int | None:
    """Bytes of the tensor in the AMX buffer, or None when AMX does not take it."""
    if op != "MUL_MAT" or "AMX_INT8" not in features:
        return None
    k, n = t.shape[0], t.shape[1]
    if n % _AMX_TILE_N2:
        return None
    if t.type_name == "F16":
        return t.n_bytes if k % 16 == 0 else None
    rule = _AMX_TYPES.get(t.type_name)
    if rule is None:
        return None
    block, size, extra, multiple = rule
    if k % multiple:
        return None
    return n * (k // block) * (size + extra)


def buffer_of(t: TensorInfo, features: frozenset[str], op: str | None = None) -> tuple[Buffer, int] | None:
    """The extra buffer ``t`` goes to on a CPU with ``features`` and the bytes it takes there; None: the plain
    CPU buffer (the mapped file)."""
    op = op or _op(t)
    amx = _amx_bytes(t, op, features)
    if amx is not None:
        return "AMX", _pad(amx)
    if _repacks(t, op, features):
        return "CPU_REPACK", _pad(t.n_bytes)
    return None


def _uses(spec: ModelSpec, nextn: bool = False, layers: Collection[int] | None = None, output: bool = True
          ) -> Iterable[tuple[TensorInfo, str]]:
    """Every (weight, op) a load gives a host buffer: each tensor but the NextN blocks' (skipped unless the MTP head
    is loaded: ``nextn``), and a tied head's second use of the embedding; only the blocks in ``layers`` (None: all)
    and, unless ``output``, none of the tensors outside the blocks (they go with the output layer)."""
    for t in spec.tensors:
        if t.layer is None:
            if output:
                yield t, _op(t)
            continue
        if (not nextn and t.layer >= spec.n_layer) or (layers is not None and t.layer not in layers):
            continue
        yield t, _op(t)
    if spec.output_tied and output:
        for t in spec.tensors:
            if t.name == "token_embd.weight":
                yield t, "MUL_MAT"


def extra_buffer_bytes(spec: ModelSpec, features: frozenset[str], nextn: bool = False,
                       layers: Collection[int] | None = None, output: bool = True) -> dict[str, int]:
    """Bytes llama.cpp puts in each extra buffer type for a load with ``use_extra_bufts`` on (buffers it does not
    use are absent): of every weight for a CPU-only load, of the host's blocks (``layers``) and, when ``output``,
    the output layer, where the other devices are all ggml-rpc workers; ``nextn``: the NextN blocks are loaded
    too (an MTP head)."""
    out: dict[str, int] = {}
    for t, op in _uses(spec, nextn, layers, output):
        got = buffer_of(t, features, op)
        if got is not None:
            out[got[0]] = out.get(got[0], 0) + got[1]
    return out


__all__ = ["ALIGNMENT", "AMX_CRASH", "EXTRA_BUFFERS", "Buffer", "auto_reason", "auto_repack", "buffer_of",
           "extra_buffer_bytes"]
