"""Self-speculative decoding: the next tokens guessed from a sequence's own tokens, and when to guess. Pure: no
llama.cpp.

Where an answer copies from its context (an edited text, tool arguments quoting the prompt, a JSON answer
repeating its input, code rewritten, a table copied), the tokens that followed an earlier place agreeing with the
sequence's last tokens are a good guess of the tokens that come next: prompt lookup, llama-server's
``ngram-simple`` and ``ngram-mod`` speculation (common/ngram-map.cpp, common/ngram-mod.cpp and
common/speculative.cpp of the llama.cpp that llama-cpp-python 0.3.36 vendors). The engine
(``service.engine.llama``) puts the guessed tokens into the same batch as the sequence's next token and keeps those
the model itself would have chosen: with greedy decoding a drafted token is accepted exactly when it is the argmax
of the row before it, so the answer is the one non-speculative decoding gives, several tokens a step.

``NgramDrafter`` finds the place agreeing longest with the sequence's end, among its own tokens and its scope's
earlier answers, and how long the agreement is; ``NgramPolicy`` decides how many of the tokens that followed it to
verify, from that length and from what the request's earlier drafts of such lengths kept. Where a text repeats a
small vocabulary (logs, tables, code) a few tokens agree with many places, and a guess from them is mostly wrong;
llama-server's ngram-mod answers that with 24-token keys only. Here the length of the agreement classes the draft,
and each class's measured acceptance sizes it: short agreements draft where they are kept (a copy just resumed
after an edit), not where they are not (a table's rows, a word list). ``DraftPolicy`` sizes a draft model's
guesses, which come with no such length.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass, field
from typing import Callable

NGRAM_SIZES = (32, 16, 8, 4, 2)
"""The key lengths looked up, longest first: the first that occurred before gives the places compared
(``CHAIN_MAX``), whose agreement with the sequence is measured token by token (``MATCH_MAX``). Long keys tell apart the places that share a few tokens (records of the same keys, a small
vocabulary); the 2-gram finds the copy again soonest after an edit. llama-server's ngram-simple looks up 12
tokens, its ngram-mod 24."""
CHAIN_MAX = 8
"""The places of one key compared, latest first (``_Index.best``): on a text of few words a 2-token key's latest
place agrees on 2 or 3 tokens where an earlier one agrees on 5."""
MATCH_MAX = 64
"""The longest agreement measured: as long as any draft (``GGUF_DRAFT_MAX``, 63 by default)."""
DRAFT_MAX = 63
"""The most tokens drafted for one sequence in one step (``GGUF_DRAFT_MAX``; llama-server's ngram-mod drafts up to
64, its ngram-simple 48). On the CPU a row costs less the more rows a step holds (``STEP_COST_PRIOR``: 48 rows
13.9 one-row steps, 64 rows 16.7): a copy drafted whole from an earlier answer comes 10% faster in 64-row steps
than in 48 (simulated on bench/speculative_bench.py's answers; measured figures in docs/benchmarks.md). 63, not
64: a whole draft and the sequence's next token make a step of 64 rows, a multiple of the blocks ggml-cpu takes
rows in (4 in the matrix products of repacked weights, ggml-cpu/repack.cpp ``forward_mul_mat_one_chunk``, which
takes the rows beyond a multiple of 4 one by one, each a pass over the weights; 16 in the others' chunks). On
the 2-core AVX2 host, gemma-3-270m, interleaved: 64 rows 431 ms, 65 rows 497 (6.7 against 7.6 ms a token); 60
rows 433, 63 rows 466, 68 rows 457 (bench/step_cost_bench.py --rows 60,63,64,65,68 --rounds 6)."""
DRAFT_MIN = 1
"""Fewer tokens than this are not worth a draft."""
DRAFT_START = 4
"""A draft model's first draft length (``DraftPolicy``); it doubles while drafts are kept whole and falls to what
was kept (at least one) when one is not."""
STEP_COST_PRIOR = ((1, 1.0), (2, 1.95), (3, 2.47), (4, 2.87), (8, 3.65), (16, 5.4), (32, 9.6), (48, 13.9),
                   (64, 16.7))
"""A step's decode time by the rows in its batch, in one-row steps, before a load has measured its own
(``StepCosts``): gemma-3-270m Q4_K_M on 2 AVX2 cores, 11.6 ms for one row (bench/step_cost_bench.py). A second
row doubles the step (ggml-cpu computes one row as a matrix-vector product, more as a matrix product), and each
further row costs about a quarter of a one-row step, the output head (262,144 x 640) most of it. SmolLM2-135M's
curve is steeper (64 rows: 27 one-row steps, against 16.7 here): each load learns its own."""
COST_MEMORY = 0.25
"""The weight of a step's measured time in its row count's running figure (``StepCosts.record``)."""
MATCH_CLASSES = (2, 4, 8, 16, 32, MATCH_MAX)
"""The lower bounds of the agreement-length classes whose acceptance ``NgramPolicy`` measures apart."""
PRIOR_KEPT = (0.3, 0.5, 0.8, 0.9, 0.97, 0.998)
"""Each class's expected share of drafted tokens kept, one after the other, before a request has drafted from it
(measured on bench/speculative_bench.py's copies, greedy, the embedded model). A 64-token agreement starts at
0.998, which drafts the whole ``GGUF_DRAFT_MAX``; 2 to 7 agreeing tokens at 0.3 and 0.5 draft nothing until the
request's own drafts of them are kept (a second row costs a step on the CPU). Replayed over the bench's 15
answers at the measured step costs, against (0.4, 0.6, 0.8, 0.9, 0.95, 0.998): code 3.19x against 3.12x its speed
without drafts, copy 2.55x against 2.46x, the others within 0.05x."""
WHOLE_DRAFT = 0.5
"""Where a class's drafts are expected kept whole at least this often (an earlier answer agreeing on 64 tokens,
0.998 a token: 0.88 for 64 tokens), the draft is as long as allowed, not what the measured step costs make best.
Rows computed in other shapes round otherwise (ggml-cpu: a row of a 4-row block of a matrix product is not the
row of a vector product), and a step's measured time is noisy on shared cores: an answer asked again was drafted
in 55-, 50- then 32-token pieces as one slow step or another moved the best length, came out otherwise each
time, and its next drafts from the pool were cut. Drafted whole, it is drafted in the same shapes each time
(bench/speculative_bench.py's json text, asked 4 times: 64, 64, 60 and kept whole each time; its prose text still
came out otherwise, where the unified cache placed its prompt elsewhere: docs/batching.md, kernel by kernel); for
a token kept 0.99 of the time 64 tokens give the step as much as the best length does at the CPU's measured
costs (2.9 against 3.0 tokens a one-row step's time)."""
PRIOR_WEIGHT = 4.0
"""How many tokens of evidence the prior is worth."""
DECAY = 0.9
"""Each draft of a class weighs the class's earlier evidence by this: the acceptance followed is the recent one."""
MIN_GAIN = 1.05
"""A draft is made where the tokens it is expected to give per unit of step time are at least this many times a
step's one token (the row cost is a model: what it leaves out should not make a draft a loss)."""
POOL_ANSWERS = 64
"""Finished answers a cache scope's n-gram pool keeps for later requests' drafts (``NgramPool``). 8 lost an answer
asked again after 8 others (bench/speculative_bench.py's 15 workloads: its CSV table at 0.41x llama-server's
ngram-mod, whose one hash pool keeps far more, 1.48x while the pool held it); an answer's index is a few thousand
dictionary entries, and a draft looks the newest answers up first."""
POOL_MIN_MATCH = 8
"""The shortest key looked up in the pool: two or three tokens shared with another answer say little about
what follows here (sampled prose drafted from the pool on 2- and 3-grams kept 28 of 209 tokens and ran at 0.98x
its speed without drafts; ngram-mod looks up 24-grams only)."""
PAUSE_AFTER_MISSES = 3
"""Consecutive drafts rejected whole before a sequence drafting from a draft model stops for a while."""
PAUSE_TOKENS = 16
"""The first pause, in generated tokens; each later pause of the same request is twice the last one."""


@dataclass
class _Index:
    """Where each key of a token list occurred: per key length, the position after its latest occurrence, and for
    every position the one after the key's occurrence before (a hash chain, as zlib's deflate finds its matches),
    so that the several places a short key occurred can be compared. Keys are hashed: an index of 32-token tuples
    held 300 bytes a token a size; a collision is caught by ``_agreement``."""

    sizes: tuple[int, ...]
    latest: dict[int, dict[int, int]] = field(default_factory=dict)
    chain: dict[int, list[int]] = field(default_factory=dict)
    """Per key length, for each position, the position after the previous occurrence of the key ending before it
    (-1: none)."""
    indexed: int = 0
    """Positions < ``indexed`` have had the keys ending before them indexed."""

    def extend(self, tokens: list[int]) -> None:
        """Index the keys ending before the positions from ``indexed`` to the end of ``tokens`` (amortised O(1) a
        token a key length: the prompt once, then the tokens each step adds)."""
        if len(tokens) < self.indexed:  # another sequence's tokens: start over
            self.latest.clear()
            self.chain.clear()
            self.indexed = 0
        for n in self.sizes:
            latest = self.latest.setdefault(n, {})
            chain = self.chain.setdefault(n, [])
            for i in range(self.indexed, len(tokens)):
                if i < n:
                    chain.append(-1)
                    continue
                key = hash(tuple(tokens[i - n:i]))
                chain.append(latest.get(key, -1))
                latest[key] = i
        self.indexed = len(tokens)

    def best(self, tokens: list[int], n: int, key: int, seq: list[int], want: int = 0) -> tuple[int, int]:
        """Of the ``CHAIN_MAX`` latest places the ``n``-token key ``key`` occurred in ``tokens``, the one agreeing
        longest with ``seq``'s end, on a tie the one followed by more tokens (up to ``want``: an answer repeating
        its opening at its end agreed as long there as at its start, where 3 tokens were left to copy instead of
        64), then the latest: (agreement, position after it); (0, -1): none."""
        at = self.latest.get(n, {}).get(key, -1)
        chain = self.chain.get(n, [])
        best, room, where = 0, 0, -1
        for _ in range(CHAIN_MAX):
            if at < 0:
                break
            m = _agreement(tokens, at, seq, MATCH_MAX)
            r = min(len(tokens) - at, want)
            if (m, r) > (best, room):
                best, room, where = m, r, at
                if m >= MATCH_MAX and r >= want:
                    break
            at = chain[at]
        return (best, where) if best >= n else (0, -1)  # below n: a hash collision


def _agreement(src: list[int], at: int, seq: list[int], limit: int) -> int:
    """How many tokens ``src[:at]`` and ``seq`` agree on, counted back from their ends (at most ``limit``)."""
    m, n = 0, len(seq)
    stop = min(limit, at, n)
    while m < stop and src[at - 1 - m] == seq[n - 1 - m]:
        m += 1
    return m


@dataclass
class _Answer:
    tokens: list[int]
    index: _Index


@dataclass
class NgramPool:
    """The answers of a scope's finished requests, for the drafts of its later ones: llama-server's ngram-mod keeps
    one hash pool of n-grams for all its slots (common/ngram-mod.cpp), so that a request benefits from what another
    generated (an answer asked for again, a regenerated turn, an agent's loop writing the same call). Here per cache
    scope (``GenerationParams.cache_scope``: one API key's, one ``cache_salt``'s), as the prompt cache, so that one
    tenant's drafts never come from, nor time, another's text. Each answer is indexed once when it ends
    (``add``: a few dictionary inserts a token), with the ``MATCH_MAX`` tokens of context before it, the last
    ``POOL_ANSWERS`` of a scope kept; a sequence drafts from the place, its own tokens' or the pool's, that agrees
    longest with its end (``NgramDrafter``)."""

    answers: int = 0
    """Answers kept per scope (0: off)."""
    sizes: tuple[int, ...] = NGRAM_SIZES
    _scopes: dict[str, list[_Answer]] = field(default_factory=dict)

    def add(self, scope: str, tokens: list[int], start: int) -> None:
        """An answer that ended: ``tokens[start:]`` generated, after the context that led to it."""
        if self.answers <= 0 or len(tokens) - start < 2:
            return
        held = tokens[max(0, start - MATCH_MAX):]
        index = _Index(tuple(n for n in self.sizes if n >= POOL_MIN_MATCH))
        index.extend(held)
        kept = self._scopes.setdefault(scope, [])
        kept.append(_Answer(held, index))
        del kept[:-self.answers]

    def find(self, scope: str, n: int, key: int, seq: list[int], want: int = 0) -> tuple[int, list[int], int]:
        """Of the newest answer of ``scope`` holding the ``n``-token key ``key`` (hashed), the place agreeing
        longest with ``seq``'s end (``_Index.best``: then followed by up to ``want`` tokens): (agreement, the
        answer's tokens, the position after it); agreement 0: none."""
        for a in reversed(self._scopes.get(scope, ())):
            m, at = a.index.best(a.tokens, n, key, seq, want)
            if m:
                return m, a.tokens, at
        return 0, [], -1

    def clear(self) -> None:
        self._scopes.clear()


@dataclass
class NgramDrafter:
    """Prompt lookup over one sequence's tokens, which only grow while it generates, and over its scope's pool.

    An index of each key's places is updated with the new tokens at each call (``_Index``: amortised O(1) a token
    a key length, the prompt once), so a draft costs a few dictionary lookups and comparisons, not a scan. Of the
    places found by the longest key that occurred, the one agreeing longest with the sequence's end is copied (``matched``: how long, which ``NgramPolicy`` classes the draft by); the pool's answer on a
    tie (the model's own earlier text, not the text it was given: on the bench's CSV table an answer asked again
    was drafted from the prompt's table where both agreed on 64 tokens, 0.44x llama-server's ngram-mod, 1.34x
    from the pool). A copy of the sequence's own recent tokens runs on into what it drafts (a loop of a few tokens is drafted
    as long as asked, as ngram-mod's chained lookups do)."""

    sizes: tuple[int, ...] = NGRAM_SIZES
    pool: NgramPool | None = None
    scope: str = ""
    """The request's cache scope: whose answers in ``pool`` it may draft from."""
    matched: int = 0
    """How many tokens the place the last draft copied agrees on with the sequence's end (0: none found; at most
    ``MATCH_MAX``)."""
    pooled: bool = False
    """The last draft copied an earlier answer of the pool, not the sequence's own tokens."""
    _own: _Index | None = None

    def draft(self, tokens: list[int], last: int, k: int) -> list[int]:
        """At most ``k`` tokens guessed to follow ``tokens`` then ``last`` (the sampled token not yet in
        ``tokens``); empty: no earlier occurrence of the last tokens."""
        n_tok = len(tokens)
        self.matched, self.pooled = 0, False
        if k <= 0 or n_tok < 2:
            return []
        if self._own is None:
            self._own = _Index(self.sizes)
        own = self._own
        own.extend(tokens)
        seq = [*tokens[n_tok + 1 - min(MATCH_MAX, n_tok + 1):], last]  # the end agreement is measured on
        for n in self.sizes:
            if n_tok + 1 < n:
                continue
            key = hash(tuple(seq[len(seq) - n:]))
            best, at = own.best(tokens, n, key, seq)
            src = tokens
            if self.pool and n >= POOL_MIN_MATCH:
                m, answer, where = self.pool.find(self.scope, n, key, seq, k)
                # A tie: the model's own earlier answer, not the text it was given, where it has as much to copy
                # (the sequence's own copy runs on into itself).
                if m and (m > best or (m == best and len(answer) - where >= k)):
                    best, src, at = m, answer, where
            if best:
                self.matched, self.pooled = best, src is not tokens
                return _copy(src, at, k, seq if src is tokens else None)
        return []


def _copy(src: list[int], at: int, k: int, tail: list[int] | None) -> list[int]:
    """``src[at:at + k]``, stopping before an image's positions (``service.engine.vision``: negative, no token a
    step can draft); with ``tail`` (the sequence's own end, ``src`` its tokens) the copy runs on past ``src``'s end
    into ``tail``'s last token and then into itself."""
    out = src[at:at + k]
    if tail is not None and len(out) < k:
        out.append(tail[-1])
        period = len(src) + 1 - at  # the copy runs ``period`` tokens behind the sequence's end
        while len(out) < k:
            out.append(out[len(out) - period])
    for j, t in enumerate(out):
        if t < 0:
            return out[:j]
    return out[:k]


@dataclass
class DraftPolicy:
    """How many tokens a draft model drafts for one sequence, from how its drafts fared (one per request)."""

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
        """The most tokens to draft now, after ``n_out`` generated tokens (0: do not draft)."""
        if n_out < self.paused_until:
            return 0
        return min(self.draft_max, self.length)

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
        rejected whole."""
        self._miss(n_out)

    def _miss(self, n_out: int) -> None:
        self.misses += 1
        if self.misses >= PAUSE_AFTER_MISSES:
            self.paused_until = n_out + self.pause
            self.pause *= 2
            self.misses = 0


def match_class(matched: int) -> int:
    """The class of an agreement of ``matched`` tokens (``MATCH_CLASSES``); -1: none."""
    c = -1
    for i, low in enumerate(MATCH_CLASSES):
        if matched >= low:
            c = i
    return c


def best_length(kept: float, cap: int, cost: Callable[[int], float] | None = None, others: int = 0,
                min_gain: float = MIN_GAIN) -> int:
    """The draft length up to ``cap`` that gives the step the most tokens per unit of its time where each drafted
    token is kept with probability ``kept`` once the ones before it were: ``(others + 1 + kept + kept^2 + ... +
    kept^L) / ((others + 1) * cost(L))``, ``cost(L)`` the step's time with ``L`` rows more than without the draft
    (``StepCosts.relative``; ``others``: the step's other generating rows); 0 where no length gives ``min_gain``
    times the step without it; ``cap`` itself where the whole of it is expected kept at least ``WHOLE_DRAFT`` of
    the time, whatever the costs say."""
    if kept ** cap >= WHOLE_DRAFT:
        return cap
    if cost is None:
        cost = StepCosts().relative(1)
    best, length = min_gain, 0
    q, tokens = 1.0, 1.0 + others
    for n in range(1, cap + 1):
        q *= kept
        tokens += q
        gain = tokens / ((1.0 + others) * cost(n))
        if gain > best:
            best, length = gain, n
    return length


@dataclass
class StepCosts:
    """A load's decode time by the rows of a step, measured on its own steps without prompt rows
    (``BatchStep.run``), for ``best_length``: the draft that pays on one machine and model is a loss on another
    (a second row costs a whole step here on the CPU, a few percent on a GPU). A row count not yet measured lies
    on the line between the measured counts nearest it, or beyond them on ``STEP_COST_PRIOR``'s shape scaled to
    the nearest."""

    seconds: dict[int, float] = field(default_factory=dict)
    """Per row count, the running time of a step (``COST_MEMORY``)."""
    _known: list[int] = field(default_factory=list)
    """``seconds``' row counts, sorted."""

    def record(self, rows: int, seconds: float) -> None:
        if rows <= 0 or seconds <= 0:
            return
        was = self.seconds.get(rows)
        if was is None:
            bisect.insort(self._known, rows)
            self.seconds[rows] = seconds
        else:
            self.seconds[rows] = was + COST_MEMORY * (seconds - was)

    def time(self, rows: int) -> float:
        """A step of ``rows`` rows, in seconds where measured near it, else in ``STEP_COST_PRIOR``'s units."""
        if rows in self.seconds:
            return self.seconds[rows]
        prior = _prior(rows)
        known = self._known
        if not known:
            return prior
        i = bisect.bisect_left(known, rows)
        if i == 0 or i == len(known):  # outside what was measured: the prior's shape from the nearest count
            near = known[0] if i == 0 else known[-1]
            return prior * self.seconds[near] / _prior(near)
        lo, hi = known[i - 1], known[i]
        w = (rows - lo) / (hi - lo)  # between two measured counts: on the line joining them
        return self.seconds[lo] + w * (self.seconds[hi] - self.seconds[lo])

    def relative(self, base: int) -> Callable[[int], float]:
        """A step of ``base`` rows with ``n`` more, in steps of ``base`` rows."""
        t0 = self.time(base)
        return lambda n: self.time(base + n) / t0


def _prior(rows: int) -> float:
    """``STEP_COST_PRIOR`` at ``rows`` (linear between its points, and on from its last two)."""
    pts = STEP_COST_PRIOR
    for (a, ca), (b, cb) in zip(pts, pts[1:]):
        if rows <= b:
            return ca + (cb - ca) * (max(rows, a) - a) / (b - a)
    (a, ca), (b, cb) = pts[-2], pts[-1]
    return cb + (cb - ca) * (rows - b) / (b - a)


@functools.lru_cache(maxsize=4096)
def _prior_length(kept: float, cap: int, base: int) -> int:
    """``best_length`` at ``STEP_COST_PRIOR``'s costs, which never change: a sampled request's drafts are sized so
    at every step that finds a place to copy (130 us a call, most of them at a class's unchanged prior chance, on
    steps of 20 ms: sampled prose, which finds 2-grams everywhere and drafts none of them)."""
    return best_length(kept, cap, StepCosts().relative(base), base - 1)


@dataclass
class NgramPolicy(DraftPolicy):
    """How many tokens an n-gram draft verifies, from how long the place it copies agrees with the sequence's end
    and what this request's drafts of that agreement class kept (one per request).

    Each class (``MATCH_CLASSES``), apart for places in the sequence's own tokens and in its scope's earlier answers
    (an answer asked again comes out otherwise from the first token that the rounding of another batch shape tips:
    a pool draft cut at its second token had shrunk the next own copies of 64 agreeing tokens to 5), holds the
    tokens its drafts kept and the drafts cut short, the older evidence weighed down by ``DECAY`` at each draft
    and ``PRIOR_KEPT`` worth ``PRIOR_WEIGHT`` tokens before any: their ratio is the chance that a drafted token is
    kept once those before it were, and the draft is as long as that chance makes worth its rows at the load's
    measured step costs (``best_length``, ``StepCosts``). A copy agreeing for 64 tokens drafts the whole
    ``draft_max``; on a text of few words, where 2 to 8 tokens agree with many places, short agreements whose
    drafts are cut at once stop drafting (the key is lengthened by what the request measures, not set once for
    all texts), and they draft again where they are kept, e.g. a copy resumed after an edit. llama-server's
    ngram-mod drafts 48 to 64 tokens from 24-token keys only, and empties its pool after 5 drafts in a row kept
    under a quarter (common/speculative.cpp ``common_speculative_impl_ngram_mod::accept``)."""

    costs: StepCosts | None = None
    """The load's step costs (None: ``STEP_COST_PRIOR``)."""
    kept: list[float] = field(default_factory=lambda: [p * PRIOR_WEIGHT for p in PRIOR_KEPT * 2])
    """Per class, own places then pool places: tokens kept (decayed, the prior's included)."""
    cut: list[float] = field(default_factory=lambda: [(1.0 - p) * PRIOR_WEIGHT for p in PRIOR_KEPT * 2])
    """Per class: drafts cut short, each the token that was not kept (decayed, the prior's included)."""
    _class: int = -1
    """The class of the draft ``budget`` last sized (-1: none), which ``record`` is told about."""

    def chance(self, c: int) -> float:
        """The chance that a drafted token of class ``c`` is kept once the ones before it were."""
        return self.kept[c] / (self.kept[c] + self.cut[c])

    def budget(self, n_out: int, matched: int = 0, *, pooled: bool = False, base: int = 1) -> int:
        """The most tokens to draft now from a place agreeing on ``matched`` tokens, in an earlier answer of the
        pool where ``pooled``, into a step of ``base`` rows without the draft (0: do not draft)."""
        c = match_class(matched)
        self._class = c if c < 0 or not pooled else c + len(MATCH_CLASSES)
        if c < 0:
            return 0
        if self.costs is None or not self.costs.seconds:
            return _prior_length(self.chance(self._class), self.draft_max, base)
        return best_length(self.chance(self._class), self.draft_max, self.costs.relative(base), base - 1)

    def record(self, n_out: int, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        c, self._class = self._class, -1
        if c < 0 or drafted <= 0:
            return
        self.kept[c] = self.kept[c] * DECAY + accepted
        self.cut[c] = self.cut[c] * DECAY + (accepted < drafted)


__all__ = ["DRAFT_MAX", "DRAFT_MIN", "DRAFT_START", "MATCH_CLASSES", "MATCH_MAX", "NGRAM_SIZES", "POOL_ANSWERS",
           "DraftPolicy", "NgramDrafter", "NgramPolicy", "NgramPool", "StepCosts", "best_length", "match_class"]
