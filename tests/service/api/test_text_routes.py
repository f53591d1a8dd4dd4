"""llama-server's /tokenize, /detokenize and /apply-template against the real service (the embedded model in its
runner process): the same tokens and rendering the generation routes use, and every bad body a 4xx."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.slow

TEXT = "The lighthouse keeper climbed the stairs at dusk."


def _tokenize(served: Any, content: str, **opts: Any) -> Any:
    r = served.client.post("/tokenize", json={"content": content, **opts})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_tokenize_gives_the_tokens_a_completion_evaluates_and_detokenize_inverts_it(served: Any) -> None:
    with_bos = _tokenize(served, TEXT, add_special=True)
    done = served.client.post("/v1/completions", json={"prompt": TEXT, "max_tokens": 1, "temperature": 0}).json()
    assert len(with_bos) == done["usage"]["prompt_tokens"], "the tokens /v1/completions counts"
    plain = _tokenize(served, TEXT)
    assert plain == with_bos[1:], "add_special adds BOS, and only it, for this model"
    r = served.client.post("/detokenize", json={"tokens": plain})
    assert r.status_code == 200 and r.json() == {"content": TEXT}
    pieces = _tokenize(served, TEXT, with_pieces=True)
    assert [p["id"] for p in pieces] == plain and "".join(p["piece"] for p in pieces) == TEXT


def test_parse_special_decides_whether_a_control_tokens_spelling_is_one_token(served: Any) -> None:
    spelled = "<start_of_turn>user"
    parsed = _tokenize(served, spelled)
    as_text = _tokenize(served, spelled, parse_special=False)
    assert len(parsed) < len(as_text), (parsed, as_text)
    detok = served.client.post("/detokenize", json={"tokens": parsed}).json()
    assert detok == {"content": spelled}, "control tokens are spelt"


def test_a_piece_that_is_not_whole_utf8_is_its_bytes(served: Any) -> None:
    pieces = _tokenize(served, "日本語の灯台守 🌊", with_pieces=True)
    raw = b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode() for p in pieces)
    assert raw.decode() == "日本語の灯台守 🌊"


def test_apply_template_renders_what_the_chat_route_evaluates(served: Any) -> None:
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]}
    r = served.client.post("/apply-template", json=body)
    assert r.status_code == 200, r.text
    prompt = r.json()["prompt"]
    assert TEXT in prompt and "Be brief." in prompt and prompt.count("<start_of_turn>") >= 2, prompt
    done = served.client.post("/v1/chat/completions", json={**body, "max_tokens": 1, "temperature": 0}).json()
    tokens = _tokenize(served, prompt, add_special=not prompt.startswith("<bos>"))
    assert len(tokens) == done["usage"]["prompt_tokens"], (len(tokens), done["usage"], prompt)


@pytest.mark.parametrize("path, body, param", [
    ("/detokenize", {"tokens": [262144]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"content": "x", "add_special": "yes"}, "add_special"),
    ("/tokenize", {"content": "x", "colour": "red"}, "colour"),
    ("/tokenize", {"content": "x\ud800"}, "content"),
    ("/tokenize", {"model": "no-such-model", "content": "x"}, "model"),
    ("/apply-template", {"messages": []}, "messages"),
    ("/apply-template", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
])
def test_bad_bodies_are_4xx_naming_the_field(served: Any, path: str, body: dict[str, Any], param: str) -> None:
    import json

    r = served.client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert param in r.text, r.text
    assert served.client.post("/tokenize", json={"content": "still serving"}).status_code == 200


def test_the_embedded_gemma_neither_infills_nor_ranks(served: Any) -> None:
    """gemma-3-270m's vocabulary has no FIM tokens and its GGUF declares no rank pooling: 400s naming why."""
    r = served.client.post("/infill", json={"input_prefix": "def f(", "input_suffix": "):"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    assert all(f"tokenizer.ggml.fim_{n}_token_id" in r.text for n in ("pre", "suf", "mid")), r.text
    r = served.client.post("/v1/rerank", json={"query": "sea", "documents": ["a ship", "a lamp"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model" and "rank pooling" in r.text, r.text
    assert served.client.post("/tokenize", json={"content": "still serving"}).status_code == 200
