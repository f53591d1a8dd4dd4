"""The engine protocol: what a model's runner does, in token ids, and the values that cross to and from it.

``Engine`` is narrow on purpose: it takes prompt token ids, sampling parameters, images and cache keys, and returns
token ids and figures (vLLM's engine core takes token ids only). The vocabulary, the chat template, tokenizing,
detokenizing and stop strings belong to the API process (``service.text``: ``ServedModel`` puts a model's text
and its engine together for the routes). ``service.engine.llama`` is the llama.cpp implementation (continuous
batching over slots that keep their prompts' KV), ``service.runner.process`` the same behind a runner process, and
``service.testing.fake`` a small fake for the paths a CPU cannot reach.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Literal, Protocol

from sizing.plan import Plan

from ..errors import BadRequest


@dataclass(frozen=True)
class Allocation:
    """What llama.cpp reported allocating on one device (parsed from its log)."""

    device: str
    weights_bytes: int = 0
    kv_bytes: int = 0
    compute_bytes: int = 0
    output_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.compute_bytes + self.output_bytes


@dataclass(frozen=True)
class EngineLimits:
    """What a loaded engine holds, fixed until the next load (read by the API without asking the runner)."""

    n_ctx: int = 0
    """Tokens one request may hold: llama.cpp's per-sequence context."""
    slots: int = 0
    """Sequences decoded together: the most choices (``n``) one request may ask for."""
    n_vocab: int = 0
    """Token ids are 0 .. n_vocab - 1."""
    n_batch: int = 0
    kv_cells_allocated: int = 0
    """KV cache cells the context holds in all (every sequence's stream)."""
    embedding: tuple[int, int] = (0, 0)
    """(n_embd, tokens one embedding batch holds); (0, 0) when embeddings are off."""
    rerank: int = 0
    """Tokens one (query, document) input may hold; 0 when the model cannot rank."""
    images: bool = False
    """The model takes images (a vision projector was loaded with it: ``Engine.image_tokens``)."""


@dataclass(frozen=True)
class EngineGauges:
    """What a loaded engine holds and did now (a metrics scrape reads it)."""

    kv_cells_used: int = 0
    """KV cache cells holding tokens (running requests' and the prompts idle slots keep for reuse)."""
    running_sequences: int = 0
    prompt_tokens_evaluated: int = 0
    """Prompt tokens fed to the model since load (cached prefixes and forked choices are not evaluated)."""
    prompt_cache: dict[str, int] = field(default_factory=dict)
    """The prompt cache beyond the slots (``PromptCache.gauges``)."""


@dataclass(frozen=True)
class CachedPrompt:
    """Tokens whose KV an engine holds for reuse, and where (``Engine.cached_prompts``; the KV events a router
    routes by, ``service.residency.kv_events``)."""

    medium: Literal["GPU", "CPU", "DISK"]
    """``GPU``: a slot's KV in llama.cpp's cache (on the cards, or in host memory on a CPU-only load); ``CPU``: a
    saved state in host memory beyond the slots; ``DISK``: one on disk (``service.engine.prompt_cache``)."""
    scope: str
    """Whose requests may reuse it (``scope_of``: the API key's and ``cache_salt``'s)."""
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class LoadReport:
    """The result of a load: the real n_ctx and the allocations beside the plan."""

    n_ctx: int
    allocations: tuple[Allocation, ...]
    offloaded_layers: tuple[int, int] | None = None
    load_seconds: float = 0.0
    log_lines: tuple[str, ...] = ()
    draft_output_bytes: int = 0
    """What the output buffer grew by after creation for self-speculation's drafts (``LlamaEngine``'s
    ``_reserve_draft_rows``): host memory (the ``CPU`` row, where the output buffer is), not in ``allocations``,
    which are llama.cpp's log lines (it logs the growth only in debug builds)."""
    draft_allocations: tuple[Allocation, ...] = ()
    """The draft model's buffers (its weights and its context's: ``service.engine.draft``), from its own log lines;
    empty without a draft model."""
    projector_allocations: tuple[Allocation, ...] = ()
    """The vision projector's buffers (its weights and the compute buffer its warmup reserved: mtmd's log lines,
    ``service.engine.vision``); empty without one."""
    embedding_allocations: tuple[Allocation, ...] = ()
    """The embedding context's buffers (its output buffer at creation: it grows with the first full batch); its log
    lines are not in ``log_lines``, which are the generation context's (what the dry run confirms)."""
    mtp_allocations: tuple[Allocation, ...] = ()
    """The MTP context's buffers (``service.engine.mtp``: the NextN layer's KV, its compute and output buffers),
    from its own log lines; the NextN block's weights are in ``allocations`` (the model's buffers). Empty
    without MTP drafting."""
    mtp_rows_bytes: int = 0
    """What the main context's output buffer grows by for the hidden rows the MTP head reads (one F32 row of
    ``n_embd`` per batch token: ``llama_context::output_reserve``), host memory, not in ``allocations``."""
    limits: EngineLimits = field(default_factory=EngineLimits)
    """What the loaded engine holds (``Engine.limits`` from now on)."""


