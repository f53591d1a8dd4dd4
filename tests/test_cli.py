"""``python -m sizing probe|plan`` on the embedded model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sizing", *args], capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_probe_json(embedded_model: str) -> None:
    r = run("probe", embedded_model, "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["architecture"] == "gemma3"
    assert d["n_ctx_train"] == 32768
    assert d["block_count"] == 18
    assert d["head_count"] == [4]
    assert d["head_count_kv"] == [1]
    assert d["key_length"] == [256] and d["value_length"] == [256]
    assert d["sliding_window"] == 512
    assert d["n_vocab"] == 262144
    assert d["quantization"] == "Q4_K_M"
    assert d["file_size_bytes"] == 253113024


def test_plan_json_on_declared_gpus(embedded_model: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    gpus = tmp_path / "gpus.json"
    gpus.write_text(json.dumps([{"name": "small", "free_mib": 1800, "total_mib": 8192}]))
    r = run("plan", embedded_model, "--gpus", str(gpus), "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    by_type = {o["cache_type"]: o["n_ctx"] for o in d["cache_types"]}
    assert set(by_type) == {"f16", "q8_0", "q4_0"}
    assert all(0 < n <= 32768 for n in by_type.values())
    # A smaller cache never buys a shorter context.
    assert by_type["f16"] <= by_type["q8_0"] <= by_type["q4_0"]


def test_plan_refuses_with_exit_status_when_nothing_fits(embedded_model: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    gpus = tmp_path / "gpus.json"
    gpus.write_text(json.dumps([{"name": "tiny", "free_mib": 100, "total_mib": 8192}]))
    r = run("plan", embedded_model, "--gpus", str(gpus), "--json", "--no-offload")
    assert r.returncode == 3
    d = json.loads(r.stdout)
    assert d["verdict"] == "refused"
    assert d["refusal"] == "INSUFFICIENT_MEMORY"
    card = next(x for x in d["estimate"]["devices"] if x["device"] == "CUDA0")
    assert card["missing_mib"] > 0
    # Offload allowed (the default): a card with no room runs the model on the CPU.
    r = run("plan", embedded_model, "--gpus", str(gpus), "--json")
    assert r.returncode == 0
    assert json.loads(r.stdout)["verdict"] == "cpu"


def test_probe_of_a_non_gguf_file_is_a_clean_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    p = tmp_path / "x.gguf"
    p.write_bytes(b"NOPE" + b"\0" * 64)
    r = run("probe", str(p))
    assert r.returncode == 2
    assert "magic" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("bench", ["offload_gpu", "memory_accuracy"])
def test_the_memory_benches_import_and_offload_gpu_says_it_needs_a_gpu(bench: str) -> None:
    """bench/offload_gpu.py cannot run here (no GPU): it must import cleanly and exit 2 with a reason."""
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / f"{bench}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{bench}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[spec.name]
    assert callable(mod.main)
    from sizing.probe.devices import nvml_devices

    if bench == "offload_gpu" and not nvml_devices():
        r = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "needs one" in r.stderr


def test_plan_with_a_projector_counts_mtmd_figures(embedded_model: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from sizing.testing.projector_fixtures import TINY, write_projector

    mmproj = write_projector(tmp_path / "mmproj-tiny.gguf", TINY, values="random")
    base = run("plan", embedded_model, "--ctx", "4096", "--json")
    r = run("plan", embedded_model, "--ctx", "4096", "--mmproj", str(mmproj), "--json")
    assert r.returncode == 0 and base.returncode == 0, r.stderr
    d, b = json.loads(r.stdout), json.loads(base.stdout)
    p = d["projector"]
    assert p["device"] == "CPU" and p["compute_source"] == "measured" and p["tokens_per_image"] == 16
    assert p["weights_mib"] == 0.62 and p["compute_mib"] > 0 and b["projector"] is None
    # The host's total grows by the projector's (0.01 MiB: each side rounded on its own).
    assert abs(d["estimate"]["total_mib"] - b["estimate"]["total_mib"] - p["total_mib"]) <= 0.02
