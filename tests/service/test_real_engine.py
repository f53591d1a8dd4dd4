"""The real service (``python -m service``, llama.cpp on the embedded model) over real HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import EMBEDDED_NAME, INSTRUCT_NAME
from tests.prom import samples, series, value

pytestmark = pytest.mark.slow

COPY = "gemma-copy"


def _events(resp: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]


@pytest.fixture(scope="module")
def small(service_factory, embedded_model, big_fixture, tmp_path_factory):  # type: ignore[no-untyped-def]
    """A service whose models dir holds a copy of the embedded model and a model too big for the declared
    card (2000 MiB free, no offload to host memory); the copy is loaded through the management API at n_ctx 512."""
    models = tmp_path_factory.mktemp("small-models")
    shutil.copyfile(embedded_model, models / f"{COPY}.gguf")
    os.link(big_fixture, models / Path(big_fixture).name)
    gpus = json.dumps([{"name": "RTX 3060", "free_mib": 2000, "total_mib": 12288}])
    svc = service_factory(
        GGUF_DEFAULT_MODEL="", GGUF_MODELS_DIR=str(models), GGUF_QUEUE_SIZE="64",
        GGUF_GPUS_JSON=gpus, GGUF_ALLOW_OFFLOAD="false",
    )
    r = svc.client.post("/api/models/load", json={"model": COPY, "n_ctx": 512, "cache_type": "f16"})
    assert r.status_code == 200, r.text
    assert r.json()["n_ctx"] == 512
    return svc


def test_the_openai_client_works_unchanged(served):  # type: ignore[no-untyped-def]
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
    ids = [m.id for m in client.models.list()]
    assert EMBEDDED_NAME in ids
    c = client.completions.create(model=EMBEDDED_NAME, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert c.choices[0].text and c.usage is not None and c.usage.completion_tokens <= 6
    msgs: Any = [{"role": "user", "content": "Name a colour."}]
    plain = client.chat.completions.create(model=EMBEDDED_NAME, messages=msgs, max_tokens=12, seed=7, temperature=0.9)
    stream = client.chat.completions.create(
        model=EMBEDDED_NAME, messages=msgs, max_tokens=12, seed=7, temperature=0.9, stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage, finish = [], None, None
    for ev in stream:
        if ev.usage is not None:
            usage = ev.usage
        for ch in ev.choices:
            parts.append(ch.delta.content or "")
            finish = ch.finish_reason or finish
    assert "".join(parts) == plain.choices[0].message.content
    assert finish == plain.choices[0].finish_reason
    assert usage is not None and plain.usage is not None
    assert usage.completion_tokens == plain.usage.completion_tokens
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="no-such-model", messages=msgs)
    assert nf.value.status_code == 404
    with pytest.raises(openai.BadRequestError) as br:
        client.chat.completions.create(model=EMBEDDED_NAME, messages=msgs, n=64)  # beyond the slots
    assert br.value.body["param"] == "n"  # type: ignore[index]


def test_response_format_json_schema_constrains_the_output(served):  # type: ignore[no-untyped-def]
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
        "required": ["answer", "sure"],
        "additionalProperties": False,
    }
    r = served.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Is the sky blue? Answer in JSON."}],
        "max_tokens": 40, "temperature": 0.7, "seed": 1,
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    })
    assert r.status_code == 200, r.text
    out = json.loads(r.json()["choices"][0]["message"]["content"])
    jsonschema.validate(out, schema)
    r = served.client.post("/v1/completions", json={
        "prompt": "A JSON object:", "max_tokens": 8, "seed": 2, "response_format": {"type": "json_object"},
    })
    assert r.status_code == 200
    text = r.json()["choices"][0]["text"]
    assert text.lstrip().startswith("{")


def test_chat_logprobs(served):  # type: ignore[no-untyped-def]
    r = served.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Count: one, two,"}], "max_tokens": 5, "temperature": 0,
        "logprobs": True, "top_logprobs": 3,
    })
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == r.json()["usage"]["completion_tokens"]
    assert "".join(t["token"] for t in content) == choice["message"]["content"]
    for t in content:
        assert t["logprob"] <= 0
        assert len(t["top_logprobs"]) == 3
        # greedy: the sampled token is the most likely one
        assert t["top_logprobs"][0]["logprob"] == pytest.approx(t["logprob"], abs=1e-6)


def test_drafted_tokens_are_in_the_usage_and_the_metrics(served):  # type: ignore[no-untyped-def]
    """Self-speculation on by default: an answer that copies its prompt is drafted, the drafts the model kept are
    OpenAI's ``accepted_prediction_tokens``, the others ``rejected_prediction_tokens``; ``speculative: false``
    gives the answer one token a step (the same answer: tests/service/engine/test_speculation.py, without repacked CPU
    weights, whose rows round otherwise together than alone)."""
    text = ("The keeper of the lighthouse wrote in his log every evening: the wind, the height of the waves, the "
            "ships that passed and the birds that rested on the gallery.")
    prompt = f"Original text:\n{text}\n\nThe same text, copied exactly:\n{text[:30]}"
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)

    def kept_so_far() -> float:  # the counter has no series for the model before its first kept draft
        got = samples(served.client.get("/metrics").text)
        return got.get(("gguf_draft_accepted_tokens_total", frozenset({("model", EMBEDDED_NAME)})), 0.0)

    before = kept_so_far()
    on = client.completions.create(model=EMBEDDED_NAME, prompt=prompt, max_tokens=32, temperature=0)
    off = client.completions.create(model=EMBEDDED_NAME, prompt=prompt, max_tokens=32, temperature=0,
                                    extra_body={"speculative": False})
    assert on.choices[0].text and off.choices[0].text
    assert on.usage is not None and on.usage.completion_tokens_details is not None
    assert off.usage is not None and off.usage.completion_tokens_details is not None
    kept = on.usage.completion_tokens_details.accepted_prediction_tokens or 0
    assert kept > 0 and (on.usage.completion_tokens_details.rejected_prediction_tokens or 0) >= 0
    assert off.usage.completion_tokens_details.accepted_prediction_tokens == 0
    assert off.usage.completion_tokens_details.rejected_prediction_tokens == 0
    assert kept_so_far() - before == kept
    assert value(served.client.get("/metrics").text, "gguf_draft_tokens_total", model=EMBEDDED_NAME) >= kept


def test_a_drafted_step_streams_as_one_event_with_every_token_counted(served):  # type: ignore[no-untyped-def]
    """A step's kept drafts go out as one event (a delta of several tokens, as vLLM streams a step), the same text
    as the answer not streamed, one log probability per token, and each token in the latency histogram."""
    text = ("The keeper of the lighthouse wrote in his log every evening: the wind, the height of the waves, the "
            "ships that passed and the birds that rested on the gallery.")
    prompt = f"Original text:\n{text}\n\nThe same text, copied exactly:\n{text[:30]}"
    body = {"model": EMBEDDED_NAME, "prompt": prompt, "max_tokens": 32, "temperature": 0, "logprobs": 1}
    whole = served.client.post("/v1/completions", json=body).json()

    def latencies() -> float:
        return value(served.client.get("/metrics").text, "gguf_token_latency_seconds_count", model=EMBEDDED_NAME)

    before = latencies()
    with served.client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                                "stream_options": {"include_usage": True}}) as r:
        events = [json.loads(e) for e in _events(r) if e != "[DONE]"]
    texts = [c["text"] for e in events for c in e["choices"] if c["text"]]
    tokens = [t for e in events for c in e["choices"] if c.get("logprobs") for t in c["logprobs"]["tokens"]]
    n = events[-1]["usage"]["completion_tokens"]
    kept = events[-1]["usage"]["completion_tokens_details"]["accepted_prediction_tokens"]
    assert n == whole["usage"]["completion_tokens"] == len(tokens) and kept > 0
    assert "".join(texts) == whole["choices"][0]["text"] == "".join(tokens)
    assert len(texts) <= n - kept  # at most one event a step: the kept drafts came with the steps that drafted them
    assert latencies() - before == n - 1


def test_a_seeded_draw_asked_again_answers_the_same_drafted_whole(served):  # type: ignore[no-untyped-def]
    """OpenAI's ``seed``: the same sampled request asked again gives the same text, and it is drafted from the first
    answer (``service.engine.replay``: every token after the first kept in the step's drafts); another seed, or
    the same seed in another cache scope, draws its own and is not drafted so."""
    body = {"model": EMBEDDED_NAME, "prompt": "An essay on the history of bread, from the first farmers.\n\n",
            "max_tokens": 40, "temperature": 1.0, "seed": 21, "ignore_eos": True}

    def ask(**extra: object) -> tuple[str, int, int]:
        got = served.client.post("/v1/completions", json={**body, **extra}).json()
        usage = got["usage"]
        return got["choices"][0]["text"], usage["completion_tokens"], \
            usage["completion_tokens_details"]["accepted_prediction_tokens"]

    first, n, kept_first = ask()
    again, n_again, kept = ask()
    assert again == first and n_again == n == 40
    # Drafted whole from the first answer: every token but the first (the prompt's step) and the last (the row
    # after the draft: a draft leaves the answer's last token to its step). The first drafted from its own text.
    assert kept == n - 2 > kept_first
    for other in ({"seed": 22}, {"cache_salt": "another tenant"}):
        assert ask(**other)[2] < n - 2, other


def test_metrics_show_allocated_beside_predicted(served):  # type: ignore[no-untyped-def]
    served.client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
    text = served.client.get("/metrics").text
    alloc = value(text, "gguf_device_bytes", model=EMBEDDED_NAME, device="CPU", kind="allocated")
    pred = value(text, "gguf_device_bytes", model=EMBEDDED_NAME, device="CPU", kind="predicted")
    assert alloc > 100 * 2**20 and pred > 100 * 2**20
    assert abs(alloc - pred) / alloc < 0.2
    assert value(text, "gguf_completion_tokens_total", model=EMBEDDED_NAME) >= 3
    assert value(text, "gguf_time_to_first_token_seconds_count", model=EMBEDDED_NAME) >= 1
    info = served.client.get("/api/models").json()["models"]
    loaded = [m for m in info if m["state"] == "loaded"][0]
    assert loaded["memory"][0]["device"] == "CPU"
    assert loaded["memory"][0]["predicted_mib"] > 0


def test_prompt_longer_than_the_context_is_400(small):  # type: ignore[no-untyped-def]
    long_prompt = "word " * 700
    r = small.client.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 4})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert err["n_ctx"] == 512 and err["prompt_tokens"] > 512
    r = small.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": long_prompt}], "stream": True})
    assert r.status_code == 400  # streaming too: a plain HTTP error before the first byte
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_prompt_plus_max_tokens_over_the_context_is_400(small):  # type: ignore[no-untyped-def]
    r = small.client.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 510})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    assert err["max_tokens"] == 510 and err["n_ctx"] == 512
    with small.client.stream("POST", "/v1/completions", json={"prompt": "Hello there", "max_tokens": 500, "stream": True}) as r:
        assert r.status_code == 200  # it fits: prompt + 500 <= 512 (and leaving stops it)


def test_a_refused_load_leaves_the_current_model_serving(small, big_fixture):  # type: ignore[no-untyped-def]
    big = Path(big_fixture).name[: -len(".gguf")]
    r = small.client.post("/api/models/load", json={"model": big})
    assert r.status_code == 507, r.text
    assert r.json()["error"]["code"] == "INSUFFICIENT_MEMORY"
    assert "RTX 3060" in r.json()["error"]["message"] and "missing" in r.json()["error"]["message"]
    assert small.client.get("/ready").status_code == 200
    r = small.client.post("/v1/completions", json={"model": COPY, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == COPY
    states = {m["name"]: m["state"] for m in small.client.get("/api/models").json()["models"]}
    assert states.pop(INSTRUCT_NAME, "unloaded") == "unloaded"  # listed once make setup fetched it
    assert states == {COPY: "loaded", big: "unloaded", EMBEDDED_NAME: "unloaded"}
    r = small.client.post("/v1/completions", json={"model": "missing-model", "prompt": "Hi"})
    assert r.status_code == 404


def test_fifty_clients_leave_mid_generation_and_the_next_is_served_within_5s(small):  # type: ignore[no-untyped-def]
    async def scenario() -> float:
        limits = httpx.Limits(max_connections=60)
        async with httpx.AsyncClient(base_url=small.url, timeout=60, limits=limits) as client:
            started = asyncio.Event()

            async def one(i: int) -> None:
                body = {"prompt": f"Story {i}:", "max_tokens": 400, "stream": True, "temperature": 1.0}
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        started.set()

            tasks = [asyncio.create_task(one(i)) for i in range(50)]
            await asyncio.wait_for(started.wait(), 30)
            await asyncio.sleep(0.3)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        t0 = time.monotonic()
        async with httpx.AsyncClient(base_url=small.url, timeout=90) as client:
            r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 8})
        assert r.status_code == 200
        assert r.json()["usage"]["completion_tokens"] >= 1
        return time.monotonic() - t0

    elapsed = asyncio.run(scenario())
    # Generous (the machine's load varies; bench/cancellation_bench.py measures it alone): the 50 abandoned
    # streams of 400 tokens would take minutes had they not been cancelled.
    assert elapsed < 60
    text = small.client.get("/metrics").text
    assert series(text, "gguf_queue_depth") == [{"model": COPY}]
    assert value(text, "gguf_queue_depth", model=COPY) == 0
