"""A draft model for speculative decoding: a second, smaller llama.cpp model whose greedy guesses the main model
verifies (``LlamaEngine._step`` and ``_verify``, as for the n-gram drafter's).

``DraftModelRunner`` holds the draft's model and context (sized by the plan: ``sizing.memory.draft``), one sequence
per slot of the main context, each kept in step with its slot by prefix: before a draft, the cells past the common
prefix of what the draft sequence holds and the slot's tokens are removed and the missing tokens evaluated (a new
prompt's whole text, once; after a step, the one or few tokens the main model kept). Then it drafts greedily,
every drafting slot one token a ``llama_decode``, until each has its length or its guess is less likely than
``P_MIN``. The draft is a point mass (one token a position), so verifying it by sampling the main model and keeping
the draft while it is the token sampled is the speculative-sampling rule: answers follow the main model's
distribution exactly, seeded ones included (one sampler draw per kept token).

Runs on the scheduler thread only, like every decode of the main context (one OpenMP team: see ``LlamaEngine``).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Any

from ..errors import BadRequest

log = logging.getLogger(__name__)

P_MIN = 0.75
"""A drafted token's least probability under the draft model; a guess below it ends the draft (llama-server's
``--draft-p-min`` default)."""


class VocabularyMismatch(BadRequest):
    """The draft model's vocabulary is not the main model's: its token ids would mean other text."""


@dataclass
class DraftJob:
    """One slot's draft request: its sequence, its tokens with the sampled one last, how many to guess."""

    seq: int
    tokens: list[int]
    k: int
    draft: list[int]
    logits_at: int = -1


def vocabulary_mismatch(main_vocab: Any, draft_vocab: Any) -> str | None:
    """Why the draft's vocabulary is not the main model's (the first difference found), or None: same type, same
    size, every token's text the same. llama-server checks the type, the special tokens and the texts of the
    first tokens and allows 128 more in one (common/speculative.cpp); here a drafted id is fed to the main model
    as it is, so the sizes and every text must be equal."""
    import llama_cpp

    t_main, t_draft = llama_cpp.llama_vocab_type(main_vocab), llama_cpp.llama_vocab_type(draft_vocab)
    if t_main != t_draft:
        return f"tokenizer type {t_draft} against the model's {t_main}"
    n_main, n_draft = llama_cpp.llama_vocab_n_tokens(main_vocab), llama_cpp.llama_vocab_n_tokens(draft_vocab)
    if n_main != n_draft:
        return f"{n_draft} tokens against the model's {n_main}"
    for name in ("llama_vocab_bos", "llama_vocab_eos"):
        a, b = getattr(llama_cpp, name)(main_vocab), getattr(llama_cpp, name)(draft_vocab)
        if a != b:
            return f"{name.rsplit('_', 1)[1].upper()} token {b} against the model's {a}"
    text = llama_cpp.llama_vocab_get_text
    for i in range(n_main):
        a, b = text(main_vocab, i), text(draft_vocab, i)
        if a != b:
            return f"token {i} is {b!r} against the model's {a!r}"
    return None


