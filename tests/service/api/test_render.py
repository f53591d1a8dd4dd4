"""vLLM's render routes against the real service (the embedded model in its runner process): the token ids a
router's prefix scorer matches are the ones /v1/completions and /v1/chat/completions evaluate for the same body
(their ``return_token_ids`` names them), and a body generation would refuse is refused the same way."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.slow

TEXT = "The lighthouse keeper climbed the stairs at dusk."
TOOLS = [{"type": "function", "function": {"name": "lamp", "description": "Light the lamp.",
                                           "parameters": {"type": "object", "properties": {"hour": {"type": "integer"}},
                                                          "required": ["hour"]}}}]


def test_completions_render_gives_the_ids_a_completion_evaluates(served: Any) -> None:
    body = {"prompt": TEXT, "max_tokens": 2, "temperature": 0, "seed": 3, "stop": ["\n"]}
    r = served.client.post("/v1/completions/render", json=body)
    assert r.status_code == 200, r.text
    (item,) = r.json()
    assert item["request_id"].startswith("cmpl-") and item["features"] is None and item["model"]
    assert item["sampling_params"]["max_tokens"] == 2 and item["sampling_params"]["stop"] == ["\n"]
    done = served.client.post("/v1/completions", json={**body, "return_token_ids": True}).json()
    assert item["token_ids"] == done["choices"][0]["prompt_token_ids"]
    assert len(item["token_ids"]) == done["usage"]["prompt_tokens"]
    tokens = served.client.post("/tokenize", json={"content": TEXT, "add_special": True}).json()["tokens"]
    assert item["token_ids"] == tokens


def test_chat_render_gives_the_ids_a_chat_evaluates_template_and_tools_included(served: Any) -> None:
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}],
            "tools": TOOLS, "max_tokens": 2, "temperature": 0}
    r = served.client.post("/v1/chat/completions/render", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["request_id"].startswith("chatcmpl-")
    done = served.client.post("/v1/chat/completions", json={**body, "return_token_ids": True}).json()
    assert got["token_ids"] == done["prompt_token_ids"] and len(got["token_ids"]) == done["usage"]["prompt_tokens"]
    without_tools = served.client.post("/v1/chat/completions/render", json={**body, "tools": None}).json()
    assert len(without_tools["token_ids"]) < len(got["token_ids"]), "the tools are in the rendering"
    text = served.client.post("/detokenize", json={"tokens": got["token_ids"]}).json()["content"]
    prompt = served.client.post("/apply-template", json=body).json()["prompt"]
    assert text.endswith(prompt) and TEXT in text and "lamp" in text


def test_render_refuses_what_generation_refuses(served: Any) -> None:
    n_ctx = next(m["n_ctx"] for m in served.client.get("/api/models").json()["models"] if m["state"] == "loaded")
    long = {"prompt": "lighthouse " * (n_ctx + 10), "max_tokens": 1}
    r = served.client.post("/v1/completions/render", json=long)
    g = served.client.post("/v1/completions", json=long)
    assert r.status_code == g.status_code == 400 and r.json()["error"]["param"] == g.json()["error"]["param"]
    for path, body, param in [("/v1/chat/completions/render", {"messages": []}, "messages"),
                              ("/v1/completions/render", {"prompt": ["a", "b"]}, "prompt"),
                              ("/v1/completions/render", {"prompt": TEXT, "model": "no-such-model"}, "model")]:
        r = served.client.post(path, json=body)
        assert 400 <= r.status_code < 500 and r.json()["error"]["param"] == param, (path, r.text)
