"""The slot policy: which slot a request gets and how much of its cached KV it may keep. Pure: no llama.cpp.

Mirrors llama-server (tools/server/server-context.cpp of the llama.cpp that llama-cpp-python 0.3.36 vendors):
a new request goes to the idle slot whose cached tokens cover the largest share of its prompt, when that share is
more than ``slot_prompt_similarity`` (``get_available_slot``), else to the least recently used one; it keeps the
longest common prefix of that slot's tokens that the cache can still stand for (``update_slots``), and with a
unified cache a longer prefix another slot holds is shared instead of evaluated again. The engine
(``service.engine.llama``) applies these decisions with ``llama_memory_seq_rm`` / ``seq_cp``; whether a
sliding-window cache still holds a position is its question to llama.cpp, passed in here as ``holds``.

A sliding-window model's sequence can be cut back only as far as its window still holds what the cut's first
token attends to (``window_holds``); llama.cpp gives a window's cells to other sequences once they are masked for
the next position, so how far depends on what else ran meanwhile. A ``Checkpoint`` (the window as it was right
after the prompt was evaluated, llama-server's context checkpoints) keeps the cut to the prompt's end possible
whatever ran since (``reusable_via``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, TypeVar

SLOT_PROMPT_SIMILARITY = 0.10
"""llama-server's ``--slot-prompt-similarity`` default (common/common.h)."""
INVARIANT_MIN_ROWS = 8
"""Batch-invariant mode: the fewest rows with which a batch computes a token as a cold prompt evaluation does.
ggml-cpu's mul_mat leaves batches of one row to ``vec_dot`` and gives larger ones to llamafile's tinyBLAS for
Q8_0/Q5_0/Q4_0 weights (ggml/src/ggml-cpu/llamafile/sgemm.cpp: "only enable sgemm for prompt processing"); on
gemma-3-270m Q4_K_M (x86 AVX2, 2 threads) a prompt's last logits came out bit-identical to a cold evaluation
for every tail of 8 to 100 tokens evaluated over a cached prefix, and different for tails of 1 to 7."""


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists (``server_tokens::get_common_prefix``).

    A binary search over slice comparisons: a few C-level list comparisons instead of a Python loop
    over ~1,000 tokens per slot."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n - 1  # a[:lo] == b[:lo]; a[:hi + 1] != b[:hi + 1]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def window_holds(pos_min: int, n_keep: int, n_swa: int) -> bool:
    """Whether a sequence whose sliding-window cache holds positions from ``pos_min`` on still holds all that the
    token at position ``n_keep`` attends to.

    A sliding-window layer's token at position ``p1`` attends to ``p0`` unless ``p1 - p0 >= n_swa``
    (src/llama-hparams.cpp ``is_masked_swa``, standard type), so the token at ``n_keep`` needs every position from
    ``n_keep - n_swa + 1`` on. Models without SWA (``n_swa`` 0) hold every position (``pos_min`` 0); an empty
    sequence (``pos_min`` -1) holds none."""
    return 0 <= pos_min <= max(0, n_keep - n_swa + 1)


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """The sliding-window part of a sequence's KV taken right after its prompt was evaluated: its first
    ``n_tokens`` tokens, the window's cells from ``pos_min`` on, llama.cpp's bytes for them
    (``llama_state_seq_get_data_ext`` with ``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``, as llama-server's context
    checkpoints, tools/server/server-context.cpp ``create_checkpoint``).

    Put back over the full-attention cells the sequence (or a cached prompt restored into it) still holds, it
    stands for any cut at ``k <= n_tokens`` that ``window_holds(pos_min, k)``: the next turn of a conversation whose
    client sent back an assistant text of its own (the cached generated tokens are not in the new prompt, so the
    sequence is cut back to the prompt's end, further than its window may still reach). Values only: llama.cpp's
    calls are the engine's (``service.engine.llama.slotting``)."""

    n_tokens: int
    pos_min: int
    state: bytearray


@dataclass(eq=False)
class Slot:
    """One sequence of the context and what its KV cells hold (owned by the engine's scheduler thread)."""

    id: int
    tokens: list[int] = field(default_factory=list)
    """The tokens whose KV this sequence holds, at positions 0..len-1."""
    cells: list[int] = field(default_factory=list)
    """An id per token's cell, shared with another slot after ``llama_memory_seq_cp`` (see ``Cells``)."""
    n_canon: int = 0
    """Batch-invariant mode: leading tokens computed as a cold evaluation computes them (``INVARIANT_MIN_ROWS``)."""
    logits: Any = None
    """The logits after ``tokens[:logits_at]``: the last prompt evaluation's, so that the same prompt again
    samples its first token from the very logits the first run used instead of re-evaluating a token."""
    logits_at: int = 0
    last_used: int = 0
    req: Any = None
    """The request decoding in this slot (None: idle)."""
    scope: str = ""
    """Whose prompt the slot holds (``GenerationParams.cache_scope``): only the same scope reuses it."""
    checkpoint: Checkpoint | None = None
    """The sliding window after the last prompt this slot evaluated (of its first ``checkpoint.n_tokens`` tokens);
    None for models without a sliding window, or once the slot was cut back below it."""


