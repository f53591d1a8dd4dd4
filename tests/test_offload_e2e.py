"""Partial offload end to end: a declared card too small for the embedded model still serves it."""

from __future__ import annotations

import json

import pytest

from tests.conftest import EMBEDDED_NAME

pytestmark = pytest.mark.slow

# Room for some layers only: the model's 514 MiB compute buffer (a 262k-token vocabulary's logits) and the
# CUDA pool bound every GPU plan carries (sizing.memory.gpu) leave part of the weights on the host.
SMALL_CARD = [{"name": "NVIDIA GeForce RTX 3060", "free_mib": 800, "total_mib": 12288}]


def test_a_card_too_small_gives_a_partial_offload_that_serves(service_factory):  # type: ignore[no-untyped-def]
    svc = service_factory(GGUF_GPUS_JSON=json.dumps(SMALL_CARD), GGUF_GPU_ALLOWANCE_MIB="0")
    svc.wait_ready()
    models = svc.client.get("/api/models").json()["models"]
    loaded = next(m for m in models if m["name"] == EMBEDDED_NAME)
    plan = loaded["plan"]
    assert plan["verdict"] == "partial_offload"
    ngl = plan["chosen"]["n_gpu_layers"]
    assert 0 < ngl < plan["model"]["block_count"] + 1
    # What the card holds is within its free memory; the rest is on the host.
    card = next(d for d in plan["estimate"]["devices"] if d["device"] == "CUDA0")
    assert card["total_mib"] <= SMALL_CARD[0]["free_mib"]
    host = next(d for d in plan["estimate"]["devices"] if d["device"] == "CPU")
    assert len(card["layers"]) + len(host["layers"]) == 18
    # The engine got the planned placement (this CPU build of llama.cpp runs it on the CPU) and serves.
    r = svc.client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] > 0
    # The dry-run lists the candidates with predicted speeds, fastest first.
    dry = svc.client.post("/api/dry-run", json={"model": EMBEDDED_NAME}).json()
    cands = dry["candidates"]
    assert len(cands) >= 2
    speeds = [c["decode_tokens_per_s"] for c in cands]
    assert speeds == sorted(speeds, reverse=True)
    assert cands[0]["n_gpu_layers"] == ngl
    assert any(c["n_gpu_layers"] == 0 for c in cands)
    assert all(c["prompt_tokens_per_s"] > 0 for c in cands)
