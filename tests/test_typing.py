"""Every product module (sizing/ and service/, pyproject.toml's [tool.mypy]) type-checks under strict mypy."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.slow
def test_the_product_is_strictly_typed() -> None:
    r = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Success" in r.stdout
    modules = [p for folder in ("sizing", "service") for p in (ROOT / folder).rglob("*.py")]
    assert f"in {len(modules)} source files" in r.stdout, r.stdout  # no product module left out of the check
