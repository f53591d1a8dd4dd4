"""Sampling: a request's llama.cpp sampler chain, sampling from saved logits, log probabilities.

The chain is built as llama-cpp-python 0.3.36's ``Llama._init_sampler`` builds it; llama.cpp's sampler API
(src/llama-sampler.cpp) runs it. ``llama_cpp`` and numpy are imported where they are used.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any, Callable

from .base import GenerationParams, TokenScore
from .grammar_sampler import grammar_sampler

PENALTY_LAST_N_TOKENS = 64
"""``Llama.last_n_tokens_size``'s default: the penalty window."""
_BLOCK = 512
"""Logits a ``TemperatureSampler`` sums together before it looks inside the block its draw falls in."""
LLAMA_DEFAULT_SEED = 0xFFFFFFFF
"""llama.h's seed that asks llama.cpp for a random one."""


def sampler_chain(model: Any, n_vocab: int, params: GenerationParams, grammar: Any, seed: int) -> Any:
    """A sampler chain built as llama-cpp-python 0.3.36 ``Llama._init_sampler`` builds it for these arguments
    (top_k 0 unless asked, typical 1, repeat_penalty 1). The caller frees it (``llama_sampler_free``)."""
    import llama_cpp

    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())

    def add(s: Any) -> None:
        llama_cpp.llama_sampler_chain_add(chain, s)

    if params.logit_bias:
        # First, as llama-server's chain puts it (common/sampling.cpp): the bias applies to the raw logits.
        arr = (llama_cpp.llama_logit_bias * len(params.logit_bias))()
        for i, (tok, bias) in enumerate(params.logit_bias):
            arr[i] = llama_cpp.llama_logit_bias(tok, bias)
        add(llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(params.logit_bias), arr))
    add(llama_cpp.llama_sampler_init_penalties(n_vocab, PENALTY_LAST_N_TOKENS, 1.0,
                                               params.frequency_penalty, params.presence_penalty))
    if grammar is not None:
        add(grammar_sampler(model.vocab, grammar))
    temp = params.temperature
    if temp < 0.0:
        add(llama_cpp.llama_sampler_init_dist(seed))
    elif temp == 0.0:
        add(llama_cpp.llama_sampler_init_greedy())
    else:
        add(llama_cpp.llama_sampler_init_top_k(params.top_k))
        add(llama_cpp.llama_sampler_init_typical(1.0, 1))
        add(llama_cpp.llama_sampler_init_top_p(params.top_p, 1))
        add(llama_cpp.llama_sampler_init_min_p(params.min_p, 1))
        add(llama_cpp.llama_sampler_init_temp(temp))
        add(llama_cpp.llama_sampler_init_dist(seed))
    return chain


class TemperatureSampler:
    """The chain ``sampler_chain`` builds for plain temperature sampling (no top-k, top-p, min-p, penalty, grammar or
    bias: OpenAI's default, the whole vocabulary), computed with numpy on the logits row where llama.cpp sees it,
    token for token what the chain draws.

    llama.cpp's chain is then penalties, top_k, typical, top_p and min_p that each return at once, ``temp`` (the
    logits divided in float) and ``dist`` (src/llama-sampler.cpp ``llama_sampler_dist_apply``: ``expf(l - max)`` in
    float, their running sum in double, the first token whose running sum reaches the sum times a draw of
    ``std::uniform_real_distribution<double>`` from a ``std::mt19937`` seeded with the seed). Here the same float
    operations and the same generator (numpy's ``MT19937`` with its legacy seeding is ``mt19937(seed)``, and
    libstdc++'s ``generate_canonical<double, 53>`` takes two of its 32-bit outputs, the first the low half); the
    running sum in double is summed by blocks of ``_BLOCK`` first, then run inside the block the draw falls in, so
    it can differ from the sequential one in its last bits only: the token differs only where the draw falls that
    close to a boundary between two tokens' shares (6,000 draws of 600 seeds and temperatures on random rows of
    262,144 logits: every token the chain's). What it saves is llama_sampler_sample's copy of the row into
    262,144 candidates and its scalar loops: 0.29 against 2.0 ms a token on gemma-3's vocabulary, where sampling
    took 9% of a sampled token's time in the runner (py-spy)."""

    def __init__(self, temperature: float, seed: int) -> None:
        import numpy as np

        self._temp = np.float32(temperature)
        self._bits = np.random.MT19937()
        self._bits._legacy_seeding(seed)
        self._x: Any = None
        """A buffer reused from token to token (a new one of 1 MiB each time costs page faults)."""

    def sample(self, row: Any, earlier: int | None = None, tolerance: float = 0.0) -> int:
        """The token the draw picks from ``row``; ``earlier`` (the token an earlier answer to the same request drew
        here, ``service.engine.replay``) where the draw picks it once each logit is moved by at most half of
        ``tolerance`` (as ``replay.prefer``'s argmax: the earlier token and the chosen one ``tolerance`` apart),
        i.e. where the two differ by the rounding of rows computed in other shapes. One draw either way."""
        import numpy as np

        n = len(row)
        if self._x is None or len(self._x) != n:
            self._x = np.empty(n, dtype=np.float32)
        x = self._x
        if self._temp != 1.0:
            np.divide(row, self._temp, out=x)
            np.subtract(x, x.max(), out=x)
        else:
            np.subtract(row, row.max(), out=x)
        np.exp(x, out=x)
        # The running sum by blocks: each block's sum, their running sum, then the sequential sum inside the block
        # the draw falls in (a whole ``np.cumsum`` in double took 0.76 ms of the 1.0).
        whole = n - n % _BLOCK
        blocks = x[:whole].reshape(-1, _BLOCK).sum(axis=1, dtype=np.float64)
        if whole < n:
            blocks = np.append(blocks, x[whole:].sum(dtype=np.float64))
        ends = np.cumsum(blocks)
        lo, hi = self._bits.random_raw(2)
        draw = (float(lo) + float(hi) * 4294967296.0) / 18446744073709551616.0
        if draw >= 1.0:
            draw = float(np.nextafter(1.0, 0.0))
        target = float(ends[-1]) * draw
        b = min(int(np.searchsorted(ends, target, side="left")), len(ends) - 1)
        start = b * _BLOCK
        inside = np.cumsum(x[start:start + _BLOCK], dtype=np.float64) + (float(ends[b - 1]) if b else 0.0)
        chosen = start + min(int(np.searchsorted(inside, target, side="left")), len(inside) - 1)
        if earlier is None or earlier == chosen or not 0 <= earlier < n or tolerance <= 0.0:
            return chosen
        # The earlier token's share of the running sum, [below, upto), and how far moving each logit by at most
        # tolerance / 2 can stretch it towards the draw: the shares on the draw's side of it down by a factor k,
        # its own and those on the other side up by k (temperature divides the logits first), k^2 = kk.
        total = float(ends[-1])
        eb = earlier // _BLOCK
        below = (float(ends[eb - 1]) if eb else 0.0) + float(x[eb * _BLOCK:earlier].sum(dtype=np.float64))
        upto = below + float(x[earlier])
        kk = math.exp(min(tolerance / float(self._temp), 700.0))
        if target >= upto:  # the draw fell after the earlier token's share: its end moved up to
            reach = 1.0 / (1.0 + (total - upto) / (upto * kk)) if upto > 0.0 else 0.0
            return earlier if draw < reach else chosen
        reach = 1.0 / (1.0 + (total - below) * kk / below)  # before it (below > target >= 0): its start down to
        return earlier if draw >= reach else chosen


