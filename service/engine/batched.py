"""Continuous batching: several sequences in one llama.cpp context, decoded together.

llama-cpp-python's ``Llama`` decodes one sequence at a time; llama-server
decodes up to ``-np`` sequences in one ``llama_decode`` (tools/server/
server-context.cpp ``update_slots``). This engine does the same through the
low-level API of llama-cpp-python 0.3.36:

- one context with ``n_seq_max`` = slots; each request owns a sequence id
  (its KV cells, ``llama_memory_seq_rm`` frees them when it ends). With a
  non-unified cache each sequence has its own stream of ``n_ctx_seq`` cells
  (``PAD(n_ctx / n_seq_max, 256)``, src/llama-context.cpp); unified, all
  sequences share ``n_ctx`` cells and a full cache is ``llama_decode`` = 1;
- a scheduler thread owns the context. Each step puts one token for every
  generating sequence into the batch, then fills what is left of ``n_batch``
  with prompt tokens (oldest request first), so a long prompt is processed in
  chunks between decode steps instead of stalling running streams;
- new requests are admitted between steps, finished ones retired;
- each request has its own sampler chain, built as ``Llama._init_sampler``
  builds it (penalties, grammar, then greedy at temperature 0 or
  top_k/typical/top_p/min_p/temp/dist(seed)), so a seeded request samples the
  same tokens whatever else is in the batch, and as the single-sequence engine.

``generate`` may be called from many threads at once: each call gets its own
queue of ``Chunk`` values. Stop strings, usage counts, log probabilities and
the final chunk follow ``service.engine.llama.LlamaEngine._generate``.
"""

from __future__ import annotations

import codecs
import collections
import logging
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from sizing.plan import Plan

from ..errors import ContextLengthExceeded, EngineFailure, InsufficientMemory, NotReady, ServiceError
from .base import Cancel, Chunk, GenerationParams, LoadReport, TokenLogprob
from .chat_template import BuiltinChatTemplate, ChatTemplate
from .grammar import compile_grammar, grammar_sampler
from .prompting import Prompting
from .llama import _LogTap, _split_stop, parse_allocations
from .params import apply_context_params, apply_model_params, plan_params

log = logging.getLogger(__name__)

_DONE = object()
_STOP = object()
_PENALTY_LAST_N_TOKENS = 64
"""``Llama.last_n_tokens_size``'s default: the single-sequence engine's penalty window."""


class _ModelView:
    """What ``ChatTemplate.from_llama`` reads from a ``Llama``, over a raw ``LlamaModel``."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.metadata: dict[str, str] = model.metadata()

    def detokenize(self, tokens: list[int], special: bool = False) -> bytes:
        return bytes(self._model.detokenize(tokens, special=special))

    def token_bos(self) -> int:
        return int(self._model.token_bos())

    def token_eos(self) -> int:
        return int(self._model.token_eos())


@dataclass(eq=False)
class _Request:
    """One generation's state, owned by the scheduler thread after admission."""

    tokens: list[int]
    params: GenerationParams
    cancel: Cancel
    max_new_tokens: int
    grammar: Any
    out: "queue.Queue[Any]" = field(default_factory=queue.Queue)
    abandoned: bool = False
    """Set by the consumer when it stops iterating (client gone, stop string seen upstream)."""
    seq: int = -1
    n_past: int = 0
    """Tokens of this sequence in the KV cache."""
    n_fed: int = 0
    """Prompt tokens sent to llama_decode so far."""
    next_token: int | None = None
    """The sampled token not yet decoded (the next step's input)."""
    sampler: Any = None
    n_out: int = 0
    decoder: Any = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))
    pending: str = ""
    pending_lp: list[TokenLogprob] = field(default_factory=list)
    batch_take: int = 0
    batch_logits_idx: int = -1

    @property
    def prompting(self) -> bool:
        return self.n_fed < len(self.tokens)

    @property
    def gone(self) -> bool:
        return self.abandoned or self.cancel.cancelled


