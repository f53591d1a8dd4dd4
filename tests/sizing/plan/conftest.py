"""Model specs of real shapes, probed from the sparse fixture files (written once per session)."""

from __future__ import annotations

from typing import Callable

import pytest

from sizing.probe import probe_path
from sizing.testing.fixtures import write_fixture
from sizing.model.spec import ModelSpec


@pytest.fixture(scope="session")
def model_spec(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., ModelSpec]:
    d = tmp_path_factory.mktemp("plan-fixtures")
    cache: dict[tuple[str, str], ModelSpec] = {}

    def get(name: str, quant: str = "bf16") -> ModelSpec:
        key = (name, quant)
        if key not in cache:
            cache[key] = probe_path(write_fixture(name, d, quant))  # type: ignore[arg-type]
        return cache[key]

    return get
