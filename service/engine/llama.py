"""The llama.cpp engine: the only module that imports ``llama_cpp`` for serving.

One engine, built as llama-server serves (tools/server/server-context.cpp of the
llama.cpp that llama-cpp-python 0.3.36 vendors), through llama-cpp-python's
low-level API:

- **Slots.** One context with ``n_seq_max`` = slots; slot *i* is sequence *i*.
  A slot keeps its tokens and their KV cells after a request ends. One slot is
  just ``parallel = 1``. With a non-unified cache every sequence has its own
  stream of ``n_ctx_seq = PAD(n_ctx / n_seq_max, 256)`` cells (src/llama-context.cpp);
  unified (the default, as llama-server's), all sequences share ``n_ctx`` cells,
  so one request may use the whole context.
- **Prefix reuse** (llama-server's ``cache_prompt``; the policy is ``service.engine.slots``,
  pure). A new request goes to the
  idle slot whose cached tokens share the longest prefix with its prompt, when
  that prefix is more than ``slot_prompt_similarity`` of the prompt
  (``get_available_slot``), else to the least recently used slot. Only the rest
  of the prompt is evaluated: the slot's cells past the common prefix are
  dropped (``llama_memory_seq_rm``). With a unified cache a longer common prefix
  held by another slot (busy or not) is shared instead of evaluated again
  (``llama_memory_seq_cp``: the cells gain a sequence id, no copy). A
  sliding-window model's SWA cache drops cells beyond the window
  (src/llama-kv-cache.cpp ``find_slot``), so a prefix is reused only where the
  SWA cells it needs are still there (``llama_memory_seq_pos_min``, as
  ``update_slots`` checks; llama-server's SWA checkpoints are not built here).
  A unified cache that runs out of cells clears idle slots, least recently used
  first, before it fails a request (``try_clear_idle_slots``).
- **Prompts beyond the slots** (issue 24; ``service.engine.prompt_cache``). A slot given to another
  conversation first copies its sequence's state into host memory (``llama_state_seq_get_data``), within a
  planned budget, optionally on disk; a later prompt that extends it is restored into its slot
  (``llama_state_seq_set_data``), as llama-server's ``--cache-ram``. Slots and entries carry a scope (API key,
  ``cache_salt``): another scope's prefix is never reused.
- **One compute thread.** Every ``llama_decode`` of an engine, its embedding
  batches too, runs on its scheduler thread, and when another engine is loaded
  in the process that thread ends once its engine has been idle for
  ``SCHEDULER_IDLE_EXIT_S`` (the next request starts another). llama.cpp's CPU
  backend computes a graph on an OpenMP team that belongs to the calling thread
  and lives as long as it; libgomp spins only briefly at its barriers once it
  manages more threads than the machine has CPUs, so one idle engine's team
  (another model, or a runner thread that evaluated embeddings) slowed
  generation on 2 cores from 62-65 to 41-50 tokens/s; when that thread ended,
  the speed came back (measured, gemma-3-270m; ``bench/openmp_bench.py``).
- **Embeddings yield to generation** (issue 29). /v1/embeddings runs on a second context (the embedding
  context, same weights), its decodes on the same scheduler thread, which runs one only while no generation is
  active or waiting, or once it has waited ``EMBEDDING_MAX_DEFER_S`` (then between two steps). A causal model
  (``llama_get_causal_attn``) that declares no pooling is evaluated in pieces of ``EMBEDDING_PIECE_TOKENS``
  (the cache carries a sequence from one piece to the next; the pooled values are combined), so a generation
  waits for one piece at most; a whole batch (non-causal attention needs a sequence in one ubatch) is aborted
  when a generation arrives (the abort callback) and run again from a cleared cache.
- **Continuous batching.** A scheduler thread owns the context. Each step puts one
  token for every generating sequence into the batch, then fills the rest of
  ``n_batch`` with prompt tokens (oldest request first), in increasing sequence id.
- **Sampling** (``service.engine.sampling``). Each request has its own sampler chain, built as
  ``Llama._init_sampler`` builds it (penalties, grammar, then greedy at
  temperature 0, or top_k/typical/top_p/min_p/temp/dist(seed)); the argmax at temperature 0 and plain
  temperature sampling are computed with numpy on the logits row instead, token for token the chain's.
- **Text.** Incremental UTF-8 decoding, stop strings (``service.engine.text``) held back until they cannot
  start a stop string, log probabilities, EOG handling (``ignore_eos``), and a
  final chunk with the usage, the prompt tokens taken from the cache, and the
  measured prompt and decode seconds.
- **Failures.** ``llama_decode`` returning 1 (no KV slot) or -2 (allocation
  failed) fails one request with ``InsufficientMemory`` (device, prompt tokens,
  max_tokens) while the others go on; a long prompt's evaluation stops when its
  client leaves (the abort callback, ``llama_decode`` = 2); a failed load is
  ``InsufficientMemory`` or ``EngineFailure``.

``generate`` may be called, and iterated, from many threads at once: each call
has its own queue of ``Chunk`` values. llama.cpp's load log is tapped and parsed
by ``service.engine.loglines``. In the service this engine runs in a runner
process of its own (``service.engine.process``).
"""

from __future__ import annotations

import codecs
import collections
import ctypes
import dataclasses
import functools
import logging
import os
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from sizing.memory import mtp_config, mtp_supported
from sizing.plan import Plan
from sizing.units import MIB, gpu_label

from ..errors import BadRequest, ContextLengthExceeded, EngineFailure, InsufficientMemory, NotReady, ServiceError
from .base import (Cancel, Chunk, EmbeddingResult, GenerationParams, ImageInput, LoadReport, RerankResult,
                   TokenLogprob, check_limits, current_delivery)
from ..chat.template import ChatTemplate
from .templates import BuiltinChatTemplate, template_for
from ..chat.grammar import compile_grammar
from .loglines import LogTap, parse_allocations, projector_allocations
from .params import (apply_context_params, apply_model_params, context_params, draft_params, embedding_context_params,
                     plan_params, repack_of)
from .prompting import Prompting
from .task_prompts import TaskPrompts
from .prompt_cache import MIN_TOKENS as PROMPT_CACHE_MIN_TOKENS, Entry, PromptCache, model_fingerprint, plan_budget
from .sampling import SavedLogits, TemperatureSampler, logprob_of, sampler_chain, temperature_sampler
from .draft import DraftJob, DraftModelRunner, VocabularyMismatch, vocabulary_mismatch
from .mtp import MtpRunner
from .speculation import DRAFT_MAX, DRAFT_MIN, LONG_MATCH, POOL_ANSWERS, DraftPolicy, NgramDrafter, NgramPool
from .vision import ImageChunk, Images
from .slots import (INVARIANT_MIN_ROWS, SLOT_PROMPT_SIMILARITY, Cells, Slot, longer_prefix, lru_idle_with_cells, pick_slot,
                    reusable)
from .native import cuda_order
from .text import first_stop, split_stop

log = logging.getLogger(__name__)

ABORT_MIN_PROMPT_TOKENS = 256
"""A batch feeding this many tokens of one prompt is decoded with llama.cpp's abort callback set."""
_TOKENIZE_MEMO = 4
"""Prompts whose tokens ``_tokenize`` remembers (per engine, cleared at load and unload)..."""
_TOKENIZE_MEMO_MAX_CHARS = 256 * 1024
"""...when they are at most this long (a bound on what the memo holds)."""
_DONE = object()
_STOP = object()
SCHEDULER_IDLE_EXIT_S = 1.0
"""With another engine loaded in the process, an idle scheduler thread ends after this long (its OpenMP team with
it); a request starts a new one, which costs its first token about 10 ms (22 -> 33 ms for a one-token request,
measured), so an engine alone keeps its thread."""
WRITE_BEHIND_RETRY_S = 0.05
"""An idle scheduler with a slot still to write behind while the disk writes another looks again this soon."""
WRITE_BEHIND_BUSY_S = 2.0
"""A finished turn waits this long for an idle moment before it is written behind between two steps."""
_engines_loaded = 0
_engines_lock = threading.Lock()
EMBEDDING_PIECE_TOKENS = 32
"""Tokens of one embedding decode of a causal model: what a generation that arrives may wait for. gemma-3-270m on
2 cores: 0.2-0.25 s (a 480-token batch took 2.9-3.4 s, half of it one unabortable node, the logits of every token
through the 262,144-token vocabulary; measured, bench/embedding_fairness_bench.py). Fixed, so that a request's
vectors do not depend on what ran beside it."""
RANK_POOLING = 4
"""llama.h's ``LLAMA_POOLING_TYPE_RANK``: the classification head on the pooled sequence (rerankers), whose
``llama_get_embeddings_seq`` is ``n_cls_out`` scores."""
EMBEDDING_MAX_DEFER_S = 1.0
"""An embedding decode that has waited this long behind generations runs between two of their steps (and to its
end: not aborted), so that embeddings progress while generations never stop: at least one piece a second."""


class _Call:
    """Work for the scheduler thread, run between two steps: an embedding decode (``embed``).

    ``yields``: deferred while a generation is active or waiting, until it has waited ``EMBEDDING_MAX_DEFER_S``
    (``_embedding_turn``); ``abort_ctx``: the context whose ``llama_decode`` ``fn`` runs may be aborted when
    something arrives for the scheduler (``fn`` then returns 2 and is run again later: it must be repeatable)."""

    def __init__(self, fn: Callable[[], Any], *, yields: bool = False, abort_ctx: Any = None) -> None:
        self.fn, self.done = fn, threading.Event()
        self.yields, self.abort_ctx = yields, abort_ctx
        self.posted = time.monotonic()
        self.result: Any = None
        self.error: BaseException | None = None

    def overdue(self) -> bool:
        return time.monotonic() - self.posted >= EMBEDDING_MAX_DEFER_S

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:  # handed to the caller, who raises it
            self.error = exc
        self.done.set()

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.done.set()


