"""Self-speculative decoding: the next tokens guessed from a sequence's own tokens, and when to guess. Pure: no
llama.cpp.

Where an answer copies from its context (an edited text, tool arguments quoting the prompt, a JSON answer
repeating its input, code rewritten), the tokens that followed the last earlier occurrence of the sequence's
last tokens are a good guess of the tokens that come next: prompt lookup, llama-server's ``ngram-simple``
speculation (common/ngram-map.cpp of the llama.cpp that llama-cpp-python 0.3.36 vendors: "the m tokens
following the last occurrence of the current n-gram"). The engine (``service.engine.llama``) puts the guessed
tokens into the same batch as the sequence's next token and keeps those the model itself would have chosen:
with greedy decoding a drafted token is accepted exactly when it is the argmax of the row before it, so the
answer is the one non-speculative decoding gives, several tokens a step.

``NgramDrafter`` finds the guesses; ``DraftPolicy`` decides how many to verify: a draft costs rows of a batch
(the output head alone is n_vocab x n_embd multiply-adds a row), so the length follows what the last drafts
kept, and a sequence whose drafts keep being rejected stops drafting for a while, the pause doubling each time
it happens again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NGRAM_SIZES = (12, 6, 3, 2)
"""The n-gram lengths looked up, longest first: a long match tells which of several places that share a few
tokens the answer is copying (records of the same keys: 420 of 420 drafted tokens kept against 339 of 570 with
3-grams first, bench/speculative_bench.py ``json``); a 2-gram finds the copy again soonest after an edit.
llama-server's ngram-simple looks up 12 tokens only."""
DRAFT_MAX = 48
"""The most tokens drafted for one sequence in one step (``GGUF_DRAFT_MAX``; llama-server's ngram-simple drafts
up to 48 too). 32 against 16 took the bench's copy from 144 to 153 tokens/s and its JSON from 163 to 189; 48
against 32, in one session alone: copy 159.1 against 155.7 (1.02x against 0.99x llama-server's), JSON 195.3
against 186.0."""
DRAFT_MIN = 1
"""Fewer tokens than this are not worth a draft."""
DRAFT_START = 4
"""A sequence's first draft length; it doubles while drafts are kept whole and falls to what was kept (at least
one) when one is not: a drafted row costs about a sixth of a one-token step (gemma-3-270m on 2 cores: 21 ms for
one row, +3.5 to 4 ms a row up to 24), a kept one saves a step."""
LONG_MATCH = 12
"""A draft found by an n-gram of at least this many tokens is verified at full length (``DraftPolicy.budget``):
that many tokens agreeing with an earlier place of the context means the answer is copying it, and it goes on
copying past where the last draft stopped agreeing (an edit, a changed word). The ramp from ``DRAFT_START`` costs
a copy a step of fixed cost per doubling: the bench's copy went from 163 to 172 tokens/s (the service alone,
bench/speculative_bench.py's prompts), as llama-server's ngram-mod drafts its 48 to 64 tokens at once from 24-token
matches. A wrong full-length draft costs its rows (a sixth of a step each, ``DRAFT_START``). A 6-gram at 16 tokens
was tried and not kept: the copy fell to 174 from 186 (more rejected rows), JSON gained nothing. ``GGUF_DRAFT_MAX``
64 against 48: copy 152 against 172."""
POOL_ANSWERS = 8
"""Finished answers a cache scope's n-gram pool keeps for later requests' drafts (``NgramPool``)."""
POOL_MIN_MATCH = 6
"""The shortest n-gram looked up in the pool: two or three tokens shared with another answer say little about
what follows here (sampled prose drafted from the pool on 2- and 3-grams kept 28 of 209 tokens and ran at 0.98x
its speed without drafts; ngram-mod looks up 24-grams only)."""
PAUSE_AFTER_MISSES = 3
"""Consecutive drafts rejected whole before a sequence stops drafting."""
PAUSE_TOKENS = 16
"""The first pause, in generated tokens; each later pause of the same request is twice the last one."""


def _index_into(index: dict[tuple[int, ...], int], tokens: list[int], start: int, sizes: tuple[int, ...]) -> None:
    """The n-grams ending just before each position ``i >= start`` (``tokens[i - n:i]``) map to ``i``, the position
    of the token that followed them; the latest occurrence wins."""
    for n in sizes:
        for i in range(max(n, start), len(tokens)):
            index[(n, *tokens[i - n:i])] = i


@dataclass
class _Answer:
    tokens: list[int]
    index: dict[tuple[int, ...], int]


