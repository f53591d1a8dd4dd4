"""``LlamaEngine``: the ``Engine`` protocol over llama.cpp, assembled from the package's parts at each load.

The parts, each with one job (see the package's docstring): ``loading`` (plan -> llama.cpp objects),
``scheduler`` (the thread and its loop), ``step`` (one batch), ``slotting`` (slots, prefix reuse, the prompt cache's
tiers), ``sequences`` (sampling, forks, ends), ``drafting`` (n-gram, draft model, MTP), ``pooling`` (embeddings,
rerank). Token ids in and out: prompts and text are the API process's (``service.text``).
"""

from __future__ import annotations

import logging
import os
import queue
import random
import threading
import time
from typing import Any, Iterator

from sizing.plan import Plan
from sizing.units import MIB

from ...errors import BadRequest, ContextLengthExceeded, NotReady
from ...grammar.schema import compile_grammar
from ..base import (Cancel, Chunk, CachedPrompt, EmbeddingResult, EngineGauges, EngineLimits, GenerationParams, ImageInput,
                    LoadReport, RerankResult, check_limits, current_delivery)
from ..loglines import parse_allocations, projector_allocations
from ..mtp import MtpRunner
from ..native import cuda_order
from ..params import repack_of
from ..prompt_cache import PromptCache, model_fingerprint, plan_budget
from ..replay import TOLERANCE
from ..sampling import draw_key
from ..slots import SLOT_PROMPT_SIMILARITY
from ..speculation import DRAFT_MAX
from ..vision import ImageChunk
from . import loading
from .drafting import Drafting
from .loading import Loaded
from .pooling import Pooler
from .scheduler import Scheduler
from .sequences import Sequences
from .slotting import SlotTable
from .state import DONE, Sequence
from .step import BatchStep

log = logging.getLogger("service.engine.llama")


class _Load:
    """One load's parts, made together and dropped together."""

    def __init__(self, loaded: Loaded, engine: "LlamaEngine", pcache: PromptCache) -> None:
        self.loaded = loaded
        self.slots = SlotTable(loaded, pcache, cache_prompt=engine._cache_prompt, similarity=engine._similarity,
                               batch_invariant=engine._batch_invariant)
        self.drafting = Drafting(loaded.runner, on=loaded.drafts, draft_max=engine._draft_max,
                                 replay_tolerance=engine._replay_tolerance)
        if pcache.directory is not None:  # the greedy answers by prompt, as they were before a restart or reload
            self.drafting.replays.load(pcache.replays())
            self.drafting.replays.persist = pcache.put_replays
        self.seqs = Sequences(loaded, self.slots, self.drafting, cache_prompt=engine._cache_prompt)
        self.step = BatchStep(loaded, self.slots, self.seqs, self.drafting, batch_invariant=engine._batch_invariant)
        self.scheduler: Scheduler
        self.pooler = Pooler(loaded.embedding, n_vocab=loaded.n_vocab, n_embd=loaded.n_embd,
                             n_cls_out=loaded.n_cls_out, on_scheduler=lambda *a, **k: self.scheduler.call(*a, **k))
        self.scheduler = Scheduler(self.step, self.seqs, self.slots, self.pooler, self.drafting)
        self.limits = EngineLimits(n_ctx=loaded.n_ctx_seq, slots=loaded.n_slots, n_vocab=loaded.n_vocab,
                                   n_batch=loaded.n_batch, kv_cells_allocated=loaded.n_ctx,
                                   embedding=self.pooler.limits(), rerank=self.pooler.rerank_limit(),
                                   images=loaded.images is not None)
        """Fixed for the load's life: read by every request's checks, computed once."""