def plain_temperature(params: GenerationParams, grammar: Any, seed: int) -> bool:
    """Whether ``sampler_chain`` would build plain temperature sampling (``TemperatureSampler`` draws it; a top_k
    of its own, even one of the whole vocabulary, sorts the candidates, and the draw then walks another order)."""
    return not (params.temperature <= 0.0 or grammar is not None or params.logit_bias or params.frequency_penalty
                or params.presence_penalty or params.top_p < 1.0 or params.top_k > 0 or params.min_p > 0.0
                or seed == LLAMA_DEFAULT_SEED)


def temperature_sampler(params: GenerationParams, grammar: Any, seed: int) -> TemperatureSampler | None:
    """A ``TemperatureSampler`` where ``sampler_chain`` would build plain temperature sampling, else None."""
    return TemperatureSampler(params.temperature, seed) if plain_temperature(params, grammar, seed) else None


def draw_key(params: GenerationParams, grammar: Any, seed: int) -> str | None:
    """What a seeded temperature draw's answer is kept under beside its prompt (``replay.Replays``): the request
    asked again with the same seed and temperature draws the same numbers, and so the same answer to within the
    rounding; None where nothing fixes the draw (no seed given: a random one) or llama.cpp's chain draws it."""
    if params.seed is None or not plain_temperature(params, grammar, seed):
        return None
    return f"temperature={float(params.temperature)!r} seed={seed}"


class SavedLogits:
    """Sampling from logits kept after the step that produced them (a cached prompt's, a forked choice's):
    ``llama_sampler_sample`` over a candidates array (src/llama-sampler.cpp: the candidates, apply, accept),
    the array reused between calls."""

    def __init__(self, n_vocab: int) -> None:
        self._n_vocab = n_vocab
        self._cand: Any = None

    def sample(self, sampler: Any, logits: Any) -> int:
        import llama_cpp
        import numpy as np

        cand = self._cand
        if cand is None:
            cand = self._cand = np.zeros(self._n_vocab, dtype=[("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
        cand["id"] = np.arange(self._n_vocab, dtype=np.int32)
        cand["logit"] = logits
        cand["p"] = 0.0
        arr = llama_cpp.llama_token_data_array(
            data=cand.ctypes.data_as(llama_cpp.llama_token_data_p), size=self._n_vocab, selected=-1, sorted=False)
        llama_cpp.llama_sampler_apply(sampler, ctypes.byref(arr))
        tok = int(cand["id"][arr.selected])
        llama_cpp.llama_sampler_accept(sampler, tok)
        return tok


def scores_of(logits: Any, k: int) -> Callable[[int], TokenScore]:
    """A function of the sampled token: its log-softmax over ``logits`` (one row), and the top ``k`` alternatives by
    id (their texts are the API process's: ``service.text``)."""
    import numpy as np

    x = logits.astype(np.float64)
    m = x.max()
    lse = m + np.log(np.exp(x - m).sum())
    top: tuple[tuple[int, float], ...] = ()
    if k > 0:
        ids = np.argpartition(-x, k)[:k]
        ids = ids[np.argsort(-x[ids])]
        top = tuple((int(i), float(x[i] - lse)) for i in ids)

    def of(tok: int) -> TokenScore:
        return TokenScore(tok, float(x[tok] - lse), top)

    return of


__all__ = ["PENALTY_LAST_N_TOKENS", "SavedLogits", "TemperatureSampler", "draw_key", "plain_temperature",
           "scores_of", "sampler_chain", "temperature_sampler"]
