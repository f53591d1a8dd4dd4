"""A small fake engine: the ``Engine`` protocol without llama.cpp, for the paths a CPU cannot reach, and its text.

Tokens are whitespace-separated words (plus one BOS: ``FakeText``, the API process's side); the output is a
deterministic function of the seed; each token takes ``token_delay_s``. A
fault can be armed at the engine boundary: ``oom_after_tokens`` makes the next
generation fail the way ``LlamaEngine`` reports a failed ``llama_decode``
(``InsufficientMemory`` naming the device, the prompt's tokens and
max_tokens), after releasing the request's KV cells.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import replace
from typing import Any, Iterator

from sizing.plan import Plan

from ..chat.format import ChatFormat
from ..engine.base import (Allocation, Cancel, Chunk, CachedPrompt, EmbeddingResult, EngineGauges, EngineLimits, GenerationParams,
                           ImageInput, LoadReport, RerankResult, TokenScore, check_limits)
from ..errors import BadRequest, InsufficientMemory, NotReady
from ..text.tasks import FimTokens

FAKE_N_VOCAB = 1000
FAKE_N_EMBD = 8

WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta")
WORD_ID = 10
"""The token id of ``WORDS[0]`` (the others follow)."""
BYTE_ID = 700
"""The token id of byte 0 (byte ``b`` is ``BYTE_ID + b``): what a test scripts an answer of any text with."""


def byte_tokens(text: str) -> tuple[int, ...]:
    """``text`` as the fake's byte tokens."""
    return tuple(BYTE_ID + b for b in text.encode())