class _ModelView:
    """What ``templates.template_for`` reads from a ``Llama``, over a raw ``LlamaModel``."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.metadata: dict[str, str] = model.metadata()

    def detokenize(self, tokens: list[int], special: bool = False) -> bytes:
        return bytes(self._model.detokenize(tokens, special=special))

    def token_bos(self) -> int:
        return int(self._model.token_bos())

    def token_eos(self) -> int:
        return int(self._model.token_eos())


# ---- scheduler state ---------------------------------------------------------------------------


@dataclass(eq=False)
class _Request:
    """One generation's state, owned by the scheduler thread after admission."""

    tokens: list[int]
    params: GenerationParams
    cancel: Cancel
    max_new_tokens: int
    grammar: Any
    out: "queue.SimpleQueue[Any]" = field(default_factory=queue.SimpleQueue)
    deliver: Any = None
    """The runner's direct delivery (``base.direct_delivery``): chunks and errors go there, only the end to ``out``."""
    abandoned: bool = False
    """Set by the consumer when it stops iterating (client gone, stop string seen upstream)."""
    slot: Slot | None = None
    n_cached: int = 0
    """Prompt tokens whose KV was reused instead of evaluated."""
    next_token: int | None = None
    """The sampled token not yet decoded (the next step's input)."""
    first_logits: Any = None
    """The whole prompt was cached with its logits: the first token is sampled from these."""
    greedy: bool = False
    """Temperature 0, no penalty, no grammar: the token is the row's argmax (see ``_on_logits``)."""
    sampler: Any = None
    """The llama.cpp sampler chain (``sampling.sampler_chain``), or None where ``temperature`` draws instead."""
    temperature: TemperatureSampler | None = None
    n_out: int = 0
    decoder: Any = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))
    stops: list[str] = field(default_factory=list)
    pending: str = ""
    pending_lp: list[TokenLogprob] = field(default_factory=list)
    batch_take: int = 0
    batch_logits_idx: int = -1
    t_start: float = 0.0
    t_first: float = 0.0
    t_last: float = 0.0
    index: int = 0
    """The choice this sequence generates (``GenerationParams.n``)."""
    followers: "list[_Request]" = field(default_factory=list)
    """The other choices of the same prompt: each has a slot reserved and forks from this one's KV and logits
    once its prompt is evaluated (``_fork``)."""
    stop_sequence: str | None = None
    seed: int = 0
    drafter: "NgramDrafter | DraftModelRunner | MtpRunner | None" = None
    """Self-speculation (``service.engine.speculation``), or the plan's draft model (``service.engine.draft``, shared
    by the requests): None where it is off for this request."""
    policy: DraftPolicy | None = None
    draft: list[int] = field(default_factory=list)
    """Tokens drafted into this step's batch after ``next_token``, each with its logits row."""
    unverified: bool = False
    """The sequence's KV holds drafted positions past ``slot.tokens`` (dropped when it ends: ``_release``)."""
    images: dict[int, ImageChunk] = field(default_factory=dict)
    """The prompt's images by the index each begins at (``service.engine.vision``): evaluated by mtmd, not
    fed as tokens; held from the request's start until it ends."""
    shifts: list[tuple[int, int]] = field(default_factory=list)
    """(index an image ends at, positions the images up to it take fewer than their tokens): M-RoPE images
    (``ImageChunk.n_pos``); empty where a token's position is its index (``LlamaEngine._pos``)."""

    @property
    def n_past(self) -> int:
        return len(self.slot.tokens) if self.slot is not None else 0

    @property
    def prompting(self) -> bool:
        return self.next_token is None and self.n_past < len(self.tokens)

    @property
    def gone(self) -> bool:
        return self.abandoned or self.cancel.cancelled


