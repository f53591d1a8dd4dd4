"""The generating sequences of one load: admitted into their slots, a token sampled from each row the batch gives
them (drafts verified), forked into choices, ended; their chunks delivered together.

Sampling (``service.engine.sampling``): each request has its own llama.cpp sampler chain, built as
``Llama._init_sampler`` builds it, or, at temperature 0 and for plain temperature sampling, the chain's token
computed with numpy on the logits row. What goes out is token ids (their scores where log probabilities were asked
for), EOG handled (``ignore_eos``), and a final chunk with the usage, the prompt tokens taken from the cache, and the
measured prompt and decode seconds. Text and stop strings are the API process's (``service.text.stream``): a choice
it stops arrives here as ended (``Cancel.end``) and finishes ``cancelled``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

from ...errors import ServiceError
from ..base import Chunk
from ..replay import prefer
from ..sampling import SavedLogits, sampler_chain, scores_of, temperature_sampler
from ..slots import Slot
from .state import DONE, Sequence

if TYPE_CHECKING:
    from .drafting import Drafting
    from .loading import Loaded
    from .slotting import SlotTable


class Sequences:
    """The active sequences (admission order) and what they send (owned by the scheduler thread)."""

    def __init__(self, loaded: "Loaded", slots: "SlotTable", drafting: "Drafting", *, cache_prompt: bool) -> None:
        self._l = loaded
        self._slots = slots
        self._drafting = drafting
        self._cache_prompt = cache_prompt
        self.active: list[Sequence] = []
        self._outbox: list[tuple[Sequence, Any]] = []
        """Chunks produced during a scheduler iteration, delivered together at its end (``flush``)."""
        self._eog: dict[int, bool] = {}
        """Token id -> ``llama_vocab_is_eog``, filled as tokens are seen."""
        self._saved = SavedLogits(loaded.n_vocab)
        """Sampling from saved logits (a cached prompt's, a forked choice's), its candidates array reused."""

    # -- admission

    def admit(self, r: Sequence, slot: Slot) -> None:
        """Give ``r`` its slot (and its other choices theirs, reserved: they fork once the prompt is evaluated)."""
        if r.followers:
            spare = self._slots.spare_for(r, slot)
            assert spare is not None
            for f, s in zip(r.followers, spare):
                self._slots.vacate(s)
                s.req, f.slot = f, s
        n_keep = self._slots.admit(r, slot)
        self._samplers(r)
        r.t_start = time.perf_counter()
        self.active.append(r)
        if n_keep == len(r.tokens):  # the whole prompt and its logits were cached: sample now
            r.first_logits = slot.logits
            self.on_logits(r, -1, None)

    def _samplers(self, r: Sequence) -> None:
        """The request's sampling: the argmax (``greedy``), numpy's temperature draw, or llama.cpp's chain."""
        if not r.greedy:
            r.temperature = temperature_sampler(r.params, r.grammar, r.seed)
        if r.temperature is None:
            r.sampler = sampler_chain(self._l.model, self._l.n_vocab, r.params, r.grammar, r.seed)

    # -- a row's token

    def on_logits(self, r: Sequence, idx: int, ctx: Any) -> None:
        """Sample this sequence's next token (from batch row ``idx``, or the saved logits) and send it."""
        import llama_cpp
        import numpy as np

        saved, r.first_logits = r.first_logits, None
        row = saved
        forking = bool(r.followers) and not r.t_first
        if row is None and (r.greedy or r.temperature is not None or r.params.logprobs is not None or forking
                            or (not r.t_first and self._cache_prompt)):
            row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, idx), shape=(self._l.n_vocab,))
        if forking:
            self._fork(r, row)
        if saved is None and not r.t_first and self._cache_prompt:
            # The prompt's logits, kept with the slot for the same prompt again (a copy: the context reuses the buffer).
            slot = r.slot
            assert slot is not None
            slot.logits, slot.logits_at = row.copy(), len(slot.tokens)
        score = scores_of(row, r.params.logprobs) if r.params.logprobs is not None else None
        want: int | None = None
        if r.greedy:
            # The chain is penalties (all zero: a no-op, llama-sampler.cpp ``llama_sampler_penalties_apply``) then
            # greedy (the first largest logit): argmax over the row, without llama_sampler_sample copying all
            # n_vocab candidates (0.4 ms a token for gemma-3's 262,144, measured; 3% at 75 tokens/s).
            tok = int(np.argmax(row))
            want = self._wanted(r)
            if want is not None:
                tok = prefer(row, tok, want, self._drafting.replays.tolerance)
        elif r.temperature is not None:
            want = self._wanted(r)
            tok = r.temperature.sample(row, want, self._drafting.replays.tolerance)
        elif saved is not None:
            tok = self._saved.sample(r.sampler, saved)
        else:
            tok = int(llama_cpp.llama_sampler_sample(r.sampler, ctx, idx))
        if r.replay is not None and tok != want:
            r.replay = None  # the answer left the earlier one: the replay ends here
        now = time.perf_counter()
        if not r.t_first:
            r.t_first = now
        r.t_last = now
        eog = self._eog.get(tok)
        if eog is None:
            eog = self._eog[tok] = bool(llama_cpp.llama_vocab_is_eog(self._l.vocab, tok))
        r.answer.append(tok)
        if eog and not r.params.ignore_eos:
            self.finish(r, "stop")
            return
        r.n_out += 1
        self._send(r, Chunk(tokens=(tok,), scores=(score(tok),) if score is not None else ()))
        if r.n_out >= r.max_new_tokens:
            self.finish(r, "length")
        else:
            r.next_token = tok

    def verify(self, r: Sequence, ctx: Any) -> None:
        """The rows of a drafted step: each samples as a step of its own would (the sampler chain, or the argmax),
        and a drafted token stands while it is the token sampled from the row before it; the first that is not
        ends the step, the sampled token becoming the next step's input. One draw of the sampler per token kept,
        as without the draft: the answer, its seed's included, is the one non-speculative decoding gives (to the
        rounding of rows computed together), several tokens a step."""
        slot = r.slot
        assert slot is not None and r.next_token is not None and r.policy is not None
        draft, r.draft = r.draft, []
        self._slots.grow(slot, [r.next_token])
        r.next_token = None
        r.unverified = True
        idx = r.batch_logits_idx
        kept = 0
        for i in range(len(draft) + 1):
            r.checking = (len(draft), kept)
            self.on_logits(r, idx + i, ctx)
            chosen = r.next_token
            if r.slot is None or i == len(draft) or chosen is None or chosen != draft[i]:
                break  # ended (its release dropped the unverified positions), or the draft was not chosen
            kept += 1
            self._slots.grow(slot, [chosen])  # already in the KV: its row is the next one
            r.next_token = None
        r.checking = (0, 0)
        r.policy.record(r.n_out, len(draft), kept)
        if r.unverified:
            self._slots.drop_tail(slot, r.pos(len(slot.tokens)))
            r.unverified = False

    def _fork(self, r: Sequence, logits: Any) -> None:
        """The other choices of ``r``'s prompt, now evaluated: each slot reserved for them gets the prompt's KV
        (``SlotTable.fork_into``) and samples its first token from the prompt's logits. No prompt token is
        evaluated twice."""
        src = r.slot
        assert src is not None
        followers, r.followers = r.followers, []
        for f in followers:
            slot = f.slot
            assert slot is not None
            self._slots.fork_into(src, slot, r.pos(len(src.tokens)))
            f.n_cached = r.n_cached
            self._samplers(f)
            f.t_start = r.t_start
            f.first_logits = logits.copy()
            self.active.append(f)
            self.on_logits(f, -1, None)

    # -- ends

    def _release(self, r: Sequence, *, keep: bool = True) -> None:
        """End ``r``'s hold on its slot; the slot keeps its tokens for the next request unless ``keep`` is off."""
        import llama_cpp

        slot = r.slot
        if slot is not None:
            unverified = r.pos(len(slot.tokens)) if r.unverified else None  # drafted positions past the kept tokens
            r.unverified = False
            self._slots.release(slot, keep=keep, unverified_from=unverified)
            r.slot = None
        if r.sampler is not None:
            llama_cpp.llama_sampler_free(r.sampler)
            r.sampler = None
        if r in self.active:
            self.active.remove(r)

    def _wanted(self, r: Sequence) -> int | None:
        """The earlier answer's token at this place while a replay runs (``service.engine.replay``): the greedy
        argmax and the seeded draw take it where it is within the rounding of rows computed in other shapes.
        None once the earlier answer is used up or left (the replay has ended)."""
        if r.replay is not None and r.n_out < len(r.replay):
            return r.replay[r.n_out]
        r.replay = None
        return None

    def finish(self, r: Sequence, finish: str) -> None:
        """The last chunk: reason, usage, timings."""
        followers, r.followers = r.followers, []
        for f in followers:  # choices that never forked (cancelled during the prompt) end with it
            self.finish(f, finish)
        if r.slot is not None:
            self._drafting.answer_ended(r, r.slot.tokens, whole=finish != "cancelled")
        self._release(r)
        self._send(r, Chunk(
            finish_reason=finish, prompt_tokens=len(r.tokens), completion_tokens=r.n_out, cached_tokens=r.n_cached,
            # An answer that ends inside a draft (its limit, a stop) counts the draft being verified: its tokens
            # up to the end were kept (a copy's last 60-token draft was left out of the usage before).
            drafted_tokens=(r.policy.drafted if r.policy else 0) + r.checking[0],
            accepted_tokens=(r.policy.accepted if r.policy else 0) + r.checking[1],
            prompt_seconds=(r.t_first - r.t_start) if r.t_first else 0.0,
            decode_seconds=(r.t_last - r.t_first) if r.n_out > 1 else 0.0,
        ))
        self._send(r, DONE)

    def fail(self, r: Sequence, err: ServiceError) -> None:
        followers, r.followers = r.followers, []
        for f in followers:
            self.fail(f, err)
        self._release(r, keep=False)
        self._send(r, err)
        self._send(r, DONE)

    # -- delivery

    def _send(self, r: Sequence, item: Any) -> None:
        if r.index and isinstance(item, Chunk):
            item = dataclasses.replace(item, index=r.index)
        self._outbox.append((r, item))

    def flush(self) -> None:
        """Deliver the iteration's chunks, after all of its sampling and just before the next ``llama_decode``.

        Each ``put`` wakes a consumer thread, which then wants the GIL. Woken in the middle of the step, they
        took it whenever the scheduler released it for a ctypes call (every sample, detokenize, EOG test)
        and the scheduler waited for each of them to give it back; woken here, they run while
        ``llama_decode`` (which releases the GIL) computes.

        A delivery with a ``flush`` (the runner process's: ``child.Child._flush_step``) is called once after the
        iteration's chunks were handed to it, before any request's end is put: it writes them all at once."""
        if self._outbox:
            out, self._outbox = self._outbox, []
            ends: list[tuple[Sequence, Any]] = []
            flushes: dict[Any, None] = {}
            for r, item in out:
                if r.deliver is not None and item is not DONE:
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
