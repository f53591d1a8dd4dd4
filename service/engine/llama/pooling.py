"""Embeddings and rerank scores: pooled values of the embedding context, which shares the model's weights.

Inputs are packed into batches of at most the embedding context's ``n_batch`` tokens and sequences, one sequence
each; the cache is cleared before every batch, so nothing is kept between them. Pooling is per ubatch in
llama.cpp (``build_pooling``; cls and last take the lowest and highest position of a sequence in the ubatch,
``llm_graph_input_cls::set_input``), so a batch is decoded whole, or, for a causal model that declares no pooling,
in pieces of ``EMBEDDING_PIECE_TOKENS`` whose pooled values are combined: the token-weighted mean of the pieces'
means, cls from the piece holding position 0, last from the piece holding the last token. Every decode runs on
the scheduler thread when generations let it (``Scheduler``'s embedding turn, issue 29); the pieces are fixed by
the inputs alone, so the vectors are the same whatever ran beside them.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

from ...errors import BadRequest, ContextLengthExceeded, EngineFailure, NotReady
from ..base import Cancel, EmbeddingResult, RerankResult
from .loading import POOLING, RANK_POOLING, Embedding

EMBEDDING_PIECE_TOKENS = 32
"""Tokens of one embedding decode of a causal model: what a generation that arrives may wait for. gemma-3-270m on
2 cores: 0.2-0.25 s (a 480-token batch took 2.9-3.4 s, half of it one unabortable node, the logits of every token
through the 262,144-token vocabulary; measured, bench/embedding_fairness_bench.py). Fixed, so that a request's
vectors do not depend on what ran beside it."""

OnScheduler = Callable[..., Any]
"""``Scheduler.call``: a function run on the scheduler thread (``yields``, ``abort_ctx``: ``state.Call``)."""


class Pooler:
    """One load's embedding context, evaluated on the scheduler thread."""

    def __init__(self, embedding: Embedding | None, *, n_vocab: int, n_embd: int, n_cls_out: int,
                 on_scheduler: OnScheduler) -> None:
        self._emb = embedding
        self._n_vocab, self._n_embd, self._n_cls_out = n_vocab, n_embd, n_cls_out
        self._on_scheduler = on_scheduler
        self._lock = threading.Lock()
        self.aborted = 0
        """Embedding decodes aborted for a generation since load (each run again)."""

    @property
    def pieces(self) -> bool:
        """Batches are evaluated in pieces (a causal model that declares no pooling)."""
        return self._emb is not None and self._emb.pieces

    @pieces.setter
    def pieces(self, on: bool) -> None:  # tests: a whole abortable batch on a model that would be pieced
        if self._emb is not None:
            self._emb.pieces = on

    def limits(self) -> tuple[int, int]:
        """(n_embd, tokens one embedding batch holds); (0, 0) when embeddings are off."""
        return (self._n_embd, self._emb.tokens) if self._emb is not None else (0, 0)

    def rerank_limit(self) -> int:
        """Tokens one (query, document) input may hold: the embedding batch of a ranking model; 0: it cannot rank."""
        return self._emb.tokens if self._emb is not None and self._emb.pooling == RANK_POOLING else 0

    def embed(self, inputs: list[list[int]], cancel: Cancel) -> EmbeddingResult:
        """Pooled embeddings, each scaled to unit L2 norm (as OpenAI's are). A ranking model (rank pooling) has
        scores, not embeddings: 400."""
        import numpy as np

        if self._emb is not None and self._emb.pooling == RANK_POOLING:
            raise BadRequest("this model is a reranker (its GGUF declares rank pooling): its outputs are relevance "
                             "scores, not embeddings; use /v1/rerank", param="input")
        out: list[tuple[float, ...]] = []
        for v in self._pool(inputs, cancel, "input"):
            norm = float(np.linalg.norm(v))
            out.append(tuple(float(x) for x in (v / norm if norm > 0 else v)))
        return EmbeddingResult(vectors=tuple(out), prompt_tokens=sum(len(t) for t in inputs))

    def rerank(self, inputs: list[list[int]], cancel: Cancel) -> RerankResult:
        """The relevance score of each (query, document) input, as llama-server's ``send_rerank`` reads it: the first
        of the ``n_cls_out`` values rank pooling gives the sequence (``llama_get_embeddings_seq``); ``BadRequest``
        naming ``model`` for a model that does not rank."""
        if self._emb is None or self._emb.pooling != RANK_POOLING:
            raise BadRequest(self._no_rank_reason(), param="model")
        scores = tuple(float(v[0]) for v in self._pool(inputs, cancel, "documents"))
        return RerankResult(scores=scores, prompt_tokens=sum(len(t) for t in inputs))

    def _no_rank_reason(self) -> str:
        if self._emb is None:
            return ("this model cannot rerank: its embedding context is off (GGUF_EMBEDDINGS: off, or auto with "
                    "layers on a GPU)")
        return ("this model cannot rerank: its GGUF declares no rank pooling ({arch}.pooling_type 4, a reranker's "
                "classification head)")

    def _check(self, inputs: list[list[int]], param: str, limit: int) -> None:
        for i, toks in enumerate(inputs):
            if not toks:
                raise BadRequest(f"{param}[{i}] is empty", param=param)
            if len(toks) > limit:
                raise ContextLengthExceeded(
                    f"{param}[{i}] has {len(toks)} tokens; an embedding holds at most {limit} (GGUF_EMBEDDING_TOKENS)",
                    param=param, prompt_tokens=len(toks), n_ctx=limit)
            if any(not 0 <= t < self._n_vocab for t in toks):
                raise BadRequest(f"{param}[{i}]: a token id is not in the vocabulary (0 .. {self._n_vocab - 1})",
                                 param=param)

    def _pool(self, inputs: list[list[int]], cancel: Cancel, param: str) -> list[Any]:
        """Each input's pooled values as llama.cpp gives them (float64 arrays: n_embd, or n_cls_out with rank
        pooling); ``param`` names the request's field in errors."""
        import llama_cpp
        import numpy as np

        with self._lock:
            emb = self._emb
            if emb is None:
                raise BadRequest("embeddings are off for this model (GGUF_EMBEDDINGS: off, or auto with layers on a "
                                 "GPU)", param=param)
            self._check(inputs, param, emb.tokens)
            pooling = emb.pooling
            rank = pooling == RANK_POOLING
            width = self._n_cls_out if rank else self._n_embd
            mem = llama_cpp.llama_get_memory(emb.ctx.ctx)
            batch = emb.batch
            piece = min(EMBEDDING_PIECE_TOKENS, emb.tokens) if emb.pieces else emb.tokens
            mean = pooling == POOLING["mean"]

            def decode(clear: bool) -> int:
                # On the scheduler thread. A batch starts from an empty cache; a later piece adds to its cells. An
                # aborted decode removes the cells of its ubatch (``llama_context::decode``: ``seq_rm`` from each
                # sequence's lowest position in it) and extracts nothing; a whole batch, run again, clears the
                # cache first: the same computation on the same cells, the same vectors.
                if clear:
                    llama_cpp.llama_memory_clear(mem, True)
                return int(llama_cpp.llama_decode(emb.ctx.ctx, batch))

            out: list[Any] = []
            i = 0
            while i < len(inputs):
                group: list[list[int]] = []
                used = 0
                while i + len(group) < len(inputs) and len(group) < emb.seqs \
                        and used + len(inputs[i + len(group)]) <= emb.tokens:
                    used += len(inputs[i + len(group)])
                    group.append(inputs[i + len(group)])
                flat = [(seq, pos, tok) for seq, toks in enumerate(group) for pos, tok in enumerate(toks)]
                parts: list[list[tuple[Any, int]]] = [[] for _ in group]  # per sequence: (a piece's pooled value, its tokens there)
                for start in range(0, len(flat), piece):
                    if cancel.cancelled:
                        raise NotReady("the client went away")
                    chunk = flat[start:start + piece]
                    held: dict[int, list[int]] = {}  # sequence -> [tokens, lowest position, highest position] here
                    for n, (seq, pos, tok) in enumerate(chunk):
                        batch.token[n], batch.pos[n], batch.n_seq_id[n], batch.logits[n] = tok, pos, 1, 1
                        batch.seq_id[n][0] = seq
                        h = held.setdefault(seq, [0, pos, pos])
                        h[0] += 1
                        h[2] = pos
                    batch.n_tokens = len(chunk)
                    whole = len(chunk) == len(flat)  # a batch in one decode: abortable (see ``decode``)
                    ret = self._on_scheduler(functools.partial(decode, start == 0), yields=True,
                                             abort_ctx=emb.ctx.ctx if whole else None)
                    if ret != 0:
                        raise EngineFailure(f"llama.cpp failed to evaluate an embedding batch (llama_decode returned {ret})")
                    for seq, (count, lo, hi) in held.items():
                        if not (mean or rank or (pooling == POOLING["cls"] and lo == 0)
                                or (pooling == POOLING["last"] and hi == len(group[seq]) - 1)):
                            continue
                        ptr = llama_cpp.llama_get_embeddings_seq(emb.ctx.ctx, seq)
                        if not ptr:
                            raise EngineFailure("llama.cpp returned no pooled embedding")
                        parts[seq].append((np.ctypeslib.as_array(ptr, shape=(width,)).astype(np.float64), count))
                for got in parts:
                    # One piece: its value as llama.cpp pooled it (cls, last, rank have one); else the weighted mean.
                    out.append(got[0][0] if len(got) == 1 else sum(p * c for p, c in got) / sum(c for _, c in got))
                i += len(group)
            return out

    def close(self) -> None:
        """After the unload: nothing is evaluated any more (a running batch finished first: the lock)."""
        with self._lock:
            self._emb = None