class Cells:
    """Which KV cells hold tokens: one id per cell with a count of the sequences holding it.

    llama.cpp's unified cache shares a cell between sequences after ``seq_cp`` and frees it when the last
    one removes it (src/llama-kv-cells.h ``seq_add``/``seq_rm``); counting the same way gives the cells in
    use exactly, without a llama.cpp call (the public API has none)."""

    def __init__(self) -> None:
        self._refs: dict[int, int] = {}
        self._next = 0

    @property
    def used(self) -> int:
        return len(self._refs)

    def new(self, n: int) -> list[int]:
        ids = list(range(self._next, self._next + n))
        self._next += n
        for i in ids:
            self._refs[i] = 1
        return ids

    def share(self, ids: list[int]) -> list[int]:
        for i in ids:
            self._refs[i] += 1
        return list(ids)

    def drop(self, ids: list[int]) -> None:
        refs = self._refs
        for i in ids:
            left = refs[i] - 1
            if left:
                refs[i] = left
            else:
                del refs[i]


def pick_slot(slots: Sequence[Slot], tokens: list[int], *, similarity: float, reuse: bool,
              scope: str = "") -> Slot | None:
    """llama-server's ``get_available_slot``: the idle slot of the request's ``scope`` whose cached tokens cover
    the largest share of the prompt (more than ``similarity``), else the least recently used one (lowest id
    first); None when all are busy. ``reuse``: prefix reuse is on for this request (else only recency counts)."""
    idle = [s for s in slots if s.req is None]
    if not idle:
        return None
    if reuse and similarity > 0 and tokens:
        best, f_best = None, 0.0
        for s in idle:
            if not s.tokens or s.scope != scope:
                continue
            f = common_prefix(s.tokens, tokens) / len(tokens)
            if f > f_best and f > similarity:
                best, f_best = s, f
        if best is not None:
            return best
    return min(idle, key=lambda s: (s.last_used, s.id))


class HeldPrompt(Protocol):
    """What ``reusable`` reads of a slot, or of a cached prompt (``service.engine.prompt_cache.Entry``)."""

    tokens: list[int]
    n_canon: int
    logits: Any
    logits_at: int
    checkpoint: Checkpoint | None


H = TypeVar("H", bound=HeldPrompt)


@dataclass
class _Prefix:
    """The first tokens of a held prompt, as its checkpoint stands for them (no logits after them)."""

    tokens: list[int]
    n_canon: int
    logits: Any = None
    logits_at: int = 0
    checkpoint: Checkpoint | None = None


def reusable(slot: H, tokens: list[int], *, batch_invariant: bool, holds: Callable[[H, int], bool]) -> int:
    """How many leading ``tokens`` the slot's KV (or a cached prompt's state) can stand for.

    The common prefix, less the prompt's last token (its logits give the first token) unless the slot kept the
    logits after exactly this prompt; in batch-invariant mode only tokens computed as a cold evaluation computes
    them, and at least ``INVARIANT_MIN_ROWS`` tokens left to evaluate; none when ``holds(slot, k)`` says the
    cache no longer holds what the token at position ``k`` attends to (a sliding window)."""
    n = len(tokens)
    lcp = common_prefix(slot.tokens, tokens)
    if lcp == n and slot.logits_at == n and slot.logits is not None:
        k = n
    else:
        k = min(lcp, n - 1)
        if batch_invariant:
            k = min(k, slot.n_canon, n - INVARIANT_MIN_ROWS)
    if k <= 0 or not holds(slot, k):
        return 0
    return k


def reusable_via(held: H, tokens: list[int], *, batch_invariant: bool, holds: Callable[[H, int], bool], n_swa: int
                 ) -> tuple[int, Checkpoint | None]:
    """``reusable`` through the held prompt's window as it is (``holds``), or, where that reaches less, through
    its checkpoint: the tokens kept, and the checkpoint to put back first (None: the window as it is).

    With the window alone, a cached prompt cut back further than the window still reaches (a client's own
    assistant text replacing the generated one) was evaluated again from its first token, or not, by what other
    sequences had taken of the window meanwhile."""
    k = reusable(held, tokens, batch_invariant=batch_invariant, holds=holds)
    c = held.checkpoint
    if c is None or c.n_tokens <= k:
        return k, None
    prefix = _Prefix(held.tokens[:c.n_tokens], min(held.n_canon, c.n_tokens))
    kc = reusable(prefix, tokens, batch_invariant=batch_invariant,
                  holds=lambda _, k: window_holds(c.pos_min, k, n_swa))
    return (kc, c) if kc > k else (k, None)


def longer_prefix(slots: Sequence[Slot], slot: Slot, tokens: list[int], n_keep: int,
                  usable: Callable[[Slot, list[int]], int]) -> tuple[Slot | None, int]:
    """Another slot whose cells hold a longer usable prefix of ``tokens`` (``usable``) than the ``n_keep`` tokens
    ``slot`` keeps, and its length; (None, n_keep) when none does."""
    best, n_best = None, n_keep
    for other in slots:
        if other is slot or len(other.tokens) <= n_best:
            continue
        k = usable(other, tokens)
        if k > n_best:
            best, n_best = other, k
    return best, n_best


def lru_idle_with_cells(slots: Sequence[Slot]) -> Slot | None:
    """The idle slot holding cells that was used least recently: the one a full unified cache clears first
    (llama-server's ``try_clear_idle_slots``)."""
    idle = [s for s in slots if s.req is None and s.tokens]
    return min(idle, key=lambda s: s.last_used) if idle else None


__all__ = ["INVARIANT_MIN_ROWS", "SLOT_PROMPT_SIMILARITY", "Cells", "Checkpoint", "Slot", "common_prefix",
           "longer_prefix", "lru_idle_with_cells", "pick_slot", "reusable", "reusable_via", "window_holds"]
