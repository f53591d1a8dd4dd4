"""Compute buffer model: exact terms and properties."""

from __future__ import annotations

from typing import Callable

import pytest

import sizing.memory.graph_alloc as ga
from sizing.memory.compute import compute_bytes, logits_bytes, output_phase_bytes
from sizing.memory.graph import _build, _simulate, graph_shape
from sizing.memory.context import ContextConfig
from sizing.errors import FlashAttentionRequiredError
from sizing.memory.estimate import estimate, output_buffer_bytes, resolve_flash_attn
from sizing.model.spec import ModelSpec

MIB = 1 << 20
MODELS = ["Qwen3-14B", "Llama-3.1-8B", "gemma-3-27b", "gemma-2-9b", "Mistral-Nemo-12B", "Qwen3-30B-A3B", "DeepSeek-V2-Lite"]


def test_logits_of_the_reserve_ubatch(fixture_spec: Callable[..., ModelSpec]) -> None:
    spec = fixture_spec("Qwen3-14B")
    cfg = ContextConfig(n_ctx=4096)
    assert logits_bytes(spec, cfg) == 4 * 151936 * 512
    # logits + result_norm in and out: what sched_reserve logs with flash attention (316.75 MiB)
    assert output_phase_bytes(spec, cfg) == round(316.75 * MIB)


def test_without_flash_attention_scores_dominate_at_long_context(fixture_spec: Callable[..., ModelSpec]) -> None:
    spec = fixture_spec("Qwen3-14B")
    cfg = ContextConfig(n_ctx=16384, flash_attn="off")
    # kq (16384 x 512 x 40 F32) + mask + 3 n_embd + 2 q + 2 kv per token: 1366.01 MiB in llama.cpp's log
    assert abs(compute_bytes(spec, cfg, flash=False) / MIB - 1366.01) < 0.02


@pytest.mark.parametrize("model", MODELS)
def test_flash_attention_never_costs_more_at_long_context(fixture_spec: Callable[..., ModelSpec], model: str) -> None:
    # At short contexts llama.cpp's own allocator layout can make FA cost more (see the Nemo test below),
    # so the property holds where the n_kv x n_head scores dominate.
    spec = fixture_spec(model)
    for n_ctx in (32768, 65536, 131072):
        for n_ub in (512, 2048):
            for par in (1, 4):
                cfg = ContextConfig(n_ctx=n_ctx, n_ubatch=n_ub, n_batch=n_ub, n_seq_max=par)
                on = estimate(spec, cfg).total_bytes
                off = estimate(spec, ContextConfig(n_ctx=n_ctx, n_ubatch=n_ub, n_batch=n_ub, n_seq_max=par, flash_attn="off")).total_bytes
                assert on <= off


@pytest.mark.parametrize("model", MODELS)
def test_a_larger_context_never_needs_less(fixture_spec: Callable[..., ModelSpec], model: str) -> None:
    spec = fixture_spec(model)
    for fa in ("on", "off"):
        prev = 0
        for n in range(256, 140000, 4099):
            total = estimate(spec, ContextConfig(n_ctx=n, flash_attn=fa, swa_full=True)).total_bytes  # type: ignore[arg-type]
            assert total >= prev
            prev = total


def test_flash_attention_can_cost_more_at_short_context_as_in_llama_cpp(fixture_spec: Callable[..., ModelSpec]) -> None:
    # llama.cpp's dry run, Mistral-Nemo, n_ctx 1000, f16 cache, n_ubatch 512: 315.01 MiB with FA, 276.00 MiB without
    # (the FA graph's layout leaves a hole below the logits); the simulated allocator reproduces both.
    spec = fixture_spec("Mistral-Nemo-12B")
    on = compute_bytes(spec, ContextConfig(n_ctx=1000), flash=True) / MIB
    off = compute_bytes(spec, ContextConfig(n_ctx=1000, flash_attn="off"), flash=False) / MIB
    assert round(on, 2) == 315.01
    assert round(off, 2) == 276.00


