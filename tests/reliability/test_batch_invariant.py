"""Batch-invariant outputs as a setting (issue 29's batching caveat): with ``GGUF_BATCH_INVARIANT`` (or a model's
``batch_invariant`` in the models file) a request's text does not depend on the requests decoded beside it, and
the plan, which knows the engine then loads without repacked weights, still equals what llama.cpp allocates."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import EMBEDDED_NAME, ServiceProcess, loaded_model

pytestmark = pytest.mark.slow

TARGET = {"prompt": "The lighthouse keeper looked at the sea and", "max_tokens": 24, "temperature": 0,
          "cache_prompt": False}


def _text(url: str, body: dict[str, Any]) -> str:
    with httpx.Client(timeout=300) as c:
        r = c.post(url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def test_batch_invariant_text_is_the_same_alone_and_batched(tmp_path: Path, embedded_model: str) -> None:
    models = tmp_path / "models"
    models.mkdir()
    (tmp_path / "models.toml").write_text(f'[models."{EMBEDDED_NAME}"]\nbatch_invariant = true\n')
    svc = ServiceProcess({"GGUF_MODELS_DIR": str(models), "GGUF_MODELS_FILE": str(tmp_path / "models.toml"),
                          "GGUF_CONTEXT_LENGTH": "4096", "GGUF_CONFIRM_LOADS": "false"}, tmp_path / "service.log")
    try:
        svc.wait_healthy()
        svc.wait_ready()
        model = loaded_model(svc.client)
        rows = {m["device"]: m for m in model["memory"]}
        assert set(rows) == {"CPU"}, "no repacked copies: the engine loads without them, and the plan knows"
        assert rows["CPU"]["allocated_mib"] == pytest.approx(rows["CPU"]["predicted_mib"], abs=0.011)
        assert model["plan"]["chosen"]["cpu_repack"] is False
        alone = _text(svc.url, TARGET)
        out: dict[int, str] = {}

        def one(i: int) -> None:
            body = TARGET if i == 0 else {**TARGET, "prompt": f"Neighbour {i} writes about ships and storms,"}
            out[i] = _text(svc.url, body)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert out[0] == alone
    finally:
        svc.stop()
