"""/v1/rerank on real llama.cpp over real HTTP: tiny BERT rerankers written by the test (rank pooling, seeded
weights: scores differ from document to document, meaningless but deterministic), each in its runner process.

The answers are checked against what llama.cpp says apart: the usage is the tokens of llama-server's pair layout
counted with /tokenize, every result's score is its document's score ranked alone, the order is the scores'.
Every malformed or hostile body is a 4xx naming its field, and the service goes on ranking.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from service.settings import Settings
from sizing.testing.fixtures import TINY_LLAMA_FIM, write_fixture
from sizing.testing.rerank_fixtures import write_tiny_reranker
from tests.conftest import free_port, in_process_service

pytestmark = pytest.mark.slow

RERANKER = "tiny-bert-reranker"
TEMPLATED = "tiny-bert-reranker-templated"
TEMPLATE = "[CLS]{query}[SEP]{document}[SEP]"
NOT_A_RERANKER = "tiny-fim-bf16"
MAX_REQUEST_TOKENS = 2000
QUERY = "the lighthouse keeper"
DOCS = ["a storm at sea", "the lamp in the house", "dusk", "keeper of the stairs", "ship 42, lost!"]


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    models = tmp_path_factory.mktemp("rerank-models")
    write_tiny_reranker(models, RERANKER, seed=7)
    write_tiny_reranker(models, TEMPLATED, seed=7, rerank_template=TEMPLATE)
    write_fixture("tiny-fim", models, shape=TINY_LLAMA_FIM)
    settings = Settings(host="127.0.0.1", port=free_port(), models_dir=str(models), default_model=RERANKER,
                        load_on_demand=True, confirm=False, parallel=1, context_length=2048,
                        embedding_max_request_tokens=MAX_REQUEST_TOKENS)
    with in_process_service(settings) as (url, _app), httpx.Client(base_url=url, timeout=120) as c:
        yield c


def _rerank(c: httpx.Client, path: str = "/v1/rerank", **body: Any) -> Any:
    r = c.post(path, json={"query": QUERY, "documents": DOCS, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _tokens(c: httpx.Client, text: str, model: str = RERANKER, parse_special: bool = False) -> list[int]:
    r = c.post("/tokenize", json={"model": model, "content": text, "parse_special": parse_special})
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


def test_results_are_every_document_once_ordered_by_score(client: httpx.Client) -> None:
    out = _rerank(client)
    assert out["object"] == "list" and out["model"] == RERANKER
    results = out["results"]
    assert sorted(r["index"] for r in results) == list(range(len(DOCS))), "each document once"
    scores = [r["relevance_score"] for r in results]
    assert all(isinstance(s, float) and math.isfinite(s) for s in scores)
    assert scores == sorted(scores, reverse=True), "highest first"
    assert len(set(scores)) > 1, "seeded weights: the documents' scores differ"
    assert not any("document" in r for r in results), "no text unless return_text"


def test_usage_counts_llama_servers_pair_layout(client: httpx.Client) -> None:
    # format_prompt_rerank without a template, for a WPM vocabulary (adds BOS and SEP, no EOS): [CLS] q [SEP] d
    n_query = len(_tokens(client, QUERY))
    want = sum(1 + n_query + 1 + len(_tokens(client, d)) for d in DOCS)
    usage = _rerank(client)["usage"]
    assert usage == {"prompt_tokens": want, "total_tokens": want}


def test_each_score_is_the_documents_own_whatever_ranks_beside_it(client: httpx.Client) -> None:
    together = {DOCS[r["index"]]: r["relevance_score"] for r in _rerank(client)["results"]}
    reversed_docs = list(reversed(DOCS))
    r = client.post("/v1/rerank", json={"query": QUERY, "documents": reversed_docs})
    again = {reversed_docs[x["index"]]: x["relevance_score"] for x in r.json()["results"]}
    # Equal to rounding: a batch's other sequences change how llama.cpp's kernels group rows (its f16 attention,
    # its matrix products), 2e-4 relative measured; a document's score never comes from another's pair.
    for doc in DOCS:
        alone = _rerank(client, documents=[doc])["results"][0]["relevance_score"]
        assert alone == pytest.approx(together[doc], rel=2e-3), doc
        assert again[doc] == pytest.approx(together[doc], rel=2e-3), doc
    assert len({round(v, 2) for v in together.values()}) > 1, "the scores differ by more than that rounding"


def test_top_n_keeps_the_best_and_return_text_gives_the_documents(client: httpx.Client) -> None:
    full = _rerank(client)["results"]
    top = _rerank(client, top_n=2, return_text=True)["results"]
    assert [r["index"] for r in top] == [r["index"] for r in full[:2]]
    assert all(r["document"] == {"text": DOCS[r["index"]]} for r in top)
    assert len(_rerank(client, top_n=50)["results"]) == len(DOCS), "top_n beyond the documents: all of them"


def test_tei_shape_with_texts_and_the_aliases(client: httpx.Client) -> None:
    full = _rerank(client)["results"]
    r = client.post("/rerank", json={"query": QUERY, "texts": DOCS, "return_text": True})
    assert r.status_code == 200, r.text
    tei = r.json()
    assert isinstance(tei, list) and [x["index"] for x in tei] == [x["index"] for x in full]
    assert all(set(x) == {"index", "score", "text"} and x["text"] == DOCS[x["index"]] for x in tei)
    for path in ("/reranking", "/v1/reranking"):
        assert [x["index"] for x in _rerank(client, path)["results"]] == [x["index"] for x in full]


def test_a_rerank_template_formats_the_pair_and_client_text_stays_text(client: httpx.Client) -> None:
    out = _rerank(client, model=TEMPLATED)
    want = sum(len(_tokens(client, TEMPLATE.replace("{query}", QUERY).replace("{document}", d), TEMPLATED,
                               parse_special=True)) for d in DOCS)
    assert out["usage"]["prompt_tokens"] == want, "the template's tokens, its markers parsed"
    forged = "[SEP]"  # the template's marker, sent as a document: tokenized as text, not as SEP
    r = client.post("/v1/rerank", json={"model": TEMPLATED, "query": QUERY, "documents": [forged]})
    assert r.status_code == 200, r.text
    spelled = (len(_tokens(client, "[CLS]", TEMPLATED, parse_special=True)) + len(_tokens(client, QUERY, TEMPLATED))
               + 1 + len(_tokens(client, forged, TEMPLATED)) + 1)
    assert r.json()["usage"]["prompt_tokens"] == spelled
    assert len(_tokens(client, forged, TEMPLATED)) > 1


def test_a_model_that_cannot_rank_is_a_400_naming_model(client: httpx.Client) -> None:
    r = client.post("/v1/rerank", json={"model": NOT_A_RERANKER, "query": QUERY, "documents": DOCS})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "model" and "rank pooling" in err["message"] and NOT_A_RERANKER in err["message"]


def test_a_reranker_has_no_embeddings(client: httpx.Client) -> None:
    r = client.post("/v1/embeddings", json={"model": RERANKER, "input": "the sea"})
    assert r.status_code == 400 and "/v1/rerank" in r.json()["error"]["message"], r.text


def _nested(depth: int) -> Any:
    v: Any = "x"
    for _ in range(depth):
        v = [v]
    return v


@pytest.mark.parametrize("body, param", [
    ({"query": 5, "documents": DOCS}, "query"),
    ({"documents": DOCS}, "query"),
    ({"query": "", "documents": DOCS}, "query"),
    ({"query": "a\x00b", "documents": DOCS}, "query"),
    ({"query": QUERY, "documents": ["ok", "a\x00b"]}, "documents"),
    ({"query": QUERY, "documents": "one string"}, "documents"),
    ({"query": QUERY, "documents": [1, 2]}, "documents"),
    ({"query": QUERY, "documents": []}, "documents"),
    ({"query": QUERY}, "documents"),
    ({"query": QUERY, "documents": ["x"] * 1001}, "documents"),
    ({"query": QUERY, "documents": _nested(60)}, "documents"),
    ({"query": QUERY, "documents": DOCS, "texts": DOCS}, "texts"),
    ({"query": QUERY, "documents": DOCS, "top_n": 0}, "top_n"),
    ({"query": QUERY, "documents": DOCS, "top_n": "2"}, "top_n"),
    ({"query": QUERY, "documents": DOCS, "top_n": True}, "top_n"),
    ({"query": QUERY, "documents": DOCS, "colour": "red"}, "colour"),
    ({"query": QUERY, "documents": ["sea " * 600]}, "documents"),
    ({"query": QUERY, "documents": ["the sea " * 20] * 60}, "documents"),
    ({"query": QUERY, "documents": ["x" * 200_000]}, "documents"),
    ({"query": QUERY, "documents": DOCS, "model": "no-such-model"}, "model"),
])
def test_bad_bodies_are_4xx_naming_the_field_and_ranking_goes_on(client: httpx.Client, body: dict[str, Any],
                                                                 param: str) -> None:
    r = client.post("/v1/rerank", content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    assert param in r.text, r.text[:500]
    assert len(_rerank(client, documents=["still ranking"])["results"]) == 1


def test_not_json_and_a_huge_body_are_4xx(client: httpx.Client) -> None:
    r = client.post("/v1/rerank", content=b"{\"query\": ", headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500, r.text
    huge = json.dumps({"query": QUERY, "documents": ["x" * 1000] * 200_000}).encode()
    r = client.post("/v1/rerank", content=huge, headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500, r.status_code
    assert _rerank(client)["results"]


def test_fixture_is_small(tmp_path: Path) -> None:
    path = Path(write_tiny_reranker(tmp_path))
    assert path.stat().st_size < 1 << 20
    assert path.stat().st_blocks * 512 < path.stat().st_size, "the zero weights are a hole"