def scope_of(api_key: str | None, salt: str | None) -> str:
    """A request's cache scope (``GenerationParams.cache_scope``): its API key's hash (keys configured) and its
    ``cache_salt``; "" for neither. Hashed: the engine, its logs and its files never hold a key."""
    if not api_key and not salt:
        return ""
    h = hashlib.blake2b(digest_size=12)
    h.update((api_key or "").encode())
    h.update(b"\0")
    h.update((salt or "").encode())
    return h.hexdigest()


@dataclass(frozen=True)
class GenerationParams:
    """Sampling and stopping parameters of one request (OpenAI names)."""

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    min_p: float = 0.0
    """Drop tokens less likely than ``min_p`` times the most likely (0: keep all)."""
    stop: tuple[str, ...] = ()
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: int | None = None
    """None: no log probabilities; k >= 0: the sampled token's and the k most likely alternatives'."""
    grammar: str | None = None
    """A GBNF grammar constraining the output (llama.cpp's grammar sampler)."""
    json_schema: str | None = None
    """A JSON schema (JSON text) the output must satisfy; the engine turns it into a grammar."""
    json_object: bool = False
    """Constrain the output to a JSON object (OpenAI ``response_format: json_object``)."""
    ignore_eos: bool = False
    """Keep generating past end-of-generation tokens (llama.cpp server's ``ignore_eos``; benchmarks)."""
    cache_prompt: bool = True
    """Reuse a slot's cached KV for the prompt's common prefix (llama-server's ``cache_prompt``); False:
    evaluate the whole prompt (the engine's own setting can turn reuse off for every request)."""
    cache_scope: str = ""
    """Whose cached prompts this request may reuse (``service.engine.prompt_cache.scope_of``: its API key and
    ``cache_salt``); a slot or cache entry of another scope is never reused."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits before sampling (``llama_sampler_init_logit_bias``);
    ``-inf`` bans a token (OpenAI's -100)."""
    n: int = 1
    """Choices: parallel sequences sharing the prompt's KV (evaluated once, then ``llama_memory_seq_cp``);
    chunks carry their choice's ``index``. Choice i samples with ``seed + i`` when a seed is given."""
    top_k: int = 0
    """Keep the k most likely tokens (0: all; Anthropic's ``top_k``)."""
    lark: str | None = None
    """An llguidance Lark grammar (tool calls: ``service/chat/tools.py``); lazy parts wait for their trigger."""
    speculative: bool = True
    """Self-speculation where the engine has it on (``GGUF_SPECULATIVE``): drafts from the sequence's own tokens,
    kept where the model chooses them itself (the answer does not change); False: one token a step."""
    images: tuple["ImageInput", ...] = field(default=(), compare=False, repr=False)
    """The images whose tokens the prompt holds (a chat's image parts, ``service.engine.vision``): the engine
    prepares again any it no longer holds since the prompt was tokenized."""


def check_limits(params: GenerationParams, n_vocab: int, n_slots: int) -> None:
    """The checks of ``Engine.check`` that need only the model's vocabulary size and slot count: token ids of
    ``logit_bias`` within the vocabulary, no more choices than slots (``BadRequest`` naming the param)."""
    for tok, _ in params.logit_bias:
        if not 0 <= tok < n_vocab:
            raise BadRequest(f"logit_bias: token id {tok} is not in the vocabulary (0 .. {n_vocab - 1})",
                             param="logit_bias")
    if params.n > max(n_slots, 1):
        raise BadRequest(f"n: at most {n_slots} choices (the model decodes {n_slots} sequences at once, "
                         "GGUF_PARALLEL)", param="n")


@dataclass(frozen=True)
class ImageInput:
    """One decoded image of a request (``service.api.images``): RGB pixels, row by row, 3 bytes each, as mtmd's
    bitmaps take them. A message part ``{"type": "image", "image": ImageInput}`` carries it to the engine, which
    gives its tokens ids derived from ``digest`` (the same image, the same ids: prefix reuse across turns)."""

    width: int
    height: int
    rgb: bytes = field(repr=False)
    digest: str
    """blake2b of the size and the pixels (hex): what identifies the image."""

    @staticmethod
    def of(width: int, height: int, rgb: bytes) -> "ImageInput":
        if width <= 0 or height <= 0 or len(rgb) != width * height * 3:
            raise ValueError(f"{width}x{height} RGB needs {max(width * height * 3, 0)} bytes, not {len(rgb)}")
        h = hashlib.blake2b(digest_size=16)
        h.update(f"{width}x{height}:".encode())
        h.update(rgb)
        return ImageInput(width, height, rgb, h.hexdigest())


