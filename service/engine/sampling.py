"""Sampling: a request's llama.cpp sampler chain, sampling from saved logits, log probabilities.

The chain is built as llama-cpp-python 0.3.36's ``Llama._init_sampler`` builds it; llama.cpp's sampler API
(src/llama-sampler.cpp) runs it. ``llama_cpp`` and numpy are imported where they are used.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable

from .base import GenerationParams, TokenLogprob
from .grammar_sampler import grammar_sampler

PENALTY_LAST_N_TOKENS = 64
"""``Llama.last_n_tokens_size``'s default: the penalty window."""


def sampler_chain(model: Any, n_vocab: int, params: GenerationParams, grammar: Any, seed: int) -> Any:
    """A sampler chain built as llama-cpp-python 0.3.36 ``Llama._init_sampler`` builds it for these arguments
    (top_k 0, min_p 0, typical 1, repeat_penalty 1). The caller frees it (``llama_sampler_free``)."""
    import llama_cpp

    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())

    def add(s: Any) -> None:
        llama_cpp.llama_sampler_chain_add(chain, s)

    if params.logit_bias:
        # First, as llama-server's chain puts it (common/sampling.cpp): the bias applies to the raw logits.
        arr = (llama_cpp.llama_logit_bias * len(params.logit_bias))()
        for i, (tok, bias) in enumerate(params.logit_bias):
            arr[i].token, arr[i].bias = tok, bias
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
        add(llama_cpp.llama_sampler_init_min_p(0.0, 1))
        add(llama_cpp.llama_sampler_init_temp(temp))
        add(llama_cpp.llama_sampler_init_dist(seed))
    return chain


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


def logprob_of(logits: Any, k: int, token_bytes: Callable[[int], bytes]) -> Callable[[int], TokenLogprob]:
    """A function of the sampled token: its log-softmax over ``logits`` (one row), and the top ``k`` alternatives
    (``token_bytes``: a token's text)."""
    import numpy as np

    x = logits.astype(np.float64)
    m = x.max()
    lse = m + np.log(np.exp(x - m).sum())
    top: tuple[tuple[str, float], ...] = ()
    if k > 0:
        ids = np.argpartition(-x, k)[:k]
        ids = ids[np.argsort(-x[ids])]
        top = tuple((token_bytes(int(i)).decode("utf-8", "replace"), float(x[i] - lse)) for i in ids)

    def of(tok: int) -> TokenLogprob:
        piece = token_bytes(tok)
        return TokenLogprob(piece.decode("utf-8", "replace"), float(x[tok] - lse), tuple(piece), top)

    return of


__all__ = ["PENALTY_LAST_N_TOKENS", "SavedLogits", "logprob_of", "sampler_chain"]
