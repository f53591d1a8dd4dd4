"""The slots of one load and what their KV cells hold: which slot a request gets, how much of its prompt the slot
(or another slot, or the prompt cache beyond the slots) already holds, and the prompts that leave a slot.

The policy is ``service.engine.slots`` (pure, llama-server's ``get_available_slot`` and ``update_slots``); here it
is applied to llama.cpp's sequences (``llama_memory_seq_rm`` / ``seq_cp``, ``llama_state_seq_get/set_data``), with
the prompt cache's tiers (``service.engine.prompt_cache``: host memory, then disk, written behind).

Sliding-window models (issue 55): when a slot's prompt has been evaluated, its window is copied out
(``Checkpoint``, llama-server's context checkpoints), and travels with the slot's prompt into the prompt cache. A
next turn that shares the prompt but not the generated answer (a client's own assistant text) is then cut back to
the prompt's end whatever the window lost since: llama.cpp hands a sequence's masked window cells to whichever
sequence needs cells next, so without the checkpoint the same turn was warm or evaluated from its first token by
what else had run meanwhile.
"""

from __future__ import annotations

import ctypes
import logging
import time
from typing import TYPE_CHECKING

from ..prompt_cache import MIN_TOKENS as PROMPT_CACHE_MIN_TOKENS, Entry, PromptCache
from ..slots import (Cells, Checkpoint, Slot, longer_prefix, lru_idle_with_cells, pick_slot, reusable_via,
                     window_holds)

if TYPE_CHECKING:
    from .loading import Loaded
    from .state import Sequence

log = logging.getLogger(__name__)

WRITE_BEHIND_BUSY_S = 2.0
"""A finished turn waits this long for an idle moment before it is written behind between two steps."""


