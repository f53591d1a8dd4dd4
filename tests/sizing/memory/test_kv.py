"""KV cache bytes: exact figures from llama.cpp's rules, and properties."""

from __future__ import annotations

from typing import Callable

import pytest

from sizing.memory.context import ContextConfig
from sizing.errors import ConfigError
from sizing.model.ggml import CACHE_TYPES, cache_type
from sizing.probe import probe_path
from sizing.memory.kv import kv_bytes, kv_bytes_per_token, kv_cells, kv_split_bytes
from sizing.model.spec import LayerSpec, ModelSpec

MIB = 1 << 20


def test_qwen3_14b_f16_is_163840_bytes_per_token(fixture_spec: Callable[..., ModelSpec]) -> None:
    spec = fixture_spec("Qwen3-14B")
    assert kv_bytes_per_token(spec) == 2 * 40 * 8 * 128 * 2 == 163_840
    assert kv_bytes_per_token(spec, "q8_0", "q8_0") == 2 * 40 * 8 * 128 // 32 * 34
    assert kv_bytes_per_token(spec, "q4_0", "q4_0") == 2 * 40 * 8 * 128 // 32 * 18


def test_gemma3_270m_at_32k(embedded_path: str) -> None:
    spec = probe_path(embedded_path)
    cfg = ContextConfig(n_ctx=32768, swa_full=False)
    full, swa = kv_split_bytes(spec, cfg, flash=True)
    assert full == 96 * MIB
    assert swa == 15 * MIB
    assert kv_cells(spec, cfg).swa == 1024
    full, swa = kv_split_bytes(spec, ContextConfig(n_ctx=32768, swa_full=True), flash=True)
    assert (full, swa) == (96 * MIB, 480 * MIB)


def test_gemma3_27b_swa_cache_is_624_mib_at_32k(fixture_spec: Callable[..., ModelSpec]) -> None:
    spec = fixture_spec("gemma-3-27b")
    _, swa = kv_split_bytes(spec, ContextConfig(n_ctx=32768, swa_full=False), flash=True)
    assert swa == 624 * MIB
    _, swa_full = kv_split_bytes(spec, ContextConfig(n_ctx=32768, swa_full=True), flash=True)
    assert swa_full == 13 * 1024 * MIB


def test_n_ctx_is_padded_to_256_and_split_into_streams() -> None:
    assert ContextConfig(n_ctx=1000).n_ctx_seq == 1024
    cfg = ContextConfig(n_ctx=10000, n_seq_max=4)
    # PAD(10240 / 4, 256) = 2560 cells in each of 4 streams
    assert (cfg.n_ctx_seq, cfg.n_stream, cfg.n_ctx_padded) == (2560, 4, 10240)
    unified = ContextConfig(n_ctx=10000, n_seq_max=4, kv_unified=True)
    assert (unified.n_ctx_seq, unified.n_stream) == (10240, 1)


def test_n_ubatch_is_clamped_to_n_batch_and_n_ctx() -> None:
    assert ContextConfig(n_ctx=1000, n_ubatch=2048, n_batch=2048).n_ubatch_effective == 1000
    assert ContextConfig(n_ctx=8192, n_ubatch=2048, n_batch=512).n_ubatch_effective == 512


def test_swa_window_grows_with_unified_sequences(fixture_spec: Callable[..., ModelSpec]) -> None:
    spec = fixture_spec("gemma-2-9b")  # n_swa 4096
    assert kv_cells(spec, ContextConfig(n_ctx=65536, n_seq_max=2, kv_unified=True)).swa == 4096 * 2 + 512
    assert kv_cells(spec, ContextConfig(n_ctx=65536, n_seq_max=2)).swa == 4096 + 512


def test_mla_caches_k_only(fixture_spec: Callable[..., ModelSpec]) -> None:
    spec = fixture_spec("DeepSeek-V2-Lite")
    assert kv_bytes_per_token(spec) == 27 * 576 * 2
    with pytest.raises(ConfigError, match="different K"):
        from sizing.memory.kv import check_cache_types

        check_cache_types(spec, ContextConfig(n_ctx=4096, type_k="q8_0", type_v="f16"))


def _spec(layers: list[LayerSpec], n_swa: int = 0) -> ModelSpec:
    return ModelSpec(
        architecture="test", name="t", n_ctx_train=8192, n_embd=1024, n_layer=len(layers), n_layer_all=len(layers),
        n_vocab=1000, layers=tuple(layers), tensors=(), file_size_bytes=0, n_swa=n_swa,
    )


def test_v_is_padded_to_the_widest_layer_without_flash_attention() -> None:
    spec = _spec([LayerSpec(0, 8, 2, 128, 128), LayerSpec(1, 8, 2, 256, 256)])
    cfg = ContextConfig(n_ctx=256)
    per_cell_fa = (2 * 128 + 2 * 128 + 2 * 256 + 2 * 256) * 2
    per_cell_nofa = (2 * 128 + 2 * 256 + 2 * 256 + 2 * 256) * 2
    assert kv_bytes(spec, cfg, flash=True) == per_cell_fa * 256
    assert kv_bytes(spec, cfg, flash=False) == per_cell_nofa * 256


def test_recurrent_layers_have_no_kv_and_block_size_must_divide_head() -> None:
    spec = _spec([LayerSpec(0, 8, 2, 80, 80), LayerSpec(1, 8, 0, 80, 80, is_recurrent=True)])
    assert kv_bytes(spec, ContextConfig(n_ctx=512), flash=True) == 512 * 2 * 160 * 2
    from sizing.memory.kv import check_cache_types

    with pytest.raises(ConfigError, match=r"block size 32 does not divide n_embd_head_k=80"):
        check_cache_types(spec, ContextConfig(n_ctx=512, type_k="q8_0", type_v="f16"), flash=True)


@pytest.mark.parametrize("name", sorted(CACHE_TYPES))
def test_every_cache_type_row_size(name: str) -> None:
    t = cache_type(name)
    assert t.row_bytes(128) * t.block_size == 128 * t.type_size


@pytest.mark.parametrize("model", ["Qwen3-14B", "gemma-3-27b", "DeepSeek-V2-Lite", "Qwen3-30B-A3B"])
def test_a_larger_context_never_needs_less(fixture_spec: Callable[..., ModelSpec], model: str) -> None:
    spec = fixture_spec(model)
    for flash in (True, False):
        prev = 0
        for n in range(256, 70000, 997):
            b = kv_bytes(spec, ContextConfig(n_ctx=n, n_seq_max=3), flash)
            assert b >= prev
            prev = b
