"""The agents' API over the fake engine (fast, in-process over real HTTP): n choices and their usage, the choices'
metrics, embeddings' shapes, the Anthropic route's errors and event order."""

from __future__ import annotations

import base64
import json

import numpy as np

from service.testing.fake import FAKE_N_EMBD


def test_n_choices_and_usage(fake):  # type: ignore[no-untyped-def]
    r = fake.client.post("/v1/completions", json={"prompt": "a b c", "n": 3, "max_tokens": 4, "seed": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["prompt_tokens"] == 4 and body["usage"]["completion_tokens"] == 12
    assert fake.engine.prompt_tokens_evaluated == 4
    # Streamed: every choice's text under its index, and its own finish_reason.
    with fake.client.stream("POST", "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 3, "seed": 2, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    finishes = {ch["index"]: ch["finish_reason"] for ev in events for ch in ev["choices"] if ch["finish_reason"]}
    assert finishes == {0: "length", 1: "length"}


def test_embeddings_shapes(fake):  # type: ignore[no-untyped-def]
    r = fake.client.post("/v1/embeddings", json={"input": ["one two", "three"], "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    vecs = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in data]
    assert all(v.shape == (FAKE_N_EMBD,) and abs(float(np.linalg.norm(v)) - 1) < 1e-5 for v in vecs)
    floats = fake.client.post("/v1/embeddings", json={"input": ["one two", "three"]}).json()["data"]
    assert [list(np.float32(x) for x in d["embedding"]) for d in floats] == [list(v) for v in vecs]
    for bad in ({"input": 5}, {"input": [[1], "a"]}, {"input": None}):
        r = fake.client.post("/v1/embeddings", json=bad)
        assert r.status_code == 400 and isinstance(r.json()["error"]["code"], str), (bad, r.text)


def test_anthropic_events_in_order(fake):  # type: ignore[no-untyped-def]
    with fake.client.stream("POST", "/v1/messages", json={
            "model": "gemma-3-270m-q4_k_m", "max_tokens": 3, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}) as s:
        names = [line[7:] for line in s.iter_lines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"]
    assert names[2] == "content_block_start" and names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    r = fake.client.post("/v1/messages", json={"model": "gemma-3-270m-q4_k_m", "max_tokens": 0,
                                               "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": r.json()["error"]["message"]}}
