"""The probe reads what the file says: checked against gguf-py's reader and ggml's C parser."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import gguf
import numpy as np
import pytest

from sizing.errors import LayerArrayError, UnsupportedModelError
from sizing.probe import probe_bytes, probe_path, tensor_nbytes
from sizing.probe.gguf import read_header
from sizing.probe.reader import ArraySummary
from sizing.probe.sources import FileSource
from tests.sizing.probe.conftest import write_model
from sizing.testing.raw_gguf import kv_arr_u32, minimal_llama


def test_small_model_fields_match_gguf_reader(small_model: Path) -> None:
    spec = probe_path(str(small_model))
    ref = gguf.GGUFReader(str(small_model))
    assert spec.architecture == "llama"
    assert spec.n_layer == spec.n_layer_all == 2
    assert spec.n_embd == 64
    assert spec.n_vocab == 32
    assert spec.n_ctx_train == 256
    assert [layer.n_head for layer in spec.layers] == [4, 4]
    assert [layer.n_head_kv for layer in spec.layers] == [2, 2]
    assert [layer.n_embd_head_k for layer in spec.layers] == [16, 16]
    assert spec.file_size_bytes == small_model.stat().st_size
    assert spec.data_offset == ref.data_offset
    assert spec.alignment == 32
    by_name = {t.name: t for t in spec.tensors}
    assert len(by_name) == len(ref.tensors) == 1 + 3 * 2 + 2
    for rt in ref.tensors:
        t = by_name[rt.name]
        assert t.shape == tuple(int(d) for d in rt.shape)
        assert t.ggml_type == int(rt.tensor_type)
        assert t.n_bytes == int(rt.n_bytes)
        assert spec.data_offset + t.offset == int(rt.data_offset)


def test_grouping_by_layer_embedding_output(small_model: Path) -> None:
    spec = probe_path(str(small_model))
    # F32 norm (64*4) + F16 q (64*64*2) + F16 up (128*64*2)
    assert [layer.weights_bytes for layer in spec.layers] == [256 + 8192 + 16384] * 2
    assert spec.token_embd_bytes == 32 * 64 * 2
    assert spec.output_bytes == 32 * 64 * 2
    assert not spec.output_tied
    assert spec.output_layer_bytes == 32 * 64 * 2 + 64 * 4
    assert spec.weights_bytes == sum(layer.weights_bytes for layer in spec.layers) + 2 * 4096 + 256


def test_tensor_nbytes_uses_block_sizes() -> None:
    assert tensor_nbytes("a", (256, 10), int(gguf.GGMLQuantizationType.Q4_K)) == 10 * 144
    assert tensor_nbytes("a", (32, 3), int(gguf.GGMLQuantizationType.Q8_0)) == 3 * 34
    assert tensor_nbytes("a", (7,), int(gguf.GGMLQuantizationType.F32)) == 28


def test_per_layer_head_count_kv_array(tmp_path: Path) -> None:
    path = write_model(tmp_path / "m.gguf", n_layer=3, n_head_kv=[2, 0, 4])[0]
    spec = probe_path(str(path))
    assert [layer.n_head_kv for layer in spec.layers] == [2, 0, 4]


def test_per_layer_array_of_wrong_length_names_the_key_offset() -> None:
    key = "llama.attention.head_count_kv"
    raw = minimal_llama(2, extra_kvs=[kv_arr_u32(key, [1, 1, 1])])
    data = bytes(raw)
    with pytest.raises(LayerArrayError) as ei:
        probe_bytes(data)
    assert key in str(ei.value)
    assert "3 entries, expected 2" in str(ei.value)
    assert data[ei.value.offset + 8 : ei.value.offset + 8 + len(key)] == key.encode()
    assert isinstance(ei.value, UnsupportedModelError)


def test_moe_mla_and_nextn_keys(tmp_path: Path) -> None:
    a = "deepseek2"
    path = write_model(
        tmp_path / "ds.gguf",
        arch=a,
        n_layer=3,
        extra={
            f"{a}.attention.kv_lora_rank": 512,
            f"{a}.attention.key_length_mla": 192,
            f"{a}.attention.value_length_mla": 128,
            f"{a}.rope.dimension_count": 64,
            f"{a}.expert_count": 64,
            f"{a}.expert_used_count": 6,
            f"{a}.nextn_predict_layers": 1,
        },
    )[0]
    spec = probe_path(str(path))
    assert spec.mla is not None
    assert (spec.mla.kv_lora_rank, spec.mla.n_embd_head_k_mla, spec.mla.n_embd_head_v_mla, spec.mla.n_rot) == (
        512, 192, 128, 64,
    )
    assert (spec.n_expert, spec.n_expert_used) == (64, 6)
    assert (spec.n_layer_all, spec.n_layer) == (3, 2)


def test_ssm_keys(tmp_path: Path) -> None:
    a = "mamba"
    path = write_model(
        tmp_path / "mamba.gguf",
        arch=a,
        extra={f"{a}.ssm.conv_kernel": 4, f"{a}.ssm.inner_size": 128, f"{a}.ssm.state_size": 16,
               f"{a}.ssm.time_step_rank": 4},
    )[0]
    spec = probe_path(str(path))
    assert spec.ssm is not None
    assert (spec.ssm.d_conv, spec.ssm.d_inner, spec.ssm.d_state, spec.ssm.dt_rank) == (4, 128, 16, 4)
    assert all(layer.is_recurrent for layer in spec.layers)


def test_sliding_window_pattern_array(tmp_path: Path) -> None:
    a = "gemma3"
    path = write_model(
        tmp_path / "g.gguf", arch=a, n_layer=3,
        extra={f"{a}.attention.sliding_window": 512, f"{a}.attention.sliding_window_pattern": [True, False, True]},
    )[0]
    spec = probe_path(str(path))
    assert [layer.is_swa for layer in spec.layers] == [True, False, True]
    assert spec.n_swa == 512


def test_long_arrays_are_summarised_not_decoded(big_vocab_model: Path) -> None:
    with FileSource(str(big_vocab_model)) as src:
        h = read_header(src)
    assert h.metadata["tokenizer.ggml.tokens"] == ArraySummary("string", 60_000)
    assert h.metadata["tokenizer.ggml.scores"] == ArraySummary("float32", 60_000)
    assert h.array_lengths["tokenizer.ggml.tokens"] == 60_000
    assert probe_path(str(big_vocab_model)).n_vocab == 60_000


# ---------------------------------------------------------------- against ggml's C parser


def _libggml() -> ctypes.CDLL:
    import llama_cpp

    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    lib = ctypes.CDLL(str(lib_dir / "libggml-base.so"))

    class Params(ctypes.Structure):
        _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.POINTER(ctypes.c_void_p))]

    lib.gguf_init_from_file.restype = ctypes.c_void_p
    lib.gguf_init_from_file.argtypes = [ctypes.c_char_p, Params]
    lib._params = Params  # type: ignore[attr-defined]
    for fn, res in [
        ("gguf_get_n_tensors", ctypes.c_int64), ("gguf_get_n_kv", ctypes.c_int64),
        ("gguf_get_data_offset", ctypes.c_size_t), ("gguf_get_alignment", ctypes.c_size_t),
    ]:
        getattr(lib, fn).restype = res
        getattr(lib, fn).argtypes = [ctypes.c_void_p]
    lib.gguf_get_tensor_name.restype = ctypes.c_char_p
    lib.gguf_get_tensor_name.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.gguf_get_tensor_offset.restype = ctypes.c_size_t
    lib.gguf_get_tensor_offset.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.gguf_get_tensor_type.restype = ctypes.c_int
    lib.gguf_get_tensor_type.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.gguf_get_tensor_size.restype = ctypes.c_size_t
    lib.gguf_get_tensor_size.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.gguf_find_key.restype = ctypes.c_int64
    lib.gguf_find_key.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.gguf_get_arr_n.restype = ctypes.c_size_t
    lib.gguf_get_arr_n.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.gguf_free.argtypes = [ctypes.c_void_p]
    return lib


def test_embedded_model_matches_ggml_c_parser(embedded_model: str) -> None:
    lib = _libggml()
    ctx = lib.gguf_init_from_file(os.fsencode(embedded_model), lib._params(True, None))  # type: ignore[attr-defined]
    assert ctx
    try:
        n = lib.gguf_get_n_tensors(ctx)
        c_tensors = {
            lib.gguf_get_tensor_name(ctx, i).decode(): (
                lib.gguf_get_tensor_offset(ctx, i), lib.gguf_get_tensor_type(ctx, i), lib.gguf_get_tensor_size(ctx, i)
            )
            for i in range(n)
        }
        c_data_offset = lib.gguf_get_data_offset(ctx)
        c_alignment = lib.gguf_get_alignment(ctx)
        c_n_kv = lib.gguf_get_n_kv(ctx)
        c_vocab = lib.gguf_get_arr_n(ctx, lib.gguf_find_key(ctx, b"tokenizer.ggml.tokens"))
    finally:
        lib.gguf_free(ctx)

    spec = probe_path(embedded_model)
    assert {t.name: (t.offset, t.ggml_type, t.n_bytes) for t in spec.tensors} == c_tensors
    assert spec.data_offset == c_data_offset
    assert spec.alignment == c_alignment
    assert len(spec.metadata) == c_n_kv
    assert spec.n_vocab == c_vocab == 262_144
    assert spec.architecture == "gemma3"
    assert spec.n_layer == 18
    # Every byte after the header is a tensor's (plus alignment padding).
    assert spec.data_offset + spec.weights_bytes <= spec.file_size_bytes
    assert spec.file_size_bytes - (spec.data_offset + spec.weights_bytes) < 32 * len(spec.tensors)


def test_numpy_reference_for_q_type_sizes() -> None:
    # Cross-check tensor_nbytes against gguf's quant_shape_to_byte_shape for every known type.
    for t, (block, size) in gguf.GGML_QUANT_SIZES.items():
        if size == 0:
            continue
        shape = (block * 3, 5)
        byte_shape = gguf.quant_shape_to_byte_shape(tuple(reversed(shape)), t)
        assert tensor_nbytes("x", shape, int(t)) == int(np.prod(byte_shape)), t.name