class FakeEngine:
    """Deterministic, configurable, thread-compatible (the runner still serialises calls)."""

    def __init__(self, *, token_delay_s: float = 0.0, device: str = "CUDA0", load_delay_s: float = 0.0) -> None:
        self.token_delay_s = token_delay_s
        self.load_delay_s = load_delay_s
        self.device = device
        self.embed_delay_s = 0.0
        """Seconds each embedding input takes (a slow embedding context, for the time bound's tests)."""
        self.oom_after_tokens: int | None = None
        """Armed fault: the next generation fails with out-of-memory after this many tokens."""
        self.fail_load: Exception | None = None
        self._n_ctx = 0
        self._cells = 0
        self.running = threading.Event()
        self.generations = 0
        self.cancelled = 0
        self.loads = 0
        self.unloads = 0
        self.report: LoadReport | None = None
        """The last load's report (its "allocations" are the plan's figures), None once unloaded."""
        self.path: str | None = None
        self._evaluated = 0
        self.prompt_cache_bytes = 0
        """What the fake says its prompt cache beyond the slots holds (set by tests)."""
        self.prompt_cache_budgets: list[int] = []
        """Every ``set_prompt_cache_budget`` asked, in order."""
        self.ranks = False
        """Set by tests: the fake is a reranker (its score: the share of the document's words in the query)."""
        self.fim = FimTokens()
        """Set by tests: the fake's FIM token ids (none by default: /infill is refused)."""

    @property
    def prompt_cache_gauges(self) -> dict[str, int]:
        return {"bytes": self.prompt_cache_bytes, "entries": 1 if self.prompt_cache_bytes else 0}

    def set_prompt_cache_budget(self, budget_bytes: int) -> None:
        self.prompt_cache_budgets.append(budget_bytes)
        self.prompt_cache_bytes = min(self.prompt_cache_bytes, budget_bytes)

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    @property
    def kv_cells_used(self) -> int:
        return self._cells

    @property
    def kv_cells_allocated(self) -> int:
        return self._n_ctx

    @property
    def running_sequences(self) -> int:
        return 1 if self.running.is_set() else 0

    @property
    def n_vocab(self) -> int:
        return FAKE_N_VOCAB

    @property
    def slots(self) -> int:
        return 4

    @property
    def prompt_tokens_evaluated(self) -> int:
        return self._evaluated

    @property
    def limits(self) -> EngineLimits:
        if not self._n_ctx:
            return EngineLimits()
        return EngineLimits(n_ctx=self._n_ctx, slots=self.slots, n_vocab=FAKE_N_VOCAB, n_batch=512,
                            kv_cells_allocated=self._n_ctx, embedding=(FAKE_N_EMBD, 512),
                            rerank=512 if self.ranks else 0)

    def gauges(self) -> EngineGauges:
        return EngineGauges(kv_cells_used=self._cells, running_sequences=1 if self.running.is_set() else 0,
                            prompt_tokens_evaluated=self._evaluated, prompt_cache=self.prompt_cache_gauges)

    def text_for(self, path: str, limits: EngineLimits) -> "FakeText":
        """This fake's text (``ServedModel``'s: a word a token), in place of a vocab-only load of the file."""
        return FakeText(self)

    def embed(self, inputs: list[list[int]], cancel: Cancel) -> EmbeddingResult:
        self._require()
        out = []
        for i, toks in enumerate(inputs):
            if not toks or len(toks) > 512:
                raise BadRequest(f"input[{i}] has {len(toks)} tokens (1 .. 512)", param="input")
            if self.embed_delay_s:  # each input takes this long, and a cancel ends the request between them
                time.sleep(self.embed_delay_s)
                if cancel.cancelled:
                    raise NotReady("the client went away")
            rng = random.Random(sum(toks))
            v = [rng.uniform(-1, 1) for _ in range(FAKE_N_EMBD)]
            norm = sum(x * x for x in v) ** 0.5
            out.append(tuple(x / norm for x in v))
        return EmbeddingResult(vectors=tuple(out), prompt_tokens=sum(len(t) for t in inputs))

    def rerank(self, inputs: list[list[int]], cancel: Cancel) -> RerankResult:
        self._require()
        if not self.ranks:
            raise BadRequest("this model cannot rerank", param="model")
        scores = tuple(len(set(toks[1:])) / len(toks) for toks in inputs)
        return RerankResult(scores=scores, prompt_tokens=sum(len(t) for t in inputs))

    def image_tokens(self, image: ImageInput, param: str) -> tuple[list[int], list[int], list[int]]:
        raise BadRequest(f"{param}: this model takes no images", param=param)

    def forget(self) -> None:
        self.prompt_cache_bytes = 0

    def cached_prompts(self) -> tuple[CachedPrompt, ...]:
        return ()  # it keeps no KV

    def load(self, path: str, plan: Plan) -> LoadReport:
        if self.load_delay_s:
            time.sleep(self.load_delay_s)
        if self.fail_load is not None:
            exc, self.fail_load = self.fail_load, None
            raise exc
        self._n_ctx = plan.cfg.n_ctx
        est = plan.estimate
        allocs = tuple(
            Allocation(d.device, d.weights_bytes, d.kv_bytes, d.compute_bytes, 0) for d in est.devices
        ) if est is not None else ()
        self.loads += 1
        self.path = path
        self.report = LoadReport(n_ctx=self._n_ctx, allocations=allocs, load_seconds=self.load_delay_s)
        return self.report

    def unload(self) -> None:
        if self._n_ctx:
            self.unloads += 1
        self._n_ctx = 0
        self._cells = 0
        self.report = None
        self.path = None

    def _require(self) -> None:
        if not self._n_ctx:
            raise NotReady("no model is loaded")

    def check(self, params: GenerationParams) -> None:
        if params.grammar is not None and not params.grammar.strip():
            raise BadRequest("empty grammar", param="response_format")
        check_limits(params, FAKE_N_VOCAB, self.slots)

    def generate(self, tokens: list[int], params: GenerationParams, cancel: Cancel) -> Iterator[Chunk]:
        return self._generate(len(tokens), params, cancel)

    def _generate(self, n_prompt: int, params: GenerationParams, cancel: Cancel) -> Iterator[Chunk]:
        """One choice after another (``n``): the prompt counted once, each choice seeded ``seed + i``."""
        self._evaluated += n_prompt
        for i in range(max(1, params.n)):
            seed = None if params.seed is None else params.seed + i
            for c in self._one(n_prompt, params, cancel, seed, i):
                yield c if not i else replace(c, index=i)

    def _one(self, n_prompt: int, params: GenerationParams, cancel: Cancel, seed: int | None,
             index: int) -> Iterator[Chunk]:
        self.generations += 1
        rng = random.Random(seed if seed is not None else random.randrange(1 << 30))
        max_new = self._n_ctx - n_prompt if params.max_tokens is None else min(params.max_tokens, self._n_ctx - n_prompt)
        oom, self.oom_after_tokens = self.oom_after_tokens, None
        self._cells = n_prompt
        self.running.set()
        n_out = 0
        finish = "length"
        try:
            while n_out < max_new:
                if cancel.cancelled or index in cancel.ended:
                    self.cancelled += 1
                    finish = "cancelled"
                    break
                if oom is not None and n_out >= oom:
                    self._cells = 0  # the failed request's memory is released
                    raise InsufficientMemory(
                        f"out of memory on {self.device} during generation (llama_decode returned -2) with "
                        f"{n_prompt} prompt tokens and max_tokens {params.max_tokens}",
                        device=self.device, prompt_tokens=n_prompt, max_tokens=params.max_tokens,
                    )
                if self.token_delay_s:
                    time.sleep(self.token_delay_s)
                tok = WORD_ID + WORDS.index(rng.choice(WORDS))
                n_out += 1
                self._cells += 1
                scores = (TokenScore(tok, -1.0, ((tok, -1.0),) * (params.logprobs or 0)),) \
                    if params.logprobs is not None else ()
                yield Chunk(tokens=(tok,), scores=scores)
        finally:
            self.running.clear()
        yield Chunk(finish_reason=finish, prompt_tokens=n_prompt, completion_tokens=n_out)


