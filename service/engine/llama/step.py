"""One ``llama_decode``: a token for each generating sequence (and its guesses), then prompt chunks up to n_batch;
then each sequence's rows handed to its sampling (``Sequences``), or a failed decode's outcome applied.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Sequence as Seq

from ...errors import EngineFailure, InsufficientMemory
from ..loglines import LogTap
from ..slots import INVARIANT_MIN_ROWS
from .loading import abort_callback

if TYPE_CHECKING:
    from .drafting import Drafting
    from .loading import Loaded
    from .sequences import Sequences
    from .slotting import SlotTable
    from .state import Sequence

log = logging.getLogger(__name__)

ABORT_MIN_PROMPT_TOKENS = 256
"""A batch feeding this many tokens of one prompt is decoded with llama.cpp's abort callback set."""


class BatchStep:
    """Builds and decodes a step's batch for the active sequences (the scheduler thread's)."""

    def __init__(self, loaded: "Loaded", slots: "SlotTable", seqs: "Sequences", drafting: "Drafting", *,
                 batch_invariant: bool) -> None:
        self._l = loaded
        self._slots = slots
        self._seqs = seqs
        self._drafting = drafting
        self._batch_invariant = batch_invariant
        self.evaluated = 0
        """Prompt tokens given to ``llama_decode`` since load: cached prefixes and forked choices do not count."""
        self._watch: list["Sequence"] = []
        """The requests whose prompt the running ``llama_decode`` evaluates, while the abort callback is set."""
        self._abort_cb = abort_callback(lambda: bool(self._watch) and all(r.gone for r in self._watch))
        self._prompt_turn = False
        """Batch-invariant mode, prompts and generating sequences both waiting: the next step is a prompt's."""

    def run(self, active: list["Sequence"]) -> None:
        """One ``llama_decode`` of the active sequences (the caller's list, admission order).

        In batch-invariant mode a step is either the generating sequences' tokens (and their drafts, fewer than
        ``INVARIANT_MIN_ROWS`` rows in all) or one prompt's chunk (at least ``INVARIANT_MIN_ROWS`` rows where the
        prompt has them), taking turns when both wait. ggml-cpu computes a row alike in every batch of fewer than
        ``INVARIANT_MIN_ROWS`` rows and alike in every larger one, but not alike across the two (see
        ``INVARIANT_MIN_ROWS``): a generated token beside another request's prompt chunk, or a drafted step of 8
        rows, came out as neither a step alone nor a cold prompt computes it. Only one prompt is fed per step: with
        a non-unified cache llama.cpp splits a batch into ubatches holding the same number of tokens of every
        sequence (``split_equal``, src/llama-batch.cpp), so several prompts in one step are processed interleaved,
        token by token, and their greedy outputs were seen to differ from one-at-a-time runs."""
        import llama_cpp

        members = self._members(active)
        n, n_prompt_fed, watch, runs = self._fill(members)
        self._l.batch.n_tokens = n
        self._seqs.flush()  # e.g. the chunks of requests cancelled this iteration: delivered while the batch computes
        ctx = self._l.ctx.ctx
        # The abort callback lets a client that leaves stop a long prompt's evaluation, but it is a Python call
        # per graph node (ggml-cpu.c ``ggml_graph_compute_thread``): only for batches that evaluate a long prompt.
        if watch:
            self._watch = [r for r in members if r.next_token is None]
            llama_cpp.llama_set_abort_callback(ctx, self._abort_cb, None)
        t0 = time.perf_counter()
        try:
            ret = int(llama_cpp.llama_decode(ctx, self._l.batch))
        finally:
            if watch:
                llama_cpp.llama_set_abort_callback(ctx, llama_cpp.ggml_abort_callback(), None)
                self._watch = []
        if ret != 0:
            self._failed(ret, members, active)
            return
        if not n_prompt_fed:  # a step of generated tokens and drafts alone: what a draft's rows cost here
            self._drafting.costs.record(n, time.perf_counter() - t0)
        self._drafting.observe(runs, n)
        self.evaluated += n_prompt_fed
        self._after(members, ctx, canon=n >= INVARIANT_MIN_ROWS)

    def _members(self, active: list["Sequence"]) -> list["Sequence"]:
        """The sequences in this step and the rows each takes: every generating one's next token and guesses
        first, then prompt chunks, oldest first, up to n_batch; in batch-invariant mode one kind or the other
        (``run``)."""
        members: list["Sequence"] = []
        room = self._l.n_batch
        for r in active:
            r.batch_take, r.batch_logits_idx, r.draft = 0, -1, []
        prompts_only = False
        if self._batch_invariant:
            generating = any(r.next_token is not None for r in active)
            prompting = any(r.prompting for r in active)
            prompts_only = prompting and (not generating or self._prompt_turn)
            self._prompt_turn = not prompts_only  # both waiting: they alternate
        if not prompts_only:
            room = self._generating(active, members, room)
        if not (self._batch_invariant and members):
            self._prompting(active, members, room)
        if prompts_only and not members:  # no prompt could go on (an image failed): the generating ones do
            self._generating(active, members, room)
        # Laid out in increasing sequence id. With a non-unified cache llama.cpp puts into one ubatch only a run
        # of consecutive sequence ids in batch order (src/llama-batch.cpp ``split_equal``, ``sequential``): out
        # of order, 4 generating sequences were decoded as up to 4 ubatches, each a full pass over the weights,
        # and the graph was rebuilt every step (2x the step time measured with 8 slots). llama-server adds its
        # slots in slot-id order (server-context.cpp ``update_slots``).
        members.sort(key=lambda r: r.slot.id)  # type: ignore[union-attr]
        return members

    def _generating(self, active: list["Sequence"], members: list["Sequence"], room: int) -> int:
        """Every generating sequence's next token and its guesses into ``members``; the rows left."""
        drafting = self._drafting
        n_gen = sum(1 for r in active if r.next_token is not None)
        # Drafted tokens take logits rows beyond one per sequence: at most the rows of idle slots and those planned.
        spare = self._l.n_slots + drafting.rows - len(active) if drafting.on else 0
        if self._batch_invariant:  # the step stays a small batch of one sequence's rows (``run``)
            spare = min(spare, INVARIANT_MIN_ROWS - 2) if n_gen == 1 else 0
        if spare > 0 and self._l.unified:
            # A unified cache's free cells go first to the tokens that stay: every sequence's next token and
            # the prompt tokens this step may evaluate; drafts only where cells are left after those.
            prompts = 0 if self._batch_invariant else sum(len(r.tokens) - r.n_past for r in active if r.prompting)
            spare = min(spare, self._l.n_ctx - self._slots.cells.used - len(active) - min(prompts, room))
        drafted = 0
        for r in active:
            if r.next_token is not None and room > 0:
                r.batch_take = 1
                room -= 1
                members.append(r)
                if spare > 0 and r.drafter is not None and not r.gone:
                    k = drafting.reserve(r, spare, room, n_gen + drafted)
                    drafted += k
                    r.batch_take += k
                    spare -= k
                    room -= k
        return room + drafting.run()

    def _prompting(self, active: list["Sequence"], members: list["Sequence"], room: int) -> None:
        """Prompt chunks into ``members``, oldest first (admission order), up to ``room`` rows; one prompt in
        batch-invariant mode, never leaving it a last chunk shorter than ``INVARIANT_MIN_ROWS``."""
        for r in list(active):  # a copy: a failed image ends its request
            if room <= 0:
                break
            if r.prompting and r.images and not self._images_before(r):
                continue
            if r.prompting:
                left = r.text_end() - r.n_past
                if left <= 0:  # an image next, its request gone meanwhile: ended by the scheduler's next turn
                    continue
                r.batch_take = min(room, left)
                if self._batch_invariant and 0 < left - r.batch_take < INVARIANT_MIN_ROWS:
                    r.batch_take = max(1, left - INVARIANT_MIN_ROWS)  # no short last chunk (see INVARIANT_MIN_ROWS)
                room -= r.batch_take
                members.append(r)
                if self._batch_invariant:
                    break  # one prompt per step: prompts never share a ubatch (see ``run``)

    def _fill(self, members: list["Sequence"]) -> tuple[int, int, bool, list[Any]]:
        """The batch's rows for ``members``: (rows, prompt tokens fed, whether a long prompt is in it, the MTP
        head's runs)."""
        batch = self._l.batch
        b_token, b_pos, b_nseq, b_seq, b_logits = batch.token, batch.pos, batch.n_seq_id, batch.seq_id, batch.logits
        n = 0
        n_prompt_fed = 0
        watch = False
        mtp = self._drafting.mtp is not None
        runs: list[tuple[int, int, Seq[int], int, Seq[int], object]] = []
        for r in members:
            seq = r.slot.id  # type: ignore[union-attr]
            p0 = r.n_past
            shift = p0 - r.pos(p0) if r.shifts else 0  # positions past M-RoPE images (``Sequence.pos``)
            if mtp and not r.shifts:  # the MTP head's cache follows every sequence (``observe``)
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
            for i in range(p0, p0 + r.batch_take):  # text only: a chunk stops at an image (``text_end``)
                b_token[n], b_pos[n], b_nseq[n], b_logits[n] = toks[i], i - shift, 1, 0
                b_seq[n][0] = seq
                if i == last:
                    b_logits[n] = 1
                    r.batch_logits_idx = n
                n += 1
            watch = watch or r.batch_take >= ABORT_MIN_PROMPT_TOKENS
            n_prompt_fed += r.batch_take
        return n, n_prompt_fed, watch, runs

    def _after(self, members: list["Sequence"], ctx: Any, *, canon: bool) -> None:
        """What the decode gave each member: its tokens now in the slot, its rows sampled."""
        slots, seqs = self._slots, self._seqs
        for r in members:
            slot = r.slot
            assert slot is not None
            p0 = len(slot.tokens)
            if r.draft:
                seqs.verify(r, ctx)
                continue
            if r.next_token is not None:
                slots.grow(slot, [r.next_token])
                r.next_token = None
            else:
                slots.grow(slot, r.tokens[p0:p0 + r.batch_take])
            if canon and slot.n_canon == p0:
                slot.n_canon += r.batch_take
            if r.batch_logits_idx >= 0:
                seqs.on_logits(r, r.batch_logits_idx, ctx)

    def _images_before(self, r: "Sequence") -> bool:
        """Evaluate the images the prompt has reached (mtmd: the tower, then their embeddings decoded into the
        sequence, each in calls of its own before this step's batch); False where one failed (``r`` ended)."""
        images = self._l.images
        assert images is not None
        slot = r.slot
        assert slot is not None
        while r.prompting and (image := r.images.get(r.n_past)) is not None:
            if r.gone:
                return True  # ended by the step's usual path
            ret = images.evaluate(self._l.ctx.ctx, image, r.pos(r.n_past), slot.id, self._l.n_batch)
            if ret != 0:
                self._seqs.fail(r, EngineFailure(f"mtmd could not evaluate an image of the prompt (code {ret})"))
                return False
            self._slots.grow(slot, image.run)
            slot.logits, slot.logits_at = None, 0
            self.evaluated += len(image.run)
        return True

    def _failed(self, code: int, members: list["Sequence"], active: list["Sequence"]) -> None:
        """llama_decode's codes (llama.h): 1 no KV slot, -2 allocation failed, 2 aborted (our callback).

        1 with idle slots holding cells: the least recently used is cleared and the step retried
        (llama-server's ``try_clear_idle_slots``). 1 or -2 otherwise: out of memory for one request, which
        fails while the others go on. 2: the requests whose client left end, the others retry. Anything
        else fails the whole batch. A partly processed batch is rolled back for the survivors: llama.cpp
        removes the failed ubatch's positions, the processed ones remain (llama.h)."""
        for r in members:
            if r.slot is not None:
                self._slots.drop_tail(r.slot, r.pos(r.n_past))
        victim_slot = self._slots.victim()
        if code == 1 and victim_slot is not None:
            log.info("KV cache full: clearing idle slot %d (%d cached tokens)", victim_slot.id, len(victim_slot.tokens))
            self._slots.vacate(victim_slot)
        elif code == 2:
            for r in members:
                if r.gone:
                    self._seqs.finish(r, "cancelled")
        elif code in (1, -2) and members:
            # The request asking for new cells in bulk (a prompt chunk) is the one that does not fit;
            # among generating ones, the largest. Ties: the newest.
            ordered = [r for r in active if r in members]  # admission order (members are in sequence-id order)
            prompting = [r for r in ordered if r.next_token is None]
            pool = prompting or ordered
            victim = max(reversed(pool), key=lambda r: r.n_past + r.batch_take)
            device = LogTap.failed_device() or self._l.device
            max_tokens = victim.params.max_tokens
            err = InsufficientMemory(
                f"out of memory on {device} during generation (llama_decode returned {code}) with "
                f"{len(victim.tokens)} prompt tokens and max_tokens {max_tokens}: the KV cache has no room "
                f"for this sequence beside {len(active) - 1} others ({self._l.n_ctx} cells, {self._l.n_slots} slots)",
                device=device, prompt_tokens=len(victim.tokens), max_tokens=max_tokens,
            )
            log.warning("decode: %s", err.message)
            self._seqs.fail(victim, err)
        else:
            err2 = EngineFailure(f"llama.cpp failed to decode a batch (llama_decode returned {code})")
            for r in members:
                self._seqs.fail(r, err2)