class SlotTable:
    """The slots, the cells they hold, and the prompt cache beyond them (owned by the scheduler thread)."""

    def __init__(self, loaded: "Loaded", pcache: PromptCache, *, cache_prompt: bool, similarity: float,
                 batch_invariant: bool) -> None:
        self._l = loaded
        self.pcache = pcache
        self.slots = [Slot(i) for i in range(loaded.n_slots)]
        self.cells = Cells()
        self._cache_prompt = cache_prompt
        self._similarity = similarity
        self._batch_invariant = batch_invariant
        self._uses = 0
        self._checkpoints = cache_prompt and self._takes_checkpoints(loaded)
        """Whether a slot's window is copied out when its prompt has been evaluated (``checkpoint``)."""
        self.unwritten: dict[int, float] = {}
        """Slots whose prompt changed since it was last written to the disk (``write_behind``): when their last
        request ended (``time.monotonic``)."""

    # -- which slot, and what of the prompt it keeps

    def pick(self, r: "Sequence") -> Slot | None:
        return pick_slot(self.slots, r.tokens, similarity=self._similarity,
                         reuse=self._cache_prompt and r.params.cache_prompt, scope=r.params.cache_scope)

    def spare_for(self, r: "Sequence", slot: Slot) -> list[Slot] | None:
        """Slots for ``r``'s other choices beside ``slot`` (least recently used first), or None while too few are
        idle."""
        spare = sorted((s for s in self.slots if s.req is None and s is not slot), key=lambda s: (s.last_used, s.id))
        return spare[:len(r.followers)] if len(spare) >= len(r.followers) else None

    @staticmethod
    def _takes_checkpoints(loaded: "Loaded") -> bool:
        """A sliding-window cache that is not full-size, on a model without recurrent state (whose partial state
        is its recurrent part, not a window: src/llama-memory-hybrid.cpp)."""
        import llama_cpp

        if loaded.n_swa <= 0 or (loaded.cparams is not None and bool(loaded.cparams.swa_full)):
            return False
        model = loaded.model.model
        return not (llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model))

    def swa_holds(self, slot: Slot, n_keep: int) -> bool:
        """Whether the sequence still holds the KV a token at position ``n_keep`` attends to.

        A sliding-window layer's token at position ``p1`` attends to ``p0`` unless ``p1 - p0 >= n_swa``
        (``is_masked_swa``, standard type), so the token at ``n_keep`` needs every position from
        ``n_keep - n_swa + 1`` on. The SWA cache reuses a cell once it is masked for the position after the
        sequence's last (src/llama-kv-cache.cpp ``find_slot``: ``seq_pos_max + 1``), which is exactly what the next
        token needs: a sequence continued where it ended always holds it. llama-server's test (``update_slots``,
        ``pos_min < pos_next - n_swa``) is two positions stricter, and refused that continuation whenever the
        window had been trimmed (every next chat turn of a 1,800-token conversation once four of them shared the
        cache; found by bench/prompt_cache_bench.py); what this one allows is checked token for token against a
        cold evaluation (tests/service/engine/test_prompt_cache.py). Models without SWA hold every position (``pos_min``
        0)."""
        import llama_cpp

        pos_min = int(llama_cpp.llama_memory_seq_pos_min(self._l.mem, slot.id))
        return self._window_holds(pos_min, n_keep)

    def _window_holds(self, pos_min: int, n_keep: int) -> bool:
        return window_holds(pos_min, n_keep, self._l.n_swa)

    def _saved_pos_min(self, slot: Slot) -> int:
        """The first position of the sliding window a state copied out of the slot now holds.

        llama.cpp writes a sequence's state without the window cells masked for its last position
        (src/llama-kv-cache.cpp ``state_write``: ``is_masked_swa(pos, seq_pos_max)``), so a saved state keeps the
        window's last ``n_swa`` positions whatever the live sequence still held: restored, it continues at its end
        or one token before, never further back. Until issue 55 an entry carried the live ``pos_min``; one saved
        from a roomy cache was then restored and cut back past its window, and the next tokens attended to a
        window with a hole (16 of 512 positions for a 16-token answer)."""
        import llama_cpp

        pos_min = int(llama_cpp.llama_memory_seq_pos_min(self._l.mem, slot.id))
        if self._l.n_swa > 0 and pos_min >= 0:
            pos_max = int(llama_cpp.llama_memory_seq_pos_max(self._l.mem, slot.id))
            pos_min = max(pos_min, pos_max - self._l.n_swa + 1)
        return pos_min

    def _held_from(self, pos_min: int, n_tokens: int) -> int:
        """A saved state's window start, at least what its token count allows (``_saved_pos_min``): files written
        before issue 55 carry the live sequence's."""
        return max(pos_min, n_tokens - self._l.n_swa) if self._l.n_swa > 0 else pos_min

    def _reach(self, slot: Slot, tokens: list[int], scope: str) -> tuple[int, Checkpoint | None]:
        """The prefix of ``tokens`` a slot's KV can stand for, and the checkpoint to put back for it (None: its
        window as it is)."""
        if slot.scope != scope:  # another tenant's prefix: never shared (a timing side channel)
            return 0, None
        return reusable_via(slot, tokens, batch_invariant=self._batch_invariant, holds=self.swa_holds,
                            n_swa=self._l.n_swa)

    def _entry_reach(self, entry: Entry, tokens: list[int]) -> tuple[int, Checkpoint | None]:
        """As ``_reach`` for a cached prompt: its sliding-window cells as they were when it was saved."""
        return reusable_via(entry, tokens, batch_invariant=self._batch_invariant,
                            holds=lambda e, k: self._window_holds(self._held_from(e.pos_min, len(e.tokens)), k),
                            n_swa=self._l.n_swa)

    def admit(self, r: "Sequence", slot: Slot) -> int:
        """Give ``r`` the slot: keep the longest usable common prefix of its KV (the slot's, another slot's, or a
        cached prompt's, each through its window or its checkpoint), drop the rest; how many tokens of the prompt
        are kept."""
        import llama_cpp

        n_keep = 0
        scope = r.params.cache_scope
        pc = self.pcache
        if self._cache_prompt and r.params.cache_prompt:
            n_keep, ckpt = self._reach(slot, r.tokens, scope)
            src, n_src = None, n_keep
            if self._l.unified and self._l.n_slots > 1:
                src, n_src = longer_prefix(self.slots, slot, r.tokens, n_keep,
                                           lambda s, t: self._reach(s, t, scope)[0])
            # A restore copies the whole state back: worth it for MIN_TOKENS or more, beyond what the slots hold.
            entry, n_entry = (pc.best(r.tokens, scope, lambda e, t: self._entry_reach(e, t)[0],
                                      max(n_src, PROMPT_CACHE_MIN_TOKENS - 1))
                              if pc.entries else (None, n_src))
            restored = entry is not None and self._restore(slot, entry, r, n_entry)
            if restored:
                n_keep = n_entry
                pc.stats.restored_tokens += n_entry
            elif entry is not None:
                n_keep = 0  # the slot was emptied for a state llama.cpp did not take back
            elif src is not None:
                self.vacate(slot)
                llama_cpp.llama_memory_seq_cp(self._l.mem, src.id, slot.id, 0, r.pos(n_src))
                slot.tokens = src.tokens[:n_src]
                slot.cells = self.cells.share(src.cells[:n_src])
                slot.n_canon = min(src.n_canon, n_src)
                slot.logits, slot.logits_at = (src.logits, src.logits_at) if src.logits_at <= n_src else (None, 0)
                c = src.checkpoint
                slot.checkpoint = c if c is not None and c.n_tokens <= n_src else None
                n_keep = n_src
                ckpt = self._reach(src, r.tokens, scope)[1]
                if ckpt is not None and not self._put_back(slot, ckpt, r.pos(n_keep)):
                    n_keep = 0
            else:
                self._keep_slot(slot, n_keep)  # before a checkpoint replaces its window: the slot's prompt as it is
                if ckpt is not None and not self._put_back(slot, ckpt, r.pos(n_keep)):
                    n_keep = 0
            if pc.enabled and not restored and 2 * n_keep < len(r.tokens):  # most of it evaluated
                pc.stats.misses += 1
            n_keep = r.image_bound(n_keep)
            self._count(r.tokens, scope, n_keep)
        else:
            self._keep_slot(slot, n_keep)
        self.truncate(slot, n_keep, r.pos(n_keep))
        slot.scope = scope
        slot.req, r.slot = r, slot
        r.n_cached = n_keep
        return n_keep

    def _count(self, tokens: list[int], scope: str, n_keep: int) -> None:
        """A lookup's result in the prompt cache's counters (hit, partial, miss), and whether a slot or cached
        prompt shared at least half of a prompt that was mostly evaluated anyway (``held_unused``)."""
        st = self.pcache.stats
        n = len(tokens)
        if 2 * n_keep >= n > 0:
            st.lookup_hit += 1
            return
        if n_keep >= PROMPT_CACHE_MIN_TOKENS:
            st.lookup_partial += 1
        else:
            st.lookup_miss += 1
        # Asked before the slot is cut: it still holds what it held (or what was restored into it).
        m = (n + 1) // 2
        head = tokens[:m]
        held = [s.tokens for s in self.slots if s.scope == scope] + [e.tokens for e in self.pcache.entries
                                                                     if e.scope == scope]
        if any(len(h) >= m and h[:m] == head for h in held):
            st.held_unused += 1

    def fork_into(self, src: Slot, slot: Slot, n_pos: int) -> None:
        """``slot`` holds ``src``'s prompt (a choice forked from it): with a unified cache the cells gain a sequence
        id, per-sequence streams are copied whole (the leader's stream holding exactly the prompt)."""
        import llama_cpp

        self.clear(slot)
        if self._l.unified:
            llama_cpp.llama_memory_seq_cp(self._l.mem, src.id, slot.id, 0, n_pos)
            slot.cells = self.cells.share(src.cells)
        else:
            llama_cpp.llama_memory_seq_cp(self._l.mem, src.id, slot.id, -1, -1)
            slot.cells = self.cells.new(len(src.tokens))
        slot.tokens = list(src.tokens)
        slot.scope = src.scope
        slot.n_canon = src.n_canon
        slot.checkpoint = src.checkpoint  # the same prompt's window: immutable, shared

    # -- cells that change

    def truncate(self, slot: Slot, n_keep: int, pos: int | None = None) -> None:
        """Drop the slot's tokens from index ``n_keep`` on, their cells from position ``pos`` (default ``n_keep``:
        they differ past M-RoPE images) on (``llama_memory_seq_rm`` of the tail)."""
        import llama_cpp

        if n_keep < len(slot.tokens) or n_keep == 0:
            llama_cpp.llama_memory_seq_rm(self._l.mem, slot.id, n_keep if pos is None else pos, -1)
            self.cells.drop(slot.cells[n_keep:])
            del slot.tokens[n_keep:]
            del slot.cells[n_keep:]
        slot.n_canon = min(slot.n_canon, n_keep)
        if slot.logits_at > n_keep:
            slot.logits, slot.logits_at = None, 0
        if slot.checkpoint is not None and slot.checkpoint.n_tokens > n_keep:
            slot.checkpoint = None

    def clear(self, slot: Slot) -> None:
        self.truncate(slot, 0)

    def grow(self, slot: Slot, tokens: list[int] | tuple[int, ...]) -> None:
        """``tokens`` were decoded into the slot's sequence after what it holds; when they end its request's prompt,
        the sliding window is copied out (``checkpoint``)."""
        n0 = len(slot.tokens)
        slot.tokens.extend(tokens)
        slot.cells.extend(self.cells.new(len(tokens)))
        r = slot.req
        if self._checkpoints and r is not None and n0 < len(r.tokens) == len(slot.tokens) and r.params.cache_prompt:
            self.checkpoint(slot)

    def checkpoint(self, slot: Slot) -> None:
        """The slot's sliding window now, as its checkpoint (``llama_state_seq_get_data_ext``, partial: the window
        alone), replacing the one of an earlier prompt.

        Taken at once, between the decode that ended the prompt and the next, whatever other sequences take of the
        window afterwards. llama.cpp writes the window's last ``n_swa`` positions (``_saved_pos_min``), so the
        checkpoint stands for the cut at the prompt's end or one token before (where the next prompt's text merged
        the last token when retokenized): the cut a chat turn makes when its client sends back an assistant text
        of its own. A 1,816-token gemma-3-270m prompt's window: 512 cells of 15 layers, 7.5 MiB. llama-server takes
        its checkpoints before the decode of a prompt's last 4 and ``4 + n_ubatch`` tokens, splitting the batch
        (server-context.cpp ``update_slots``), and evaluates those 4 again at the next turn."""
        import llama_cpp

        ctx = self._l.ctx.ctx
        flags = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        size = int(llama_cpp.llama_state_seq_get_size_ext(ctx, slot.id, flags))
        slot.checkpoint = None
        if size <= 0:
            return
        state = bytearray(size)
        buf = (ctypes.c_uint8 * size).from_buffer(state)
        n = int(llama_cpp.llama_state_seq_get_data_ext(ctx, buf, size, slot.id, flags))
        del buf
        if n != size:
            log.warning("prompt cache: llama.cpp wrote %d of %d bytes of slot %d's window; no checkpoint", n, size,
                        slot.id)
            return
        slot.checkpoint = Checkpoint(len(slot.tokens), self._saved_pos_min(slot), state)

    def _put_back(self, slot: Slot, ckpt: Checkpoint, pos: int) -> bool:
        """The slot's window replaced by ``ckpt`` (a checkpoint of the prompt the slot holds, or of one whose first
        tokens it holds), and everything from position ``pos`` (at most the checkpoint's end) dropped; False: llama.cpp
        did not take it back (the slot is emptied, counted in ``restore_failed``)."""
        import llama_cpp

        state = ckpt.state
        buf = (ctypes.c_uint8 * len(state)).from_buffer(state)
        got = int(llama_cpp.llama_state_seq_set_data_ext(self._l.ctx.ctx, buf, len(state), slot.id,
                                                         llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY))
        del buf
        if got != len(state):
            self.pcache.stats.restore_failed += 1
            log.warning("prompt cache: llama.cpp took %d of %d bytes of a checkpoint back; evaluated cold", got,
                        len(state))
            self.clear(slot)
            return False
        llama_cpp.llama_memory_seq_rm(self._l.mem, slot.id, pos, -1)  # both caches cut at the same position
        return True

    def drop_tail(self, slot: Slot, pos: int) -> None:
        """Positions from ``pos`` on that are not the slot's tokens (rejected drafts, a failed batch's)."""
        import llama_cpp

        llama_cpp.llama_memory_seq_rm(self._l.mem, slot.id, pos, -1)

    def release(self, slot: Slot, *, keep: bool, unverified_from: int | None) -> None:
        """End a request's hold on ``slot``; the slot keeps its tokens for the next request unless ``keep`` is off.
        ``unverified_from``: the position from which drafted positions are not the sequence's."""
        if unverified_from is not None:
            self.drop_tail(slot, unverified_from)
        if not (keep and self._cache_prompt):
            self.clear(slot)
        elif self.pcache.directory is not None:
            self.unwritten[slot.id] = time.monotonic()
        self._uses += 1
        slot.last_used = self._uses
        slot.req = None

    def victim(self) -> Slot | None:
        """The idle slot holding cells a full unified cache gives up first (``try_clear_idle_slots``), if any."""
        return lru_idle_with_cells(self.slots) if self._l.unified else None

    def forget(self) -> None:
        """Every idle slot's cached prompt and the prompt cache beyond the slots, its files too."""
        for s in self.slots:
            if s.req is None:
                self.clear(s)
        self.pcache.clear()

    # -- the prompt cache beyond the slots

    def _keep_slot(self, slot: Slot, n_keep: int) -> None:
        """Before the slot drops tokens past ``n_keep``: its prompt into the prompt cache beyond the slots, when it
        loses enough to be worth a restore (``MIN_TOKENS``: not the last tokens of a turn a new prompt rewrites)."""
        if self.pcache.enabled and len(slot.tokens) - n_keep >= PROMPT_CACHE_MIN_TOKENS:
            self._save(slot)

    def vacate(self, slot: Slot) -> None:
        """Empty the slot for another prompt, its own kept in the prompt cache first (``_keep_slot``)."""
        self._keep_slot(slot, 0)
        self.clear(slot)

    def keep_all(self) -> None:
        """At unload, with a disk folder: what the slots hold outlives the context on disk."""
        if self.pcache.directory is not None:
            for slot in self.slots:
                self._keep_slot(slot, 0)

    def write_behind(self, *, busy: bool = False) -> bool:
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
        pc = self.pcache
        if not self.unwritten or pc.directory is None:
            self.unwritten.clear()
            return False
        if pc.writing:
            return False
        due = time.monotonic() - WRITE_BEHIND_BUSY_S
        for sid, ended in sorted(self.unwritten.items(), key=lambda kv: kv[1]):
            if busy and ended > due:
                return False
            del self.unwritten[sid]
            slot = self.slots[sid]
            if slot.req is None and pc.needs(slot.tokens, slot.scope, memory=False):  # a taken slot: after it
                self._save(slot, memory=False)
                return True
        return False

    def _save(self, slot: Slot, *, memory: bool = True) -> None:
        """The slot's prompt into the prompt cache (``memory`` off: to its disk folder only, ``write_behind``)."""
        import llama_cpp

        pc = self.pcache
        if not pc.needs(slot.tokens, slot.scope, memory=memory):
            return
        ctx = self._l.ctx.ctx
        size = int(llama_cpp.llama_state_seq_get_size(ctx, slot.id))
        if size <= 0 or not pc.takes(size):
            return
        state = bytearray(size)  # llama.cpp writes into it: no copy
        buf = (ctypes.c_uint8 * size).from_buffer(state)
        n = int(llama_cpp.llama_state_seq_get_data(ctx, buf, size, slot.id))
        del buf  # the bytearray may not change size while a ctypes view holds it
        if n != size:
            log.warning("prompt cache: llama.cpp wrote %d of %d bytes of slot %d's state; not kept", n, size, slot.id)
            return
        pc.put(slot.tokens, state, scope=slot.scope, pos_min=self._saved_pos_min(slot), n_canon=slot.n_canon,
               memory=memory, checkpoint=slot.checkpoint)

    def _restore(self, slot: Slot, entry: Entry, r: "Sequence", n_keep: int) -> bool:
        """Put a cached prompt back into the slot (the slot's own prompt kept first), cut back to ``n_keep`` tokens of
        ``r``'s prompt, through its checkpoint where its window does not reach that far; False: it could not be.

        A cut that drops ``MIN_TOKENS`` or more leaves the whole entry in the cache (the state it was restored
        from, no copy), as the slot's prompt would have been kept when it changed hands."""
        import llama_cpp

        pc = self.pcache
        needed = self._entry_reach(entry, r.tokens)[1] is not None
        kept = pc.checkpoint_of(entry)  # read from its file where only the file holds it (after a restart)
        state = pc.take(entry)  # first: the slot's own prompt, kept next, may not evict it
        self.vacate(slot)
        if state is None:
            return False
        n = len(entry.tokens)
        while self._l.unified and self.cells.used + n > self._l.n_ctx:  # room, as a full cache makes it
            victim = lru_idle_with_cells([s for s in self.slots if s is not slot])
            if victim is None:
                break
            self.vacate(victim)
        buf = (ctypes.c_uint8 * len(state)).from_buffer(state)
        got = int(llama_cpp.llama_state_seq_set_data(self._l.ctx.ctx, buf, len(state), slot.id))
        del buf
        if got != len(state):
            llama_cpp.llama_memory_seq_rm(self._l.mem, slot.id, -1, -1)
            pc.stats.restore_failed += 1
            log.warning("prompt cache: llama.cpp took %d of %d bytes of a %d-token prompt back; evaluated cold",
                        got, len(state), n)
            return False
        if n - n_keep >= PROMPT_CACHE_MIN_TOKENS:
            pc.put(entry.tokens, state, scope=entry.scope, pos_min=entry.pos_min, n_canon=entry.n_canon,
                   checkpoint=kept)
        slot.tokens = list(entry.tokens)
        slot.cells = self.cells.new(n)
        slot.n_canon = entry.n_canon
        slot.logits, slot.logits_at = None, 0
        slot.scope = entry.scope
        slot.checkpoint = kept
        if needed and kept is None:  # its file's checkpoint did not read back (counted): evaluated cold
            self.clear(slot)
            return False
        if kept is not None and needed and not self._put_back(slot, kept, r.pos(n_keep)):
            return False
        pc.stats.hits += 1
        return True
