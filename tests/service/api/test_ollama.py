"""Ollama's native API through the official ``ollama`` client, on the embedded model over real HTTP: chat and
generate (streamed and whole, the timings, num_predict, num_ctx), format with a JSON schema, tools, embeddings,
the model listings (tags, show, ps, version), delete and pull; malformed bodies are 4xx in Ollama's shape."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import threading
from datetime import datetime, timedelta, timezone
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import jsonschema
import ollama
import pytest

from tests.conftest import EMBEDDED_NAME, ROOT, ServiceProcess
from tests.service.catalog.test_pull import _Hub

pytestmark = pytest.mark.slow

KEY = "ollama-test-key"
N_CTX = 2048
OPTS = {"num_predict": 8, "temperature": 0, "seed": 7}
ASK = [{"role": "user", "content": "Name a colour."}]


class _TreeHub(_Hub):
    """The hub's resolve protocol (tests/service/catalog/test_pull.py) and its file listing, which
    ``hf.co/OWNER/REPO:QUANT`` reads (``GET /api/models/OWNER/REPO/tree/REVISION``)."""

    def do_GET(self) -> None:  # noqa: N802
        m = re.match(r"^/api/models/([^/]+/[^/]+)/tree/[^/?]+", self.path)
        if m is None:
            return super().do_GET()
        d = self.root / m.group(1)
        if not d.is_dir():
            body = b'{"error": "Repository not found"}'
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound")
        else:
            body = json.dumps([{"type": "file", "path": p.name, "size": p.stat().st_size, "oid": "0" * 40}
                               for p in sorted(d.iterdir())]).encode()
            self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory, embedded_model: str) -> Iterator[str]:
    """A local Hugging Face hub (its resolve protocol) holding a copy of the embedded model."""
    root = tmp_path_factory.mktemp("hub")
    (root / "acme" / "tiny").mkdir(parents=True)
    os.link(embedded_model, root / "acme" / "tiny" / "pulled-tiny.gguf")
    os.link(embedded_model, root / "acme" / "tiny" / "tiny-Q4_K_M.gguf")
    from sizing.testing.projector_fixtures import TINY, write_projector

    for kind in ("f32", "f16"):  # a vision model's repo: its projectors beside it (the f16 one is pulled)
        write_projector(root / "acme" / "tiny" / f"mmproj-tiny-{kind}.gguf", TINY)
    handler = type("Hub", (_TreeHub,), {"root": root, "requests": []})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ollama-models")


@pytest.fixture(scope="module")
def svc(service_factory: Callable[..., ServiceProcess], models_dir: Path, hub: str) -> ServiceProcess:
    s = service_factory(GGUF_CONFIRM_LOADS="false", GGUF_CONTEXT_LENGTH=str(N_CTX), GGUF_EMBEDDINGS="on",
                        # An admin key: Ollama's client pulls, deletes and unloads, which ordinary keys may not
                        # (issue 54; tests/reliability/test_roles.py).
                        GGUF_EMBEDDING_TOKENS="128", GGUF_ADMIN_KEYS=KEY, GGUF_MODELS_DIR=str(models_dir),
                        HF_ENDPOINT=hub)
    s.wait_ready()
    return s


@pytest.fixture(scope="module")
def client(svc: ServiceProcess) -> ollama.Client:
    return ollama.Client(host=svc.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=300)


@pytest.fixture(scope="module")
def raw(svc: ServiceProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=svc.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=300) as c:
        yield c


def _check_timings(r: Any) -> None:
    assert r.done is True
    assert r.prompt_eval_count > 0 and r.eval_count > 0
    assert r.prompt_eval_duration > 0 and r.eval_duration >= 0 and r.load_duration >= 0
    assert r.total_duration >= r.prompt_eval_duration + r.eval_duration  # nanoseconds of the same request


def test_version_is_numeric(raw: httpx.Client) -> None:
    r = raw.get("/api/version")
    assert r.status_code == 200
    assert all(p.isdigit() for p in r.json()["version"].split("."))


def test_chat_whole(client: ollama.Client) -> None:
    r = client.chat(model=EMBEDDED_NAME, messages=ASK, stream=False, options=OPTS)
    assert r.model == EMBEDDED_NAME
    assert r.message.role == "assistant" and isinstance(r.message.content, str) and r.message.content
    assert r.done_reason in ("stop", "length")
    assert 0 < r.eval_count <= 8
    _check_timings(r)


def test_chat_streamed(client: ollama.Client) -> None:
    parts = list(client.chat(model=f"{EMBEDDED_NAME}:latest", messages=ASK, options=OPTS, stream=True))
    assert len(parts) >= 2
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content or "" for p in parts)
    last = parts[-1]
    assert last.done_reason in ("stop", "length") and last.message.content == ""
    _check_timings(last)


def test_streams_ndjson_unless_told_not_to(raw: httpx.Client) -> None:
    """Ollama's default is to stream (the Python client sends ``stream`` itself; curl and others do not)."""
    r = raw.post("/api/chat", json={"model": EMBEDDED_NAME, "messages": ASK, "options": OPTS})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in r.text.splitlines()]
    assert len(lines) >= 2 and lines[-1]["done"] is True and not any(x["done"] for x in lines[:-1])
    assert lines[-1]["done_reason"] in ("stop", "length")


