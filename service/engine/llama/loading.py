"""A plan into llama.cpp objects: the model, its context and what comes with them (an embedding context, a draft
model or MTP head, a vision projector), held together as one ``Loaded`` value until the unload closes them.

The plan's parameters are applied once (``service.engine.params``); llama.cpp's load log is tapped
(``service.engine.loglines``) so that the report can show what it allocated beside the plan.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from sizing.memory import mtp_config, mtp_supported
from sizing.plan import Plan
from sizing.units import gpu_label

from ...errors import EngineFailure, InsufficientMemory, ServiceError
from ..draft import DraftModelRunner, VocabularyMismatch, vocabulary_mismatch
from ..loglines import LogTap
from ..mtp import MtpRunner
from ..params import (apply_context_params, apply_model_params, context_params, draft_params, embedding_context_params,
                      plan_params)
from ..vision import Images

log = logging.getLogger(__name__)

POOLING = {"mean": 1, "cls": 2, "last": 3}
"""llama.h's ``LLAMA_POOLING_TYPE_MEAN``, ``_CLS``, ``_LAST``: the poolings ``Pooler`` reads."""
RANK_POOLING = 4
"""llama.h's ``LLAMA_POOLING_TYPE_RANK``: the classification head on the pooled sequence (rerankers), whose
``llama_get_embeddings_seq`` is ``n_cls_out`` scores."""


@dataclass
class Embedding:
    """The embedding context (``embeddings`` on, a pooling type) beside the generation context, same weights."""

    ctx: Any
    tokens: int
    """Tokens one batch holds (``llama_n_batch``)."""
    seqs: int
    batch: Any
    pooling: int
    pieces: bool
    """Batches are evaluated in pieces (``Pooler``): a causal model that declares no pooling."""


@dataclass
class Loaded:
    """One load's llama.cpp objects and the figures read off them (fixed until the unload)."""

    model: Any
    ctx: Any
    mem: Any
    vocab: Any
    keep: list[Any]
    """Objects llama.cpp holds pointers into (the model parameters' arrays)."""
    n_vocab: int
    n_ctx: int
    n_ctx_seq: int
    n_batch: int
    n_slots: int
    n_swa: int
    n_embd: int
    unified: bool
    device: str
    """Where the layers run, for messages (``CUDA0,CUDA1`` or ``CPU``)."""
    batch: Any
    """The generation context's ``llama_batch`` (n_batch tokens)."""
    drafts: bool
    """This model is drafted for: speculation on and no recurrent state (a rejected draft's tokens cannot be taken
    back from one: ``llama_memory_seq_rm`` refuses a tail of a recurrent sequence)."""
    runner: DraftModelRunner | MtpRunner | None = None
    """The plan's draft model or the file's MTP head; None: n-gram drafts."""
    images: Images | None = None
    """The projector (mtmd) where the plan has one: the model takes images."""
    embedding: Embedding | None = None
    n_cls_out: int = 1
    """Values rank pooling gives a sequence (``llama_model_n_cls_out``): the first is the relevance score."""
    rerank_template: str | None = None
    """The GGUF's ``tokenizer.chat_template.rerank`` (``{query}``, ``{document}``), when it has one."""
    lines: list[str] = field(default_factory=list)
    """llama.cpp's log lines of the load: the main context's, then the embedding context's, the draft's, the MTP
    head's and the projector's (``spans``)."""
    spans: tuple[int, int, int, int] = (0, 0, 0, 0)
    """Where each part's lines end in ``lines``: main, embedding, draft, MTP (the projector's run to the end)."""
    use_extra_bufts: bool = False
    n_threads: int = 0
    cparams: Any = None
    """The plan's context parameters (``service.engine.params.ContextParams``)."""


def declared_pooling(model: Any) -> int | None:
    """The pooling the GGUF declares (``{arch}.pooling_type``) when it is mean, cls, last or rank; else None."""
    meta = model.metadata()
    declared = meta.get(f"{meta.get('general.architecture', '')}.pooling_type")
    try:
        value = int(declared) if declared is not None else -1
    except ValueError:
        value = -1
    return value if value in POOLING.values() or value == RANK_POOLING else None


