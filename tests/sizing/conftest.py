"""Session fixtures for the sizing tests: header-only GGUFs of real shapes, written once per session."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from sizing.probe import probe_path
from sizing.testing.fixtures import write_fixture
from sizing.model.spec import ModelSpec


@pytest.fixture(scope="session")
def fixture_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf-fixtures")


@pytest.fixture(scope="session")
def fixture_path(fixture_dir: Path) -> Callable[..., str]:
    """``fixture_path("Qwen3-14B", quant="bf16")``: the sparse GGUF, written on first use."""

    def get(name: str, quant: str = "bf16") -> str:
        return write_fixture(name, fixture_dir, quant)  # type: ignore[arg-type]

    return get


@pytest.fixture(scope="session")
def fixture_spec(fixture_path: Callable[..., str]) -> Callable[..., ModelSpec]:
    cache: dict[tuple[str, str], ModelSpec] = {}

    def get(name: str, quant: str = "bf16") -> ModelSpec:
        if (name, quant) not in cache:
            cache[name, quant] = probe_path(fixture_path(name, quant))
        return cache[name, quant]

    return get


@pytest.fixture(scope="session")
def embedded_path() -> str:
    from service.catalog.embedded import embedded_model_path

    return embedded_model_path()