def test_num_predict_cuts_with_length(client: ollama.Client) -> None:
    r = client.chat(model=EMBEDDED_NAME, messages=[{"role": "user", "content": "Count from one to fifty."}],
                    stream=False, options={"num_predict": 3, "temperature": 0})
    assert r.done_reason == "length" and r.eval_count == 3


def test_generate_whole_and_streamed(client: ollama.Client) -> None:
    r = client.generate(model=EMBEDDED_NAME, prompt="The sky is", system="Answer briefly.", options=OPTS,
                        stream=False)
    assert isinstance(r.response, str) and r.response and r.done
    _check_timings(r)
    parts = list(client.generate(model=EMBEDDED_NAME, prompt="The sky is", raw=True, options=OPTS, stream=True))
    assert parts[-1].done and parts[-1].eval_count > 0
    assert "".join(p.response for p in parts)


def test_empty_prompt_loads(client: ollama.Client) -> None:
    r = client.generate(model=EMBEDDED_NAME, prompt="", stream=False)
    assert r.done and r.done_reason == "load"


def test_format_schema_validates(client: ollama.Client) -> None:
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 8}},
              "required": ["colour"], "additionalProperties": False}
    r = client.chat(model=EMBEDDED_NAME, messages=ASK, format=schema, stream=False,
                    options={"num_predict": 40, "temperature": 0})
    jsonschema.validate(json.loads(r.message.content), schema)
    r = client.generate(model=EMBEDDED_NAME, prompt="A colour as JSON:", format="json", stream=False,
                        options={"num_predict": 40, "temperature": 0})
    assert r.done_reason == "length" or isinstance(json.loads(r.response), dict)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                   "required": ["city"], "additionalProperties": False}}}


