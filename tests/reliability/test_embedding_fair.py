"""Embeddings yield to generation (issue 29: one embeddings request held the engine; 64 inputs of 480 tokens took
116 s and an 8-token chat meanwhile 12.4 s, 0.1 s idle), and a request holds a bounded number of tokens.

Against the real service (``python -m service``, its engine in a runner process): a short completion is answered
while a long embeddings request runs, whose vectors equal the same request's run alone; past
GGUF_EMBEDDING_MAX_REQUEST_TOKENS the request is a 400 naming ``input`` and the same runner serves on. In process,
the engine's abort of a whole embedding batch for a generation, run again: the same vectors."""

from __future__ import annotations

import threading
import time
from typing import Any, Iterator

import httpx
import numpy as np
import pytest

from service.engine.base import Cancel, GenerationParams
from tests.conftest import EMBEDDED_NAME

pytestmark = pytest.mark.slow

MAX_REQUEST_TOKENS = 2000
"""The service's GGUF_EMBEDDING_MAX_REQUEST_TOKENS here: above the long request's 1,440 tokens."""
LONG = [[2] + [1000 + 37 * i + j for j in range(479)] for i in range(3)]
"""Three inputs of 480 token ids: one embedding batch each (GGUF_EMBEDDING_TOKENS 512), about 10 s on 2 cores."""
COMPLETION_BOUND_S = 3.0
"""A 2-token completion beside the embeddings. Before, it waited for a whole embedding batch (3-3.5 s for 480
tokens on 2 cores) before its first step and another between its two steps: about 7 s (an 8-token chat took
12.4 s, the issue). Now it waits for one piece of 32 tokens at most (0.2-0.25 s; idle it takes 0.1 s). 3 s:
under half the old behaviour, with room for a loaded machine."""


def _runner_pid(c: httpx.Client) -> int:
    models = {m["name"]: m for m in c.get("/api/models").json()["models"]}
    return int(models[EMBEDDED_NAME]["runner"]["pid"])


@pytest.fixture(scope="module")
def svc(service_factory: Any, embedded_model: str) -> Any:
    s = service_factory(GGUF_EMBEDDING_MAX_REQUEST_TOKENS=str(MAX_REQUEST_TOKENS))
    s.wait_ready()
    return s


def _embed(c: httpx.Client, inputs: Any) -> httpx.Response:
    return c.post("/v1/embeddings", json={"input": inputs}, timeout=300)


def test_a_completion_is_answered_while_a_long_embeddings_request_runs(svc: Any) -> None:
    c = svc.client
    alone = _embed(c, LONG)
    assert alone.status_code == 200, alone.text
    box: dict[str, Any] = {}

    def embed() -> None:
        with httpx.Client(base_url=svc.url) as ec:
            box["r"] = _embed(ec, LONG)

    t = threading.Thread(target=embed)
    t.start()
    latencies, overlapped = [], []
    try:
        time.sleep(1.0)  # the request is past its tokenizing: its batches run
        for i in range(3):
            t0 = time.perf_counter()
            r = c.post("/v1/completions", json={"prompt": f"[{i}] The lighthouse keeper said", "max_tokens": 2,
                                                "temperature": 0.0})
            latencies.append(time.perf_counter() - t0)
            overlapped.append(t.is_alive())
            assert r.status_code == 200, r.text
            time.sleep(0.5)
    finally:
        t.join(300)
    assert max(latencies) < COMPLETION_BOUND_S, latencies
    assert all(overlapped), "the embeddings ended before a completion did: nothing was measured"
    beside = box["r"]
    assert beside.status_code == 200, beside.text
    # Fairness does not change results: the request's pieces depend on its inputs alone.
    assert [d["embedding"] for d in beside.json()["data"]] == [d["embedding"] for d in alone.json()["data"]]
    assert beside.json()["usage"]["prompt_tokens"] == 1440


def test_the_total_token_limit_is_a_400_naming_input(svc: Any) -> None:
    c = svc.client
    pid = _runner_pid(c)
    over_ids = LONG + LONG  # 2,880 token ids
    texts = ["The keeper climbed the stairs at dusk and lit the lamp. " * 30] * 6  # 362 tokens each, 2,172 in all
    # 120,000 characters: more than 2,000 tokens whatever they are (a token of gemma's vocabulary spells at most 48
    # characters, Engine.max_token_chars): refused unread.
    huge = ["lamp " * 8000] * 3
    for inputs in (over_ids, texts, huge):
        t0 = time.perf_counter()
        r = _embed(c, inputs)
        assert r.status_code == 400, r.text[:300]
        err = r.json()["error"]
        assert err["param"] == "input" and "GGUF_EMBEDDING_MAX_REQUEST_TOKENS" in err["message"], err
        assert time.perf_counter() - t0 < 5  # refused before any batch ran (1,440 tokens above take 10 s)
    long = _embed(c, ["lamp " * 14000])  # one text of 70,000 characters: more than the 512 tokens of a batch
    assert long.status_code == 400 and long.json()["error"]["param"] == "input", long.text[:300]
    assert long.json()["error"]["code"] == "context_length_exceeded"
    ok = _embed(c, ["The keeper climbed the stairs at dusk and lit the lamp."])
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 640
    assert _runner_pid(c) == pid and svc.proc.poll() is None


# ---- in process: the abort of a whole batch ---------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(embedded_model: str) -> Iterator[Any]:
    from service.engine.llama import LlamaEngine
    from service.text.served import ServedModel
    from sizing.plan import PlanRequest, make_plan
    from sizing.probe import host_memory, probe_path

    plan = make_plan(probe_path(embedded_model), [], host_memory(),
                     PlanRequest(n_ctx=1024, n_seq_max=2, kv_unified=True, min_ctx=256, embedding_tokens=256))
    eng = ServedModel.of(LlamaEngine())
    eng.load(embedded_model, plan)
    yield eng
    eng.unload()


def test_a_whole_batch_aborted_for_a_generation_runs_again_to_the_same_vectors(engine: Any) -> None:
    """A batch decoded whole (as for a non-causal model: forced here on gemma) is aborted when a generation
    arrives (llama.cpp's abort callback: ``llama_decode`` returns 2, the cells of its ubatch removed) and run again
    from a cleared cache: the vectors equal the undisturbed run's."""
    engine.engine.pooler.pieces = False
    try:
        inputs = [[2] + [3000 + 11 * i + j for j in range(249)] for i in range(3)]  # 250 tokens: a batch each
        alone = np.array(engine.embed(inputs, Cancel()).vectors)
        before = engine.engine.pooler.aborted
        box: dict[str, Any] = {}
        t = threading.Thread(target=lambda: box.setdefault("v", engine.embed(inputs, Cancel()).vectors))
        t.start()
        params = GenerationParams(max_tokens=2, temperature=0.0, cache_prompt=False)
        for i in range(3):
            time.sleep(0.3)
            text = "".join(ch.text for ch in engine.complete(f"[{i}] The capital of France is", params, Cancel()))
            assert text
        t.join(120)
        assert engine.engine.pooler.aborted > before, "no embedding batch was aborted: the test measured nothing"
        assert np.array_equal(np.array(box["v"]), alone)
    finally:
        engine.engine.pooler.pieces = True
