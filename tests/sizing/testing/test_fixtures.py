"""The fixture writer: real shapes, sparse files. (How fast it writes is bench/probe_bench.py's
business, not a timed assertion here.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sizing.probe import probe_path
from sizing.testing.fixtures import FIXTURES, write_fixture


def test_qwen3_14b_shape_and_sparseness(tmp_path: Path) -> None:
    path = write_fixture("Qwen3-14B", tmp_path)
    spec = probe_path(path)
    assert (spec.n_layer, spec.n_embd, spec.n_vocab, spec.n_ctx_train) == (40, 5120, 151936, 40960)
    assert {(l.n_head, l.n_head_kv, l.n_embd_head_k) for l in spec.layers} == {(40, 8, 128)}
    st = os.stat(path)
    assert st.st_size == spec.file_size_bytes > 29 * 10**9  # full size (BF16 14.8B parameters)...
    assert st.st_blocks * 512 < 50 * 10**6  # ...but only the header is on disk
    assert write_fixture("Qwen3-14B", tmp_path) == path  # cached


@pytest.mark.parametrize("quant,main_type", [("q8_0", "Q8_0"), ("q4_k_m", "Q4_K")])
def test_quantized_fixtures_use_realistic_types(tmp_path: Path, quant: str, main_type: str) -> None:
    spec = probe_path(write_fixture("Llama-3.1-8B", tmp_path, quant))  # type: ignore[arg-type]
    types = {t.name: t.type_name for t in spec.tensors}
    assert types["blk.0.attn_q.weight"] == main_type
    assert types["blk.0.attn_norm.weight"] == "F32"
    if quant == "q4_k_m":
        assert types["output.weight"] == "Q6_K"
    assert spec.weights_bytes < 10 * 10**9


def test_every_fixture_names_its_architecture() -> None:
    assert {"qwen3", "llama", "qwen2", "gemma2", "gemma3", "qwen3moe", "deepseek2"} <= {s.arch for s in FIXTURES.values()}
    with pytest.raises(KeyError, match="unknown fixture"):
        write_fixture("nope", "/tmp")
