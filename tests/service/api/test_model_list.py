"""``GET /v1/models`` lists the default model first, then the loaded ones, then the rest: clients and UIs that take
the first entry (many do) name a model that answers, not one that is not loaded (a 503)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from service.settings import GEMMA_MODEL_NAME
from service.testing.fake import FakeEngine


def test_the_default_model_comes_first_then_the_loaded_ones_then_the_rest(
        fake_factory: Callable[..., Any], embedded_model: str, tmp_path: Path) -> None:
    files = []
    for name in ("aaa-first", "mmm-loaded", "zzz-last"):  # the registry lists the models directory by name
        os.link(embedded_model, tmp_path / f"{name}.gguf")
        files.append(str(tmp_path / f"{name}.gguf"))
    svc = fake_factory(models=files, engine_factory=lambda s: FakeEngine(), default_model=GEMMA_MODEL_NAME)
    assert svc.client.post("/api/models/load", json={"model": "mmm-loaded"}).status_code == 200
    ids = [m["id"] for m in svc.client.get("/v1/models").json()["data"]]
    registry_order = [m["name"] for m in svc.client.get("/api/models").json()["models"]]
    assert registry_order.index(GEMMA_MODEL_NAME) > registry_order.index("mmm-loaded") > 0, "the order changes here"
    rest = [n for n in registry_order if n not in (GEMMA_MODEL_NAME, "mmm-loaded")]
    assert ids == [GEMMA_MODEL_NAME, "mmm-loaded", *rest], ids
    assert [m["loaded"] for m in svc.client.get("/v1/models").json()["data"][:2]] == [True, True]
    # Unloaded, the default stays first; the other loaded model comes next.
    assert svc.client.post("/api/models/unload", json={"model": GEMMA_MODEL_NAME}).status_code == 200
    ids = [m["id"] for m in svc.client.get("/v1/models").json()["data"]]
    assert ids[:2] == [GEMMA_MODEL_NAME, "mmm-loaded"], ids
