"""The dry-run adapter: log parsing (pure) and llama.cpp's refusals (real, in a child process)."""

from __future__ import annotations

from typing import Callable

import pytest

from service.engine.dryrun import dry_run, parse_context_log
from sizing.memory.context import ContextConfig

LOG = [
    "llama_context: n_ctx                 = 5120",
    "llama_context: n_ctx_seq             = 5120",
    "llama_context:        CPU  output buffer size =     1.00 MiB",
    "llama_kv_cache_iswa: creating non-SWA KV cache, size = 5120 cells",
    "llama_kv_cache: size =  400.00 MiB (  5120 cells,  10 layers,  1/1 seqs), K (f16):  200.00 MiB, V (f16):  200.00 MiB",
    "llama_kv_cache_iswa: creating     SWA KV cache, size = 1536 cells",
    "llama_kv_cache: size =  624.00 MiB (  1536 cells,  52 layers,  1/1 seqs), K (f16):  312.00 MiB, V (f16):  312.00 MiB",
    "sched_reserve:        CPU compute buffer size =   533.13 MiB",
]


def test_parse_context_log() -> None:
    r = parse_context_log(ContextConfig(n_ctx=5000), LOG, created=True)
    assert r.ok and r.n_ctx == 5120 and r.n_ctx_seq == 5120
    assert r.kv_mib == 1024.0 and r.cells() == 5120 and r.cells(swa=True) == 1536
    assert r.compute_mib == {"CPU": 533.13} and r.output_mib == 1.0


def test_parse_refusal_keeps_the_reason() -> None:
    lines = ["llama_init_from_model: quantized V cache requires flash_attn to be enabled"]
    r = parse_context_log(ContextConfig(n_ctx=4096, type_v="q8_0", flash_attn="off"), lines, created=False)
    assert not r.ok and r.failure is not None and r.failure.kind == "refused"
    assert "requires flash_attn" in r.failure.message and r.failure.log_tail == tuple(lines)


@pytest.mark.slow
def test_llama_refuses_quantized_v_without_flash_attention(fixture_path: Callable[..., str]) -> None:
    path = fixture_path("Llama-3.1-8B")
    bad = dry_run(path, ContextConfig(n_ctx=4096, type_k="q8_0", type_v="q8_0", flash_attn="off"), timeout_s=120)
    assert bad.failure is not None and "quantized V cache requires flash_attn" in bad.failure.message
    good = dry_run(path, ContextConfig(n_ctx=4096, type_k="q8_0", type_v="q8_0", flash_attn="on"), timeout_s=120)
    assert good.ok and good.kv_mib == 272.0 and good.flash_attn is True


def test_missing_file_is_our_error() -> None:
    from service.engine.dryrun import DryRunError

    with pytest.raises(DryRunError):
        dry_run("/nonexistent.gguf", ContextConfig(n_ctx=256))