class LlamaEngine(Prompting, TaskPrompts):
    """llama.cpp behind the ``Engine`` protocol: slots that remember their prompts, decoded in shared batches."""

    def __init__(self, *, n_threads: int | None = None, batch_invariant: bool = False, cache_prompt: bool = True,
                 slot_prompt_similarity: float = SLOT_PROMPT_SIMILARITY, chat_template: str | None = None,
                 embedding_pooling: str = "mean", prompt_cache_mib: int = 0, prompt_cache_dir: str | None = None,
                 prompt_cache_disk_mib: int = 0, speculative: bool = True, draft_max: int = DRAFT_MAX) -> None:
        """``n_threads``: default the physical cores (``params.physical_cores``), as llama.cpp's tools.

        ``cache_prompt``: keep each slot's KV after a request and reuse its common prefix with the next
        prompt (off: every request is evaluated from an empty sequence).

        ``batch_invariant``: load without the CPU backend's repacked weight layouts (``use_extra_bufts``
        off). ggml-cpu's repack kernels (ggml/src/ggml-cpu/repack.cpp ``forward_mul_mat``) multiply rows in
        groups of 4 with a gemm and the rest with a gemv, which round differently: a token's logits then
        depend on how many other tokens share its batch (0.78 max logit difference measured with 4 rows,
        gemma-3-270m Q4_K_M), across requests and across the chunks a prompt is evaluated in. Off, a
        request's tokens do not depend on its neighbours; prompt processing is slower.

        ``chat_template``: a Jinja chat template used instead of the model's (``GGUF_CHAT_TEMPLATE_FILE``).
        ``embedding_pooling``: the pooling of /v1/embeddings for models whose GGUF declares none (mean, cls,
        last); the embedding context itself is sized by the plan (``ContextConfig.embedding_tokens``).

        ``prompt_cache_mib``: the ceiling of the host memory idle conversations' KV may hold beyond the slots
        (``service.engine.prompt_cache``; the load's budget is planned under it; 0: off); ``prompt_cache_dir``:
        also keep them on disk there, at most ``prompt_cache_disk_mib``.

        ``speculative``: draft up to ``draft_max`` tokens a step from each sequence's own tokens and keep those
        the model chooses itself (``service.engine.speculation``; off in batch-invariant mode, whose point is
        that a token's batch does not change it). Drafted rows fit in the logits rows llama.cpp reserves at
        context creation (one per sequence, ``output_reserve(n_seq_max)``) and in the rows the plan adds for them
        (``ContextConfig.draft_rows``, reserved at load): a step drafts at most the idle slots' rows and those."""
        cuda_order(os.environ)  # in this process, before CUDA starts (service.engine.native)
        self._n_threads = n_threads
        self._template_override = chat_template
        self._pooling_fallback = embedding_pooling
        self._emb: Any = None
        """The embedding context (``embeddings`` on, a pooling type), beside the generation context."""
        self._emb_lock = threading.Lock()
        self._emb_tokens = 0
        self._emb_seqs = 0
        self._emb_batch: Any = None
        self._emb_pooling = 0
        self._emb_pieces = False
        """Embedding batches are evaluated in pieces (``embed``): a causal model that declares no pooling."""
        self._emb_abort_cb: Any = None
        self._emb_watch: "queue.SimpleQueue[Any] | None" = None
        """While an abortable embedding decode runs: the scheduler's inbox (anything in it aborts the decode)."""
        self._emb_aborted = 0
        """Embedding decodes aborted for a generation since load (each run again)."""
        self._n_embd = 0
        self._n_cls_out = 0
        """Values rank pooling gives a sequence (``llama_model_n_cls_out``): the first is the relevance score."""
        self._rerank_template: str | None = None
        """The GGUF's ``tokenizer.chat_template.rerank`` (``{query}``, ``{document}``), when it has one."""
        self._evaluated = 0
        self._preserved: set[int] = set()
        self._batch_invariant = batch_invariant
        self._speculative = speculative and not batch_invariant
        self._draft_max = max(0, draft_max)
        self._draft_rows = 0
        """Logits rows beyond one per sequence held for drafts (the plan's ``draft_rows``, reserved at load)."""
        self._draft_runner: DraftModelRunner | MtpRunner | None = None
        self._vision: Images | None = None
        """The projector (mtmd) where the plan has one: the model takes images."""
        """The plan's draft model (``service.engine.draft``): drafts come from it instead of the n-gram drafter."""
        self._drafts = False
        """This model is drafted for: speculation on and no recurrent state (one cannot take back a rejected
        draft's tokens: ``llama_memory_seq_rm`` refuses a tail of a recurrent sequence)."""
        self._cache_prompt = cache_prompt
        self._similarity = slot_prompt_similarity
        self._lock = threading.Lock()  # load/unload against each other
        self._model: Any = None
        self._ctx: Any = None
        self._mem: Any = None
        self._vocab: Any = None
        self._template: ChatTemplate | BuiltinChatTemplate | None = None
        self._device = "CPU"
        self._n_ctx = 0
        self._n_ctx_seq = 0
        self._n_batch = 0
        self._n_slots = 0
        self._n_swa = 0
        self._unified = False
        self._n_vocab = 0
        self._inbox: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._sched_lock = threading.Lock()  # the scheduler thread's start and end against posts to its inbox
        self._sched_on = False  # a model is loaded: a post starts the scheduler thread if it has ended
        self._slots: list[Slot] = []
        self._cells = Cells()
        self._running = 0
        self._uses = 0
        self._batch: Any = None
        self._keep: list[Any] = []
        self._outbox: list[tuple[_Request, Any]] = []
        """Chunks produced during a scheduler iteration, delivered together at its end (``_flush``)."""
        self._piece: dict[int, bytes] = {}
        """Token id -> its text bytes (``detokenize([tok])``), filled as tokens are seen: no ctypes call per token."""
        self._eog: dict[int, bool] = {}
        """Token id -> ``llama_vocab_is_eog``, filled as tokens are seen."""
        self._saved = SavedLogits(0)
        """Sampling from saved logits (a cached prompt's, a forked choice's), its candidates array reused."""
        self._tok_lock = threading.Lock()
        self._max_piece = 0
        """``max_token_chars``, once computed (0: not yet)."""
        self._tok_memo: "collections.OrderedDict[tuple[str, bool, bool], list[int]]" = collections.OrderedDict()
        self._abort_cb: Any = None
        self._abort_watch: list[_Request] = []
        """The requests whose prompt the running ``llama_decode`` evaluates, while the abort callback is set."""
        self._pc_ceiling = max(0, prompt_cache_mib) * MIB
        self._pc_dir = prompt_cache_dir
        self._pc_disk = max(0, prompt_cache_disk_mib) * MIB
        self._pcache = PromptCache(0)
        """Idle conversations beyond the slots (owned by the scheduler thread; its gauges are read from others)."""
        self._unwritten: dict[int, float] = {}
        """Slots whose prompt changed since it was last written to the disk (``_write_behind``): when their last
        request ended (``time.monotonic``)."""
        self._answers = NgramPool()
        """Finished answers per cache scope, for the n-gram drafts of later requests (scheduler thread)."""

    # -- Engine protocol -------------------------------------------------

    @property
    def n_ctx(self) -> int:
        """Tokens one request may hold: llama.cpp's per-sequence context (``llama_n_ctx_seq``; unified: n_ctx)."""
        return self._n_ctx_seq

    @property
    def slots(self) -> int:
        """Sequences decoded together (``n_seq_max``)."""
        return self._n_slots

    @property
    def n_vocab(self) -> int:
        return self._n_vocab

    @property
    def prompt_tokens_evaluated(self) -> int:
        """Prompt tokens given to ``llama_decode`` since load: cached prefixes and forked choices do not count."""
        return self._evaluated

    @property
    def kv_cells_used(self) -> int:
        """Cells holding tokens: running requests' and the cached prompts of idle slots (shared cells once)."""
        return self._cells.used

    @property
    def kv_cells_allocated(self) -> int:
        return self._n_ctx

    @property
    def running_sequences(self) -> int:
        return self._running

    def check(self, params: GenerationParams) -> None:
        """Compile the request's grammar now, so a bad schema is a 400 before any byte is streamed; token ids of
        ``logit_bias`` within the vocabulary; no more choices than slots."""
        compile_grammar(params)
        check_limits(params, self._n_vocab, self._n_slots)

    def load(self, path: str, plan: Plan) -> LoadReport:
        import llama_cpp
        from llama_cpp import _internals

        LogTap.install()
        p = plan.placement
        mparams, cparams = plan_params(plan, use_extra_bufts=not self._batch_invariant)
        mp = llama_cpp.llama_model_default_params()
        keep = apply_model_params(mp, mparams)
        mp.load_mode = llama_cpp.LLAMA_LOAD_MODE_MMAP
        cp = llama_cpp.llama_context_default_params()
        apply_context_params(cp, cparams, n_threads=self._n_threads)
        lines = LogTap.start()
        t0 = time.perf_counter()
        model = ctx = emb = None
        runner: DraftModelRunner | None = None
        images: Images | None = None
        emb_pieces = False
        eparams = embedding_context_params(plan.cfg)
        try:
            model = _internals.LlamaModel(path_model=path, params=mp, verbose=False)
            ctx = _internals.LlamaContext(model=model, params=cp, verbose=False)
            n_main = len(lines)  # the embedding context's lines are reported apart (LoadReport.embedding_allocations)
            if eparams is not None:
                ecp = llama_cpp.llama_context_default_params()
                apply_context_params(ecp, eparams, n_threads=self._n_threads)
                ecp.pooling_type = self._pooling(model)
                emb = _internals.LlamaContext(model=model, params=ecp, verbose=False)
                # Pieces carry a sequence through the cache, which needs causal attention (``decode`` asserts a
                # non-causal sequence whole in one ubatch) and a pooling this engine can combine: a model that
                # declares one may pool through layers of its own (a classifier, dense projections).
                emb_pieces = bool(llama_cpp.llama_get_causal_attn(emb.ctx)) and self._declared_pooling(model) is None
            n_emb = len(lines)
            if plan.draft is not None and self._speculative:
                runner = self._load_draft(plan, mparams.use_extra_bufts, model)
            n_draft = len(lines)
            if runner is None and plan.cfg.mtp and self._speculative:
                runner = self._load_mtp(ctx, plan, model, os.path.basename(path))
            n_mtp = len(lines)
            pm = plan.estimate.projector if plan.estimate is not None else None
            if pm is not None:
                images = Images.load(pm.path, model.model, use_gpu=pm.use_gpu, flash_attn=pm.flash_attn,
                                     n_threads=cp.n_threads, n_ubatch=int(cp.n_ubatch),
                                     image_max_tokens=pm.image_max_tokens)
        except BaseException as exc:
            if images is not None:
                images.close()
            if runner is not None:
                runner.close()
            for held in (emb, ctx, model):
                if held is not None:
                    held.close()
            if not isinstance(exc, ValueError):
                raise
            text = "\n".join(lines[-20:]).lower()
            if "out of memory" in text or "failed to allocate" in text:
                raise InsufficientMemory(f"llama.cpp could not allocate the model: {exc}") from exc
            raise EngineFailure(f"llama.cpp failed to load {path}: {exc}") from exc
        finally:
            LogTap.stop()
        elapsed = time.perf_counter() - t0
        self.unload()
        with self._lock:
            self._model, self._ctx = model, ctx
            self._mem = llama_cpp.llama_get_memory(ctx.ctx)
            self._emb = emb
            if emb is not None and eparams is not None:
                self._emb_tokens = int(llama_cpp.llama_n_batch(emb.ctx))
                self._emb_seqs = eparams.n_seq_max
                self._emb_batch = llama_cpp.llama_batch_init(self._emb_tokens, 0, 1)
                self._emb_pooling, self._emb_pieces = int(ecp.pooling_type), emb_pieces
                self._emb_aborted = 0

                @llama_cpp.ggml_abort_callback  # type: ignore[misc]
                def _emb_abort(_data: ctypes.c_void_p) -> bool:
                    watch = self._emb_watch
                    return watch is not None and not watch.empty()

                self._emb_abort_cb = _emb_abort  # kept: llama.cpp holds the pointer
            self._vocab = model.vocab
            self._keep = keep
            self._piece, self._eog = {}, {}
            with self._tok_lock:
                self._tok_memo.clear()
                self._max_piece = 0
            self._n_vocab = int(model.n_vocab())
            self._n_ctx = int(llama_cpp.llama_n_ctx(ctx.ctx))
            self._n_ctx_seq = int(llama_cpp.llama_n_ctx_seq(ctx.ctx))
            self._n_batch = int(llama_cpp.llama_n_batch(ctx.ctx))
            self._n_slots = int(llama_cpp.llama_n_seq_max(ctx.ctx))
            self._n_swa = int(llama_cpp.llama_model_n_swa(model.model))
            self._unified = bool(cparams.kv_unified) or self._n_slots == 1
            self._slots = [Slot(i) for i in range(self._n_slots)]
            self._cells = Cells()
            self._pcache = self._open_prompt_cache(path, plan, cparams)
            self._unwritten = {}
            self._answers = NgramPool(POOL_ANSWERS)
            self._batch = llama_cpp.llama_batch_init(self._n_batch, 0, 1)
            self._saved = SavedLogits(self._n_vocab)
            self._draft_rows = 0
            self._draft_runner = runner
            self._vision = images
            self._drafts = self._speculative and not (llama_cpp.llama_model_is_recurrent(model.model)
                                                      or llama_cpp.llama_model_is_hybrid(model.model))

            @llama_cpp.ggml_abort_callback  # type: ignore[misc]
            def _abort(_data: ctypes.c_void_p) -> bool:
                watch = self._abort_watch
                return bool(watch) and all(r.gone for r in watch)

            self._abort_cb = _abort  # kept: llama.cpp holds the pointer
            self._template = template_for(_ModelView(model), self._template_override)
            self._format = None
            # Markers of the template's tool calls and thinking that are control tokens are written out in the text
            # (as llama-server's preserved tokens), so that the parsers see them; other control tokens stay silent.
            self._preserved = set(self.chat_format().special.values())
            self._evaluated = 0
            self._n_embd = int(model.n_embd())
            self._n_cls_out = max(1, int(llama_cpp.llama_model_n_cls_out(model.model)))
            raw = llama_cpp.llama_model_chat_template(model.model, b"rerank")
            self._rerank_template = raw.decode("utf-8", "replace") if raw else None
            self._device = ",".join(gpu_label(i) for i in p.gpus) if p.gpus and p.n_gpu_layers else "CPU"
            with self._sched_lock:
                self._inbox = queue.SimpleQueue()
                self._sched_on = True
                self._start_scheduler()
            if self._drafts and plan.cfg.draft_rows > 0:
                # On the scheduler thread: a decode on this one would give it an OpenMP team of its own, which
                # slowed every later decode of the process by a third (the "One compute thread" note above).
                rows = plan.cfg.draft_rows
                self._draft_rows = self._on_scheduler(lambda: self._reserve_draft_rows(rows))
            global _engines_loaded
            with _engines_lock:
                _engines_loaded += 1
        allocs, offloaded = parse_allocations(lines[:n_main])
        emb_allocs, _ = parse_allocations(lines[n_main:n_emb])
        draft_allocs, _ = parse_allocations(lines[n_emb:n_draft])
        mtp_allocs, _ = parse_allocations(lines[n_draft:n_mtp])
        projector_allocs = projector_allocations(lines[n_mtp:], pm.device) if pm is not None else ()
        why = "batch-invariant mode" if self._batch_invariant else repack_of(plan).reason
        pc = self._pcache
        log.info("llama engine: %d slots (%s cache), n_ctx %d (%d per sequence), n_batch %d, threads %d, prompt cache %s "
                 "(beyond the slots: %d MiB of host memory%s), CPU weight repacking %s (%s)",
                 self._n_slots, "unified" if cparams.kv_unified else "per-sequence", self._n_ctx, self._n_ctx_seq,
                 self._n_batch, cp.n_threads, "on" if self._cache_prompt else "off", pc.budget_bytes >> 20,
                 f", {pc.disk_entries} entries on disk in {pc.directory}" if pc.directory else "",
                 "on" if mparams.use_extra_bufts else "off", why)
        n_nextn = int(llama_cpp.llama_model_n_layer_nextn(self._model.model))
        mtp = isinstance(runner, MtpRunner)
        if n_nextn:
            log.info("llama engine: the file's %d NextN/MTP block(s) %s", n_nextn,
                     "draft (MTP), planned beside the model" if mtp else
                     f"are not loaded ({plan.mtp_refusal or 'no MTP head asked for'}) and not planned")
        return LoadReport(n_ctx=self._n_ctx_seq, allocations=allocs, offloaded_layers=offloaded,
                          load_seconds=elapsed, log_lines=tuple(lines[:n_main]), embedding_allocations=emb_allocs,
                          draft_output_bytes=self._draft_rows * self._n_vocab * 4,
                          draft_allocations=draft_allocs, projector_allocations=projector_allocs,
                          mtp_allocations=mtp_allocs,
                          mtp_rows_bytes=self._n_embd * self._n_batch * 4 if mtp else 0)

    def _load_mtp(self, main: Any, plan: Plan, model: Any, name: str) -> MtpRunner:
        """The MTP context of a model loaded with its NextN block (``service.engine.mtp``; the plan's
        ``sizing.memory.mtp``): the main context's size, sequences, batch and cache type, a KV cache of the NextN
        layer alone. Raises ``ValueError`` where llama.cpp cannot create it."""
        import llama_cpp
        from llama_cpp import _internals

        if not mtp_supported(plan.model):
            raise ValueError(f"no MTP drafting for {plan.model.architecture} with "
                             f"{plan.model.n_layer_all - plan.model.n_layer} NextN block(s)")
        cp = llama_cpp.llama_context_default_params()
        apply_context_params(cp, context_params(mtp_config(plan.cfg)), n_threads=self._n_threads)
        cp.ctx_other = main.ctx
        ctx = _internals.LlamaContext(model=model, params=cp, verbose=False)
        try:
            return MtpRunner(main.ctx, ctx, n_slots=int(llama_cpp.llama_n_seq_max(ctx.ctx)), name=name)
        except BaseException:
            ctx.close()
            raise

    def _load_draft(self, plan: Plan, use_extra_bufts: bool, main: Any) -> DraftModelRunner:
        """The plan's draft model and its context (``sizing.memory.draft``: whole on the card of the main model's
        output layer, or the host; the main context's size and sequences), its vocabulary checked against the
        main model's. Raises ``ValueError`` where llama.cpp cannot load it, ``VocabularyMismatch``."""
        import llama_cpp
        from llama_cpp import _internals

        draft = plan.draft
        assert draft is not None
        mparams, cparams = draft_params(plan, use_extra_bufts=use_extra_bufts)
        mp = llama_cpp.llama_model_default_params()
        keep = apply_model_params(mp, mparams)
        mp.load_mode = llama_cpp.LLAMA_LOAD_MODE_MMAP
        cp = llama_cpp.llama_context_default_params()
        apply_context_params(cp, cparams, n_threads=self._n_threads)
        model = _internals.LlamaModel(path_model=draft.path, params=mp, verbose=False)
        why = vocabulary_mismatch(main.vocab, model.vocab)
        if why is not None:
            model.close()
            raise VocabularyMismatch(f"the draft model {draft.path} does not share the model's vocabulary: {why}",
                                     param="draft_model")
        try:
            ctx = _internals.LlamaContext(model=model, params=cp, verbose=False)
        except BaseException:
            model.close()
            raise
        return DraftModelRunner(model, ctx, n_slots=int(llama_cpp.llama_n_seq_max(ctx.ctx)), name=draft.label,
                                keep=keep)

    def _reserve_draft_rows(self, rows: int) -> int:
        """Grow llama.cpp's output buffer to hold ``rows`` drafted tokens' logits beside one row per sequence, now
        rather than at the first draft: one batch of that many outputs in sequence 0 of the empty context, then
        removed. ``output_reserve`` (src/llama-context.cpp) reallocates to ``n_vocab * max(n_outputs, n_seq_max)``
        F32 and logs it only in debug builds, so the plan's line (``sizing.memory.draft_output_bytes``) and this
        figure are llama.cpp's formula; what is measured is that the batch was accepted. 0: no rows (none planned,
        or the batch failed: drafts then stay in the rows of idle slots)."""
        import llama_cpp

        rows = max(0, min(rows, self._n_batch - self._n_slots, self._n_ctx_seq - self._n_slots))
        if rows <= 0:
            return 0
        n = self._n_slots + rows
        batch = self._batch
        tok = max(0, int(llama_cpp.llama_vocab_bos(self._vocab)))
        for i in range(n):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, i, 1, 1
            batch.seq_id[i][0] = 0
        batch.n_tokens = n
        ret = int(llama_cpp.llama_decode(self._ctx.ctx, batch))
        llama_cpp.llama_memory_seq_rm(self._mem, 0, -1, -1)
        if ret != 0:
            log.warning("llama engine: the output buffer could not grow for %d drafted rows (llama_decode %d): drafts "
                        "use idle slots' rows only", rows, ret)
            return 0
        return rows

    def unload(self) -> None:
        """Stop the scheduler (requests still queued or running fail with ``NotReady``), free the context."""
        import llama_cpp

        global _engines_loaded
        with self._lock:
            with self._sched_lock:
                was_on, self._sched_on = self._sched_on, False
                thread, self._thread = self._thread, None
                if thread is not None:
                    self._inbox.put(_STOP)
            if was_on:
                with _engines_lock:
                    _engines_loaded -= 1
            if thread is not None:
                thread.join()
            if self._mem is not None and self._pcache.directory is not None:
                for slot in self._slots:  # what the slots hold outlives the context on disk
                    self._keep_slot(slot, 0)
            self._pcache.close()
            self._pcache = PromptCache(0)
            if self._batch is not None:
                llama_cpp.llama_batch_free(self._batch)
                self._batch = None
            with self._emb_lock:  # after a running embedding batch
                emb, self._emb = self._emb, None
                if self._emb_batch is not None:
                    llama_cpp.llama_batch_free(self._emb_batch)
                    self._emb_batch = None
                self._emb_tokens = self._emb_seqs = 0
            if emb is not None:
                emb.close()
            runner, self._draft_runner = self._draft_runner, None
            if runner is not None:
                runner.close()
            vision, self._vision = self._vision, None
            if vision is not None:
                vision.close()
            self._format = None
            ctx, model = self._ctx, self._model
            self._ctx = self._model = self._vocab = self._mem = None
            self._template = None
            self._n_ctx = self._n_ctx_seq = self._n_slots = 0
            self._slots = []
            self._cells = Cells()
            self._running = 0
            with self._tok_lock:
                self._tok_memo.clear()
            if ctx is not None:
                ctx.close()
            if model is not None:
                model.close()
            self._keep = []
            self._abort_cb = None
            self._emb_abort_cb = None

    def _open_prompt_cache(self, path: str, plan: Plan, cparams: Any) -> PromptCache:
        """The load's prompt cache beyond the slots: its planned budget, and its folder on disk when one is set."""
        import llama_cpp

        if not self._cache_prompt:
            return PromptCache(0)
        pc = PromptCache(plan_budget(plan, self._pc_ceiling))
        if self._pc_dir and self._pc_disk > 0:
            from pathlib import Path

            fields = {"model": model_fingerprint(path), "type_k": cparams.type_k, "type_v": cparams.type_v,
                      "flash_attn": cparams.flash_attn_type, "n_ctx_seq": self._n_ctx_seq,
                      "swa_full": bool(cparams.swa_full), "n_swa": self._n_swa, "n_embd": int(self._model.n_embd()),
                      "llama_cpp": getattr(llama_cpp, "__version__", "")}
            pm = plan.estimate.projector if plan.estimate is not None else None
            if pm is not None:  # an image's KV is the projector's embeddings of it
                fields["projector"] = model_fingerprint(pm.path)
            try:
                pc.open_disk(Path(self._pc_dir), fields, self._pc_disk)
            except OSError as exc:
                log.warning("prompt cache: %s cannot be used (%s); keeping conversations in memory only",
                            self._pc_dir, exc)
                pc.directory = None
        return pc

    def set_prompt_cache_budget(self, budget_bytes: int) -> None:
        """Another budget for the prompt cache beyond the slots (residency empties it before it evicts or refuses a
        model for memory, then gives it what is left): on the scheduler thread, which owns the entries."""
        if self._model is not None:
            self._on_scheduler(lambda: self._pcache.set_budget(budget_bytes))

    @property
    def prompt_cache_gauges(self) -> dict[str, int]:
        """What the prompt cache beyond the slots holds and did (``PromptCache.gauges``)."""
        return self._pcache.gauges()

    def _require(self) -> Any:
        model = self._model
        if model is None:
            raise NotReady("no model is loaded")
        return model

    # -- embeddings (a second context on the same weights) -------------------

    _POOLING = {"mean": 1, "cls": 2, "last": 3}
    """llama.h's ``LLAMA_POOLING_TYPE_MEAN``, ``_CLS``, ``_LAST``: the poolings ``embed`` reads."""

    def _declared_pooling(self, model: Any) -> int | None:
        """The pooling the GGUF declares (``{arch}.pooling_type``) when it is mean, cls, last or rank; else None."""
        meta = model.metadata()
        declared = meta.get(f"{meta.get('general.architecture', '')}.pooling_type")
        try:
            value = int(declared) if declared is not None else -1
        except ValueError:
            value = -1
        return value if value in self._POOLING.values() or value == RANK_POOLING else None

    def _pooling(self, model: Any) -> int:
        """The model's pooling type (GGUF ``{arch}.pooling_type``: mean, cls, last, rank), else the configured one."""
        declared = self._declared_pooling(model)
        return declared if declared is not None else self._POOLING.get(self._pooling_fallback, self._POOLING["mean"])

    def max_token_chars(self) -> int:
        """The longest piece of the vocabulary, in bytes (at least its characters): computed on first use, a walk
        over every token (0.55 s for gemma-3's 262,144, measured: 48 bytes), kept until the next load."""
        import llama_cpp

        with self._tok_lock:
            if self._max_piece:
                return self._max_piece
            vocab = self._require().vocab
            buf = ctypes.create_string_buffer(512)
            longest = 0
            for tok in range(self._n_vocab):
                longest = max(longest, int(llama_cpp.llama_token_to_piece(vocab, tok, buf, len(buf), 0, True)))
            self._max_piece = longest
            return longest

    def embedding_limits(self) -> tuple[int, int]:
        return (self._n_embd, self._emb_tokens) if self._emb is not None else (0, 0)

    def tokenize(self, text: str) -> list[int]:
        return self._tokenize(text, add_bos=True, special=False)

    def embed(self, inputs: list[list[int]], cancel: Cancel) -> EmbeddingResult:
        """Pooled embeddings, each scaled to unit L2 norm (as OpenAI's are), of inputs that fit one batch each.

        Inputs are packed into batches of at most ``embedding_limits()[1]`` tokens and ``EMBEDDING_SEQS``
        sequences, one sequence each; the cache is cleared before every batch, so nothing is kept between them.
        Pooling is per ubatch in llama.cpp (``build_pooling``; cls and last take the lowest and highest position
        of a sequence in the ubatch, ``llm_graph_input_cls::set_input``), so a batch is decoded whole, or, for a
        causal model that declares no pooling (``_emb_pieces``), in pieces of ``EMBEDDING_PIECE_TOKENS`` whose
        pooled values are combined: the token-weighted mean of the pieces' means, cls from the piece holding
        position 0, last from the piece holding the last token. Every decode runs on the scheduler thread when
        generations let it (``_embedding_turn``); the pieces are fixed by the inputs alone, so the vectors are
        the same whatever ran beside them. A ranking model (rank pooling) has scores, not embeddings: 400."""
        import numpy as np

        if self._emb is not None and self._emb_pooling == RANK_POOLING:
            raise BadRequest("this model is a reranker (its GGUF declares rank pooling): its outputs are relevance "
                             "scores, not embeddings; use /v1/rerank", param="input")
        out: list[tuple[float, ...]] = []
        for v in self._pool(inputs, cancel, "input"):
            norm = float(np.linalg.norm(v))
            out.append(tuple(float(x) for x in (v / norm if norm > 0 else v)))
        return EmbeddingResult(vectors=tuple(out), prompt_tokens=sum(len(t) for t in inputs))

    def rerank(self, inputs: list[list[int]], cancel: Cancel) -> RerankResult:
        """The relevance score of each (query, document) input (``rerank_tokens``), as llama-server's
        ``send_rerank`` reads it: the first of the ``n_cls_out`` values rank pooling gives the sequence
        (``llama_get_embeddings_seq``). Batched and scheduled as ``embed``; ``BadRequest`` naming ``model``
        for a model that does not rank."""
        if self._emb is None or self._emb_pooling != RANK_POOLING:
            raise BadRequest(self._no_rank_reason(), param="model")
        scores = tuple(float(v[0]) for v in self._pool(inputs, cancel, "documents"))
        return RerankResult(scores=scores, prompt_tokens=sum(len(t) for t in inputs))

    def _no_rank_reason(self) -> str:
        if self._emb is None:
            return ("this model cannot rerank: its embedding context is off (GGUF_EMBEDDINGS: off, or auto with "
                    "layers on a GPU)")
        return ("this model cannot rerank: its GGUF declares no rank pooling ({arch}.pooling_type 4, a reranker's "
                "classification head)")

    def rerank_limit(self) -> int:
        """Tokens one (query, document) input may hold: the embedding batch of a ranking model; 0: it cannot rank."""
        return self._emb_tokens if self._emb is not None and self._emb_pooling == RANK_POOLING else 0

    def _pool(self, inputs: list[list[int]], cancel: Cancel, param: str) -> list[Any]:
        """Each input's pooled values as llama.cpp gives them (float64 arrays: n_embd, or n_cls_out with rank
        pooling), evaluated as ``embed`` describes; ``param`` names the request's field in errors."""
        import llama_cpp
        import numpy as np

        with self._emb_lock:
            emb = self._emb
            if emb is None:
                raise BadRequest("embeddings are off for this model (GGUF_EMBEDDINGS: off, or auto with layers on a GPU)", param=param)
            limit = self._emb_tokens
            pooling = self._emb_pooling
            rank = pooling == RANK_POOLING
            width = self._n_cls_out if rank else self._n_embd
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
            mem = llama_cpp.llama_get_memory(emb.ctx)
            batch = self._emb_batch
            piece = min(EMBEDDING_PIECE_TOKENS, limit) if self._emb_pieces else limit
            mean = pooling == self._POOLING["mean"]

            def decode(clear: bool) -> int:
                # On the scheduler thread. A batch starts from an empty cache; a later piece adds to its cells. An
                # aborted decode removes the cells of its ubatch (``llama_context::decode``: ``seq_rm`` from each
                # sequence's lowest position in it) and extracts nothing; a whole batch, run again, clears the
                # cache first: the same computation on the same cells, the same vectors.
                if clear:
                    llama_cpp.llama_memory_clear(mem, True)
                return int(llama_cpp.llama_decode(emb.ctx, batch))

            out: list[Any] = []
            i = 0
            while i < len(inputs):
                group: list[list[int]] = []
                used = 0
                while i + len(group) < len(inputs) and len(group) < self._emb_seqs \
                        and used + len(inputs[i + len(group)]) <= limit:
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
                                             abort_ctx=emb.ctx if whole else None)
                    if ret != 0:
                        raise EngineFailure(f"llama.cpp failed to evaluate an embedding batch (llama_decode returned {ret})")
                    for seq, (count, lo, hi) in held.items():
                        if not (mean or rank or (pooling == self._POOLING["cls"] and lo == 0)
                                or (pooling == self._POOLING["last"] and hi == len(group[seq]) - 1)):
                            continue
                        ptr = llama_cpp.llama_get_embeddings_seq(emb.ctx, seq)
                        if not ptr:
                            raise EngineFailure("llama.cpp returned no pooled embedding")
                        parts[seq].append((np.ctypeslib.as_array(ptr, shape=(width,)).astype(np.float64), count))
                for got in parts:
                    # One piece: its value as llama.cpp pooled it (cls, last, rank have one); else the weighted mean.
                    out.append(got[0][0] if len(got) == 1 else sum(p * c for p, c in got) / sum(c for _, c in got))
                i += len(group)
            return out

    def _tokenize(self, text: str, *, add_bos: bool, special: bool = True) -> list[int]:
        """llama.cpp's tokenizer (``special``: control-token spellings become control tokens), remembering the
        last few prompts: the API counts a prompt's tokens before it generates from the same text (2.9 ms a
        time for 1,500 tokens, measured)."""
        key = (text, add_bos, special)
        with self._tok_lock:
            hit = self._tok_memo.get(key)
        if hit is not None:
            return list(hit)
        tokens = list(self._require().tokenize(text.encode("utf-8"), add_bos, special))
        if len(text) > _TOKENIZE_MEMO_MAX_CHARS:
            return tokens
        with self._tok_lock:
            self._tok_memo[key] = tokens
            while len(self._tok_memo) > _TOKENIZE_MEMO:
                self._tok_memo.popitem(last=False)
        return list(tokens)

    def _generate_tokens(self, tokens: list[int], params: GenerationParams, cancel: Cancel) -> Iterator[Chunk]:
        return self.generate(tokens, params, cancel)

    def generate(self, tokens: list[int], params: GenerationParams, cancel: Cancel) -> Iterator[Chunk]:
        """The chunks of one generation; safe to call (and iterate) from many threads at once."""
        self._require()
        n_prompt = len(tokens)
        n_ctx_seq = self._n_ctx_seq
        if n_prompt >= n_ctx_seq:
            # The service checks this first (``_check_context`` with ``n_ctx``); direct callers get the same error.
            raise ContextLengthExceeded(
                f"the prompt has {n_prompt} tokens; a sequence holds {n_ctx_seq} "
                f"({self._n_slots} slots share {self._n_ctx} cells)",
                param="prompt", prompt_tokens=n_prompt, n_ctx=n_ctx_seq,
            )
        room = n_ctx_seq - n_prompt
        max_new = room if params.max_tokens is None else min(params.max_tokens, room)
        if max_new <= 0:
            yield Chunk(finish_reason="length", prompt_tokens=n_prompt, completion_tokens=0)
            return
        grammar = compile_grammar(params)
        greedy = (params.temperature == 0.0 and grammar is None and params.frequency_penalty == 0.0
                  and params.presence_penalty == 0.0 and not params.logit_bias)
        images = self._images_of(tokens, params.images)
        deliver = current_delivery()
        out: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        base_seed = params.seed if params.seed is not None else random.randint(0, 2**31 - 1)
        reqs = [
            _Request(tokens=list(tokens), params=params, cancel=cancel, max_new_tokens=max_new,
                     grammar=compile_grammar(params) if i else grammar, stops=[s for s in params.stop if s],
                     greedy=greedy, deliver=deliver, out=out, index=i, seed=(base_seed + i) % 2**32)
            for i in range(max(1, params.n))
        ]
        if self._drafts and params.speculative and self._draft_max >= DRAFT_MIN:
            for r in reqs:
                # The draft model sees no image: a prompt with one drafts from its own tokens.
                r.drafter = ((self._draft_runner if not images else None)
                             or NgramDrafter(pool=self._answers, scope=params.cache_scope))
                r.policy = DraftPolicy(draft_max=self._draft_max)
        shifts: list[tuple[int, int]] = []
        total = 0
        for start in sorted(images):
            image = images[start]
            if image.n_pos != len(image.run):
                total += len(image.run) - image.n_pos
                shifts.append((start + len(image.run), total))
        for r in reqs:
            r.images, r.shifts = images, shifts
        reqs[0].followers = reqs[1:]
        if not self._post(reqs[0]):
            raise NotReady("the model was unloaded")
        left = len(reqs)
        try:
            while True:
                item = out.get()
                if item is _DONE:
                    left -= 1
                    if not left:
                        return
                    continue
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            for r in reqs:
                r.abandoned = True

    def _images_of(self, tokens: list[int], given: tuple[ImageInput, ...] = ()) -> dict[int, ImageChunk]:
        """The images of a prompt (runs of negative ids, ``service.engine.vision``) by where each begins; ``given``:
        the request's images, prepared again where their chunks were dropped."""
        if not tokens or min(tokens) >= 0:
            return {}
        if self._vision is None:
            raise BadRequest("this model takes no images: it was loaded without a vision projector (mmproj)",
                             param="messages")
        if tokens[-1] < 0:  # the first token is sampled from the logits of a text token
            raise BadRequest("a prompt may not end with an image", param="messages")
        return dict(self._vision.find(tokens, given))

    def forget(self) -> None:
        """Drop every idle slot's cached prompt, the prompt cache beyond the slots (its files too) and the answers
        the n-gram drafts look up (the next requests start from empty sequences)."""
        done = threading.Event()
        if self._post(done):
            done.wait()

    # -- scheduler thread ------------------------------------------------

    def _start_scheduler(self) -> None:
        """(Under ``_sched_lock``.) A scheduler thread for the current inbox."""
        self._thread = threading.Thread(target=self._run, args=(self._inbox,), name="llama-scheduler", daemon=True)
        self._thread.start()

    def _post(self, item: Any) -> bool:
        """Hand ``item`` to the scheduler thread, starting one if the last ended idle; False when unloaded."""
        with self._sched_lock:
            if not self._sched_on:
                return False
            if self._thread is None:
                self._start_scheduler()
            self._inbox.put(item)
            return True

    def _on_scheduler(self, fn: Callable[[], Any], *, yields: bool = False, abort_ctx: Any = None) -> Any:
        """``fn()`` on the scheduler thread, between two of its steps (see "One compute thread" above); ``yields``
        and ``abort_ctx``: see ``_Call``."""
        call = _Call(fn, yields=yields, abort_ctx=abort_ctx)
        if not self._post(call):
            raise NotReady("the model was unloaded")
        call.done.wait()
        if call.error is not None:
            raise call.error
        return call.result

    def _park(self, inbox: "queue.SimpleQueue[Any]") -> bool:
        """Idle for ``SCHEDULER_IDLE_EXIT_S``: end this thread if another engine is loaded (its OpenMP team would
        slow theirs) and nothing arrived meanwhile."""
        with _engines_lock:
            if _engines_loaded < 2:
                return False
        with self._sched_lock:
            if not inbox.empty() or self._thread is not threading.current_thread():
                return False
            self._thread = None
            return True

    def _run(self, inbox: "queue.SimpleQueue[Any]") -> None:
        waiting: collections.deque[_Request] = collections.deque()
        active: list[_Request] = []
        deferred: collections.deque[_Call] = collections.deque()  # embedding decodes, behind the generations
        try:
            while True:
                # Block only when idle (and end the thread once idle long enough); else take what has arrived and
                # go on decoding.
                items = []
                if not active and not waiting and not deferred and not self._write_behind():
                    try:
                        # A slot left unwritten while the disk was busy is tried again soon.
                        items.append(inbox.get(timeout=WRITE_BEHIND_RETRY_S if self._unwritten
                                               else SCHEDULER_IDLE_EXIT_S))
                    except queue.Empty:
                        if not self._unwritten and self._park(inbox):
                            return
                        continue
                while True:
                    try:
                        items.append(inbox.get_nowait())
                    except queue.Empty:
                        break
                stop = False
                for it in items:
                    if it is _STOP:
                        stop = True
                    elif isinstance(it, threading.Event):
                        for s in self._slots:
                            if s.req is None:
                                self._clear_slot(s)
                        self._pcache.clear()
                        self._answers.clear()
                        it.set()
                    elif isinstance(it, _Call):
                        if it.yields:
                            deferred.append(it)
                        else:
                            it.run()
                    else:
                        waiting.append(it)
                if stop:
                    break
                for r in [r for r in waiting if r.gone]:
                    waiting.remove(r)
                    self._finish(r, "cancelled", active)
                while waiting:
                    head = waiting[0]
                    slot = self._pick_slot(head)
                    if slot is None:
                        break
                    if head.followers:  # n > 1: a slot for every choice, or wait for them
                        spare = sorted((s for s in self._slots if s.req is None and s is not slot),
                                       key=lambda s: (s.last_used, s.id))
                        if len(spare) < len(head.followers):
                            break
                        for f, s in zip(head.followers, spare):
                            self._vacate(s)
                            s.req, f.slot = f, s
                    self._admit(waiting.popleft(), slot, active)
                for r in [r for r in active if r.gone]:
                    self._finish(r, "cancelled", active)
                if active:
                    self._step(active)
                    if self._unwritten:
                        self._write_behind(busy=True)
                # Generations first: an embedding decode runs when none is active or waiting, or once it has
                # waited EMBEDDING_MAX_DEFER_S, after a step (a request admitted now has had its first one).
                if deferred and (not (active or waiting) or deferred[0].overdue()):
                    self._flush()  # the step's tokens go out while the embedding decodes
                    if self._embedding_turn(deferred[0], inbox):
                        deferred.popleft()
                self._running = len(active)
                self._flush()
        except BaseException as exc:  # a bug here must not leave clients waiting forever
            log.exception("llama scheduler failed")
            err = EngineFailure(f"the batch scheduler failed: {type(exc).__name__}: {exc}")
            for r in list(active):
                self._fail(r, err, active)
            self._flush()
            for r in waiting:
                r.out.put(err)
                r.out.put(_DONE)
            waiting.clear()
            for c in deferred:
                c.fail(err)
            deferred.clear()
        gone = NotReady("the model was unloaded")
        for c in deferred:
            c.fail(gone)
        for r in list(active):
            self._fail(r, gone, active)
        self._flush()
        for r in waiting:
            r.out.put(gone)
            r.out.put(_DONE)
        while True:
            try:
                it = inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(it, _Request):
                it.out.put(gone)
                it.out.put(_DONE)
            elif isinstance(it, threading.Event):
                it.set()
            elif isinstance(it, _Call):
                it.fail(gone)

    def _embedding_turn(self, call: _Call, inbox: "queue.SimpleQueue[Any]") -> bool:
        """Run a deferred embedding decode now; False when something arrived for the scheduler meanwhile and
        aborted it (it stays first in line and runs again when the generations let it).

        The abort callback is set on the embedding context only for an abortable decode that is not overdue:
        ggml-cpu calls it after every graph node (``ggml_graph_compute_thread``), so a generation that arrives
        waits for the node being computed (the largest, the logits of the batch, 1.3-1.5 s for 402 tokens of
        gemma-3-270m on 2 cores), not the whole batch; ``llama_decode`` then returns 2."""
        import llama_cpp

        ctx = call.abort_ctx if call.abort_ctx is not None and not call.overdue() else None
        if ctx is not None:
            self._emb_watch = inbox
            llama_cpp.llama_set_abort_callback(ctx, self._emb_abort_cb, None)
        try:
            result = call.fn()
        except BaseException as exc:  # handed to the caller, who raises it
            call.fail(exc)
            return True
        finally:
            if ctx is not None:
                llama_cpp.llama_set_abort_callback(ctx, llama_cpp.ggml_abort_callback(), None)
                self._emb_watch = None
        if ctx is not None and result == 2:
            self._emb_aborted += 1
            return False
        call.result = result
        call.done.set()
        return True

    def _send(self, r: _Request, item: Any) -> None:
        if r.index and isinstance(item, Chunk):
            item = dataclasses.replace(item, index=r.index)
        self._outbox.append((r, item))

    def _flush(self) -> None:
        """Deliver the iteration's chunks, after all of its sampling and just before the next ``llama_decode``.

        Each ``put`` wakes a consumer thread, which then wants the GIL. Woken in the middle of the step, they
        took it whenever the scheduler released it for a ctypes call (every sample, detokenize, EOG test)
        and the scheduler waited for each of them to give it back; woken here, they run while
        ``llama_decode`` (which releases the GIL) computes.

        A delivery with a ``flush`` (the runner process's: ``child.Child._flush_step``) is called once after the
        iteration's chunks were handed to it, before any request's end is put: it writes them all at once."""
        if self._outbox:
            out, self._outbox = self._outbox, []
            ends: list[tuple[_Request, Any]] = []
            flushes: dict[Any, None] = {}
            for r, item in out:
                if r.deliver is not None and item is not _DONE:
                    r.deliver(item)
                    f = getattr(r.deliver, "flush", None)
                    if f is not None:
                        flushes[f] = None
                else:
                    ends.append((r, item))
            for f in flushes:
                f()
            for r, item in ends:
                r.out.put(item)

    def _pick_slot(self, r: _Request) -> Slot | None:
        return pick_slot(self._slots, r.tokens, similarity=self._similarity,
                         reuse=self._cache_prompt and r.params.cache_prompt, scope=r.params.cache_scope)

    def _swa_holds(self, slot: Slot, n_keep: int) -> bool:
        """Whether the sequence still holds the KV a token at position ``n_keep`` attends to.

        A sliding-window layer's token at position ``p1`` attends to ``p0`` unless ``p1 - p0 >= n_swa``
        (``is_masked_swa``, standard type), so the token at ``n_keep`` needs every position from
        ``n_keep - n_swa + 1`` on. The SWA cache reuses a cell once it is masked for the position after the
        sequence's last (src/llama-kv-cache.cpp ``find_slot``: ``seq_pos_max + 1``), which is exactly what the next
        token needs: a sequence continued where it ended always holds it. llama-server's test (``update_slots``,
        ``pos_min < pos_next - n_swa``) is two positions stricter, and refused that continuation whenever the
        window had been trimmed (every next chat turn of a 1,800-token conversation once four of them shared the
        cache; found by bench/prompt_cache_bench.py); what this one allows is checked token for token against a
        cold evaluation (tests/engine/test_prompt_cache.py). Models without SWA hold every position (``pos_min``
        0)."""
        import llama_cpp

        pos_min = int(llama_cpp.llama_memory_seq_pos_min(self._mem, slot.id))
        return self._window_holds(pos_min, n_keep)

    def _window_holds(self, pos_min: int, n_keep: int) -> bool:
        return 0 <= pos_min <= max(0, n_keep - self._n_swa + 1)

    def _admit(self, r: _Request, slot: Slot, active: list[_Request]) -> None:
        """Give ``r`` the slot: keep the longest usable common prefix of its KV, drop the rest."""
        import llama_cpp

        n_keep = 0
        scope = r.params.cache_scope
        if self._cache_prompt and r.params.cache_prompt:
            n_keep = self._reusable(slot, r.tokens, scope)
            src, n_src = None, n_keep
            if self._unified and self._n_slots > 1:
                src, n_src = longer_prefix(self._slots, slot, r.tokens, n_keep,
                                           lambda s, t: self._reusable(s, t, scope))
            # A restore copies the whole state back: worth it for MIN_TOKENS or more, beyond what the slots hold.
            entry, n_entry = (self._pcache.best(r.tokens, scope, self._entry_usable,
                                                max(n_src, PROMPT_CACHE_MIN_TOKENS - 1))
                              if self._pcache.entries else (None, n_src))
            if entry is not None and self._restore(slot, entry):
                n_keep = n_entry
                self._pcache.stats.restored_tokens += n_entry
            elif src is not None:
                self._vacate(slot)
                llama_cpp.llama_memory_seq_cp(self._mem, src.id, slot.id, 0, self._pos(r, n_src))
                slot.tokens = src.tokens[:n_src]
                slot.cells = self._cells.share(src.cells[:n_src])
                slot.n_canon = min(src.n_canon, n_src)
                slot.logits, slot.logits_at = (src.logits, src.logits_at) if src.logits_at <= n_src else (None, 0)
                n_keep = n_src
            if self._pcache.enabled and entry is None and 2 * n_keep < len(r.tokens):  # most of it evaluated
                self._pcache.stats.misses += 1
            n_keep = self._image_bound(r, n_keep)
        self._keep_slot(slot, n_keep)
        self._truncate(slot, n_keep, self._pos(r, n_keep))
        slot.scope = scope
        slot.req, r.slot = slot, slot
        r.n_cached = n_keep
        self._samplers(r)
        r.t_start = time.perf_counter()
        active.append(r)
        if n_keep == len(r.tokens):  # the whole prompt and its logits were cached: sample now
            r.first_logits = slot.logits
            self._on_logits(r, -1, None, active)

    @staticmethod
    def _pos(r: _Request, index: int) -> int:
        """The position of the token at ``index`` of ``r``'s sequence: its index, less what the M-RoPE images before
        it take fewer positions than tokens (``_Request.shifts``). Called at image boundaries and for text."""
        shift = 0
        for end, total in r.shifts:
            if end > index:
                break
            shift = total
        return index - shift

    @staticmethod
    def _image_bound(r: _Request, n_keep: int) -> int:
        """``n_keep`` moved back to the start of the image it falls inside of (an image is evaluated whole: mtmd
        decodes its embeddings in one call, non-causally for Gemma 3)."""
        for start, image in r.images.items():
            if start < n_keep < start + len(image.run):
                return start
        return n_keep

    def _reusable(self, slot: Slot, tokens: list[int], scope: str) -> int:
        if slot.scope != scope:  # another tenant's prefix: never shared (a timing side channel)
            return 0
        return reusable(slot, tokens, batch_invariant=self._batch_invariant, holds=self._swa_holds)

    def _entry_usable(self, entry: Entry, tokens: list[int]) -> int:
        """As ``_reusable`` for a cached prompt: its sliding-window cells as they were when it was saved."""
        return reusable(entry, tokens, batch_invariant=self._batch_invariant,
                        holds=lambda e, k: self._window_holds(e.pos_min, k))

    def _keep_slot(self, slot: Slot, n_keep: int) -> None:
        """Before the slot drops tokens past ``n_keep``: its prompt into the prompt cache beyond the slots, when it
        loses enough to be worth a restore (``MIN_TOKENS``: not the last tokens of a turn a new prompt rewrites)."""
        if self._pcache.enabled and len(slot.tokens) - n_keep >= PROMPT_CACHE_MIN_TOKENS:
            self._save_slot(slot)

    def _vacate(self, slot: Slot) -> None:
        """Empty the slot for another prompt, its own kept in the prompt cache first (``_keep_slot``)."""
        self._keep_slot(slot, 0)
        self._clear_slot(slot)

    def _write_behind(self, *, busy: bool = False) -> bool:
        """One idle slot's prompt that changed since it was last written goes to the disk folder: its state copied
        out of llama.cpp here (a memcpy of the sequence's cells: 2.4 ms for gemma-3-270m's 1,600-token, 12 MiB
        state), written and fsynced by the cache's writer thread. A killed server (SIGKILL, the OOM killer, a lost
        node) then loses only the turns in flight, where before a slot's prompt reached the disk only when another
        took the slot or at unload.

        When the scheduler is idle (nothing active, waiting or deferred); ``busy``: between two steps, only for a
        slot whose turn ended ``WRITE_BEHIND_BUSY_S`` ago with no idle moment since, so that steady traffic cannot
        keep a finished turn off the disk (it costs that step one copy). One slot a call and one write at a time:
        the scheduler looks at its inbox between two, and at most one state waits for the disk. True: a slot was
        written (look at the inbox before blocking)."""
        pc = self._pcache
        if not self._unwritten or pc.directory is None:
            self._unwritten.clear()
            return False
        if pc.writing:
            return False
        due = time.monotonic() - WRITE_BEHIND_BUSY_S
        for sid, ended in sorted(self._unwritten.items(), key=lambda kv: kv[1]):
            if busy and ended > due:
                return False
            del self._unwritten[sid]
            slot = self._slots[sid]
            if slot.req is None and pc.needs(slot.tokens, slot.scope, memory=False):  # a taken slot: after it
                self._save_slot(slot, memory=False)
                return True
        return False

    def _save_slot(self, slot: Slot, *, memory: bool = True) -> None:
        """The slot's prompt into the prompt cache (``memory`` off: to its disk folder only, ``_write_behind``)."""
        import llama_cpp

        pc = self._pcache
        if not pc.needs(slot.tokens, slot.scope, memory=memory):
            return
        size = int(llama_cpp.llama_state_seq_get_size(self._ctx.ctx, slot.id))
        if size <= 0 or not pc.takes(size):
            return
        state = bytearray(size)  # llama.cpp writes into it: no copy
        buf = (ctypes.c_uint8 * size).from_buffer(state)
        n = int(llama_cpp.llama_state_seq_get_data(self._ctx.ctx, buf, size, slot.id))
        del buf  # the bytearray may not change size while a ctypes view holds it
        if n != size:
            log.warning("prompt cache: llama.cpp wrote %d of %d bytes of slot %d's state; not kept", n, size, slot.id)
            return
        pos_min = int(llama_cpp.llama_memory_seq_pos_min(self._mem, slot.id))
        pc.put(slot.tokens, state, scope=slot.scope, pos_min=pos_min, n_canon=slot.n_canon, memory=memory)

    def _restore(self, slot: Slot, entry: Entry) -> bool:
        """Put a cached prompt back into the slot (the slot's own prompt kept first); False: it could not be."""
        import llama_cpp

        pc = self._pcache
        self._vacate(slot)
        n = len(entry.tokens)
        while self._unified and self._cells.used + n > self._n_ctx:  # room, as a full cache makes it
            victim = lru_idle_with_cells([s for s in self._slots if s is not slot])
            if victim is None:
                break
            self._vacate(victim)
        state = pc.take(entry)
        if state is None:
            return False
        buf = (ctypes.c_uint8 * len(state)).from_buffer(state)
        got = int(llama_cpp.llama_state_seq_set_data(self._ctx.ctx, buf, len(state), slot.id))
        del buf
        if got != len(state):
            llama_cpp.llama_memory_seq_rm(self._mem, slot.id, -1, -1)
            pc.stats.restore_failed += 1
            log.warning("prompt cache: llama.cpp took %d of %d bytes of a %d-token prompt back; evaluated cold",
                        got, len(state), n)
            return False
        slot.tokens = list(entry.tokens)
        slot.cells = self._cells.new(n)
        slot.n_canon = entry.n_canon
        slot.logits, slot.logits_at = None, 0
        slot.scope = entry.scope
        pc.stats.hits += 1
        return True

    def _truncate(self, slot: Slot, n_keep: int, pos: int | None = None) -> None:
        """Drop the slot's tokens from index ``n_keep`` on, their cells from position ``pos`` (default ``n_keep``:
        they differ past M-RoPE images) on (``llama_memory_seq_rm`` of the tail)."""
        import llama_cpp

        if n_keep < len(slot.tokens) or n_keep == 0:
            llama_cpp.llama_memory_seq_rm(self._mem, slot.id, n_keep if pos is None else pos, -1)
            self._cells.drop(slot.cells[n_keep:])
            del slot.tokens[n_keep:]
            del slot.cells[n_keep:]
        slot.n_canon = min(slot.n_canon, n_keep)
        if slot.logits_at > n_keep:
            slot.logits, slot.logits_at = None, 0

    def _clear_slot(self, slot: Slot) -> None:
        self._truncate(slot, 0)

    def _release(self, r: _Request, active: list[_Request], *, keep: bool = True) -> None:
        """End ``r``'s hold on its slot; the slot keeps its tokens for the next request unless ``keep`` is off."""
        import llama_cpp

        slot = r.slot
        if slot is not None:
            if r.unverified:  # drafted positions past the tokens kept (``_verify``): not this sequence's
                llama_cpp.llama_memory_seq_rm(self._mem, slot.id, self._pos(r, len(slot.tokens)), -1)
                r.unverified = False
            if not (keep and self._cache_prompt):
                self._clear_slot(slot)
            elif self._pcache.directory is not None:
                self._unwritten[slot.id] = time.monotonic()
            self._uses += 1
            slot.last_used = self._uses
            slot.req = None
            r.slot = None
        if r.sampler is not None:
            llama_cpp.llama_sampler_free(r.sampler)
            r.sampler = None
        if r in active:
            active.remove(r)

    def _finish(self, r: _Request, finish: str, active: list[_Request], *, stopped: bool = False) -> None:
        """The last chunks: flush the decoder (unless a stop string ended the text), then reason, usage, timings."""
        followers, r.followers = r.followers, []
        for f in followers:  # choices that never forked (cancelled during the prompt) end with it
            self._finish(f, finish, active)
        if isinstance(r.drafter, NgramDrafter) and r.slot is not None and finish != "cancelled":
            self._answers.add(r.params.cache_scope, r.slot.tokens, len(r.tokens))
        self._release(r, active)
        if not stopped:
            r.pending += r.decoder.decode(b"", final=True)
            if r.pending or r.pending_lp:
                self._send(r, Chunk(text=r.pending, logprobs=tuple(r.pending_lp)))
        self._send(r, Chunk(
            finish_reason=finish, prompt_tokens=len(r.tokens), completion_tokens=r.n_out, cached_tokens=r.n_cached,
            stop_sequence=r.stop_sequence,
            drafted_tokens=r.policy.drafted if r.policy else 0, accepted_tokens=r.policy.accepted if r.policy else 0,
            prompt_seconds=(r.t_first - r.t_start) if r.t_first else 0.0,
            decode_seconds=(r.t_last - r.t_first) if r.n_out > 1 else 0.0,
        ))
        self._send(r, _DONE)

    def _fail(self, r: _Request, err: ServiceError, active: list[_Request]) -> None:
        followers, r.followers = r.followers, []
        for f in followers:
            self._fail(f, err, active)
        self._release(r, active, keep=False)
        self._send(r, err)
        self._send(r, _DONE)

    def _step(self, active: list[_Request]) -> None:
        """One ``llama_decode``: a token for each generating sequence, then prompt chunks up to n_batch.

        In batch-invariant mode only one prompt is fed per step: with a non-unified cache llama.cpp splits a
        batch into ubatches holding the same number of tokens of every sequence (``split_equal``,
        src/llama-batch.cpp), so several prompts in one step are processed interleaved, token by token,
        and their greedy outputs were seen to differ from one-at-a-time runs."""
        import llama_cpp

        batch = self._batch
        b_token, b_pos, b_nseq, b_seq, b_logits = batch.token, batch.pos, batch.n_seq_id, batch.seq_id, batch.logits
        members: list[_Request] = []
        room = self._n_batch
        # Drafted tokens take logits rows beyond one per sequence: at most the rows of idle slots (see __init__).
        spare = self._n_slots + self._draft_rows - len(active) if self._drafts else 0
        if spare > 0 and self._unified:
            # A unified cache's free cells go first to the tokens that stay: every sequence's next token and
            # the prompt tokens this step may evaluate; drafts only where cells are left after those.
            prompts = sum(len(r.tokens) - r.n_past for r in active if r.prompting)
            spare = min(spare, self._n_ctx - self._cells.used - len(active) - min(prompts, room))
        jobs: list[tuple[_Request, DraftJob]] = []
        for r in active:
            r.batch_take, r.batch_logits_idx, r.draft = 0, -1, []
            if r.next_token is not None and room > 0:
                r.batch_take = 1
                room -= 1
                members.append(r)
                if spare > 0 and r.drafter is not None and not r.gone:
                    assert r.policy is not None and r.slot is not None
                    k = min(spare, room, r.max_new_tokens - r.n_out - 1)
                    if isinstance(r.drafter, NgramDrafter):
                        k = min(k, r.policy.budget(r.n_out, LONG_MATCH))  # the most any match may take
                        if k < DRAFT_MIN:
                            continue
                        r.draft = r.drafter.draft(r.slot.tokens, r.next_token, k)
                        r.draft = r.draft[:r.policy.budget(r.n_out, r.drafter.matched)]
                        k = len(r.draft)
                    elif (k := min(k, r.policy.budget(r.n_out))) < DRAFT_MIN:
                        continue
                    else:  # the draft model's: all of this step's at once, below (k held for it meanwhile)
                        jobs.append((r, DraftJob(r.slot.id, [*r.slot.tokens, r.next_token], k, [])))
                    r.batch_take += k
                    spare -= k
                    room -= k
        if jobs:
            assert self._draft_runner is not None
            self._draft_runner.draft([j for _, j in jobs])
            for r, j in jobs:
                r.draft = j.draft
                if not j.draft:
                    r.policy.declined(r.n_out)  # type: ignore[union-attr]
                room += j.k - len(j.draft)
                r.batch_take -= j.k - len(j.draft)
        for r in list(active):  # oldest first: admission order (a copy: a failed image ends its request)
            if room <= 0:
                break
            if r.prompting and r.images and not self._images_before(r, active):
                continue
            if r.prompting:
                left = self._text_end(r) - r.n_past
                if left <= 0:  # an image next, its request gone meanwhile: ended by the scheduler's next turn
                    continue
                r.batch_take = min(room, left)
                if self._batch_invariant and 0 < left - r.batch_take < INVARIANT_MIN_ROWS:
                    r.batch_take = max(1, left - INVARIANT_MIN_ROWS)  # no short last chunk (see INVARIANT_MIN_ROWS)
                room -= r.batch_take
                members.append(r)
                if self._batch_invariant:
                    break  # one prompt per step: prompts never share a ubatch (see the docstring)
        # Laid out in increasing sequence id. With a non-unified cache llama.cpp puts into one ubatch only a run
        # of consecutive sequence ids in batch order (src/llama-batch.cpp ``split_equal``, ``sequential``): out
        # of order, 4 generating sequences were decoded as up to 4 ubatches, each a full pass over the weights,
        # and the graph was rebuilt every step (2x the step time measured with 8 slots). llama-server adds its
        # slots in slot-id order (server-context.cpp ``update_slots``).
        members.sort(key=lambda r: r.slot.id)  # type: ignore[union-attr]
        n = 0
        n_prompt_fed = 0
        watch: list[_Request] = []
        mtp = self._draft_runner if isinstance(self._draft_runner, MtpRunner) else None
        runs: list[tuple[int, int, Sequence[int], int, Sequence[int], object]] = []
        for r in members:
            seq = r.slot.id  # type: ignore[union-attr]
            p0 = r.n_past
            shift = p0 - self._pos(r, p0) if r.shifts else 0  # positions past M-RoPE images (``_pos``)
            if mtp is not None and not r.shifts:  # the MTP head's cache follows every sequence (``observe``)
                fed = ([r.next_token, *r.draft] if r.next_token is not None
                       else r.tokens[p0:p0 + r.batch_take])
                runs.append((seq, p0, fed, n, r.slot.tokens, r))  # type: ignore[union-attr]
            if r.next_token is not None:
                r.batch_logits_idx = n
                b_token[n], b_pos[n], b_nseq[n], b_logits[n] = r.next_token, p0 - shift, 1, 1
                b_seq[n][0] = seq
                n += 1
                for i, t in enumerate(r.draft, 1):
                    b_token[n], b_pos[n], b_nseq[n], b_logits[n] = t, p0 + i - shift, 1, 1
                    b_seq[n][0] = seq
                    n += 1
                continue
            last = len(r.tokens) - 1
            toks = r.tokens
            for i in range(p0, p0 + r.batch_take):  # text only: a chunk stops at an image (``_text_end``)
                b_token[n], b_pos[n], b_nseq[n], b_logits[n] = toks[i], i - shift, 1, 0
                b_seq[n][0] = seq
                if i == last:
                    b_logits[n] = 1
                    r.batch_logits_idx = n
                n += 1
            if r.batch_take >= ABORT_MIN_PROMPT_TOKENS:
                watch.append(r)
            n_prompt_fed += r.batch_take
        batch.n_tokens = n
        self._flush()  # e.g. the chunks of requests cancelled this iteration: delivered while the batch computes
        ctx = self._ctx.ctx
        # The abort callback lets a client that leaves stop a long prompt's evaluation, but it is a Python call
        # per graph node (ggml-cpu.c ``ggml_graph_compute_thread``): only for batches that evaluate a long prompt.
        if watch:
            self._abort_watch = [r for r in members if r.next_token is None]
            llama_cpp.llama_set_abort_callback(ctx, self._abort_cb, None)
        try:
            ret = int(llama_cpp.llama_decode(ctx, batch))
        finally:
            if watch:
                llama_cpp.llama_set_abort_callback(ctx, llama_cpp.ggml_abort_callback(), None)
                self._abort_watch = []
        if ret != 0:
            self._decode_failed(ret, members, active)
            return
        if mtp is not None:
            mtp.observe(runs, n)
        self._evaluated += n_prompt_fed
        canon = n >= INVARIANT_MIN_ROWS
        for r in members:
            slot = r.slot
            assert slot is not None
            p0 = len(slot.tokens)
            if r.draft:
                self._verify(r, ctx, active)
                continue
            if r.next_token is not None:
                slot.tokens.append(r.next_token)
                r.next_token = None
            else:
                slot.tokens.extend(r.tokens[p0:p0 + r.batch_take])
            slot.cells.extend(self._cells.new(r.batch_take))
            if canon and slot.n_canon == p0:
                slot.n_canon += r.batch_take
            if r.batch_logits_idx >= 0:
                self._on_logits(r, r.batch_logits_idx, ctx, active)

    def _text_end(self, r: _Request) -> int:
        """Where the prompt's text from ``n_past`` on ends: its next image, or its end."""
        p0 = r.n_past
        return min((start for start in r.images if start >= p0), default=len(r.tokens))

    def _images_before(self, r: _Request, active: list[_Request]) -> bool:
        """Evaluate the images the prompt has reached (mtmd: the tower, then their embeddings decoded into the
        sequence, each in calls of its own before this step's batch); False where one failed (``r`` ended)."""
        assert self._vision is not None
        slot = r.slot
        assert slot is not None
        while r.prompting and (image := r.images.get(r.n_past)) is not None:
            if r.gone:
                return True  # ended by the step's usual path
            ret = self._vision.evaluate(self._ctx.ctx, image, self._pos(r, r.n_past), slot.id, self._n_batch)
            if ret != 0:
                self._fail(r, EngineFailure(f"mtmd could not evaluate an image of the prompt (code {ret})"), active)
                return False
            n = len(image.run)
            slot.tokens.extend(image.run)
            slot.cells.extend(self._cells.new(n))
            slot.logits, slot.logits_at = None, 0
            self._evaluated += n
        return True

    def _verify(self, r: _Request, ctx: Any, active: list[_Request]) -> None:
        """The rows of a drafted step: each samples as a step of its own would (the sampler chain, or the argmax),
        and a drafted token stands while it is the token sampled from the row before it; the first that is not
        ends the step, the sampled token becoming the next step's input. One draw of the sampler per token kept,
        as without the draft: the answer, its seed's included, is the one non-speculative decoding gives (to the
        rounding of rows computed together), several tokens a step."""
        import llama_cpp

        slot = r.slot
        assert slot is not None and r.next_token is not None and r.policy is not None
        draft, r.draft = r.draft, []
        slot.tokens.append(r.next_token)
        slot.cells.extend(self._cells.new(1))
        r.next_token = None
        r.unverified = True
        idx = r.batch_logits_idx
        kept = 0
        for i in range(len(draft) + 1):
            self._on_logits(r, idx + i, ctx, active)
            if r.slot is None or i == len(draft) or r.next_token != draft[i]:
                break  # ended (its release dropped the unverified positions), or the draft was not chosen
            kept += 1
            slot.tokens.append(r.next_token)  # already in the KV: its row is the next one
            slot.cells.extend(self._cells.new(1))
            r.next_token = None
        r.policy.record(r.n_out, len(draft), kept)
        if r.unverified:
            llama_cpp.llama_memory_seq_rm(self._mem, slot.id, self._pos(r, len(slot.tokens)), -1)
            r.unverified = False

    def _on_logits(self, r: _Request, idx: int, ctx: Any, active: list[_Request]) -> None:
        """Sample this sequence's next token (from batch row ``idx``, or the saved logits) and turn it into text."""
        import llama_cpp
        import numpy as np

        saved, r.first_logits = r.first_logits, None
        row = saved
        forking = bool(r.followers) and not r.t_first
        if row is None and (r.greedy or r.temperature is not None or r.params.logprobs is not None or forking
                            or (not r.t_first and self._cache_prompt)):
            row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, idx), shape=(self._n_vocab,))
        if forking:
            self._fork(r, row, active)
        if saved is None and not r.t_first and self._cache_prompt:
            # The prompt's logits, kept with the slot for the same prompt again (a copy: the context reuses the buffer).
            slot = r.slot
            assert slot is not None
            slot.logits, slot.logits_at = row.copy(), len(slot.tokens)
        lp = logprob_of(row, r.params.logprobs, self._token_bytes) if r.params.logprobs is not None else None
        if r.greedy:
            # The chain is penalties (all zero: a no-op, llama-sampler.cpp ``llama_sampler_penalties_apply``) then
            # greedy (the first largest logit): argmax over the row, without llama_sampler_sample copying all
            # n_vocab candidates (0.4 ms a token for gemma-3's 262,144, measured; 3% at 75 tokens/s).
            tok = int(np.argmax(row))
        elif r.temperature is not None:
            tok = r.temperature.sample(row)
        elif saved is not None:
            tok = self._saved.sample(r.sampler, saved)
        else:
            tok = int(llama_cpp.llama_sampler_sample(r.sampler, ctx, idx))
        now = time.perf_counter()
        if not r.t_first:
            r.t_first = now
        r.t_last = now
        eog = self._eog.get(tok)
        if eog is None:
            eog = self._eog[tok] = bool(llama_cpp.llama_vocab_is_eog(self._vocab, tok))
        if eog and not r.params.ignore_eos:
            self._finish(r, "stop", active)
            return
        r.n_out += 1
        if lp is not None:
            r.pending_lp.append(lp(tok))
        r.pending += r.decoder.decode(self._token_bytes(tok))
        if r.stops:
            text = r.pending
            emit, r.pending, stopped = split_stop(text, r.stops)
            if stopped:
                r.stop_sequence = first_stop(text, r.stops)
        else:
            emit, r.pending, stopped = r.pending, "", False
        if emit:
            self._send(r, Chunk(text=emit, logprobs=tuple(r.pending_lp)))
            r.pending_lp = []
        if stopped:
            self._finish(r, "stop", active, stopped=True)
        elif r.n_out >= r.max_new_tokens:
            self._finish(r, "length", active)
        else:
            r.next_token = tok

    def _fork(self, r: _Request, logits: Any, active: list[_Request]) -> None:
        """The other choices of ``r``'s prompt, now evaluated: each slot reserved for them gets the prompt's KV
        (``llama_memory_seq_cp``: with a unified cache the cells gain a sequence id; per-sequence streams are
        copied whole, the leader's stream holding exactly the prompt) and samples its first token from the
        prompt's logits. No prompt token is evaluated twice."""
        import llama_cpp

        src = r.slot
        assert src is not None
        followers, r.followers = r.followers, []
        for f in followers:
            slot = f.slot
            assert slot is not None
            self._clear_slot(slot)
            if self._unified:
                llama_cpp.llama_memory_seq_cp(self._mem, src.id, slot.id, 0, self._pos(r, len(src.tokens)))
                slot.cells = self._cells.share(src.cells)
            else:
                llama_cpp.llama_memory_seq_cp(self._mem, src.id, slot.id, -1, -1)
                slot.cells = self._cells.new(len(src.tokens))
            slot.tokens = list(src.tokens)
            slot.scope = src.scope
            slot.n_canon = src.n_canon
            f.n_cached = r.n_cached
            self._samplers(f)
            f.t_start = r.t_start
            f.first_logits = logits.copy()
            active.append(f)
            self._on_logits(f, -1, None, active)

    def _samplers(self, r: _Request) -> None:
        """The request's sampling: the argmax (``greedy``), numpy's temperature draw, or llama.cpp's chain."""
        if not r.greedy:
            r.temperature = temperature_sampler(r.params, r.grammar, r.seed)
        if r.temperature is None:
            r.sampler = sampler_chain(self._model, self._n_vocab, r.params, r.grammar, r.seed)

    def _token_bytes(self, tok: int) -> bytes:
        """``detokenize([tok])``: a function of the token id alone, so computed once per id."""
        piece = self._piece.get(tok)
        if piece is None:
            piece = self._piece[tok] = bytes(self._model.detokenize([tok], special=tok in self._preserved))
        return piece

    def _decode_failed(self, code: int, members: list[_Request], active: list[_Request]) -> None:
        """llama_decode's codes (llama.h): 1 no KV slot, -2 allocation failed, 2 aborted (our callback).

        1 with idle slots holding cells: the least recently used is cleared and the step retried
        (llama-server's ``try_clear_idle_slots``). 1 or -2 otherwise: out of memory for one request, which
        fails while the others go on. 2: the requests whose client left end, the others retry. Anything
        else fails the whole batch. A partly processed batch is rolled back for the survivors: llama.cpp
        removes the failed ubatch's positions, the processed ones remain (llama.h)."""
        import llama_cpp

        for r in members:
            if r.slot is not None:
                llama_cpp.llama_memory_seq_rm(self._mem, r.slot.id, self._pos(r, r.n_past), -1)
        victim_slot = lru_idle_with_cells(self._slots)
        if code == 1 and victim_slot is not None and self._unified:
            log.info("KV cache full: clearing idle slot %d (%d cached tokens)", victim_slot.id, len(victim_slot.tokens))
            self._vacate(victim_slot)
        elif code == 2:
            for r in members:
                if r.gone:
                    self._finish(r, "cancelled", active)
        elif code in (1, -2) and members:
            # The request asking for new cells in bulk (a prompt chunk) is the one that does not fit;
            # among generating ones, the largest. Ties: the newest.
            ordered = [r for r in active if r in members]  # admission order (members are in sequence-id order)
            prompting = [r for r in ordered if r.next_token is None]
            pool = prompting or ordered
            victim = max(reversed(pool), key=lambda r: r.n_past + r.batch_take)
            device = LogTap.failed_device() or self._device
            max_tokens = victim.params.max_tokens
            err = InsufficientMemory(
                f"out of memory on {device} during generation (llama_decode returned {code}) with "
                f"{len(victim.tokens)} prompt tokens and max_tokens {max_tokens}: the KV cache has no room "
                f"for this sequence beside {len(active) - 1} others ({self._n_ctx} cells, {self._n_slots} slots)",
                device=device, prompt_tokens=len(victim.tokens), max_tokens=max_tokens,
            )
            log.warning("decode: %s", err.message)
            self._fail(victim, err, active)
        else:
            err2 = EngineFailure(f"llama.cpp failed to decode a batch (llama_decode returned {code})")
            for r in members:
                self._fail(r, err2, active)
