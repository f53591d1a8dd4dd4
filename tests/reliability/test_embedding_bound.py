"""One embeddings request cannot hold a swap for minutes (issue 54): its engine time is bounded by
``GGUF_EMBEDDING_MAX_S``, refused before it runs when its tokens at the model's speed would pass it, and ended when it
runs past it. A request for another model that waits for the embedding model's memory is then served within that
bound plus a load, not 503 after ``GGUF_LOAD_ON_DEMAND_WAIT_S``.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

from service.testing.fake import FakeEngine
from tests.figures import figure

from .conftest import FakeService


def test_an_embedding_past_its_time_is_ended_and_the_next_is_refused_by_its_measured_speed(
        fake_factory: Callable[..., FakeService]) -> None:
    engine = FakeEngine()
    engine.embed_delay_s = 0.25
    svc = fake_factory(engine=engine, embedding_max_s=1.0)
    many = ["alpha beta gamma"] * 12  # 3 s at 0.25 s an input; predicted by the plan's speed as instant
    t0 = time.monotonic()
    r = svc.client.post("/v1/embeddings", json={"input": many})
    took = time.monotonic() - t0
    assert r.status_code == 400 and "ran past 1 s" in r.json()["error"]["message"], r.text
    assert took < 2.0, f"ended at its bound, not after every input ({took:.1f} s)"
    # One that takes long enough to measure (0.5 s at least: RATE_MIN_S) is measured, about 4 tokens a second here...
    assert svc.client.post("/v1/embeddings", json={"input": ["alpha beta"] * 3}).status_code == 200
    # ...and the long one is now refused before it runs, with the figures.
    t0 = time.monotonic()
    r = svc.client.post("/v1/embeddings", json={"input": many})
    assert time.monotonic() - t0 < 0.5
    err = r.json()["error"]
    assert r.status_code == 400 and "would take about" in err["message"] and "GGUF_EMBEDDING_MAX_S" in err["message"]
    assert err["predicted_s"] > 1.0 and err["limit_s"] == 1.0, err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_swap_waits_for_an_embedding_at_most_its_bound(service_factory: Any, embedded_model: str,
                                                         tmp_path: Path) -> None:
    """The round's case, on the real server: two copies of the embedded model, one loaded at a time. The 64 x
    480-token request is refused at once; an allowed long one runs while a completion for the other model waits
    for its memory, and that completion is served within the bound plus a swap."""
    models = tmp_path / "models"
    models.mkdir()
    for name in ("one", "two"):
        os.link(embedded_model, models / f"{name}.gguf")
    limit_s = 15.0
    svc = service_factory(GGUF_MODELS_DIR=str(models), GGUF_DEFAULT_MODEL="", GGUF_MAX_LOADED_MODELS="1",
                          GGUF_LOAD_ON_DEMAND="true", GGUF_CONTEXT_LENGTH="2048",
                          GGUF_EMBEDDING_MAX_S=str(limit_s), GGUF_CONFIRM_LOADS="false")
    c = httpx.Client(base_url=svc.url, timeout=300)
    word = "lighthouse "
    assert c.post("/v1/embeddings", json={"model": "one", "input": [word * 8]}).status_code == 200
    t0 = time.monotonic()
    r = c.post("/v1/embeddings", json={"model": "one", "input": [word * 480] * 64})
    assert r.status_code == 400 and "would take about" in r.json()["error"]["message"], r.text
    assert time.monotonic() - t0 < 5, "refused before it runs"
    # As long an embedding as the bound allows by the speed measured here, then a completion for the other model.
    # (A shared machine's speed moves: a measurement refused or ended by the bound is not one.)
    rates = []
    for _ in range(2):
        t = time.monotonic()
        got = c.post("/v1/embeddings", json={"model": "one", "input": [word * 100] * 4})
        if got.status_code == 200:
            rates.append(got.json()["usage"]["prompt_tokens"] / (time.monotonic() - t))
        else:
            assert got.status_code == 400 and "GGUF_EMBEDDING_MAX_S" in got.text, got.text
    rate = max(rates) if rates else 400 / limit_s
    n_inputs = max(1, int(rate * limit_s * 0.6 / 200))
    out: dict[str, Any] = {}

    def embed_long() -> None:
        out["embed"] = c.post("/v1/embeddings", json={"model": "one", "input": [word * 200] * n_inputs})
        out["embed_done"] = time.monotonic()

    thread = threading.Thread(target=embed_long)
    thread.start()
    time.sleep(0.5)
    t_ask = time.monotonic()
    r = httpx.post(svc.url + "/v1/completions", json={"model": "two", "prompt": "Hello", "max_tokens": 2}, timeout=300)
    waited = time.monotonic() - t_ask
    thread.join()
    assert out["embed"].status_code in (200, 400), out["embed"].text
    assert r.status_code == 200, r.text
    figure(f"swap behind a long embedding (bound {limit_s:g} s, {n_inputs} x 200 tokens at {rate:.0f} tok/s "
           f"measured): the other model's completion waited {waited:.1f} s")
    assert waited <= limit_s + 60, f"the swap waited {waited:.1f} s for a bound of {limit_s:g} s"