def load(path: str, plan: Plan, *, n_threads: int | None, batch_invariant: bool, speculative: bool,
         pooling_fallback: str) -> Loaded:
    """The plan's llama.cpp objects. ``InsufficientMemory`` where llama.cpp could not allocate them,
    ``EngineFailure`` where it failed otherwise; nothing is left open either way. ``batch_invariant``: without
    repacked weights, and with no draft model or MTP head (n-gram drafts only, in steps small enough to leave a
    row's rounding alone: ``step.BatchStep.run``)."""
    import llama_cpp
    from llama_cpp import _internals

    LogTap.install()
    mparams, cparams = plan_params(plan, use_extra_bufts=not batch_invariant)
    mp = llama_cpp.llama_model_default_params()
    keep = apply_model_params(mp, mparams)
    mp.load_mode = llama_cpp.LLAMA_LOAD_MODE_MMAP
    cp = llama_cpp.llama_context_default_params()
    apply_context_params(cp, cparams, n_threads=n_threads)
    lines = LogTap.start()
    model = ctx = emb = None
    runner: DraftModelRunner | MtpRunner | None = None
    images: Images | None = None
    emb_pieces = False
    eparams = embedding_context_params(plan.cfg)
    ecp: Any = None
    try:
        model = _internals.LlamaModel(path_model=path, params=mp, verbose=False)
        ctx = _internals.LlamaContext(model=model, params=cp, verbose=False)
        n_main = len(lines)  # the embedding context's lines are reported apart (LoadReport.embedding_allocations)
        if eparams is not None:
            emb, ecp, emb_pieces = _embedding_context(model, eparams, n_threads, pooling_fallback)
        n_emb = len(lines)
        model_drafts = speculative and not batch_invariant
        if plan.draft is not None and model_drafts:
            runner = _load_draft(plan, mparams.use_extra_bufts, model, n_threads)
        n_draft = len(lines)
        if runner is None and plan.cfg.mtp and model_drafts:
            runner = _load_mtp(ctx, plan, model, os.path.basename(path), n_threads)
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
        raise _load_failure(exc, lines, path) from exc
    finally:
        LogTap.stop()
    embedding = None
    if emb is not None and eparams is not None:
        n = int(llama_cpp.llama_n_batch(emb.ctx))
        embedding = Embedding(emb, n, eparams.n_seq_max, llama_cpp.llama_batch_init(n, 0, 1), int(ecp.pooling_type),
                              emb_pieces)
    n_batch = int(llama_cpp.llama_n_batch(ctx.ctx))
    n_slots = int(llama_cpp.llama_n_seq_max(ctx.ctx))
    p = plan.placement
    raw = llama_cpp.llama_model_chat_template(model.model, b"rerank")
    return Loaded(
        model=model, ctx=ctx, mem=llama_cpp.llama_get_memory(ctx.ctx), vocab=model.vocab, keep=keep,
        n_vocab=int(model.n_vocab()), n_ctx=int(llama_cpp.llama_n_ctx(ctx.ctx)),
        n_ctx_seq=int(llama_cpp.llama_n_ctx_seq(ctx.ctx)), n_batch=n_batch, n_slots=n_slots,
        n_swa=int(llama_cpp.llama_model_n_swa(model.model)), n_embd=int(model.n_embd()),
        unified=bool(cparams.kv_unified) or n_slots == 1,
        device=",".join(plan.gpus[i].label if i < len(plan.gpus) else gpu_label(i) for i in p.gpus)
        if p.gpus and p.n_gpu_layers else "CPU",
        batch=llama_cpp.llama_batch_init(n_batch, 0, 1),
        drafts=speculative and not (llama_cpp.llama_model_is_recurrent(model.model)
                                    or llama_cpp.llama_model_is_hybrid(model.model)),
        runner=runner, images=images, embedding=embedding,
        n_cls_out=max(1, int(llama_cpp.llama_model_n_cls_out(model.model))),
        rerank_template=raw.decode("utf-8", "replace") if raw else None,
        lines=lines, spans=(n_main, n_emb, n_draft, n_mtp), use_extra_bufts=mparams.use_extra_bufts,
        n_threads=int(cp.n_threads), cparams=cparams)


def _embedding_context(model: Any, eparams: Any, n_threads: int | None, pooling_fallback: str) -> tuple[Any, Any, bool]:
    """The embedding context beside the generation one: (context, its parameters, whether it takes pieces)."""
    import llama_cpp
    from llama_cpp import _internals

    ecp = llama_cpp.llama_context_default_params()
    apply_context_params(ecp, eparams, n_threads=n_threads)
    declared = declared_pooling(model)
    ecp.pooling_type = declared if declared is not None else POOLING.get(pooling_fallback, POOLING["mean"])
    emb = _internals.LlamaContext(model=model, params=ecp, verbose=False)
    # Pieces carry a sequence through the cache, which needs causal attention (``decode`` asserts a non-causal
    # sequence whole in one ubatch) and a pooling this engine can combine: a model that declares one may pool
    # through layers of its own (a classifier, dense projections).
    return emb, ecp, bool(llama_cpp.llama_get_causal_attn(emb.ctx)) and declared is None


