"""The architecture table and the per-layer memory kinds it derives (pure; llama.cpp's rules, exact cases)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from sizing.model import arch as archs
from sizing.memory.context import ContextConfig
from sizing.probe import probe_path
from sizing.memory.kv import kv_layers, recurrent_state_bytes, state_layers
from sizing.model.spec import ModelSpec


def test_set_swa_pattern_examples_of_llama_hparams() -> None:
    # the examples in the comment above llama_hparams::set_swa_pattern (src/llama-hparams.h)
    t3 = archs.ArchTraits(swa=archs.SwaRule(3))
    assert archs.swa_layers(t3, 7, 7, 4096, None, [False] * 7) == [True, True, False, True, True, False, True]
    t2 = archs.ArchTraits(swa=archs.SwaRule(2, dense_first=True))
    assert archs.swa_layers(t2, 4, 4, 4096, None, [False] * 4) == [False, True, False, True]
    # n_pattern 0: every layer slides; 1: none
    assert archs.swa_layers(t3, 3, 3, 4096, 0, [False] * 3) == [True, True, True]
    assert archs.swa_layers(t3, 3, 3, 4096, 1, [False] * 3) == [False, False, False]


def test_swa_conditions_follow_load_arch_hparams() -> None:
    exaone4 = archs.traits("exaone4")
    # exaone4 slides only in its 64-layer model (src/models/exaone4.cpp)
    assert not any(archs.swa_layers(exaone4, 30, 30, 4096, None, [False] * 30))
    assert sum(archs.swa_layers(exaone4, 64, 64, 4096, None, [False] * 64)) == 48
    assert archs.swa_window(exaone4, None) == 4096
    # gemma3 slides only when the key is there and positive; olmo2 likewise
    assert not any(archs.swa_layers(archs.traits("gemma3"), 6, 6, None, None, [False] * 6))
    assert not any(archs.swa_layers(archs.traits("olmo2"), 8, 8, 0, None, [False] * 8))
    # llama4: chunked 8192 unless the key says 0
    llama4 = archs.traits("llama4")
    assert archs.swa_window(llama4, 1234) == 8192
    assert not any(archs.swa_layers(llama4, 4, 4, 0, None, [False] * 4))
    # lfm2: the attention layers slide when a window is set
    lfm2 = archs.traits("lfm2")
    assert archs.swa_layers(lfm2, 3, 3, 512, None, [True, False, True]) == [False, True, False]
    assert not any(archs.swa_layers(lfm2, 3, 3, None, None, [True, False, True]))
    # phi3 ignores the file's window
    assert not any(archs.swa_layers(archs.traits("phi3"), 4, 4, 2048, None, [False] * 4))


def test_hybrid_layers_keep_what_create_memory_gives_them() -> None:
    n = 6
    # falcon-h1: every layer keeps both KV and state
    t = archs.traits("falcon-h1")
    rec = archs.recurrent_layers(t, n, n, [2] * n, [1024] * n, None, None)
    kv, st = archs.memory_layers(t, n, n, rec, [1024] * n, None)
    assert kv == [True] * n and st == [True] * n
    # nemotron_h: M (mamba), * (attention), - (MLP only: neither)
    heads, ff = [0, 8, 0, 0], [0, 0, 1000, 0]
    t = archs.traits("nemotron_h")
    rec = archs.recurrent_layers(t, 4, 4, heads, ff, None, None)
    kv, st = archs.memory_layers(t, 4, 4, rec, ff, None)
    assert kv == [False, True, False, False] and st == [True, False, False, True]
    # qwen3next: every layer but each 4th is recurrent; the NextN block keeps nothing
    t = archs.traits("qwen3next")
    rec = archs.recurrent_layers(t, 8, 9, [2] * 9, [0] * 9, None, None)
    kv, st = archs.memory_layers(t, 8, 9, rec, [0] * 9, None)
    assert st == [True, True, True, False, True, True, True, False, False]
    assert kv == [False, False, False, True, False, False, False, True, False]
    # an explicit recurrent_layers array wins over the interval
    assert archs.recurrent_layers(t, 3, 3, [2] * 3, [0] * 3, [True, False, True], 4) == [True, False, True]
    # gemma3n / gemma4 reuse the KV of their first layers
    kv, _ = archs.memory_layers(archs.traits("gemma4"), 6, 6, [False] * 6, [0] * 6, 4)
    assert kv == [True, True, True, True, False, False]


def test_state_widths_follow_n_embd_r_and_n_embd_s() -> None:
    # Mamba-2: conv (d_conv - 1) x (d_inner + 2 n_group d_state), ssm d_state x d_inner
    w = archs.state_widths(2560, 0, 0, d_conv=4, d_inner=5120, d_state=128, n_group=1)
    assert (w.kind, w.n_embd_r, w.n_embd_s) == ("ssm", 3 * (5120 + 256), 128 * 5120)
    # RWKV: token shift x n_embd, n_embd x head size
    w = archs.state_widths(2048, 0, 0, wkv_head_size=64)
    assert (w.kind, w.n_embd_r, w.n_embd_s) == ("rwkv", 2 * 2048, 2048 * 64)
    # LFM2 short convolution: n_embd x (L - 1), no s
    w = archs.state_widths(2048, 32, 64, shortconv_l_cache=3)
    assert (w.kind, w.n_embd_r, w.n_embd_s) == ("shortconv", 2 * 2048, 0)
    # KDA: 3 x (d_conv - 1) x n_head x head_dim, head_dim^2 x n_head
    w = archs.state_widths(2304, 32, 128, kda_head_dim=128, d_conv=4)
    assert (w.kind, w.n_embd_r, w.n_embd_s) == ("kda", 3 * 3 * 32 * 128, 128 * 128 * 32)


def test_an_unknown_architecture_is_sized_as_attention_and_marked(tmp_path: Path) -> None:
    from tests.sizing.probe.conftest import write_model

    path = write_model(tmp_path / "x.gguf", arch="frobnicator", n_layer=2)[0]
    spec = probe_path(str(path))
    assert not spec.arch_known
    assert [l.has_kv for l in spec.layers] == [True, True]
    assert archs.traits("frobnicator") is archs.UNKNOWN


@pytest.mark.parametrize("name, kv, state", [
    ("Falcon-H1-0.5B", 36, 36), ("Nemotron-H-8B", 4, 24), ("LFM2-1.2B", 6, 10), ("Jamba-Mini-1.5", 4, 28),
    ("Qwen3-Next-80B-A3B", 12, 36), ("RWKV7-Goose-1.5B", 0, 24), ("granite-4.0-h-micro", 4, 36), ("gpt-oss-20b", 24, 0),
])
def test_fixture_layers(name: str, kv: int, state: int, fixture_spec: Callable[..., ModelSpec]) -> None:
    spec = fixture_spec(name)
    assert len(kv_layers(spec)) == kv
    assert len(state_layers(spec)) == state
    if state:
        assert recurrent_state_bytes(spec, ContextConfig(4096, n_seq_max=4)) == 4 * recurrent_state_bytes(
            spec, ContextConfig(4096))


def test_gpt_oss_slides_every_other_layer(fixture_spec: Callable[..., ModelSpec]) -> None:
    spec = fixture_spec("gpt-oss-20b")
    assert [l.is_swa for l in spec.layers[:4]] == [True, False, True, False]
    assert spec.n_swa == 128


def test_docs_say_for_every_architecture_whether_it_is_simulated_or_measured() -> None:
    doc = (Path(__file__).resolve().parents[3] / "docs" / "memory.md").read_text(encoding="utf-8")
    rows = {line.split("|")[1].strip(): line for line in doc.splitlines() if line.startswith("| ") and line.count("|") == 7}
    for name, t in archs.ARCHS.items():
        assert name in rows, f"docs/memory.md does not list {name}"
        expected = ("no memory" if t.memory == "none" else "simulated (CPU)" if t.mirrored else "| measured |")
        assert expected in rows[name], (name, rows[name])