class BatchedEngine(Prompting):
    """Several requests decoded in shared ``llama_decode`` batches, behind the ``Engine`` protocol."""

    def __init__(self, *, n_threads: int | None = None, batch_invariant: bool = False) -> None:
        """``batch_invariant``: load without the CPU backend's repacked weight layouts (``use_extra_bufts``
        off). ggml-cpu's repack kernels (ggml/src/ggml-cpu/repack.cpp ``forward_mul_mat``) multiply rows in
        groups of 4 with a gemm and the rest with a gemv, which round differently: a sequence's logits then
        depend on how many other sequences share its batch (0.78 max logit difference measured with 4 rows,
        gemma-3-270m Q4_K_M). Off, a request's tokens do not depend on its neighbours; prompt processing is
        slower."""
        self._n_threads = n_threads
        self._batch_invariant = batch_invariant
        self._lock = threading.Lock()  # load/unload against each other and against new requests
        self._model: Any = None
        self._ctx: Any = None
        self._vocab: Any = None
        self._template: ChatTemplate | BuiltinChatTemplate | None = None
        self._device = "CPU"
        self._n_ctx = 0
        self._n_ctx_seq = 0
        self._n_batch = 0
        self._slots = 0
        self._n_vocab = 0
        self._inbox: "queue.Queue[Any]" = queue.Queue()
        self._thread: threading.Thread | None = None
        self._cells_used = 0
        self._running = 0
        self._batch: Any = None
        self._keep: list[Any] = []
        self._outbox: list[tuple[_Request, Any]] = []
        """Chunks produced during a scheduler iteration, delivered together at its end (``_flush``)."""
        self._piece: dict[int, bytes] = {}
        """Token id -> its text bytes (``detokenize([tok])``), filled as tokens are seen: no ctypes call per token."""
        self._eog: dict[int, bool] = {}
        """Token id -> ``llama_vocab_is_eog``, filled as tokens are seen."""

    # -- Engine protocol -------------------------------------------------

    @property
    def n_ctx(self) -> int:
        """Tokens one request may hold: llama.cpp's per-sequence context (``llama_n_ctx_seq``)."""
        return self._n_ctx_seq

    @property
    def n_ctx_total(self) -> int:
        """Cells of the whole cache (all sequences)."""
        return self._n_ctx

    @property
    def slots(self) -> int:
        """Sequences decoded together (``n_seq_max``)."""
        return self._slots

    @property
    def kv_cells_used(self) -> int:
        return self._cells_used

    @property
    def kv_cells_allocated(self) -> int:
        return self._n_ctx

    @property
    def running_sequences(self) -> int:
        return self._running

    def check(self, params: GenerationParams) -> None:
        """Compile the request's grammar now, so a bad schema is a 400 before any byte is streamed."""
        compile_grammar(params)

    def load(self, path: str, plan: Plan) -> LoadReport:
        import llama_cpp
        from llama_cpp import _internals

        _LogTap.install()
        p = plan.placement
        mparams, cparams = plan_params(plan, use_extra_bufts=not self._batch_invariant)
        mp = llama_cpp.llama_model_default_params()
        keep = apply_model_params(mp, mparams)
        mp.load_mode = llama_cpp.LLAMA_LOAD_MODE_MMAP
        cp = llama_cpp.llama_context_default_params()
        apply_context_params(cp, cparams, n_threads=self._n_threads)
        lines = _LogTap.start()
        t0 = time.perf_counter()
        model = ctx = None
        try:
            model = _internals.LlamaModel(path_model=path, params=mp, verbose=False)
            ctx = _internals.LlamaContext(model=model, params=cp, verbose=False)
        except ValueError as exc:
            if model is not None:
                model.close()
            text = "\n".join(lines[-20:])
            if "out of memory" in text.lower() or "failed to allocate" in text.lower():
                raise InsufficientMemory(f"llama.cpp could not allocate the model: {exc}") from exc
            raise EngineFailure(f"llama.cpp failed to load {path}: {exc}") from exc
        finally:
            _LogTap.stop()
        elapsed = time.perf_counter() - t0
        self.unload()
        with self._lock:
            self._model, self._ctx = model, ctx
            self._vocab = model.vocab
            self._keep = keep
            self._piece, self._eog = {}, {}
            self._n_vocab = int(model.n_vocab())
            self._n_ctx = int(llama_cpp.llama_n_ctx(ctx.ctx))
            self._n_ctx_seq = int(llama_cpp.llama_n_ctx_seq(ctx.ctx))
            self._n_batch = int(llama_cpp.llama_n_batch(ctx.ctx))
            self._slots = int(llama_cpp.llama_n_seq_max(ctx.ctx))
            self._batch = llama_cpp.llama_batch_init(self._n_batch, 0, 1)
            self._template = ChatTemplate.from_llama(_ModelView(model))
            self._device = ",".join(f"CUDA{i}" for i in p.gpus) if p.gpus and p.n_gpu_layers else "CPU"
            self._inbox = queue.Queue()
            self._thread = threading.Thread(target=self._run, args=(self._inbox,), name="batched-scheduler", daemon=True)
            self._thread.start()
        allocs, offloaded = parse_allocations(lines)
        log.info("batched engine: %d slots, n_ctx %d (%d per sequence), n_batch %d",
                 self._slots, self._n_ctx, self._n_ctx_seq, self._n_batch)
        return LoadReport(n_ctx=self._n_ctx_seq, allocations=allocs, offloaded_layers=offloaded,
                          load_seconds=elapsed, log_lines=tuple(lines))

    def unload(self) -> None:
        """Stop the scheduler (requests still queued or running fail with ``NotReady``), free the context."""
        import llama_cpp

        with self._lock:
            thread, self._thread = self._thread, None
            if thread is not None:
                self._inbox.put(_STOP)
                thread.join()
            if self._batch is not None:
                llama_cpp.llama_batch_free(self._batch)
                self._batch = None
            ctx, model = self._ctx, self._model
            self._ctx = self._model = self._vocab = None
            self._template = None
            self._n_ctx = self._n_ctx_seq = self._slots = 0
            self._cells_used = self._running = 0
            if ctx is not None:
                ctx.close()
            if model is not None:
                model.close()
            self._keep = []

    def _require(self) -> Any:
        model = self._model
        if model is None:
            raise NotReady("no model is loaded")
        return model

    def _tokenize(self, text: str, *, add_bos: bool, special: bool = True) -> list[int]:
        return list(self._require().tokenize(text.encode("utf-8"), add_bos, special))

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
                f"({self._slots} slots share {self._n_ctx} cells)",
                param="prompt", prompt_tokens=n_prompt, n_ctx=n_ctx_seq,
            )
        room = n_ctx_seq - n_prompt
        max_new = room if params.max_tokens is None else min(params.max_tokens, room)
        if max_new <= 0:
            yield Chunk(finish_reason="length", prompt_tokens=n_prompt, completion_tokens=0)
            return
        req = _Request(tokens=list(tokens), params=params, cancel=cancel, max_new_tokens=max_new,
                       grammar=compile_grammar(params))
        self._inbox.put(req)
        try:
            while True:
                item = req.out.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            req.abandoned = True

    # -- scheduler thread ------------------------------------------------

    def _run(self, inbox: "queue.Queue[Any]") -> None:
        waiting: collections.deque[_Request] = collections.deque()
        active: list[_Request] = []
        free = list(range(self._slots - 1, -1, -1))  # pop() gives 0 first
        try:
            while True:
                # Block only when idle; else take what has arrived and go on decoding.
                items = [inbox.get()] if not active and not waiting else []
                while True:
                    try:
                        items.append(inbox.get_nowait())
                    except queue.Empty:
                        break
                if any(it is _STOP for it in items):
                    waiting.extend(it for it in items if it is not _STOP)
                    break
                waiting.extend(items)
                for r in [r for r in waiting if r.gone]:
                    waiting.remove(r)
                    self._finish(r, "cancelled", free, active)
                while waiting and free:
                    self._admit(waiting.popleft(), free, active)
                for r in [r for r in active if r.gone]:
                    self._finish(r, "cancelled", free, active)
                if active:
                    self._step(active, free)
                self._cells_used = sum(r.n_past for r in active)
                self._running = len(active)
                self._flush()
        except BaseException as exc:  # a bug here must not leave clients waiting forever
            log.exception("batched scheduler failed")
            err = EngineFailure(f"the batch scheduler failed: {type(exc).__name__}: {exc}")
            for r in list(active):
                self._fail(r, err, free, active)
            self._flush()
            for r in waiting:
                r.out.put(err)
                r.out.put(_DONE)
            waiting.clear()
        gone = NotReady("the model was unloaded")
        for r in list(active):
            self._fail(r, gone, free, active)
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

    def _send(self, r: _Request, item: Any) -> None:
        self._outbox.append((r, item))

    def _flush(self) -> None:
        """Deliver the iteration's chunks, after all of its sampling and just before the next ``llama_decode``.

        Each ``put`` wakes a consumer thread, which then wants the GIL. Woken in the middle of the step, they
        took it whenever the scheduler released it for a ctypes call (every sample, detokenize, EOG test)
        and the scheduler waited for each of them to give it back; on a loaded machine a consumer preempted
        while holding the GIL stalled every sequence. Woken here, they run while ``llama_decode`` (which
        releases the GIL) computes."""
        out, self._outbox = self._outbox, []
        for r, item in out:
            r.out.put(item)

    def _admit(self, r: _Request, free: list[int], active: list[_Request]) -> None:
        import llama_cpp

        r.seq = min(free)  # the lowest free id: the batch's ids stay consecutive (see _step)
        free.remove(r.seq)
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self._ctx.ctx), r.seq, -1, -1)
        seed = r.params.seed if r.params.seed is not None else random.randint(0, 2**31 - 1)
        r.sampler = _sampler_chain(self._model, self._n_vocab, r.params, r.grammar, seed)
        active.append(r)

    def _release(self, r: _Request, free: list[int], active: list[_Request]) -> None:
        import llama_cpp

        if r.seq >= 0:
            llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self._ctx.ctx), r.seq, -1, -1)
            free.append(r.seq)
            r.seq = -1
        if r.sampler is not None:
            llama_cpp.llama_sampler_free(r.sampler)
            r.sampler = None
        if r in active:
            active.remove(r)

    def _finish(self, r: _Request, finish: str, free: list[int], active: list[_Request], *, stopped: bool = False) -> None:
        """The last chunks, as ``LlamaEngine._generate`` ends: flush the decoder, then reason and usage."""
        self._release(r, free, active)
        if not stopped:
            r.pending += r.decoder.decode(b"", final=True)
            if r.pending or r.pending_lp:
                self._send(r, Chunk(text=r.pending, logprobs=tuple(r.pending_lp)))
        self._send(r, Chunk(finish_reason=finish, prompt_tokens=len(r.tokens), completion_tokens=r.n_out))
        self._send(r, _DONE)

    def _fail(self, r: _Request, err: ServiceError, free: list[int], active: list[_Request]) -> None:
        self._release(r, free, active)
        self._send(r, err)
        self._send(r, _DONE)

    def _step(self, active: list[_Request], free: list[int]) -> None:
        """One ``llama_decode``: a token for each generating sequence, then prompt chunks up to n_batch.

        In batch-invariant mode only one prompt is fed per step: with a non-unified cache llama.cpp splits a
        batch into ubatches holding the same number of tokens of every sequence (``split_equal``,
        src/llama-batch.cpp), so several prompts in one step are processed interleaved, token by token,
        and their greedy outputs were seen to differ from one-at-a-time runs."""
        import llama_cpp

        batch = self._batch
        n = 0

        def add(tok: int, pos: int, seq: int, logits: bool) -> None:
            nonlocal n
            batch.token[n] = tok
            batch.pos[n] = pos
            batch.n_seq_id[n] = 1
            batch.seq_id[n][0] = seq
            batch.logits[n] = 1 if logits else 0
            n += 1

        # Who takes part and how many tokens each: one for every generating sequence, then prompt tokens,
        # oldest request first, up to n_batch.
        members: list[_Request] = []
        room = self._n_batch
        for r in active:
            r.batch_take, r.batch_logits_idx = 0, -1
            if r.next_token is not None and room > 0:
                r.batch_take = 1
                room -= 1
                members.append(r)
        for r in active:  # oldest first: admission order
            if room <= 0:
                break
            if r.next_token is None and r.prompting:
                r.batch_take = min(room, len(r.tokens) - r.n_fed)
                room -= r.batch_take
                members.append(r)
                if self._batch_invariant:
                    break  # one prompt per step: prompts never share a ubatch (see _step's docstring)
        # Laid out in increasing sequence id. With a non-unified cache llama.cpp puts into one ubatch only a run
        # of consecutive sequence ids in batch order (src/llama-batch.cpp ``split_equal``, ``sequential``): out
        # of order, 4 generating sequences were decoded as up to 4 ubatches, each a full pass over the weights,
        # and the graph was rebuilt every step (2x the step time measured with 8 slots). llama-server adds its
        # slots in slot-id order (server-context.cpp ``update_slots``).
        members.sort(key=lambda r: r.seq)
        for r in members:
            if r.next_token is not None:
                r.batch_logits_idx = n
                add(r.next_token, r.n_past, r.seq, True)
                continue
            for j in range(r.batch_take):
                i = r.n_fed + j
                last = i == len(r.tokens) - 1
                if last:
                    r.batch_logits_idx = n
                add(r.tokens[i], i, r.seq, last)
        batch.n_tokens = n
        self._flush()  # e.g. the chunks of requests cancelled this iteration: delivered while the batch computes
        ret = int(llama_cpp.llama_decode(self._ctx.ctx, batch))
        if ret != 0:
            self._decode_failed(ret, members, active, free)
            return
        ctx = self._ctx.ctx
        for r in members:
            r.n_past += r.batch_take
            if r.next_token is None:
                r.n_fed += r.batch_take
            r.next_token = None
            if r.batch_logits_idx >= 0:
                self._on_logits(r, r.batch_logits_idx, ctx, free, active)

    def _on_logits(self, r: _Request, idx: int, ctx: Any, free: list[int], active: list[_Request]) -> None:
        """Sample this sequence's next token and turn it into text, as ``LlamaEngine._generate``'s loop does."""
        import llama_cpp

        lp = self._logprob(ctx, idx, r.params.logprobs) if r.params.logprobs is not None else None
        tok = int(llama_cpp.llama_sampler_sample(r.sampler, ctx, idx))
        eog = self._eog.get(tok)
        if eog is None:
            eog = self._eog[tok] = bool(llama_cpp.llama_vocab_is_eog(self._vocab, tok))
        if eog:
            self._finish(r, "stop", free, active)
            return
        r.n_out += 1
        if lp is not None:
            r.pending_lp.append(lp(tok))
        r.pending += r.decoder.decode(self._token_bytes(tok))
        emit, r.pending, stopped = _split_stop(r.pending, [s for s in r.params.stop if s])
        if emit:
            self._send(r, Chunk(text=emit, logprobs=tuple(r.pending_lp)))
            r.pending_lp = []
        if stopped:
            self._finish(r, "stop", free, active, stopped=True)
        elif r.n_out >= r.max_new_tokens:
            self._finish(r, "length", free, active)
        else:
            r.next_token = tok

    def _token_bytes(self, tok: int) -> bytes:
        """``detokenize([tok])``: a function of the token id alone, so computed once per id."""
        piece = self._piece.get(tok)
        if piece is None:
            piece = self._piece[tok] = bytes(self._model.detokenize([tok]))
        return piece

    def _logprob(self, ctx: Any, idx: int, k: int) -> Any:
        """A function of the sampled token: its log-softmax over row ``idx``'s logits, and the top k."""
        import llama_cpp
        import numpy as np

        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, idx), shape=(self._n_vocab,))
        x = logits.astype(np.float64)
        m = x.max()
        lse = m + np.log(np.exp(x - m).sum())
        top: tuple[tuple[str, float], ...] = ()
        if k > 0:
            ids = np.argpartition(-x, k)[:k]
            ids = ids[np.argsort(-x[ids])]
            top = tuple((self._token_bytes(int(i)).decode("utf-8", "replace"), float(x[i] - lse))
                        for i in ids)

        def of(tok: int) -> TokenLogprob:
            piece = self._token_bytes(tok)
            return TokenLogprob(piece.decode("utf-8", "replace"), float(x[tok] - lse), tuple(piece), top)

        return of

    def _decode_failed(self, code: int, members: list[_Request], active: list[_Request], free: list[int]) -> None:
        """llama_decode's codes (llama.h): 1 no KV slot, -2 allocation failed: out of memory for one request,
        which fails while the others go on; anything else fails the whole batch."""
        import llama_cpp

        mem = llama_cpp.llama_get_memory(self._ctx.ctx)
        if code in (1, -2) and members:
            # The request asking for new cells in bulk (a prompt chunk) is the one that does not fit;
            # among generating ones, the largest. Ties: the newest.
            ordered = [r for r in active if r in members]  # admission order (members are in sequence-id order)
            prompting = [r for r in ordered if r.next_token is None]
            pool = prompting or ordered
            victim = max(reversed(pool), key=lambda r: r.n_past + r.batch_take)
            device = _LogTap.failed_device() or self._device
            max_tokens = victim.params.max_tokens
            err = InsufficientMemory(
                f"out of memory on {device} during generation (llama_decode returned {code}) with "
                f"{len(victim.tokens)} prompt tokens and max_tokens {max_tokens}: the KV cache has no room "
                f"for this sequence beside {len(active) - 1} others ({self._n_ctx} cells, {self._slots} slots)",
                device=device, prompt_tokens=len(victim.tokens), max_tokens=max_tokens,
            )
            log.warning("batched decode: %s", err.message)
            self._fail(victim, err, free, active)
            failed = [victim]
        else:
            err2 = EngineFailure(f"llama.cpp failed to decode a batch (llama_decode returned {code})")
            failed = list(members)
            for r in failed:
                self._fail(r, err2, free, active)
        # Undo what a partly processed batch left in the survivors' cells (llama.h: processed ubatches remain).
        for r in members:
            if r not in failed and r.seq >= 0:
                llama_cpp.llama_memory_seq_rm(mem, r.seq, r.n_past, -1)