@dataclass(frozen=True)
class TokenScore:
    """A sampled token's log probability and its most likely alternatives, as ids (natural log): what the runner
    returns; ``service.text`` spells them (``TokenLogprob``)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Chunk:
    """One step of a generation: from the engine its token ids, to the routes their text (``service.text``'s
    ``TextStream`` turns the one into the other); when finished the reason and usage."""

    text: str = ""
    tokens: tuple[int, ...] = ()
    """The engine's: the tokens sampled (the final chunk of a choice has none); a text chunk's: the tokens its text
    came from (``TextStream``)."""
    scores: tuple[TokenScore, ...] = ()
    """The engine's: one per token when log probabilities were asked for."""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: tuple["TokenLogprob", ...] = ()
    """One entry per token this chunk's text came from, when requested."""
    role: str | None = None
    index: int = 0
    """The choice this chunk belongs to (``GenerationParams.n`` > 1)."""
    stop_sequence: str | None = field(default=None, compare=False)
    """Final chunk: the stop string that ended the generation (None: an end-of-generation token, the limit; set in
    the API process, which finds them)."""
    cached_tokens: int = field(default=0, compare=False)
    """Final chunk: prompt tokens whose KV came from the cache instead of being evaluated (OpenAI
    ``usage.prompt_tokens_details.cached_tokens``). Not part of a chunk's identity, as the timings."""
    prompt_seconds: float = field(default=0.0, compare=False)
    """Final chunk: time to evaluate the prompt's uncached tokens and sample the first token (0: not measured).
    Timings are not part of a chunk's identity: the same generation is equal however fast it ran."""
    decode_seconds: float = field(default=0.0, compare=False)
    """Final chunk: time to decode the tokens after the first (completion_tokens - 1 of them)."""
    drafted_tokens: int = field(default=0, compare=False)
    """Final chunk: tokens drafted by self-speculation and verified (``service.engine.speculation``)."""
    accepted_tokens: int = field(default=0, compare=False)
    """Final chunk: drafted tokens the model chose itself (each saved a decode step)."""


def one_step(a: Chunk, b: Chunk) -> bool:
    """Whether ``b`` may join ``a`` in one chunk: both nothing but sampled tokens of one choice (a drafted step's
    tokens cross the process, become text and go out as one event, as vLLM streams a step)."""
    return (a.index == b.index and bool(a.tokens) and bool(b.tokens) and bool(a.scores) == bool(b.scores)
            and _bare(a) and _bare(b))


def joined(chunks: list[Chunk]) -> Chunk:
    """Chunks that ``one_step`` joins, as one: their tokens and scores in order."""
    return Chunk(tokens=tuple(t for c in chunks for t in c.tokens), scores=tuple(s for c in chunks for s in c.scores),
                 index=chunks[0].index)


def _bare(c: Chunk) -> bool:
    """Nothing set but the tokens, their scores and the choice (field by field: ``dataclasses.replace`` and a
    comparison took 20 us, on the scheduler's thread, for every token of a drafted step)."""
    return (not c.text and c.finish_reason is None and not c.prompt_tokens and not c.completion_tokens
            and not c.logprobs and c.role is None and c.stop_sequence is None and not c.cached_tokens
            and not c.prompt_seconds and not c.decode_seconds and not c.drafted_tokens and not c.accepted_tokens)


@dataclass(frozen=True)
class EmbeddingResult:
    """Pooled, L2-normalised embeddings of a batch of inputs, and the tokens they took."""

    vectors: tuple[tuple[float, ...], ...]
    prompt_tokens: int


@dataclass(frozen=True)
class RerankResult:
    """The relevance score of each (query, document) input, in input order, and the tokens they took."""

    scores: tuple[float, ...]
    prompt_tokens: int


@dataclass(frozen=True)
class TokenLogprob:
    """The log probability of one sampled token and its most likely alternatives (natural log)."""

    token: str
    logprob: float
    bytes_: tuple[int, ...] = ()
    top: tuple[tuple[str, float], ...] = ()


_delivery = threading.local()


