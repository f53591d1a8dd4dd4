"""A newcomer's first chat: ``python -m service`` on its own defaults (no GGUF_DEFAULT_MODEL: what ``make run``
serves) loads the embedded instruct model, SmolLM2-135M-Instruct, and answers a question through the official
``openai`` client as an assistant; gemma-3-270m, the embedded base model, is still served by its name.

The question carries "Answer in one sentence.": the bare "What is the capital of France?" is answered "L'Étoile, la
Marseillaise, ..." at temperature 0 here, its first token "L" chosen over "The" by 0.24 logits (a 135M model in
Q4_1: another CPU's kernels could flip it either way); with the instruction every greedy token up to "Paris" leads the
next one by 1.6 logits or more (measured with llama.cpp on this file, 2026-12-06)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import EMBEDDED_NAME, INSTRUCT_NAME, ServiceProcess

QUESTION = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def make_run(tmp_path_factory: pytest.TempPathFactory, instruct_model: str, embedded_model: str
             ) -> Iterator[ServiceProcess]:
    """The service as ``make run`` starts it: every GGUF_* setting at its default (the tests' GGUF_DEFAULT_MODEL
    removed) but the port and an empty models directory of its own."""
    d = tmp_path_factory.mktemp("first-chat")
    (d / "models").mkdir()
    kept = ("GGUF_TEST_SESSION", "GGUF_HOST", "GGUF_PORT")  # the session's marker; loopback and the port it picked
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("GGUF_") and k not in kept}
    env["GGUF_MODELS_DIR"] = str(d / "models")
    with ServiceProcess(env, d / "service.log").running() as svc:
        yield svc


def test_the_default_model_is_the_instruct_one(make_run: ServiceProcess) -> None:
    models = {m["name"]: m for m in make_run.client.get("/api/models").json()["models"]}
    assert models[INSTRUCT_NAME]["state"] == "loaded" and models[INSTRUCT_NAME]["origin"] == "embedded"
    assert models[EMBEDDED_NAME]["state"] != "loaded" and models[EMBEDDED_NAME]["origin"] == "embedded"
    ids = [m["id"] for m in make_run.client.get("/v1/models").json()["data"]]
    assert {INSTRUCT_NAME, EMBEDDED_NAME} <= set(ids)
    # A request that names no model goes to the default.
    r = make_run.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": QUESTION}],
                                                           "max_tokens": 32, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == INSTRUCT_NAME


def test_a_first_chat_through_the_openai_client_gets_an_answer(make_run: ServiceProcess) -> None:
    client = openai.OpenAI(base_url=make_run.url + "/v1", api_key="unused", max_retries=0)
    messages: Any = [{"role": "user", "content": QUESTION}]
    chat = client.chat.completions.create(model=INSTRUCT_NAME, messages=messages, temperature=0, max_tokens=32)
    choice = chat.choices[0]
    assert chat.model == INSTRUCT_NAME
    assert choice.message.role == "assistant"
    answer = choice.message.content or ""
    assert "Paris" in answer, answer
    assert choice.finish_reason == "stop", answer  # an answer that ends, not a continuation cut by max_tokens
    assert not answer.lstrip().startswith(QUESTION), answer  # gemma's way: the question repeated


def test_gemma_is_still_served_by_name(make_run: ServiceProcess, instruct_model: str) -> None:
    r = make_run.client.post("/api/models/load", json={"model": EMBEDDED_NAME, "n_ctx": 2048})
    assert r.status_code == 200, r.text
    r = make_run.client.post("/v1/completions", json={"model": EMBEDDED_NAME, "prompt": "The capital of France is",
                                                      "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == EMBEDDED_NAME and r.json()["choices"][0]["text"]
    # Ollama's delete refuses either embedded model; its listing shows both.
    for name in (INSTRUCT_NAME, EMBEDDED_NAME):
        r = make_run.client.request("DELETE", "/api/delete", json={"model": name})
        assert r.status_code == 400 and "embedded" in r.text, r.text
    tags = {m["name"]: m for m in make_run.client.get("/api/tags").json()["models"]}
    assert tags[INSTRUCT_NAME]["details"]["quantization_level"] == "Q4_1"
    assert tags[INSTRUCT_NAME]["size"] == Path(instruct_model).stat().st_size
    assert EMBEDDED_NAME in tags