class FakeText:
    """The fake's text (``service.text.model.ModelText``): a word a token; what it generates is ``WORDS``."""

    def __init__(self, engine: FakeEngine) -> None:
        self._engine = engine

    def close(self) -> None:
        pass

    def chat_format(self) -> ChatFormat:
        return ChatFormat()

    def tokenize(self, text: str) -> list[int]:
        return [1] + [sum(w.encode()) % FAKE_N_VOCAB for w in text.split()]

    def token_bytes(self, token: int) -> bytes:
        if WORD_ID <= token < WORD_ID + len(WORDS):
            return (WORDS[token - WORD_ID] + " ").encode()
        if BYTE_ID <= token < BYTE_ID + 256:
            return bytes((token - BYTE_ID,))
        return f"<{token}>".encode()

    def count_tokens(self, text: str) -> int:
        return 1 + len(text.split())

    def _chat_text(self, messages: list[dict[str, Any]]) -> str:
        return " ".join(f"{m.get('role')}: {m.get('content') or ''}" for m in messages)

    def count_chat_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> int:
        return self.count_tokens(self._chat_text(messages))

    def max_token_chars(self) -> int:
        return 0  # a word is a token: no bound

    def prompt_tokens(self, prompt: str) -> list[int]:
        return self.tokenize(prompt)

    def chat_prompt_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        return self.tokenize(self._chat_text(messages))

    def tokenize_text(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        toks = self.tokenize(text)
        return toks if add_special else toks[1:]

    def token_pieces(self, tokens: list[int]) -> list[bytes]:
        for i, t in enumerate(tokens):
            if not 0 <= t < FAKE_N_VOCAB:
                raise BadRequest(f"tokens[{i}]: {t} is not a token of this model (0 .. {FAKE_N_VOCAB - 1})",
                                 param="tokens")
        return [f"<{t}>".encode() for t in tokens]

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        return self._chat_text(messages)

    def fim_tokens(self) -> FimTokens:
        return self._engine.fim

    def rerank_tokens(self, query: str, documents: list[str], max_tokens: int) -> list[list[int]]:
        out = [self.tokenize(query) + self.tokenize(d)[1:] for d in documents]
        if sum(map(len, out)) > max_tokens:
            raise BadRequest(f"documents: more than {max_tokens} tokens in all", param="documents")
        return out

    def infill_tokens(self, prefix: str, suffix: str, extra: list[tuple[str, str]], prompt: str,
                      n_predict: int) -> list[int]:
        f = self._engine.fim
        if f.missing():
            raise BadRequest("this model cannot infill: " + ", ".join(f.missing()), param="model")
        return [f.pre, *self.tokenize(prefix)[1:], *self.tokenize(prompt)[1:], f.suf, *self.tokenize(suffix)[1:], f.mid]
