"""The images' and compose's healthcheck commands against the real service: healthy once loaded, not before."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def _commands() -> list[list[str]]:
    dockerfile = (ROOT / "Dockerfile").read_text(encoding="utf-8").replace("\\\n", " ")
    found = [json.loads(m) for m in re.findall(r"^HEALTHCHECK\b.*?\bCMD\s+(.*)$", dockerfile, re.MULTILINE)]
    with (ROOT / "docker-compose.yml").open(encoding="utf-8") as fh:
        compose = yaml.safe_load(fh)
    found += [s["healthcheck"]["test"][1:] for s in compose["services"].values()]
    assert len(found) >= 3
    return found


def _run(argv: list[str], port: int) -> int:
    argv = [sys.executable if a == "python" else a for a in argv]
    env = {**os.environ, "GGUF_PORT": str(port)}
    return subprocess.run(argv, env=env, capture_output=True, timeout=30).returncode


@pytest.mark.slow
def test_healthcheck_passes_once_the_model_is_loaded(served: Any) -> None:
    for argv in _commands():
        assert _run(argv, served.port) == 0, argv


@pytest.mark.slow
def test_healthcheck_fails_with_no_model_loaded(service_factory: Any) -> None:
    svc = service_factory(GGUF_DEFAULT_MODEL="")
    assert svc.client.get("/health").status_code == 200
    assert svc.client.get("/ready").status_code == 503
    for argv in _commands():
        assert _run(argv, svc.port) != 0, argv