class DraftModelRunner:
    """The draft model's llama.cpp model and context, one sequence per slot of the main context."""

    def __init__(self, model: Any, ctx: Any, *, n_slots: int, name: str, keep: list[Any]) -> None:
        import llama_cpp

        self.model, self.ctx, self.name = model, ctx, name
        self._mem = llama_cpp.llama_get_memory(ctx.ctx)
        self._n_batch = int(llama_cpp.llama_n_batch(ctx.ctx))
        self._n_vocab = int(model.n_vocab())
        self._batch = llama_cpp.llama_batch_init(self._n_batch, 0, 1)
        self._held: list[list[int]] = [[] for _ in range(n_slots)]
        """What each sequence of the draft context holds, token by token."""
        self.keep = keep
        """What llama.cpp's model parameters point into, kept as long as the model."""

    def close(self) -> None:
        import llama_cpp

        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        self.ctx.close()
        self.model.close()

    def draft(self, jobs: list[DraftJob]) -> None:
        """Fill each job's ``draft`` with at most ``k`` guessed tokens (empty where the draft decode failed)."""
        if not jobs:
            return
        try:
            going = self._catch_up(jobs)
            while going:
                self._decode_one_each(going)
                going = [j for j in going if self._take(j)]
        except _DecodeFailed as exc:
            log.warning("draft model %s: llama_decode returned %d; no draft this step", self.name, exc.code)
            for j in jobs:
                j.draft = []
                self._forget(j.seq)

    # -- the draft context's sequences

    def _forget(self, seq: int, keep: int = 0) -> None:
        import llama_cpp

        llama_cpp.llama_memory_seq_rm(self._mem, seq, keep, -1)
        del self._held[seq][keep:]

    def _catch_up(self, jobs: list[DraftJob]) -> list[DraftJob]:
        """Each sequence made to hold its job's tokens: cells past the common prefix removed, the missing evaluated
        (the last one always, for its logits), in batches of n_batch; each job's first guess taken from the batch
        that held its last token. Returns the jobs that draft on."""
        todo: list[tuple[DraftJob, int]] = []
        for j in jobs:
            held, want = self._held[j.seq], j.tokens
            n = len(held)
            if n > len(want) - 1 or held != want[:n]:
                n = 0
                for a, b in zip(held, want):
                    if a != b:
                        break
                    n += 1
                n = min(n, len(want) - 1)
            if n < len(held):
                self._forget(j.seq, n)
            todo.append((j, n))
        batch = self._batch
        going: list[DraftJob] = []
        while todo:
            fill = 0
            rest: list[tuple[DraftJob, int]] = []
            done: list[DraftJob] = []
            for j, at in todo:
                take = min(len(j.tokens) - at, self._n_batch - fill)
                if take <= 0:
                    rest.append((j, at))
                    continue
                last = len(j.tokens) - 1
                for i in range(at, at + take):
                    batch.token[fill], batch.pos[fill], batch.n_seq_id[fill] = j.tokens[i], i, 1
                    batch.seq_id[fill][0] = j.seq
                    batch.logits[fill] = 0
                    if i == last:
                        batch.logits[fill] = 1
                        j.logits_at = fill
                    fill += 1
                self._held[j.seq].extend(j.tokens[at:at + take])
                if at + take <= last:
                    rest.append((j, at + take))
                else:
                    done.append(j)
            batch.n_tokens = fill
            self._decode(batch)
            going.extend(j for j in done if self._take(j))  # before the next batch overwrites the rows
            todo = rest
        return going

    def _decode_one_each(self, going: list[DraftJob]) -> None:
        batch = self._batch
        for n, j in enumerate(going):
            tok = j.draft[-1]
            batch.token[n], batch.pos[n], batch.n_seq_id[n], batch.logits[n] = tok, len(self._held[j.seq]), 1, 1
            batch.seq_id[n][0] = j.seq
            self._held[j.seq].append(tok)
            j.logits_at = n
        batch.n_tokens = len(going)
        self._decode(batch)

    def _decode(self, batch: Any) -> None:
        import llama_cpp

        ret = int(llama_cpp.llama_decode(self.ctx.ctx, batch))
        if ret != 0:
            raise _DecodeFailed(ret)

    def _take(self, j: DraftJob) -> bool:
        """The draft's next token from its row (if likely enough); whether the job drafts on."""
        if j.logits_at < 0 or len(j.draft) >= j.k:
            return False
        tok, p = confident_guess(self.ctx.ctx, j.logits_at, self._n_vocab)
        j.logits_at = -1
        if p < P_MIN:
            return False
        j.draft.append(tok)
        return len(j.draft) < j.k


def confident_guess(ctx: Any, i: int, n_vocab: int) -> tuple[int, float]:
    """The most likely token of logits row ``i`` of ``ctx`` and its probability (softmax over the whole row)."""
    import llama_cpp
    import numpy as np

    ptr = llama_cpp.llama_get_logits_ith(ctx, i)
    row = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,))
    tok = int(row.argmax())
    return tok, 1.0 / float(np.exp(row - float(row[tok])).sum())


class _DecodeFailed(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


__all__ = ["P_MIN", "DraftJob", "DraftModelRunner", "VocabularyMismatch", "confident_guess", "vocabulary_mismatch"]