def test_tools_answer_parses(client: ollama.Client) -> None:
    r = client.chat(model=EMBEDDED_NAME, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                    tools=[WEATHER], stream=False, options={"num_predict": 24, "temperature": 0})
    for call in r.message.tool_calls or []:  # the small model may answer in words; a call it makes parses
        assert call.function.name == "get_weather"
        assert isinstance(call.function.arguments, dict)
    # A round trip in Ollama's shape: a call with object arguments, its result named by the tool.
    turns = [{"role": "user", "content": "What is the weather in Paris?"},
             {"role": "assistant", "content": "",
              "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
             {"role": "tool", "tool_name": "get_weather", "content": "18 degrees, sunny"}]
    r = client.chat(model=EMBEDDED_NAME, messages=turns, tools=[WEATHER], stream=False, options=OPTS)
    assert r.done and (r.message.content or r.message.tool_calls)


def test_think_on_a_model_that_does_not_think_is_refused(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=EMBEDDED_NAME, messages=ASK, think=True, stream=False, options=OPTS)
    assert e.value.status_code == 400 and "does not support thinking" in e.value.error
    assert client.chat(model=EMBEDDED_NAME, messages=ASK, think=False, stream=False, options=OPTS).done


def test_tool_result_without_a_call_is_refused(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=EMBEDDED_NAME, messages=[*ASK, {"role": "tool", "tool_name": "nope", "content": "x"}],
                    stream=False, options=OPTS)
    assert e.value.status_code == 400 and "tool" in e.value.error


@pytest.fixture(scope="module")
def thinker(service_factory: Callable[..., ServiceProcess]) -> ollama.Client:
    """The embedded model with a template whose generation prompt opens ``<think>`` (tests/fixtures)."""
    s = service_factory(GGUF_CONFIRM_LOADS="false", GGUF_CONTEXT_LENGTH="1024", GGUF_EMBEDDINGS="off",
                        GGUF_CHAT_TEMPLATE_FILE=str(ROOT / "tests" / "fixtures" / "thinking_template.jinja"))
    s.wait_ready()
    return ollama.Client(host=s.url, timeout=300)


def test_thinking_goes_to_message_thinking(thinker: ollama.Client) -> None:
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    opts = {"num_predict": 24, "temperature": 0}
    r = thinker.chat(model=EMBEDDED_NAME, messages=ask, think=True, stream=False, options=opts)
    assert r.message.thinking and r.message.thinking.strip() and "think>" not in r.message.thinking
    assert r.message.content and "think>" not in r.message.content
    parts = list(thinker.chat(model=EMBEDDED_NAME, messages=ask, think=True, stream=True, options=opts))
    assert "".join(p.message.thinking or "" for p in parts) == r.message.thinking
    assert "".join(p.message.content or "" for p in parts) == r.message.content
    hidden = thinker.chat(model=EMBEDDED_NAME, messages=ask, think=False, stream=False, options=opts)
    assert hidden.message.thinking is None and hidden.message.content == r.message.content
    s = thinker.show(EMBEDDED_NAME)
    assert "thinking" in s.capabilities and "<think>" in s.template and "embedding" not in s.capabilities


def test_num_ctx_is_a_ceiling_never_a_reload(client: ollama.Client) -> None:
    long = [{"role": "user", "content": "word " * 60}]
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=EMBEDDED_NAME, messages=long, stream=False, options={"num_ctx": 32, "num_predict": 4})
    assert e.value.status_code == 400 and "context length is 32 tokens" in e.value.error
    r = client.chat(model=EMBEDDED_NAME, messages=long, stream=False, options={"num_ctx": 1 << 20, "num_predict": 2})
    assert r.done
    (loaded,) = [m for m in client.ps().models if m.model == EMBEDDED_NAME]
    assert loaded.context_length == N_CTX  # the model's own context stands


def test_embed(client: ollama.Client) -> None:
    r = client.embed(model=EMBEDDED_NAME, input=["a red apple", "the blue sea"])
    assert len(r.embeddings) == 2 and len(r.embeddings[0]) == 640
    assert math.isclose(sum(x * x for x in r.embeddings[0]), 1.0, rel_tol=1e-3)
    assert r.embeddings[0] != r.embeddings[1]
    one = client.embeddings(model=EMBEDDED_NAME, prompt="a red apple")
    # The same text alone and in a batch: equal up to the CPU kernels' batch-dependent rounding, which is larger on
    # some hosts (AVX512 with AMX: 4e-3 at most, measured) than on others (AVX2: 1e-5); the engine's test bounds
    # it by the cosine the same way (tests/service/engine/test_choices_bias_embeddings.py).
    assert len(one.embedding) == 640
    assert sum(x * y for x, y in zip(one.embedding, r.embeddings[0])) > 0.999


def test_tags_show_ps(client: ollama.Client, embedded_model: str) -> None:
    (m,) = [m for m in client.list().models if m.model == EMBEDDED_NAME]
    assert m.size == os.path.getsize(embedded_model)
    assert m.details.format == "gguf" and m.details.family == "gemma3" and m.details.quantization_level == "Q4_K_M"
    assert m.details.parameter_size.endswith("M") and len(m.digest) == 64
    s = client.show(EMBEDDED_NAME)
    assert s.modelinfo["general.architecture"] == "gemma3" and s.modelinfo["gemma3.context_length"] == 32768
    assert {"completion", "tools", "embedding"} <= set(s.capabilities) and "thinking" not in s.capabilities
    client.chat(model=EMBEDDED_NAME, messages=ASK, stream=False, options={"num_predict": 1}, keep_alive="10m")
    (p,) = [p for p in client.ps().models if p.model == EMBEDDED_NAME]
    assert p.size > 0 and 0 <= p.size_vram <= p.size and p.context_length == N_CTX
    left = p.expires_at - datetime.now(timezone.utc)
    assert timedelta(minutes=9) < left <= timedelta(minutes=10, seconds=5)


