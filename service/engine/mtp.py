"""MTP drafting: the NextN block a GGUF carries beside its trunk (GLM-4.5/4.6, DeepSeek-V3, MiMo...) guesses the
next tokens from the main model's hidden state, and the main model verifies them as it verifies any draft
(``LlamaEngine._step`` and ``_verify``).

The head runs in a context of its own on the same model (``LLAMA_CONTEXT_TYPE_MTP``: llama.cpp builds the NextN
block's graph, with a KV cache of that layer alone), one sequence per slot. Its input at position p is the token
there and the main model's hidden row of position p - 1 (``llama_get_embeddings_nextn`` of the main context, a
row for every token of a batch); its output at p is a guess of the token at p + 1 and a hidden row of its own,
which is the next guess's input. That is the pairing of the vendored llama.cpp's ``common_speculative_impl_draft_mtp``
(common/speculative.cpp: ``process`` after every main batch, ``draft``, ``accept``), for a single head whose KV is
its own (``n_layer_nextn`` 1, not a shared cache: ``sizing.memory.mtp.MTP_ARCHITECTURES``; the plan sizes it there).

``MtpRunner.observe`` runs after each main decode: every token the batch held enters the head's sequence with the
hidden row before it (the first with the row kept from the last batch), so the head's cache follows the slot's,
prompt included. Positions past what the slot kept (rejected drafts, the last draft's own guesses) are dropped
before they are written again. A slot whose cells the head does not hold (a prompt restored from the prompt cache,
another conversation) restarts its sequence where the batch starts: the head then attends to less context and
guesses worse, never wrongly, since every guess is verified.

``MtpRunner.draft`` guesses greedily as the draft model's runner does (``service.engine.draft``): one token a
``llama_process`` for every drafting slot, until each has its length or its guess is less likely than ``P_MIN``.

Runs on the scheduler thread only, like every decode of the main context.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

from .draft import P_MIN, DraftJob, confident_guess

log = logging.getLogger(__name__)


@dataclass
class _Seq:
    """What the head's cache holds for one slot, and the main model's hidden rows of the slot's last batch."""

    base: int = 0
    """The first position the head's sequence holds (0, or where it restarted)."""
    held: list[int] = field(default_factory=list)
    """The tokens at positions ``base``, ``base + 1``...: what its cells were computed from."""
    owner: object = None
    """The request the cells were last written for: a new one has its prefix compared once."""
    h_at: int = 0
    """The position of the first of ``h``'s rows."""
    h: Any = None
    """The main model's hidden rows (numpy, n_rows x n_embd) of the positions the last batch held for the slot."""

    def row_before(self, pos: int) -> Any:
        """The main model's hidden row of ``pos - 1`` where it was kept, else None."""
        i = pos - 1 - self.h_at
        if self.h is None or not 0 <= i < len(self.h):
            return None
        return self.h[i]