def _load_failure(exc: ValueError, lines: list[str], path: str) -> ServiceError:
    """llama-cpp-python's ValueError for a failed load, typed by llama.cpp's last log lines."""
    text = "\n".join(lines[-20:]).lower()
    if "out of memory" in text or "failed to allocate" in text:
        return InsufficientMemory(f"llama.cpp could not allocate the model: {exc}")
    return EngineFailure(f"llama.cpp failed to load {path}: {exc}")


def close(loaded: Loaded) -> None:
    """Free what ``load`` made (batches, the draft, the projector, the contexts, the model)."""
    import llama_cpp

    llama_cpp.llama_batch_free(loaded.batch)
    if loaded.embedding is not None:
        llama_cpp.llama_batch_free(loaded.embedding.batch)
        loaded.embedding.ctx.close()
    if loaded.runner is not None:
        loaded.runner.close()
    if loaded.images is not None:
        loaded.images.close()
    loaded.ctx.close()
    loaded.model.close()


def reserve_draft_rows(loaded: Loaded, rows: int) -> int:
    """Grow llama.cpp's output buffer to hold ``rows`` drafted tokens' logits beside one row per sequence, now
    rather than at the first draft: one batch of that many outputs in sequence 0 of the empty context, then
    removed. ``output_reserve`` (src/llama-context.cpp) reallocates to ``n_vocab * max(n_outputs, n_seq_max)``
    F32 and logs it only in debug builds, so the plan's line (``sizing.memory.draft_output_bytes``) and this
    figure are llama.cpp's formula; what is measured is that the batch was accepted. 0: no rows (none planned,
    or the batch failed: drafts then stay in the rows of idle slots). On the scheduler thread (a decode on another
    gives that thread an OpenMP team of its own)."""
    import llama_cpp

    n_slots = loaded.n_slots
    rows = max(0, min(rows, loaded.n_batch - n_slots, loaded.n_ctx_seq - n_slots))
    if rows <= 0:
        return 0
    n = n_slots + rows
    batch = loaded.batch
    tok = max(0, int(llama_cpp.llama_vocab_bos(loaded.vocab)))
    for i in range(n):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, i, 1, 1
        batch.seq_id[i][0] = 0
    batch.n_tokens = n
    ret = int(llama_cpp.llama_decode(loaded.ctx.ctx, batch))
    llama_cpp.llama_memory_seq_rm(loaded.mem, 0, -1, -1)
    if ret != 0:
        log.warning("llama engine: the output buffer could not grow for %d drafted rows (llama_decode %d): drafts "
                    "use idle slots' rows only", rows, ret)
        return 0
    return rows


def _load_mtp(main: Any, plan: Plan, model: Any, name: str, n_threads: int | None) -> MtpRunner:
    """The MTP context of a model loaded with its NextN block (``service.engine.mtp``; the plan's
    ``sizing.memory.mtp``): the main context's size, sequences, batch and cache type, a KV cache of the NextN
    layer alone. Raises ``ValueError`` where llama.cpp cannot create it."""
    import llama_cpp
    from llama_cpp import _internals

    if not mtp_supported(plan.model):
        raise ValueError(f"no MTP drafting for {plan.model.architecture} with "
                         f"{plan.model.n_layer_all - plan.model.n_layer} NextN block(s)")
    cp = llama_cpp.llama_context_default_params()
    apply_context_params(cp, context_params(mtp_config(plan.cfg)), n_threads=n_threads)
    cp.ctx_other = main.ctx
    ctx = _internals.LlamaContext(model=model, params=cp, verbose=False)
    try:
        return MtpRunner(main.ctx, ctx, n_slots=int(llama_cpp.llama_n_seq_max(ctx.ctx)), name=name)
    except BaseException:
        ctx.close()
        raise


def _load_draft(plan: Plan, use_extra_bufts: bool, main: Any, n_threads: int | None) -> DraftModelRunner:
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
    apply_context_params(cp, cparams, n_threads=n_threads)
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


def abort_callback(fn: Any) -> Any:
    """``fn`` (no arguments, True to abort) as llama.cpp's ``ggml_abort_callback``; the caller keeps it alive."""
    import llama_cpp

    @llama_cpp.ggml_abort_callback  # type: ignore[untyped-decorator]
    def _cb(_data: ctypes.c_void_p) -> bool:
        return bool(fn())

    return _cb
