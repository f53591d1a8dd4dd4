"""The probe fuzzer (bench/fuzz_probe.py) for a few seconds: no crash, hang or allocation beyond the input."""

from __future__ import annotations

import runpy

import pytest


def test_fuzz_probe_short(capsys: pytest.CaptureFixture[str]) -> None:
    mod = runpy.run_path("bench/fuzz_probe.py", run_name="fuzz_probe")
    assert mod["main"](["--seconds", "5", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "0 crashes, 0 hangs" in out