@contextlib.contextmanager
def direct_delivery(deliver: Callable[[Any], None]) -> Iterator[None]:
    """While a runner worker runs one job in this thread: an engine may hand that job's chunks (and a failure
    during generation) to ``deliver`` from its own thread instead of yielding them through the worker, whose
    generation iterator then only returns at the end. One thread wake-up a token instead of two
    (service/residency/fifo.py). A ``deliver`` with a ``flush`` attribute is flushed after each batch of chunks it was
    handed (``LlamaEngine._flush``). Engines that do not look (the fake) yield as usual."""
    before = getattr(_delivery, "fn", None)
    _delivery.fn = deliver
    try:
        yield
    finally:
        _delivery.fn = before


def current_delivery() -> Callable[[Any], None] | None:
    """The ``direct_delivery`` of the job this thread runs, if any."""
    return getattr(_delivery, "fn", None)


@dataclass
class Cancel:
    """Set by the HTTP layer when the client goes away; checked between tokens. ``on_set`` callbacks carry it
    further (to a runner process: ``service.runner.process``). ``end(index)`` ends one choice only (a stop string
    the API process found in it), ``on_end`` carries that."""

    event: threading.Event = field(default_factory=threading.Event)
    _callbacks: list[Callable[[], None]] = field(default_factory=list, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    ended: set[int] = field(default_factory=set)
    """Choices ended early by the API process (their stop string)."""
    _end_callbacks: list[Callable[[int], None]] = field(default_factory=list, repr=False)

    def end(self, index: int) -> None:
        """End choice ``index`` only (the others go on)."""
        with self._lock:
            if index in self.ended:
                return
            self.ended.add(index)
            callbacks = list(self._end_callbacks)
        for fn in callbacks:
            fn(index)

    def on_end(self, fn: Callable[[int], None]) -> None:
        """Call ``fn(index)`` for each choice ended from now on (and at once for those ended already)."""
        with self._lock:
            self._end_callbacks.append(fn)
            done = sorted(self.ended)
        for i in done:
            fn(i)

    def set(self) -> None:
        with self._lock:
            self.event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn()

    def on_set(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` (once) when the cancel is set; at once if it is set already."""
        with self._lock:
            if not self.event.is_set():
                self._callbacks.append(fn)
                return
        fn()

    @property
    def cancelled(self) -> bool:
        return self.event.is_set()


class Engine(Protocol):
    """A model's runner: loads a plan, then generates from token ids. ``generate`` may be called from as many
    threads at once as the engine has slots (the queue's workers); load and unload run alone. Twelve members: a new
    capability that the API process can do (text, templates, prompts) is not one of them."""

    @property
    def limits(self) -> EngineLimits:
        """What the loaded engine holds (zeros when nothing is loaded)."""
        ...

    def load(self, path: str, plan: Plan) -> LoadReport: ...

    def unload(self) -> None: ...

    def check(self, params: GenerationParams) -> None:
        """Raise ``BadRequest`` for parameters this engine cannot honour (before any byte is sent): a grammar that
        does not compile, ``logit_bias`` ids outside the vocabulary, more choices than slots."""
        ...

    def generate(self, tokens: list[int], params: GenerationParams, cancel: Cancel) -> Iterator[Chunk]:
        """A generation from prompt tokens (image runs included, ``image_tokens``): chunks of sampled token ids,
        then each choice's final chunk (finish reason, usage, timings). Stop strings are the API process's: it
        ends a choice with ``cancel.end``."""
        ...

    def image_tokens(self, image: ImageInput, param: str) -> tuple[list[int], list[int], list[int]]:
        """An image's tokens for a prompt (the projector's: before, the image's run of negative ids, after);
        ``BadRequest`` naming ``param`` for a model that takes no images or an image it cannot take."""
        ...

    def embed(self, inputs: list[list[int]], cancel: Cancel) -> EmbeddingResult:
        """Pooled, normalised embeddings of token lists (each within ``limits.embedding``)."""
        ...

    def rerank(self, inputs: list[list[int]], cancel: Cancel) -> "RerankResult":
        """The relevance score of each (query, document) input (each within ``limits.rerank``)."""
        ...

    def gauges(self) -> EngineGauges:
        """What it holds and did now."""
        ...

    def set_prompt_cache_budget(self, budget_bytes: int) -> None:
        """Another host-memory budget for the prompt cache beyond the slots."""
        ...

    def forget(self) -> None:
        """Drop every idle slot's cached prompt and the prompt cache beyond the slots."""
        ...

    def cached_prompts(self) -> tuple[CachedPrompt, ...]:
        """The prompts whose KV it holds now: each slot's, and the prompt cache's in memory and on disk."""
        ...