def test_delete(client: ollama.Client, models_dir: Path, embedded_model: str) -> None:
    shutil.copyfile(embedded_model, models_dir / "spare.gguf")
    assert "spare" in [m.model for m in client.list().models]
    assert client.delete("spare").status == "success"
    assert not (models_dir / "spare.gguf").exists()
    assert "spare" not in [m.model for m in client.list().models]
    with pytest.raises(ollama.ResponseError) as e:
        client.delete("spare")
    assert e.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as e:
        client.delete(EMBEDDED_NAME)
    assert e.value.status_code == 400 and "embedded" in e.value.error


def test_pull(client: ollama.Client, models_dir: Path) -> None:
    parts = list(client.pull("hf.co/acme/tiny/pulled-tiny.gguf", stream=True))
    assert parts[0].status == "pulling manifest" and parts[-1].status == "success"
    assert any(p.total and p.completed == p.total for p in parts)
    assert (models_dir / "pulled-tiny.gguf").exists()
    assert "pulled-tiny" in [m.model for m in client.list().models]
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("hf.co/acme/tiny/missing.gguf", stream=False)
    assert e.value.status_code >= 400
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("llama3:8b")
    assert e.value.status_code == 400
    assert not list(models_dir.glob("*mmproj*"))  # a file named: that file alone
    # Ollama's hf.co/OWNER/REPO:QUANT: the repo's one model file named with the quantization, any case, and its
    # vision projector with it (the f16 one of two), beside it where the model finds it.
    done = client.pull("hf.co/acme/tiny:q4_k_m", stream=False)
    assert done.status == "success" and (models_dir / "tiny-Q4_K_M.gguf").exists()
    assert sorted(p.name for p in models_dir.glob("*mmproj*")) == ["mmproj-tiny-f16.gguf"]
    assert "vision" in (client.show("tiny-Q4_K_M").capabilities or [])
    assert not [m for m in client.list().models if "mmproj" in (m.model or "")]
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("hf.co/acme/tiny:Q8_0")
    assert e.value.status_code == 404 and "Q8_0" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("hf.co/acme/tiny:tiny")  # both files are named with it
    assert e.value.status_code == 400 and "several" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("hf.co/acme/none:Q4_K_M")
    assert e.value.status_code == 404


@pytest.mark.parametrize("path,body", [
    ("/api/chat", b"{not json"),
    ("/api/chat", {"model": EMBEDDED_NAME, "messages": "hi"}),
    ("/api/chat", {"model": EMBEDDED_NAME, "messages": [{"role": "robot", "content": "hi"}]}),
    ("/api/chat", {"model": EMBEDDED_NAME, "messages": ASK, "options": {"temperature": "hot"}}),
    ("/api/chat", {"model": EMBEDDED_NAME, "messages": ASK, "options": {"temperature": 9}, "stream": False}),
    ("/api/chat", {"model": EMBEDDED_NAME, "messages": ASK, "format": 5}),
    ("/api/chat", {"model": EMBEDDED_NAME, "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}),
    ("/api/chat", {"model": EMBEDDED_NAME, "messages": ASK, "tools": [{"type": "function"}], "stream": False}),
    ("/api/chat", {"model": "no-such-model", "messages": ASK}),
    ("/api/chat", {"messages": ASK}),
    ("/api/generate", {"model": EMBEDDED_NAME, "prompt": 5}),
    ("/api/generate", {"model": EMBEDDED_NAME, "prompt": "x", "suffix": "y"}),
    ("/api/embed", {"model": EMBEDDED_NAME, "input": [1, 2]}),
    ("/api/embed", {"model": EMBEDDED_NAME}),
    ("/api/show", {"model": "../etc/passwd"}),
    ("/api/show", {}),
    ("/api/pull", {"model": 3}),
])
def test_malformed_bodies_are_4xx_in_ollamas_shape(raw: httpx.Client, path: str, body: Any) -> None:
    r = raw.post(path, content=body) if isinstance(body, bytes) else raw.post(path, json=body)
    assert 400 <= r.status_code < 500, r.text
    assert isinstance(r.json()["error"], str) and r.json()["error"]


def test_auth_applies(svc: ServiceProcess) -> None:
    r = httpx.post(svc.url + "/api/chat", json={"model": EMBEDDED_NAME, "messages": ASK})
    assert r.status_code == 401 and isinstance(r.json()["error"], str)
