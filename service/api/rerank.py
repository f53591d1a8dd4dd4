"""llama-server's reranking: ``POST /v1/rerank`` (and its aliases ``/rerank``, ``/reranking``, ``/v1/reranking``).

The shapes are llama-server's (tools/server/server-context.cpp ``handle_rerank``, server-common.cpp
``format_response_rerank``, llama.cpp vendored by llama-cpp-python 0.3.36): a body with ``documents`` is Jina's
(and Cohere's) shape, answered ``{model, object: "list", usage, results: [{index, relevance_score}]}``; a body with
``texts`` is Hugging Face TEI's, answered as a bare list of ``{index, score}``. Either way the results are sorted
by score, highest first, and cut to ``top_n``; ``return_text`` adds each document's text (TEI's ``text``; in
Jina's shape ``document: {text}``, as Jina and Cohere answer ``return_documents``, which llama-server leaves out).

Only a model whose GGUF declares rank pooling ranks (``{arch}.pooling_type`` 4: its embedding context is made
with ``LLAMA_POOLING_TYPE_RANK``); any other gets a 400 naming ``model``. Each (query, document) pair is formatted
as llama-server formats it (``service.text.tasks``), tokenized in the admission pool and scored through
the model's queue like an embedding batch (``LlamaEngine.rerank``), within the same bounds: at most
``MAX_DOCUMENTS`` documents, ``GGUF_EMBEDDING_MAX_REQUEST_TOKENS`` tokens in all, each pair within one embedding
batch (``GGUF_EMBEDDING_TOKENS``).
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, Iterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ..engine.base import Cancel, Chunk
from ..errors import BadRequest, ContextLengthExceeded, EngineFailure, ServiceError
from ..residency import Lease
from ..residency.fifo import chunks
from .admission import LARGE_TEXT_CHARS
from .deps import ManagerDep, MetricsDep
from .errors import code_of
from .generation import resolve_model, watch_disconnect
from .metrics import Metrics
from .validation import KeepAlive

router = APIRouter()

MAX_DOCUMENTS = 1000
"""Most documents of one request (Cohere's limit); the token bound (GGUF_EMBEDDING_MAX_REQUEST_TOKENS) applies too."""


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(None, max_length=256)
    query: str = Field(description="The text the documents are ranked against (not empty).")
    documents: list[str] | None = Field(None, max_length=MAX_DOCUMENTS, description="The texts to rank (Jina's and "
                                        "Cohere's shape).")
    texts: list[str] | None = Field(None, max_length=MAX_DOCUMENTS, description="The texts to rank, in Hugging Face "
                                    "TEI's shape (the answer is then TEI's: a list of {index, score}).")
    top_n: int | None = Field(None, ge=1, description="Answer only the n best (default: every document).")
    return_text: bool = Field(False, description="Each result carries its document's text.")
    keep_alive: KeepAlive = None

    def checked(self) -> list[str]:
        """The documents, after the checks a body can fail without the model (400 naming the field)."""
        if self.documents is not None and self.texts is not None:
            raise BadRequest("documents and texts are two names for one list: send one", param="texts")
        docs = self.documents if self.documents is not None else self.texts
        param = "texts" if self.texts is not None else "documents"
        if not docs:
            raise BadRequest(f"{param} must be a non-empty string array", param=param)
        if not self.query:
            raise BadRequest("query: an empty query ranks nothing", param="query")
        if "\x00" in self.query:
            raise BadRequest("query: contains a NUL character", param="query")
        for i, d in enumerate(docs):
            if "\x00" in d:
                raise BadRequest(f"{param}[{i}]: contains a NUL character", param=param)
        return docs


@router.post("/v1/rerank")
@router.post("/rerank", include_in_schema=False)
@router.post("/reranking", include_in_schema=False)
@router.post("/v1/reranking", include_in_schema=False)
async def rerank(request: Request, body: RerankRequest, manager: ManagerDep, metrics: MetricsDep) -> Any:
    """The documents ranked by relevance to the query, highest first (llama-server's /v1/rerank)."""
    documents = body.checked()
    max_tokens = manager.settings.embedding_max_request_tokens
    lease = await resolve_model(manager, body, request)
    try:
        scores, n_tokens = await _score(request, lease, metrics, body.query, documents, max_tokens)
        if scores is None:
            return JSONResponse({}, status_code=499)  # the client left before its turn
    finally:
        if not lease.queued:
            lease.release()
    order = sorted(range(len(scores)), key=lambda i: -scores[i])  # stable: ties keep the documents' order
    if body.top_n is not None:
        order = order[:body.top_n]
    if body.texts is not None:  # TEI's shape
        return [{"index": i, "score": scores[i], **({"text": documents[i]} if body.return_text else {})} for i in order]
    results = [{"index": i, "relevance_score": scores[i],
                **({"document": {"text": documents[i]}} if body.return_text else {})} for i in order]
    return {"model": lease.name, "object": "list", "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
            "results": results}


def _cannot_rank(lease: Lease) -> BadRequest:
    if not lease.engine.embedding_limits()[1]:
        why = "its embedding context is off (GGUF_EMBEDDINGS: off, or auto with layers on a GPU)"
    else:
        why = ("its GGUF declares no rank pooling ({arch}.pooling_type 4, LLAMA_POOLING_TYPE_RANK: a reranker's "
               "classification head)")
    return BadRequest(f"model '{lease.name}' cannot rerank: {why}", param="model")


async def _score(request: Request, lease: Lease, metrics: Metrics, query: str, documents: list[str],
                 max_tokens: int) -> tuple[list[float] | None, int]:
    """Each document's score (None: the client left first) and the tokens evaluated; refusals raised before any
    batch runs."""
    name, engine = lease.name, lease.engine
    limit = engine.rerank_limit()
    if not limit:
        raise _cannot_rank(lease)
    admission = request.app.state.admission
    chars = len(query) * len(documents) + sum(map(len, documents))
    cancel = Cancel()
    box: dict[str, Any] = {}

    def work(tokens: list[list[int]]) -> Iterator[Chunk]:
        box["result"] = engine.rerank(tokens, cancel)
        return iter(())

    watcher = asyncio.ensure_future(watch_disconnect(request, cancel))
    try:
        if chars >= LARGE_TEXT_CHARS:
            # Refused unread where no tokenization can fit (each token spells at most max_token_chars characters),
            # as long prompts and embedding inputs are (service/api/admission.py).
            per_token = int(await admission.run(name, 0, engine.max_token_chars))
            if per_token > 0 and chars > max_tokens * per_token:
                raise BadRequest(f"documents: more than {max_tokens} tokens with the query in all; one request "
                                 f"ranks at most {max_tokens} (GGUF_EMBEDDING_MAX_REQUEST_TOKENS)", param="documents")
            for i, d in enumerate(documents):
                if per_token > 0 and len(query) + len(d) > limit * per_token:
                    raise ContextLengthExceeded(
                        f"documents[{i}] and the query hold {len(query) + len(d)} characters; a token of this model "
                        f"spells at most {per_token}, so the pair takes more than the {limit} tokens one holds "
                        "(GGUF_EMBEDDING_TOKENS)", param="documents", n_ctx=limit)
        tokens: list[list[int]] = await admission.run(
            name, chars, lambda: engine.rerank_tokens(query, documents, max_tokens))
        if cancel.cancelled:
            return None, 0
        job = lease.runner.submit(lambda: work(tokens), cancel, on_done=lease.release)
        lease.queued = True
        async for _ in chunks(job):
            pass
    except ServiceError as exc:
        metrics.error(code_of(exc, request.url.path))
        raise
    finally:
        watcher.cancel()
    result = box.get("result")
    if result is None:
        return None, 0
    scores = list(result.scores)
    if not all(math.isfinite(s) for s in scores):
        raise EngineFailure(f"model '{name}' gave a score that is not a finite number")
    return scores, int(result.prompt_tokens)


__all__ = ["MAX_DOCUMENTS", "RerankRequest", "router"]
