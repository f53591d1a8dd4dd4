"""The dry-run adapter: log parsing (pure) and llama.cpp's refusals (real, in a child process)."""

from __future__ import annotations

from typing import Callable

import pytest

from service.engine.dryrun import dry_run, forced_norm_overcount, parse_context_log
from service.engine.loglines import ggml_fmt_size
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


def _sched_log(n_embd: int, n_tokens: int, copies: int, wiped: str = "norm-10", compute: float = 539.33) -> list[str]:
    """A context's log with GGML_SCHED_DEBUG=1 over two devices in llama.cpp's format (the lines of a dry run of
    the embedded gemma over two ggml-rpc workers, their inputs shortened): a token graph, the measured prompt graph
    whose second split takes ``wiped`` beside the residual, a token graph and the prompt graph the load keeps."""
    a, b = "RPC0[127.0.0.1:21001]", "RPC0[127.0.0.1:21011]"
    act = ggml_fmt_size(4 * n_embd * n_tokens)

    def graph(n: int, size: str, extra: str = "") -> list[str]:
        return [f"graph_reserve: reserving a graph for ubatch with n_tokens = {n:4d}, n_seqs =  4, n_outputs = {n:4d}",
                "## SPLIT #0: CPU # 0 inputs",
                f"## SPLIT #1: {a} # 2 inputs: [embd ({size:>5})] [inp_pos (   2K)] ",
                f"## SPLIT #2: {b} # 3 inputs: {extra}[l_out-9 ({size:>5})] [inp_pos (   2K)] [out_ids (   2K)] "]

    return [*graph(4, "10K"), *graph(n_tokens, act, f"[{wiped} ({act:>5})] "), *graph(4, "10K"), *graph(n_tokens, act),
            f"sched_reserve: {a} compute buffer size =    37.57 MiB",
            f"sched_reserve: {b} compute buffer size = {compute:8.2f} MiB",
            "sched_reserve:        CPU compute buffer size =    22.34 MiB",
            f"sched_reserve: reserve took 24.76 ms, sched copies = {copies}"]


def test_the_dry_runs_wiped_norm_pins_are_taken_out() -> None:
    """llama.cpp's dry run measures a graph whose layer-10 norm runs on the previous device (its reserve_size
    resets the scheduler's pins); the load keeps the pin: ``copies`` copies of that input are not allocated."""
    n_embd, n_tokens, copies = 640, 512, 4
    r = parse_context_log(ContextConfig(n_ctx=2048), _sched_log(n_embd, n_tokens, copies), created=True, n_embd=n_embd)
    over = copies * 4 * n_embd * n_tokens / (1 << 20)
    assert r.overcount_mib == {"RPC0[127.0.0.1:21011]": round(over, 2)}
    assert r.compute_mib["RPC0[127.0.0.1:21011]"] == round(539.33 - over, 2)
    assert r.compute_mib["RPC0[127.0.0.1:21001]"] == 37.57 and r.compute_mib["CPU"] == 22.34
    assert not any("## SPLIT" in ln for ln in r.log_tail)


@pytest.mark.parametrize("case", ["one copy", "another tensor", "another size", "no n_embd"])
def test_nothing_is_taken_out_where_the_log_does_not_show_that_shape(case: str) -> None:
    n_embd, n_tokens = 640, 512
    lines = {"one copy": _sched_log(n_embd, n_tokens, 1),
             "another tensor": _sched_log(n_embd, n_tokens, 4, wiped="ffn_inp-10"),
             "another size": _sched_log(2 * n_embd, n_tokens, 4)}.get(case, _sched_log(n_embd, n_tokens, 4))
    assert forced_norm_overcount(lines, 0 if case == "no n_embd" else n_embd) == {}
    r = parse_context_log(ContextConfig(n_ctx=2048), lines, created=True, n_embd=0 if case == "no n_embd" else n_embd)
    assert r.compute_mib["RPC0[127.0.0.1:21011]"] == 539.33 and r.overcount_mib == {}


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