class LlamaEngine:
    """llama.cpp behind the ``Engine`` protocol: slots that remember their prompts, decoded in shared batches."""

    def __init__(self, *, n_threads: int | None = None, batch_invariant: bool = False, cache_prompt: bool = True,
                 slot_prompt_similarity: float = SLOT_PROMPT_SIMILARITY, embedding_pooling: str = "mean",
                 prompt_cache_mib: int = 0, prompt_cache_dir: str | None = None,
                 prompt_cache_disk_mib: int = 0, speculative: bool = True, draft_max: int = DRAFT_MAX,
                 replay_tolerance: float = TOLERANCE) -> None:
        """``n_threads``: default the physical cores (``params.physical_cores``), as llama.cpp's tools.

        ``cache_prompt``: keep each slot's KV after a request and reuse its common prefix with the next
        prompt (off: every request is evaluated from an empty sequence).

        ``batch_invariant``: load without the CPU backend's repacked weight layouts (``use_extra_bufts``
        off). ggml-cpu's repack kernels (ggml/src/ggml-cpu/repack.cpp ``forward_mul_mat``) multiply rows in
        groups of 4 with a gemm and the rest with a gemv, which round differently: a token's logits then
        depend on how many other tokens share its batch (0.78 max logit difference measured with 4 rows,
        gemma-3-270m Q4_K_M), across requests and across the chunks a prompt is evaluated in. Off, a
        request's tokens do not depend on its neighbours; prompt processing is slower.

        ``embedding_pooling``: the pooling of /v1/embeddings for models whose GGUF declares none (mean, cls,
        last); the embedding context itself is sized by the plan (``ContextConfig.embedding_tokens``).

        ``prompt_cache_mib``: the ceiling of the host memory idle conversations' KV may hold beyond the slots
        (``service.engine.prompt_cache``; the load's budget is planned under it; 0: off); ``prompt_cache_dir``:
        also keep them on disk there, at most ``prompt_cache_disk_mib``.

        ``speculative``: draft up to ``draft_max`` tokens a step from each sequence's own tokens and keep those
        the model chooses itself (``service.engine.speculation``; in batch-invariant mode only n-gram drafts,
        so few that the step stays a small batch, whose rows ggml-cpu computes as it computes a step of one row:
        ``BatchStep.run``). Drafted rows fit in the logits rows llama.cpp reserves at
        context creation (one per sequence, ``output_reserve(n_seq_max)``) and in the rows the plan adds for them
        (``ContextConfig.draft_rows``, reserved at load): a step drafts at most the idle slots' rows and those.

        ``replay_tolerance``: a greedy request whose prompt was answered before in its cache scope takes that
        answer's token wherever it is within this many logits of the argmax, and drafts it whole
        (``service.engine.replay``); a seeded temperature draw, where the draw picks it with each logit moved by
        half as much; 0: off."""
        cuda_order(os.environ)  # in this process, before CUDA starts (service.engine.native)
        self._n_threads = n_threads
        self._pooling_fallback = embedding_pooling
        self._batch_invariant = batch_invariant
        self._speculative = speculative
        self._draft_max = max(0, draft_max)
        self._replay_tolerance = max(0.0, replay_tolerance)
        self._cache_prompt = cache_prompt
        self._similarity = slot_prompt_similarity
        self._pc_ceiling = max(0, prompt_cache_mib) * MIB
        self._pc_dir = prompt_cache_dir
        self._pc_disk = max(0, prompt_cache_disk_mib) * MIB
        self._lock = threading.Lock()  # load/unload against each other
        self._load: _Load | None = None

    # -- what a load holds

    def _now(self) -> _Load:
        current = self._load
        if current is None:
            raise NotReady("no model is loaded")
        return current

    @property
    def loaded(self) -> Loaded | None:
        """The load's llama.cpp objects (None when nothing is loaded): for tests and benches that look inside."""
        current = self._load
        return current.loaded if current is not None else None

    @property
    def pooler(self) -> Pooler:
        return self._now().pooler

    # -- Engine protocol: figures

    @property
    def limits(self) -> EngineLimits:
        current = self._load
        return current.limits if current is not None else EngineLimits()

    def gauges(self) -> EngineGauges:
        """Cells holding tokens (running requests' and the cached prompts of idle slots, shared cells once), the
        sequences of the last step, prompt tokens given to ``llama_decode`` since load (cached prefixes and forked
        choices do not count), the prompt cache beyond the slots."""
        current = self._load
        if current is None:
            return EngineGauges(prompt_cache=PromptCache(0).gauges())
        return EngineGauges(kv_cells_used=current.slots.cells.used, running_sequences=current.scheduler.running,
                            prompt_tokens_evaluated=current.step.evaluated,
                            prompt_cache=current.slots.pcache.gauges())

    def busy_for_s(self) -> float:
        """How long the scheduler thread has been in one step, embedding decode or call (0: waiting for work, or
        nothing loaded): what the runner's watchdog reads (``Scheduler.busy_for_s``)."""
        current = self._load
        return current.scheduler.busy_for_s() if current is not None else 0.0

    def cached_prompts(self) -> tuple[CachedPrompt, ...]:
        """Each slot's cached tokens (``GPU``: llama.cpp's KV cache) and the prompt cache's entries in host memory
        (``CPU``) and on disk (``DISK``; an entry in both is in both). Read without stopping generation: a slot
        changing meanwhile is caught by the next read."""
        current = self._load
        if current is None:
            return ()
        out = [CachedPrompt("GPU", s.scope, tuple(s.tokens)) for s in current.slots.slots if s.tokens]
        for e in list(current.slots.pcache.entries):
            if e.state is not None:
                out.append(CachedPrompt("CPU", e.scope, tuple(e.tokens)))
            if e.path is not None:
                out.append(CachedPrompt("DISK", e.scope, tuple(e.tokens)))
        return tuple(out)

    def check(self, params: GenerationParams) -> None:
        """Compile the request's grammar now, so a bad schema is a 400 before any byte is streamed; token ids of
        ``logit_bias`` within the vocabulary; no more choices than slots."""
        compile_grammar(params)
        limits = self.limits
        check_limits(params, limits.n_vocab, limits.slots)

    # -- load and unload

    def load(self, path: str, plan: Plan) -> LoadReport:
        t0 = time.perf_counter()
        loaded = loading.load(path, plan, n_threads=self._n_threads, batch_invariant=self._batch_invariant,
                              speculative=self._speculative, pooling_fallback=self._pooling_fallback)
        elapsed = time.perf_counter() - t0
        self.unload()
        with self._lock:
            try:
                current = _Load(loaded, self, self._open_prompt_cache(path, plan, loaded))
            except BaseException:
                loading.close(loaded)
                raise
            self._load = current
            current.scheduler.start()
            if loaded.drafts and plan.cfg.draft_rows > 0:
                # On the scheduler thread: a decode on this one would give it an OpenMP team of its own, which
                # slowed every later decode of the process by a third (``scheduler``'s "One compute thread").
                rows = plan.cfg.draft_rows
                current.drafting.rows = current.scheduler.call(lambda: loading.reserve_draft_rows(loaded, rows))
        return self._report(path, plan, current, elapsed)

    def _report(self, path: str, plan: Plan, current: _Load, elapsed: float) -> LoadReport:
        import llama_cpp

        loaded = current.loaded
        lines, (n_main, n_emb, n_draft, n_mtp) = loaded.lines, loaded.spans
        pm = plan.estimate.projector if plan.estimate is not None else None
        allocs, offloaded = parse_allocations(lines[:n_main])
        why = "batch-invariant mode" if self._batch_invariant else repack_of(plan).reason
        pc = current.slots.pcache
        log.info("llama engine: %d slots (%s cache), n_ctx %d (%d per sequence), n_batch %d, threads %d, prompt cache %s "
                 "(beyond the slots: %d MiB of host memory%s), CPU weight repacking %s (%s)",
                 loaded.n_slots, "unified" if loaded.cparams.kv_unified else "per-sequence", loaded.n_ctx,
                 loaded.n_ctx_seq, loaded.n_batch, loaded.n_threads,
                 "on" if self._cache_prompt else "off", pc.budget_bytes >> 20,
                 f", {pc.disk_entries} entries on disk in {pc.directory}" if pc.directory else "",
                 "on" if loaded.use_extra_bufts else "off", why)
        n_nextn = int(llama_cpp.llama_model_n_layer_nextn(loaded.model.model))
        mtp = isinstance(loaded.runner, MtpRunner)
        if n_nextn:
            log.info("llama engine: the file's %d NextN/MTP block(s) %s", n_nextn,
                     "draft (MTP), planned beside the model" if mtp else
                     f"are not loaded ({plan.mtp_refusal or 'no MTP head asked for'}) and not planned")
        return LoadReport(limits=self.limits, n_ctx=loaded.n_ctx_seq, allocations=allocs, offloaded_layers=offloaded,
                          load_seconds=elapsed, log_lines=tuple(lines[:n_main]),
                          embedding_allocations=parse_allocations(lines[n_main:n_emb])[0],
                          draft_output_bytes=current.drafting.rows * loaded.n_vocab * 4,
                          draft_allocations=parse_allocations(lines[n_emb:n_draft])[0],
                          projector_allocations=projector_allocations(lines[n_mtp:], pm.device) if pm is not None else (),
                          mtp_allocations=parse_allocations(lines[n_draft:n_mtp])[0],
                          mtp_rows_bytes=loaded.n_embd * loaded.n_batch * 4 if mtp else 0)

    def _open_prompt_cache(self, path: str, plan: Plan, loaded: Loaded) -> PromptCache:
        """The load's prompt cache beyond the slots: its planned budget, and its folder on disk when one is set."""
        import llama_cpp

        if not self._cache_prompt:
            return PromptCache(0)
        pc = PromptCache(plan_budget(plan, self._pc_ceiling))
        if self._pc_dir and self._pc_disk > 0:
            from pathlib import Path

            cparams = loaded.cparams
            fields = {"model": model_fingerprint(path), "type_k": cparams.type_k, "type_v": cparams.type_v,
                      "flash_attn": cparams.flash_attn_type, "n_ctx_seq": loaded.n_ctx_seq,
                      "swa_full": bool(cparams.swa_full), "n_swa": loaded.n_swa, "n_embd": loaded.n_embd,
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

    def unload(self) -> None:
        """Stop the scheduler (requests still queued or running fail with ``NotReady``), free the context."""
        with self._lock:
            current, self._load = self._load, None
            if current is None:
                return
            current.scheduler.stop()
            current.slots.keep_all()  # what the slots hold outlives the context on disk
            current.slots.pcache.close()
            current.pooler.close()  # after a running embedding batch
            loading.close(current.loaded)

    def set_prompt_cache_budget(self, budget_bytes: int) -> None:
        """Another budget for the prompt cache beyond the slots (residency empties it before it evicts or refuses a
        model for memory, then gives it what is left): on the scheduler thread, which owns the entries."""
        current = self._load
        if current is not None:
            current.scheduler.call(lambda: current.slots.pcache.set_budget(budget_bytes))

    def forget(self) -> None:
        """Drop every idle slot's cached prompt, the prompt cache beyond the slots (its files too) and the answers
        the n-gram drafts look up (the next requests start from empty sequences)."""
        current = self._load
        done = threading.Event()
        if current is not None and current.scheduler.post(done):
            done.wait()

    # -- embeddings and rerank (``pooling``)

    def embed(self, inputs: list[list[int]], cancel: Cancel) -> EmbeddingResult:
        return self._now().pooler.embed(inputs, cancel)

    def rerank(self, inputs: list[list[int]], cancel: Cancel) -> RerankResult:
        return self._now().pooler.rerank(inputs, cancel)

    # -- images

    def image_tokens(self, image: ImageInput, param: str) -> tuple[list[int], list[int], list[int]]:
        """An image's tokens (the projector's: before, its run, after); the chunk stays with the projector, found
        again by the run's ids when a prompt holds them (``Images.find``)."""
        images = self._now().loaded.images
        if images is None:
            raise BadRequest(f"{param}: this model takes no images (it was loaded without a vision projector: "
                             "mmproj)", param=param)
        before, chunk, after = images.tokens(image, param)
        return list(before), list(chunk.run), list(after)

    # -- generation

    def generate(self, tokens: list[int], params: GenerationParams, cancel: Cancel) -> Iterator[Chunk]:
        """The chunks of one generation; safe to call (and iterate) from many threads at once."""
        current = self._now()
        loaded = current.loaded
        n_prompt = len(tokens)
        n_ctx_seq = loaded.n_ctx_seq
        if n_prompt >= n_ctx_seq:
            # The service checks this first (``_check_context`` with ``n_ctx``); direct callers get the same error.
            raise ContextLengthExceeded(
                f"the prompt has {n_prompt} tokens; a sequence holds {n_ctx_seq} "
                f"({loaded.n_slots} slots share {loaded.n_ctx} cells)",
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
        images = self._images_of(loaded, tokens, params.images)
        deliver = current_delivery()
        out: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        base_seed = params.seed if params.seed is not None else random.randint(0, 2**31 - 1)
        reqs = [
            Sequence(tokens=list(tokens), params=params, cancel=cancel, max_new_tokens=max_new,
                     grammar=compile_grammar(params) if i else grammar, greedy=greedy, deliver=deliver, out=out,
                     index=i, seed=(base_seed + i) % 2**32)
            for i in range(max(1, params.n))
        ]
        current.drafting.assign(reqs, params, images=bool(images))
        if not images:  # the answer given before to this prompt, greedy or by this seed's draw
            for r in reqs:
                r.replay_key = "" if greedy else draw_key(params, r.grammar, r.seed)
                if r.replay_key is not None:
                    r.replay = current.drafting.replays.find(params.cache_scope, tokens, r.replay_key)
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
        if not current.scheduler.post(reqs[0]):
            raise NotReady("the model was unloaded")
        left = len(reqs)
        try:
            while True:
                item = out.get()
                if item is DONE:
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

    @staticmethod
    def _images_of(loaded: Loaded, tokens: list[int], given: tuple[ImageInput, ...] = ()) -> dict[int, ImageChunk]:
        """The images of a prompt (runs of negative ids, ``service.engine.vision``) by where each begins; ``given``:
        the request's images, prepared again where their chunks were dropped."""
        if not tokens or min(tokens) >= 0:
            return {}
        if loaded.images is None:
            raise BadRequest("this model takes no images: it was loaded without a vision projector (mmproj)",
                             param="messages")
        if tokens[-1] < 0:  # the first token is sampled from the logits of a text token
            raise BadRequest("a prompt may not end with an image", param="messages")
        return dict(loaded.images.find(tokens, given))
