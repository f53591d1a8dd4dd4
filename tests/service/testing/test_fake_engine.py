"""The paths a CPU cannot reach for real, through the real app and HTTP, on the fake engine."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest

from service.testing.fake import FakeEngine
from service.errors import EngineFailure
from tests.conftest import EMBEDDED_NAME
from tests.prom import value


def _events(resp: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]


def _metric(text: str, name: str, **labels: str) -> float:
    return value(text, name, **labels)


def test_oom_during_generation_is_503_names_device_and_the_next_request_is_served(fake):  # type: ignore[no-untyped-def]
    fake.engine.oom_after_tokens = 3
    r = fake.client.post("/v1/completions", json={"prompt": "one two three", "max_tokens": 50, "seed": 1})
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "insufficient_memory"
    assert err["type"] == "invalid_request_error"
    assert err["device"] == "CUDA0" and "CUDA0" in err["message"]
    assert err["prompt_tokens"] == 4
    assert err["max_tokens"] == 50
    metrics = fake.client.get("/metrics").text
    assert _metric(metrics, "gguf_kv_cells_used", model=EMBEDDED_NAME) == 0  # the failed request's cells are released
    assert _metric(metrics, "gguf_generation_errors_total", code="insufficient_memory") == 1
    r = fake.client.post("/v1/completions", json={"prompt": "one two three", "max_tokens": 5, "seed": 1})
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 5


def test_oom_while_streaming_ends_with_the_error_event_and_done(fake):  # type: ignore[no-untyped-def]
    fake.engine.oom_after_tokens = 2
    body = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 20, "stream": True}
    with fake.client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = _events(r)
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "insufficient_memory" and err["device"] == "CUDA0"
    assert err["max_tokens"] == 20 and err["prompt_tokens"] > 0
    contents = [json.loads(e)["choices"][0]["delta"].get("content") for e in events[1:-2]]
    assert len(contents) == 2  # the two tokens before the failure
    r = fake.client.post("/v1/chat/completions", json={**body, "stream": False})
    assert r.status_code == 200


def test_a_refused_load_is_507_on_the_management_api_and_the_current_model_keeps_serving(  # type: ignore[no-untyped-def]
    fake_factory, big_fixture
):
    gpus = json.dumps([{"name": "RTX 3060", "free_mib": 2000, "total_mib": 12288}])
    svc = fake_factory(models=[big_fixture], gpus_json=gpus, allow_offload=False)
    big = "gemma-3-27b-bf16"
    r = svc.client.post("/api/models/load", json={"model": big})
    assert r.status_code == 507, r.text
    err = r.json()["error"]
    assert err["code"] == "INSUFFICIENT_MEMORY"
    assert "RTX 3060" in err["message"] or "GPU" in err["message"]
    assert "missing" in err["message"]
    assert svc.client.get("/ready").status_code == 200
    r = svc.client.post("/v1/completions", json={"prompt": "still here", "max_tokens": 2})
    assert r.status_code == 200
    assert r.json()["model"] == EMBEDDED_NAME
    states = {m["name"]: m["state"] for m in svc.client.get("/api/models").json()["models"]}
    assert states[EMBEDDED_NAME] == "loaded"
    assert states[big] == "unloaded"
    r = svc.client.post("/v1/completions", json={"model": big, "prompt": "x"})
    assert r.status_code == 503  # known but not loaded: never served by the loaded model


def test_queue_beyond_its_bound_is_429_with_retry_after_and_never_interrupts(fake_factory):  # type: ignore[no-untyped-def]
    svc = fake_factory(FakeEngine(token_delay_s=0.02), queue_size=1)
    results: dict[str, Any] = {}

    def run(key: str, n: int) -> None:
        with httpx.Client(base_url=svc.url, timeout=30) as c:
            results[key] = c.post("/v1/completions", json={"prompt": "x", "max_tokens": n, "seed": 5})

    first = threading.Thread(target=run, args=("first", 40))
    first.start()
    assert svc.engine.running.wait(5)
    second = threading.Thread(target=run, args=("second", 3))
    second.start()
    deadline = time.monotonic() + 5
    while _metric(svc.client.get("/metrics").text, "gguf_queue_depth", model=EMBEDDED_NAME) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    r = svc.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
    assert r.status_code == 429
    assert r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "queue_full"
    first.join()
    second.join()
    assert results["first"].status_code == 200
    assert results["first"].json()["usage"]["completion_tokens"] == 40  # not interrupted
    assert results["first"].json()["choices"][0]["finish_reason"] == "length"
    assert results["second"].status_code == 200


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": "lots"}, "max_tokens"),
        ({"prompt": "x", "temperature": 3}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "n": 5}, "n"),  # more choices than the engine has slots
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"prompt": "x", "logprobs": 99}, "logprobs"),
        ({"prompt": 5}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "x", "response_format": {"type": "xml"}}, "response_format.type"),
        ({"prompt": "x", "response_format": {"type": "json_schema"}}, "response_format"),
        ({"prompt": "x", "seed": "abc"}, "seed"),
        ({"prompt": "x", "stream": "yes please"}, "stream"),
    ],
)
def test_bad_values_are_400_with_param(fake, body, param):  # type: ignore[no-untyped-def]
    r = fake.client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param
    assert err["type"] == "invalid_request_error"
    assert fake.client.get("/health").status_code == 200


@pytest.mark.parametrize(
    "raw",
    [b"{not json", b"[]", b"null", b'"text"', b"\xff\xfe", b'{"messages": "hi"}', b'{"messages": [{"role": "wizard"}]}'],
)
def test_malformed_chat_bodies_are_400_never_500(fake, raw):  # type: ignore[no-untyped-def]
    r = fake.client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) >= {"message", "type", "param", "code"}


def test_unknown_model_is_404_and_a_known_unloaded_one_is_not_served_by_another(fake, tmp_path):  # type: ignore[no-untyped-def]
    r = fake.client.post("/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
    r = fake.client.post("/api/models/load", json={"model": "../etc/passwd"})
    assert r.status_code == 404


def test_streaming_concatenates_to_the_plain_answer_with_logprobs(fake):  # type: ignore[no-untyped-def]
    body = {"prompt": "a b c", "max_tokens": 7, "seed": 11, "logprobs": 2}
    plain = fake.client.post("/v1/completions", json=body).json()
    with fake.client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(e) for e in _events(r)[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == plain["choices"][0]["text"]
    streamed_tokens = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert streamed_tokens == plain["choices"][0]["logprobs"]["tokens"]
    assert len(plain["choices"][0]["logprobs"]["top_logprobs"][0]) >= 1


def test_ready_is_503_while_loading_and_after_a_failed_load_health_stays_200(fake_factory):  # type: ignore[no-untyped-def]
    svc = fake_factory(FakeEngine(load_delay_s=1.0), wait_ready=False)
    r = svc.client.get("/ready")
    assert r.status_code == 503
    assert r.json()["error"]["state"] == "loading"
    models = {m["name"]: m for m in svc.client.get("/api/models").json()["models"]}
    assert models[EMBEDDED_NAME]["state"] == "loading"
    assert svc.client.get("/health").status_code == 200
    deadline = time.monotonic() + 10
    while svc.client.get("/ready").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert svc.client.get("/ready").status_code == 200
    svc.client.post("/api/models/unload")
    svc.engine.load_delay_s = 0
    svc.engine.fail_load = EngineFailure("llama.cpp failed to load: bad tensor")
    r = svc.client.post("/api/models/load", json={"model": EMBEDDED_NAME})
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "engine_error"
    r = svc.client.get("/ready")
    assert r.status_code == 503
    assert r.json()["error"]["state"] == "failed"
    models = {m["name"]: m for m in svc.client.get("/api/models").json()["models"]}
    assert models[EMBEDDED_NAME]["state"] == "failed"
    assert "bad tensor" in models[EMBEDDED_NAME]["error"]
    assert svc.client.get("/health").status_code == 200


def test_a_client_that_leaves_stops_its_generation_within_a_token(fake_factory):  # type: ignore[no-untyped-def]
    svc = fake_factory(FakeEngine(token_delay_s=0.02))
    with httpx.Client(base_url=svc.url, timeout=0.3) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/v1/completions", json={"prompt": "x", "max_tokens": 5000})
    deadline = time.monotonic() + 2
    while svc.engine.cancelled < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert svc.engine.cancelled == 1
    assert not svc.engine.running.is_set()
    t0 = time.monotonic()
    r = svc.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
    assert r.status_code == 200
    # Generous: 3 tokens take 0.06 s; had the abandoned 5000-token generation run on, 100 s.
    assert time.monotonic() - t0 < 20


def test_metrics_count_requests_tokens_and_latency(fake):  # type: ignore[no-untyped-def]
    fake.client.post("/v1/completions", json={"prompt": "a b", "max_tokens": 4})
    fake.client.post("/v1/completions", json={"prompt": "a b", "max_tokens": 0})
    text = fake.client.get("/metrics").text
    assert _metric(text, "gguf_requests_total", method="POST", route="/v1/completions", status="200") == 1
    assert _metric(text, "gguf_requests_total", method="POST", route="/v1/completions", status="400") == 1
    assert _metric(text, "gguf_prompt_tokens_total", model=EMBEDDED_NAME) == 3
    assert _metric(text, "gguf_completion_tokens_total", model=EMBEDDED_NAME) == 4
    assert _metric(text, "gguf_time_to_first_token_seconds_count", model=EMBEDDED_NAME) == 1
    assert _metric(text, "gguf_token_latency_seconds_count", model=EMBEDDED_NAME) == 3
    assert _metric(text, "gguf_queue_depth", model=EMBEDDED_NAME) == 0
    assert _metric(text, "gguf_kv_cells_used", model=EMBEDDED_NAME) == 7
    assert _metric(text, "gguf_device_bytes", model=EMBEDDED_NAME, device="CPU", kind="allocated") > 0
    assert _metric(text, "gguf_device_bytes", model=EMBEDDED_NAME, device="CPU", kind="predicted") > 0


def test_hf_listing_without_a_reachable_hub_is_502_and_bad_repo_ids_are_400(fake_factory, monkeypatch):  # type: ignore[no-untyped-def]
    import huggingface_hub.constants

    from tests.conftest import free_port

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens
    svc = fake_factory()
    r = svc.client.post("/api/hf/files", json={"repo_id": "unsloth/gemma-3-270m-it-GGUF"})
    assert r.status_code == 502, r.text
    assert r.json()["error"]["code"] == "upstream_error"
    r = svc.client.post("/api/hf/files", json={"repo_id": "../../etc"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "repo_id"
