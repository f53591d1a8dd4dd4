"""Reliability and security: fixtures, and the ``soak`` marker (long runs, only with ``GGUF_SOAK=1``: ``make soak``)."""

from __future__ import annotations

import os

import pytest

from tests.service.conftest import FakeService, big_fixture, fake, fake_factory  # noqa: F401  (fixtures shared)

SOAK = os.environ.get("GGUF_SOAK") == "1"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "soak: minutes-long reliability runs; run with GGUF_SOAK=1 (make soak)")


@pytest.fixture(autouse=True)
def _soak_only_when_asked(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("soak") is not None and not SOAK:
        pytest.skip("soak test: set GGUF_SOAK=1 (make soak)")


def rss_kib(pid: int) -> int:
    """Resident memory of a process, KiB (Linux /proc)."""
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def threads_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    raise RuntimeError("no Threads")


__all__ = ["FakeService", "rss_kib", "threads_of"]