def test_simulation_is_exact_for_qwen3_14b(fixture_spec: Callable[..., ModelSpec]) -> None:
    # sched_reserve's figures (llama.cpp dry run) for three layouts: FA on, FA off, quantized cache with its rotation
    spec = fixture_spec("Qwen3-14B")
    assert round(compute_bytes(spec, ContextConfig(n_ctx=16384, n_ubatch=2048, n_batch=2048), True) / MIB, 2) == 1267.01
    assert round(compute_bytes(spec, ContextConfig(n_ctx=4096, type_k="q8_0", flash_attn="off"), False) / MIB, 2) == 372.07


@pytest.mark.parametrize(
    ("model", "cfg", "flash", "mib"),
    [
        # sched_reserve's figures (llama.cpp dry run): MLA (absorbed) + MoE with shared experts and a dense lead layer
        ("DeepSeek-V2-Lite", ContextConfig(n_ctx=4096), True, 240.26),
        ("DeepSeek-V2-Lite", ContextConfig(n_ctx=1000), True, 212.00),
        ("DeepSeek-V2-Lite", ContextConfig(n_ctx=4096, n_ubatch=2048, n_batch=2048, n_seq_max=4), True, 848.01),
        ("DeepSeek-V2-Lite", ContextConfig(n_ctx=50000, n_seq_max=4, flash_attn="off"), False, 523.77),
        # build_moe_ffn with normalised top-k weights
        ("Qwen3-30B-A3B", ContextConfig(n_ctx=4096, flash_attn="off"), False, 304.75),
        ("Qwen3-30B-A3B", ContextConfig(n_ctx=4096, n_ubatch=2048, n_batch=2048, type_k="q8_0"), True, 1219.01),
    ],
)
def test_simulation_is_exact_for_moe_and_mla(
    fixture_spec: Callable[..., ModelSpec], model: str, cfg: ContextConfig, flash: bool, mib: float
) -> None:
    assert round(compute_bytes(fixture_spec(model), cfg, flash) / MIB, 2) == mib


@pytest.mark.parametrize("model", ["Qwen3-14B", "gemma-3-27b", "DeepSeek-V2-Lite", "Qwen3-30B-A3B"])
def test_replayed_trace_equals_a_fresh_simulation(fixture_spec: Callable[..., ModelSpec], model: str) -> None:
    # one allocator trace per graph structure, replayed with the sizes of each KV length
    shape = graph_shape(fixture_spec(model))
    assert shape is not None
    for full, swa in ((256, 256), (1024, 768), (13056, 1280), (50176, 4352)):
        for flash, tk in ((True, "f16"), (True, "q8_0"), (False, "f16")):
            direct = ga.peak_bytes(_build(shape, full, swa, 512, 1, flash, tk, tk if flash else "f16"))
            assert _simulate(shape, full, swa, 512, 1, flash, tk, tk if flash else "f16") == direct


def test_quantized_cache_with_flash_attention_off_is_refused() -> None:
    with pytest.raises(FlashAttentionRequiredError, match=r"type_k=q8_0, type_v=q4_0.*flash_attn is 'off'"):
        resolve_flash_attn(ContextConfig(n_ctx=4096, type_k="q8_0", type_v="q4_0", flash_attn="off"))
    assert resolve_flash_attn(ContextConfig(n_ctx=4096, type_k="q8_0", type_v="q8_0", flash_attn="auto")) is True
    assert resolve_flash_attn(ContextConfig(n_ctx=4096, flash_attn="off")) is False


def test_output_buffer_is_one_row_of_logits_per_sequence(fixture_spec: Callable[..., ModelSpec]) -> None:
    spec = fixture_spec("Qwen3-14B")
    assert output_buffer_bytes(spec, ContextConfig(n_ctx=4096, n_seq_max=4)) == 151936 * 4 * 4