@dataclass
class NgramPool:
    """The answers of a scope's finished requests, for the drafts of its later ones: llama-server's ngram-mod keeps
    one hash pool of n-grams for all its slots (common/ngram-mod.cpp), so that a request benefits from what another
    generated (an answer asked for again, a regenerated turn, an agent's loop writing the same call). Here per cache
    scope (``GenerationParams.cache_scope``: one API key's, one ``cache_salt``'s), as the prompt cache, so that one
    tenant's drafts never come from, nor time, another's text. Each answer is indexed once when it ends
    (``add``: a few dictionary inserts a token), the last ``POOL_ANSWERS`` of a scope kept; a sequence's own
    tokens are looked up first (``NgramDrafter``), the pool where they have no n-gram as long."""

    answers: int = 0
    """Answers kept per scope (0: off)."""
    sizes: tuple[int, ...] = NGRAM_SIZES
    _scopes: dict[str, list[_Answer]] = field(default_factory=dict)

    def add(self, scope: str, tokens: list[int], start: int) -> None:
        """An answer that ended: ``tokens[start:]`` generated, after the context that led to it."""
        if self.answers <= 0 or len(tokens) - start < 2:
            return
        held = tokens[max(0, start - max(self.sizes)):]
        index: dict[tuple[int, ...], int] = {}
        _index_into(index, held, 0, self.sizes)
        kept = self._scopes.setdefault(scope, [])
        kept.append(_Answer(held, index))
        del kept[:-self.answers]

    def lookup(self, scope: str, key: tuple[int, ...], k: int) -> list[int]:
        """What followed the n-gram ``key`` (``(n, *tokens)``) in the newest answer of ``scope`` holding it."""
        for a in reversed(self._scopes.get(scope, ())):
            at = a.index.get(key)
            if at is not None:
                return a.tokens[at:at + k]
        return []

    def clear(self) -> None:
        self._scopes.clear()


@dataclass
class NgramDrafter:
    """Prompt lookup over one sequence's tokens, which only grow while it generates, and over its scope's pool.

    An index from each n-gram to the position after its latest occurrence is updated with the new tokens at
    each call (amortised O(1) a token, the prompt once), so a draft costs a dictionary lookup, not a scan."""

    sizes: tuple[int, ...] = NGRAM_SIZES
    pool: NgramPool | None = None
    scope: str = ""
    """The request's cache scope: whose answers in ``pool`` it may draft from."""
    matched: int = 0
    """The n-gram length the last draft was found by (0: none)."""
    _index: dict[tuple[int, ...], int] = field(default_factory=dict)
    _indexed: int = 0
    """Positions < ``_indexed`` have had the n-grams ending before them indexed."""

    def draft(self, tokens: list[int], last: int, k: int) -> list[int]:
        """At most ``k`` tokens guessed to follow ``tokens`` then ``last`` (the sampled token not yet in
        ``tokens``); empty: no earlier occurrence of the last n-gram."""
        n_tok = len(tokens)
        self.matched = 0
        if k <= 0 or n_tok < 2:
            return []
        if n_tok < self._indexed:  # another sequence's tokens: start over
            self._index.clear()
            self._indexed = 0
        index = self._index
        _index_into(index, tokens, self._indexed, self.sizes)
        self._indexed = n_tok
        for n in self.sizes:
            if n_tok < n - 1:
                continue
            key = (n, *tokens[n_tok - n + 1:], last)
            at = index.get(key)
            out = (tokens[at:at + k] if at is not None
                   else self.pool.lookup(self.scope, key, k) if self.pool and n >= POOL_MIN_MATCH else [])
            if out:
                self.matched = n
                for j, t in enumerate(out):
                    if t < 0:  # an image's positions (``service.engine.vision``): no token a step can draft
                        return out[:j]
                return out
        return []


@dataclass
class DraftPolicy:
    """How many tokens one sequence drafts, from how its drafts fared (one per request)."""

    draft_max: int = DRAFT_MAX
    misses: int = 0
    """Consecutive drafts of which no token was accepted."""
    paused_until: int = 0
    """Generated-token count before which the sequence does not draft."""
    pause: int = PAUSE_TOKENS
    length: int = DRAFT_START
    """The next draft's length (``DRAFT_START``, then following what the drafts kept)."""
    drafted: int = 0
    accepted: int = 0

    def budget(self, n_out: int, matched: int = 0) -> int:
        """The most tokens to draft now, after ``n_out`` generated tokens (0: do not draft); ``matched``: the
        n-gram length the draft was found by (``LONG_MATCH`` and more: the whole ``draft_max``)."""
        if n_out < self.paused_until:
            return 0
        return self.draft_max if matched >= LONG_MATCH else min(self.draft_max, self.length)

    def record(self, n_out: int, drafted: int, accepted: int) -> None:
        """A verified draft: ``drafted`` tokens of which the first ``accepted`` were the model's own choice."""
        self.drafted += drafted
        self.accepted += accepted
        if accepted == drafted:
            self.length = min(self.draft_max, max(self.length, 2 * drafted))
        else:
            self.length = max(DRAFT_MIN, accepted + 1)
        if accepted:
            self.misses = 0
            return
        self._miss(n_out)

    def declined(self, n_out: int) -> None:
        """A draft model had no guess it was sure enough of: its decode was spent for nothing, a miss as a draft
        rejected whole (the n-gram drafter's empty look-up costs nothing and is not counted)."""
        self._miss(n_out)

    def _miss(self, n_out: int) -> None:
        self.misses += 1
        if self.misses >= PAUSE_AFTER_MISSES:
            self.paused_until = n_out + self.pause
            self.pause *= 2
            self.misses = 0


__all__ = ["DRAFT_MAX", "DRAFT_MIN", "DRAFT_START", "LONG_MATCH", "NGRAM_SIZES", "POOL_ANSWERS", "DraftPolicy",
           "NgramDrafter", "NgramPool"]
