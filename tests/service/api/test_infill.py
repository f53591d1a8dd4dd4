"""/infill on real llama.cpp over real HTTP: ``TINY_LLAMA_FIM`` (zero weights, FIM tokens in its vocabulary and
their ids in its header) in its runner process, generating through the one generation path.

The prompt is checked token by token against llama-server's FIM layout built here from /tokenize; the answer is
/completion's shape, whole and streamed; a model without FIM tokens, and every malformed body, is a 4xx.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import pytest

from service.settings import Settings
from sizing.testing.fixtures import FIM_TOKENS, TINY_LLAMA, TINY_LLAMA_FIM, write_fixture
from tests.conftest import free_port, in_process_service

pytestmark = pytest.mark.slow

FIM = "tiny-fim-bf16"
PLAIN = "tiny-llama-bf16"
N_BATCH = 512
BODY = {"input_prefix": "def area(r):\n    return ", "input_suffix": "\n\nprint(area(2))\n",
        "input_extra": [{"filename": "consts.py", "text": "PI = 3.14159\n"}, {"text": "import math\n"}],
        "prompt": "PI", "n_predict": 6, "seed": 3, "ignore_eos": True}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[httpx.Client, Any]]:
    models = tmp_path_factory.mktemp("infill-models")
    write_fixture("tiny-fim", models, shape=TINY_LLAMA_FIM)
    write_fixture("tiny-llama", models, shape=TINY_LLAMA)
    settings = Settings(host="127.0.0.1", port=free_port(), models_dir=str(models), default_model=FIM,
                        load_on_demand=True, confirm=False, parallel=1, context_length=2048)
    with in_process_service(settings) as (url, app), httpx.Client(base_url=url, timeout=120) as c:
        yield c, app


def _ids(c: httpx.Client, text: str, special: bool = False) -> list[int]:
    r = c.post("/tokenize", json={"model": FIM, "content": text, "parse_special": special})
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


def _fim(c: httpx.Client, key: str) -> int:
    (tok,) = _ids(c, FIM_TOKENS[key], special=True)
    return tok


def _layout(c: httpx.Client, body: dict[str, Any]) -> list[int]:
    """llama-server's format_prompt_infill for a prompt that fits: repo-level context, BOS, PRE prefix prompt SUF
    suffix MID."""
    rep, sep = _fim(c, "fim_rep"), _fim(c, "fim_sep")
    out = [rep, *_ids(c, "myproject\n")]
    for chunk in body.get("input_extra", []):
        out += [sep, *_ids(c, chunk.get("filename", "tmp") + "\n"), *_ids(c, chunk["text"])]
    out += [sep, *_ids(c, "filename\n")]
    bos = c.post("/tokenize", json={"model": FIM, "content": "", "add_special": True}).json()["tokens"]
    out += [*bos, _fim(c, "fim_pre"), *_ids(c, body["input_prefix"]), *_ids(c, body.get("prompt", ""), True),
            _fim(c, "fim_suf"), *_ids(c, body["input_suffix"]), _fim(c, "fim_mid")]
    return out


def _engine(app: Any) -> Any:
    return app.state.manager.models[FIM].engine


def test_the_prompt_is_llama_servers_fim_layout(served: tuple[httpx.Client, Any]) -> None:
    c, app = served
    want = _layout(c, BODY)
    extra = [(x.get("filename", "tmp"), x["text"]) for x in BODY["input_extra"]]  # type: ignore[attr-defined]
    got = _engine(app).infill_tokens(BODY["input_prefix"], BODY["input_suffix"], extra, BODY["prompt"], 6)
    assert got == want
    r = c.post("/infill", json=BODY)
    assert r.status_code == 200, r.text
    assert r.json()["tokens_evaluated"] == len(want), "the generation evaluated exactly that prompt"


def test_prefix_suffix_and_extra_are_cut_as_llama_server_cuts_them(served: tuple[httpx.Client, Any]) -> None:
    c, app = served
    prefix, suffix = " ".join(f"p{i}" for i in range(600)), " ".join(f"s{i}" for i in range(600))
    extra_text = " ".join(f"e{i}" for i in range(3000))
    got = _engine(app).infill_tokens(prefix, suffix, [("big.py", extra_text)], "", 100)
    pre, suf, mid = _fim(c, "fim_pre"), _fim(c, "fim_suf"), _fim(c, "fim_mid")
    i_pre, i_suf = got.index(pre), got.index(suf)
    assert got[i_pre + 1:i_suf] == _ids(c, prefix)[-3 * (N_BATCH // 4):], "the prefix's last 3/4 of a batch"
    assert got[i_suf + 1:-1] == _ids(c, suffix)[:N_BATCH // 4 - 2], "the suffix's first quarter, less 2"
    assert got[-1] == mid
    n_extra = i_pre - 1  # before BOS
    assert n_extra == 2048 - N_BATCH - 2 * 100, "the extra context fills the rest of the context, 2 x n_predict kept"
    assert len(got) < 2048


def test_answer_in_completions_shape_whole_and_streamed_alike(served: tuple[httpx.Client, Any]) -> None:
    c, _ = served
    whole = c.post("/infill", json=BODY).json()
    assert whole["stop"] is True and whole["model"] == FIM and isinstance(whole["content"], str)
    assert whole["tokens_predicted"] == 6 and whole["stop_type"] == "limit" and whole["stopping_word"] == ""
    assert set(whole["timings"]) >= {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms"}
    with c.stream("POST", "/infill", json={**BODY, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    *pieces, last = events
    assert pieces and all(e["stop"] is False and set(e) == {"index", "content", "stop"} for e in pieces)
    assert last["stop"] is True and last["tokens_predicted"] == 6
    assert "".join(e["content"] for e in pieces) == whole["content"], "same seed: the same answer"


def test_max_tokens_is_n_predicts_other_name(served: tuple[httpx.Client, Any]) -> None:
    c, _ = served
    body = {k: v for k, v in BODY.items() if k != "n_predict"}
    r = c.post("/infill", json={**body, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 3, r.text


def test_a_model_without_fim_tokens_is_a_400_naming_them(served: tuple[httpx.Client, Any]) -> None:
    c, _ = served
    r = c.post("/infill", json={**BODY, "model": PLAIN})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "model"
    for key in ("fim_pre", "fim_suf", "fim_mid"):
        assert f"tokenizer.ggml.{key}_token_id" in err["message"]


def _nested(depth: int) -> Any:
    v: Any = {"text": "x"}
    for _ in range(depth):
        v = [v]
    return v


@pytest.mark.parametrize("body, param", [
    ({"input_suffix": "x"}, "input_prefix"),
    ({"input_prefix": "x"}, "input_suffix"),
    ({"input_prefix": 1, "input_suffix": "x"}, "input_prefix"),
    ({"input_prefix": "x", "input_suffix": ["x"]}, "input_suffix"),
    ({"input_prefix": "x", "input_suffix": "y", "input_extra": "z"}, "input_extra"),
    ({"input_prefix": "x", "input_suffix": "y", "input_extra": [{"filename": "a"}]}, "input_extra"),
    ({"input_prefix": "x", "input_suffix": "y", "input_extra": [{"text": "a", "filename": 3}]}, "input_extra"),
    ({"input_prefix": "x", "input_suffix": "y", "input_extra": [{"text": "a"}] * 1025}, "input_extra"),
    ({"input_prefix": "x", "input_suffix": "y", "input_extra": _nested(60)}, "input_extra"),
    ({"input_prefix": "x", "input_suffix": "y", "prompt": 5}, "prompt"),
    ({"input_prefix": "x", "input_suffix": "y", "n_predict": -2}, "n_predict"),
    ({"input_prefix": "x", "input_suffix": "y", "n_predict": "4"}, "n_predict"),
    ({"input_prefix": "x", "input_suffix": "y", "n": 2}, "n"),
    ({"input_prefix": "x", "input_suffix": "y", "temperature": "hot"}, "temperature"),
    ({"input_prefix": "x", "input_suffix": "y", "prompt": "x" * 300_000}, "prompt"),
    ({"input_prefix": "x", "input_suffix": "y", "model": "no-such-model"}, "model"),
])
def test_bad_bodies_are_4xx_naming_the_field_and_infill_goes_on(served: tuple[httpx.Client, Any],
                                                               body: dict[str, Any], param: str) -> None:
    c, _ = served
    r = c.post("/infill", content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    assert param in r.text, r.text[:500]
    ok = c.post("/infill", json={"input_prefix": "a", "input_suffix": "b", "n_predict": 1})
    assert ok.status_code == 200, ok.text


def test_nul_characters_are_text_and_never_a_5xx(served: tuple[httpx.Client, Any]) -> None:
    c, _ = served
    r = c.post("/infill", json={"input_prefix": "a\x00b", "input_suffix": "\x00", "prompt": "\x00",
                                "input_extra": [{"filename": "\x00", "text": "\x00"}], "n_predict": 1})
    assert r.status_code < 500, r.text