def _sampler_chain(model: Any, n_vocab: int, params: GenerationParams, grammar: Any, seed: int) -> Any:
    """A sampler chain built as llama-cpp-python 0.3.36 ``Llama._init_sampler`` builds it for
    ``LlamaEngine``'s arguments (top_k 0, min_p 0, typical 1, repeat_penalty 1), so outputs match."""
    import llama_cpp

    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())

    def add(s: Any) -> None:
        llama_cpp.llama_sampler_chain_add(chain, s)

    add(llama_cpp.llama_sampler_init_penalties(n_vocab, _PENALTY_LAST_N_TOKENS, 1.0,
                                               params.frequency_penalty, params.presence_penalty))
    if grammar is not None:
        add(grammar_sampler(model.vocab, grammar))
    temp = params.temperature
    if temp < 0.0:
        add(llama_cpp.llama_sampler_init_dist(seed))
    elif temp == 0.0:
        add(llama_cpp.llama_sampler_init_greedy())
    else:
        add(llama_cpp.llama_sampler_init_top_k(0))
        add(llama_cpp.llama_sampler_init_typical(1.0, 1))
        add(llama_cpp.llama_sampler_init_top_p(params.top_p, 1))
        add(llama_cpp.llama_sampler_init_min_p(0.0, 1))
        add(llama_cpp.llama_sampler_init_temp(temp))
        add(llama_cpp.llama_sampler_init_dist(seed))
    return chain
