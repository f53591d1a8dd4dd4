"""Ollama's native API over the fake engine (fast, in-process over real HTTP): the num_ctx ceiling's exact
arithmetic, the counts of the final object, load and unload by an empty request, the error shape, and the pull
names."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest

from service.api.ollama import pull_source
from service.errors import BadRequest
from tests.conftest import EMBEDDED_NAME

ASK = [{"role": "user", "content": "one two three four"}]


def _chat(fake, **kw):  # type: ignore[no-untyped-def]
    return fake.client.post("/api/chat", json={"model": EMBEDDED_NAME, "messages": ASK, "stream": False, **kw})


def test_num_ctx_is_a_ceiling_for_the_prompt_and_the_generation(fake):  # type: ignore[no-untyped-def]
    first = _chat(fake, options={"num_predict": 3})
    assert first.status_code == 200, first.text
    n_prompt = first.json()["prompt_eval_count"]
    assert first.json()["eval_count"] == 3 and first.json()["done_reason"] == "length"
    # The prompt plus num_predict beyond the ceiling: the context error, naming the ceiling.
    r = _chat(fake, options={"num_ctx": n_prompt + 2, "num_predict": 3})
    assert r.status_code == 400 and f"maximum context length is {n_prompt + 2} tokens" in r.json()["error"]
    # Without num_predict the generation stops at the ceiling.
    r = _chat(fake, options={"num_ctx": n_prompt + 2})
    assert r.status_code == 200 and r.json()["eval_count"] == 2 and r.json()["done_reason"] == "length"
    # A prompt that alone fills the ceiling.
    r = _chat(fake, options={"num_ctx": n_prompt})
    assert r.status_code == 400 and "the prompt has" in r.json()["error"]
    # Larger than the model's context: ignored (no reload, no error).
    r = _chat(fake, options={"num_ctx": 1 << 30, "num_predict": 2})
    assert r.status_code == 200 and r.json()["eval_count"] == 2


def test_stream_counts_match_the_whole_answer(fake):  # type: ignore[no-untyped-def]
    whole = _chat(fake, options={"num_predict": 4, "seed": 3}).json()
    with fake.client.stream("POST", "/api/chat", json={"model": EMBEDDED_NAME, "messages": ASK,
                                                        "options": {"num_predict": 4, "seed": 3}}) as s:
        assert s.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in s.iter_lines() if line]
    assert "".join(x["message"]["content"] for x in lines) == whole["message"]["content"]
    last = lines[-1]
    assert last["done"] and last["eval_count"] == whole["eval_count"] == 4
    assert last["prompt_eval_count"] == whole["prompt_eval_count"]
    for key in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(last[key], int) and last[key] >= 0


def test_generate_is_a_user_turn_and_raw_is_the_prompt(fake):  # type: ignore[no-untyped-def]
    templated = fake.client.post("/api/generate", json={"model": EMBEDDED_NAME, "prompt": "one two", "stream": False,
                                                         "options": {"num_predict": 1}}).json()
    raw = fake.client.post("/api/generate", json={"model": EMBEDDED_NAME, "prompt": "one two", "raw": True,
                                                   "stream": False, "options": {"num_predict": 1}}).json()
    assert raw["prompt_eval_count"] == 3  # the fake's tokenizer: BOS and a token per word
    assert templated["prompt_eval_count"] > raw["prompt_eval_count"]  # the template's turn markers
    assert isinstance(raw["response"], str) and raw["done_reason"] == "length"


def test_empty_requests_load_and_unload(fake_factory):  # type: ignore[no-untyped-def]
    fake = fake_factory(load_on_demand=True)
    r = fake.client.post("/api/generate", json={"model": EMBEDDED_NAME, "keep_alive": 0})
    assert r.status_code == 200 and r.json()["done_reason"] == "unload"
    assert fake.client.get("/api/ps").json()["models"] == []
    r = fake.client.post("/api/chat", json={"model": f"{EMBEDDED_NAME}:latest", "messages": [], "keep_alive": -1})
    assert r.status_code == 200 and r.json()["done_reason"] == "load", r.text
    (m,) = fake.client.get("/api/ps").json()["models"]
    assert m["model"] == EMBEDDED_NAME and m["expires_at"].startswith("2318")  # keep_alive -1: never
    _chat(fake, options={"num_predict": 1}, keep_alive="5m")
    (m,) = fake.client.get("/api/ps").json()["models"]
    left = datetime.fromisoformat(m["expires_at"].replace("Z", "+00:00")) - datetime.now(timezone.utc)
    assert timedelta(minutes=4, seconds=50) < left <= timedelta(minutes=5)


def test_errors_are_ollamas_shape(fake):  # type: ignore[no-untyped-def]
    r = fake.client.post("/api/chat", json={"model": "nope", "messages": ASK, "stream": False})
    assert r.status_code == 404 and r.json() == {"error": "The model 'nope' does not exist"}
    r = fake.client.post("/api/chat", json={"model": EMBEDDED_NAME, "messages": ASK, "options": {"top_k": "x"}})
    assert r.status_code == 400 and set(r.json()) == {"error"} and "top_k" in r.json()["error"]
    r = fake.client.post("/api/chat", json={"model": EMBEDDED_NAME, "messages": ASK, "stream": False,
                                            "options": {"temperature": 5}})
    assert r.status_code == 400 and r.json()["error"].startswith("options.temperature")
    # The OpenAI routes keep their envelope.
    r = fake.client.post("/v1/chat/completions", json={"model": "nope", "messages": ASK})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_tool_results_answer_the_earliest_open_call_of_their_tool(fake):  # type: ignore[no-untyped-def]
    calls = [{"function": {"name": "a", "arguments": {"x": 1}}}, {"function": {"name": "b", "arguments": {}}}]
    turns = [*ASK, {"role": "assistant", "content": "", "tool_calls": calls},
             {"role": "tool", "tool_name": "b", "content": "B"}, {"role": "tool", "tool_name": "a", "content": "A"}]
    r = _chat(fake, messages=turns, options={"num_predict": 1})
    assert r.status_code == 200, r.text
    extra = [*turns, {"role": "tool", "tool_name": "a", "content": "again"}]  # a's one call is answered already
    r = _chat(fake, messages=extra, options={"num_predict": 1})
    assert r.status_code == 400 and "tool" in r.json()["error"]


@pytest.mark.parametrize("name,want", [
    ("hf.co/acme/tiny/model-Q4_K_M.gguf", ("acme/tiny", "model-Q4_K_M.gguf", None, None)),
    ("huggingface.co/acme/tiny/m.gguf@v2", ("acme/tiny", "m.gguf", None, "v2")),
    ("https://hf.co/acme/tiny/m.gguf", ("acme/tiny", "m.gguf", None, None)),
    ("acme/tiny/m.gguf", ("acme/tiny", "m.gguf", None, None)),
    ("hf.co/acme/tiny-GGUF:Q4_K_M", ("acme/tiny-GGUF", None, "Q4_K_M", None)),
    ("hf.co/acme/tiny:q8_0@main", ("acme/tiny", None, "q8_0", "main")),
])
def test_pull_names(name: str, want: tuple[str, str | None, str | None, str | None]) -> None:
    assert pull_source(name) == want


@pytest.mark.parametrize("name", ["llama3:8b", "acme/tiny:Q4_K_M", "hf.co/acme/tiny:", "acme/tiny", "a/b/c/d.gguf",
                                  "hf.co/acme", ""])
def test_pull_names_refused(name: str) -> None:
    with pytest.raises(BadRequest):
        pull_source(name)


def test_tool_calls_have_object_arguments() -> None:
    from service.api.ollama import tool_calls
    from service.chat.choices import Answer, ToolCall

    a = Answer(calls=[ToolCall("call_0", "get_weather", '{"city": "Paris"}'), ToolCall("call_1", "f", '{"cut": ')])
    assert tool_calls(a) == [
        {"id": "call_0", "function": {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "call_1", "function": {"index": 1, "name": "f", "arguments": {}}},  # cut short by num_predict
    ]


def test_show_and_tags(fake, embedded_model):  # type: ignore[no-untyped-def]
    import os

    s = fake.client.post("/api/show", json={"model": f"{EMBEDDED_NAME}:latest"}).json()
    assert s["modelfile"] == f"FROM {EMBEDDED_NAME}\n" and "top_k 40" in s["parameters"]
    assert s["details"]["family"] == "gemma3" and s["model_info"]["general.parameter_count"] > 2e8
    assert s["model_info"]["tokenizer.ggml.tokens"] is None  # the vocabulary, unless verbose
    verbose = fake.client.post("/api/show", json={"model": EMBEDDED_NAME, "verbose": True}).json()
    assert verbose["model_info"]["tokenizer.ggml.tokens"]["count"] == 262144
    (m,) = [m for m in fake.client.get("/api/tags").json()["models"] if m["name"] == EMBEDDED_NAME]
    assert m["size"] == os.path.getsize(embedded_model) and m["details"]["parameter_size"] == "268.10M"
    assert fake.client.post("/api/show", json={"model": "nope"}).status_code == 404


def test_delete_unloads_the_model_first(fake_factory, embedded_model, tmp_path):  # type: ignore[no-untyped-def]
    import os

    spare = tmp_path / "spare.gguf"
    os.link(embedded_model, spare)
    fake = fake_factory(models=[str(spare)], default_model="spare")
    assert [m["model"] for m in fake.client.get("/api/ps").json()["models"]] == ["spare"]
    r = fake.client.request("DELETE", "/api/delete", json={"model": "spare"})
    assert r.status_code == 200, r.text
    assert fake.client.get("/api/ps").json()["models"] == []
    assert "spare" not in [m["name"] for m in fake.client.get("/api/tags").json()["models"]]
    r = fake.client.post("/api/chat", json={"model": "spare", "messages": ASK, "stream": False})
    assert r.status_code == 404 and r.json()["error"] == "The model 'spare' does not exist"


def _scripted(text: str):  # type: ignore[no-untyped-def]
    """A fake engine whose every answer is ``text``, in pieces of a few characters (the model's tokens)."""
    from service.engine.base import Chunk
    from service.testing.fake import FakeEngine, byte_tokens

    class Scripted(FakeEngine):
        def _one(self, n_prompt, params, cancel, seed, index):  # type: ignore[no-untyped-def]
            pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
            for p in pieces:
                yield Chunk(tokens=byte_tokens(p))
            yield Chunk(finish_reason="stop", prompt_tokens=n_prompt, completion_tokens=len(pieces))

    return Scripted()


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_a_tool_call_streamed_whole_and_not(fake_factory):  # type: ignore[no-untyped-def]
    call = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}'  # the generic format
    fake = fake_factory(engine=_scripted(call))
    body = {"model": EMBEDDED_NAME, "messages": ASK, "tools": [WEATHER]}
    whole = fake.client.post("/api/chat", json={**body, "stream": False}).json()
    (c,) = whole["message"]["tool_calls"]
    assert c["function"] == {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}}
    assert whole["message"]["content"] == "" and whole["done_reason"] == "stop"
    with fake.client.stream("POST", "/api/chat", json=body) as s:
        lines = [json.loads(line) for line in s.iter_lines() if line]
    with_calls = [x for x in lines if x["message"].get("tool_calls")]
    assert len(with_calls) == 1 and not with_calls[0]["done"] and lines[-1]["done"]  # the call in one object
    assert with_calls[0]["message"]["tool_calls"][0]["function"] == c["function"]
    assert "".join(x["message"]["content"] for x in lines) == ""  # the call's syntax is never content