class MtpRunner:
    """The MTP context of a loaded model and the sequences of its slots (see the module docstring)."""

    def __init__(self, main_ctx: Any, ctx: Any, *, n_slots: int, name: str) -> None:
        import llama_cpp
        import numpy as np

        from .native import nextn_api

        api = nextn_api()
        if api is None:
            raise ValueError("this llama-cpp-python build does not export llama.cpp's MTP staging API")
        self._api, self._main, self.ctx, self.name = api, main_ctx, ctx, name
        model = llama_cpp.llama_get_model(ctx.ctx)
        self._n_embd = int(llama_cpp.llama_model_n_embd_out(model))
        self._n_vocab = int(llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model)))
        self._mem = llama_cpp.llama_get_memory(ctx.ctx)
        self._batch = llama_cpp.llama_batch_ext_init(ctx.ctx)
        self._pos = (ctypes.c_int32 * 4)()
        self._zeros = np.zeros(self._n_embd, dtype=np.float32)
        self._seqs = [_Seq() for _ in range(n_slots)]
        self.p_min = P_MIN
        """A guess's least probability under the head (``service.engine.draft.P_MIN``)."""
        # The main context gives a hidden row for every token of its batches; the head's, for its outputs only.
        api.set_embeddings(main_ctx, True, False)
        api.set_embeddings(ctx.ctx, True, True)

    def close(self) -> None:
        import llama_cpp

        if self._batch is not None:
            llama_cpp.llama_batch_ext_free(self._batch)
            self._batch = None
            self._api.set_embeddings(self._main, False, False)
        self.ctx.close()

    # -- after every main decode

    def observe(self, runs: Sequence[tuple[int, int, Sequence[int], int, Sequence[int], object]], n_rows: int) -> None:
        """The main batch just decoded, as runs ``(seq, pos0, tokens, row0, prefix, owner)``: a slot's tokens at
        positions ``pos0...`` in batch rows ``row0...``, the slot's tokens before them (``prefix``: compared when
        ``owner``, the request, is new to the sequence). ``n_rows``: the batch's token count."""
        import numpy as np

        if not runs:
            return
        h_all = np.ctypeslib.as_array(self._api.rows(self._main), shape=(n_rows, self._n_embd))
        self._clear()
        for seq, pos0, tokens, row0, prefix, owner in runs:
            s = self._seqs[seq]
            h_prev = self._sync(s, seq, pos0, prefix, owner)
            for i, tok in enumerate(tokens):
                self._add(seq, tok, pos0 + i, h_prev if i == 0 else h_all[row0 + i - 1], output=False)
            s.held.extend(tokens)
            s.h_at, s.h = pos0, h_all[row0:row0 + len(tokens)].copy()
        if not self._process():
            for seq, *_ in runs:
                self._restart(self._seqs[seq], seq, 0)

    # -- drafting

    def draft(self, jobs: list[DraftJob]) -> None:
        """Fill each job's ``draft`` with at most ``k`` guessed tokens (empty where the head's decode failed)."""
        import numpy as np

        going: list[DraftJob] = []
        self._clear()
        for j in jobs:
            s = self._seqs[j.seq]
            pos0 = len(j.tokens) - 1
            h_prev = self._sync(s, j.seq, pos0, j.tokens, s.owner)
            j.logits_at = self._add(j.seq, j.tokens[-1], pos0, h_prev, output=True)
            s.held.append(j.tokens[-1])
            going.append(j)
        while going:
            if not self._process():
                for j in jobs:
                    j.draft = []
                return
            nxt: list[tuple[DraftJob, int, Any]] = []
            for j in going:
                tok, p = confident_guess(self.ctx.ctx, j.logits_at, self._n_vocab)
                if p < self.p_min:
                    continue
                j.draft.append(tok)
                if len(j.draft) < j.k:
                    ptr = self._api.row(self.ctx.ctx, j.logits_at)
                    nxt.append((j, tok, np.ctypeslib.as_array(ptr, shape=(self._n_embd,)).copy()))
            self._clear()
            going = []
            for j, tok, h in nxt:
                s = self._seqs[j.seq]
                j.logits_at = self._add(j.seq, tok, len(j.tokens) - 1 + len(j.draft), h, output=True)
                s.held.append(tok)
                going.append(j)

    # -- the head's sequences

    def _sync(self, s: _Seq, seq: int, pos0: int, prefix: Sequence[int], owner: object) -> Any:
        """Make the sequence end just before ``pos0``; the main model's row of ``pos0 - 1`` (zeros where it is not
        kept: a restart)."""
        end = s.base + len(s.held)
        ok = s.base <= pos0 <= end
        if ok and owner is not s.owner:
            ok = s.held[:pos0 - s.base] == list(prefix[s.base:pos0])
        s.owner = owner
        if not ok:
            self._restart(s, seq, pos0)
        elif pos0 < end:
            import llama_cpp

            llama_cpp.llama_memory_seq_rm(self._mem, seq, pos0, -1)
            del s.held[pos0 - s.base:]
        row = s.row_before(pos0)
        return self._zeros if row is None else row

    def _restart(self, s: _Seq, seq: int, pos0: int) -> None:
        import llama_cpp

        llama_cpp.llama_memory_seq_rm(self._mem, seq, -1, -1)
        s.base, s.held, s.h = pos0, [], None

    def _clear(self) -> None:
        import llama_cpp

        llama_cpp.llama_batch_ext_clear(self._batch)

    def _add(self, seq: int, tok: int, pos: int, h: Any, *, output: bool) -> int:
        import llama_cpp
        import numpy as np

        b = self._batch
        idx = int(llama_cpp.llama_batch_ext_add_token(b, seq, tok))
        self._pos[0] = pos
        llama_cpp.llama_batch_ext_set_pos(b, idx, self._pos)
        row = np.ascontiguousarray(h, dtype=np.float32)
        embd = llama_cpp.llama_embd(row.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, self._n_embd)
        llama_cpp.llama_batch_ext_set_embd_token(b, idx, embd)  # copied into the batch
        if output:
            llama_cpp.llama_batch_ext_set_output_logits(b, idx, True)
        return idx

    def _process(self) -> bool:
        import llama_cpp

        ret = int(llama_cpp.llama_process(self.ctx.ctx, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, self._batch))
        if ret != 0:
            log.warning("MTP head of %s: llama_process returned %d", self.name, ret)
            return False
        return True


__all__ = ["MtpRunner"]
