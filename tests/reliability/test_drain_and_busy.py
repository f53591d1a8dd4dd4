"""Past the drain deadline, and loads while generations run: every client gets an ending, never a cut body."""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import Any, Callable

import httpx
import pytest

from tests.conftest import EMBEDDED_NAME, ServiceProcess, stream_events

from .conftest import FakeService
from tests.figures import figure

pytestmark = pytest.mark.slow


def _post(url: str, body: dict[str, Any], out: dict[str, Any]) -> None:
    try:
        r = httpx.post(url, json=body, timeout=120)
        out["status"], out["headers"], out["body"] = r.status_code, dict(r.headers), r.json()
    except Exception as exc:
        out["error"] = repr(exc)


@pytest.mark.timeout(180)
def test_past_the_drain_timeout_streams_end_with_an_error_event_and_queued_requests_get_503(
        service_factory: Callable[..., ServiceProcess]) -> None:
    svc = service_factory(GGUF_DRAIN_TIMEOUT_S="2", GGUF_CONFIRM_LOADS="false", GGUF_CONTEXT_LENGTH="2048",
                          GGUF_PARALLEL="1")  # one slot, so that the second request queues behind the stream
    svc.wait_ready()
    long = {"prompt": "Once upon a time", "max_tokens": 1500, "temperature": 0, "ignore_eos": True, "stream": True}
    first, streamed = threading.Event(), {}
    t1 = threading.Thread(target=stream_events, args=(svc.url + "/v1/completions", long, first, streamed))
    t1.start()
    assert first.wait(60)
    queued: dict[str, Any] = {}  # one slot: this one waits behind the stream
    t2 = threading.Thread(target=_post, args=(svc.url + "/v1/completions", {"prompt": "b", "max_tokens": 4}, queued))
    t2.start()
    time.sleep(0.5)
    t_signal = time.monotonic()
    svc.proc.send_signal(signal.SIGTERM)
    t1.join(60)
    t2.join(60)
    rc = svc.proc.wait(timeout=60)
    elapsed = time.monotonic() - t_signal
    assert "error" not in streamed, streamed
    events = streamed["events"]
    assert events[-1] == "[DONE]", events[-3:]
    err = json.loads(events[-2])["error"]
    assert err["code"] == "model_not_ready" and err["state"] == "draining", err
    assert len(events) > 3, "tokens were streamed before the deadline"
    assert queued.get("status") == 503, queued
    assert queued["headers"].get("retry-after") == "1"
    assert queued["body"]["error"]["state"] == "draining"
    assert rc == 0, svc.log()
    assert elapsed < 2 + 10, elapsed  # generous: the deadline is 2 s; the rest is unloading on a busy CPU
    figure(f"drain deadline 2 s: stream ended by an error event + [DONE] after {len(events) - 2} events; "
           f"queued request 503 Retry-After 1; exit {rc} {elapsed:.1f} s after SIGTERM")


@pytest.mark.timeout(120)
def test_load_and_unload_wait_their_limit_then_409_or_force(fake_factory: Callable[..., FakeService]) -> None:
    from service.testing.fake import FakeEngine

    svc = fake_factory(engine=FakeEngine(token_delay_s=0.05), load_wait_s=1.0)
    body = {"prompt": "a", "max_tokens": 400, "stream": True}
    first, streamed = threading.Event(), {}
    t = threading.Thread(target=stream_events, args=(svc.url + "/v1/completions", body, first, streamed))
    t.start()
    assert first.wait(10)
    t0 = time.monotonic()
    r = svc.client.post("/api/models/unload")
    waited = time.monotonic() - t0
    assert r.status_code == 409, r.text
    assert r.json()["error"]["code"] == "model_busy" and r.headers["retry-after"] == "5"
    assert 0.9 < waited < 10, waited
    r = svc.client.post("/api/models/load", json={"model": EMBEDDED_NAME})
    assert r.status_code == 409, r.text
    assert svc.client.get("/ready").status_code == 200, "the model keeps serving"
    assert t.is_alive(), "the stream was not disturbed"
    r = svc.client.post("/api/models/load", json={"model": EMBEDDED_NAME, "force": True})
    assert r.status_code == 200, r.text
    t.join(10)
    events = streamed["events"]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "model_not_ready", events[-3:]
    assert svc.client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200
    # Unload with force while a stream runs: the same ending, and nothing is left loaded.
    first2, streamed2 = threading.Event(), {}
    t2 = threading.Thread(target=stream_events, args=(svc.url + "/v1/completions", body, first2, streamed2))
    t2.start()
    assert first2.wait(10)
    r = svc.client.post("/api/models/unload", json={"force": True})
    assert r.status_code == 200, r.text
    t2.join(10)
    assert streamed2["events"][-1] == "[DONE]"
    assert svc.client.get("/ready").status_code == 503
    assert svc.client.post("/api/models/load", json={"model": EMBEDDED_NAME}).status_code == 200
