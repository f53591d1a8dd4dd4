"""Plain temperature sampling drawn with numpy (``TemperatureSampler``) is llama.cpp's chain, token for token: the
same seeds give the same tokens, and only the chain's plain case takes it."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest

from service.engine.base import GenerationParams
from service.engine.sampling import LLAMA_DEFAULT_SEED, TemperatureSampler, sampler_chain, temperature_sampler

N_VOCAB = 262_144


class _Model:
    vocab = None  # sampler_chain reads it only for a grammar


def _chain_tokens(rows: list[Any], params: GenerationParams, seed: int) -> list[int]:
    import llama_cpp

    chain = sampler_chain(_Model(), N_VOCAB, params, None, seed)
    cand = np.zeros(N_VOCAB, dtype=[("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
    out = []
    try:
        for row in rows:
            cand["id"] = np.arange(N_VOCAB, dtype=np.int32)
            cand["logit"], cand["p"] = row, 0.0
            arr = llama_cpp.llama_token_data_array(data=cand.ctypes.data_as(llama_cpp.llama_token_data_p),
                                                   size=N_VOCAB, selected=-1, sorted=False)
            llama_cpp.llama_sampler_apply(chain, ctypes.byref(arr))
            tok = int(cand["id"][arr.selected])
            llama_cpp.llama_sampler_accept(chain, tok)
            out.append(tok)
    finally:
        llama_cpp.llama_sampler_free(chain)
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_the_numpy_draw_is_the_chains(temperature: float) -> None:
    rng = np.random.default_rng(7)
    params = GenerationParams(temperature=temperature, top_p=1.0)
    for seed in (0, 1, 3, 42, 2**31 - 1, 2**32 - 2):
        rows = [(rng.standard_normal(N_VOCAB) * 4).astype(np.float32) for _ in range(4)]
        rows.append(np.full(N_VOCAB, -1.0, dtype=np.float32))  # every token alike: the draw decides alone
        sampler = temperature_sampler(params, None, seed)
        assert sampler is not None
        assert [sampler.sample(r) for r in rows] == _chain_tokens(rows, params, seed), seed


def test_a_peaked_row_gives_its_peak() -> None:
    row = np.full(N_VOCAB, -50.0, dtype=np.float32)
    row[123_456] = 50.0
    assert TemperatureSampler(1.0, 5).sample(row) == 123_456


@pytest.mark.parametrize("params, seed", [
    (GenerationParams(temperature=0.0), 1),
    (GenerationParams(temperature=1.0, top_p=0.9), 1),
    (GenerationParams(temperature=1.0, top_k=40), 1),
    (GenerationParams(temperature=1.0, top_k=N_VOCAB), 1),  # sorts the candidates: another order to walk
    (GenerationParams(temperature=1.0, frequency_penalty=0.5), 1),
    (GenerationParams(temperature=1.0, logit_bias=((5, -100.0),)), 1),
    (GenerationParams(temperature=1.0), LLAMA_DEFAULT_SEED),  # llama.cpp draws a random seed for it
])
def test_only_the_plain_case_draws_with_numpy(params: GenerationParams, seed: int) -> None:
    assert temperature_sampler(params, None, seed) is None
    assert temperature_sampler(params, object(), 1) is None  # a grammar
