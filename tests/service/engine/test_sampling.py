"""Plain temperature sampling drawn with numpy (``TemperatureSampler``) is llama.cpp's chain, token for token: the
same seeds give the same tokens, and only the chain's plain case takes it."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest

from service.engine.base import GenerationParams
from service.engine.sampling import (LLAMA_DEFAULT_SEED, TemperatureSampler, draw_key, sampler_chain,
                                     temperature_sampler)

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


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_an_earlier_token_is_drawn_where_logits_moved_by_half_the_tolerance_draw_it(temperature: float) -> None:
    """A seeded request asked again takes its earlier answer's token where the same draw picks it once each logit
    is moved by at most half the tolerance (``service.engine.replay``), and not where no such move does: checked
    against the draw over a row actually moved so, towards the draw by the whole half tolerance. The shares move
    continuously with the move, so where the fully moved row's draw falls on or beyond the earlier token, the draw
    crossed the earlier token's share on the way (a token whose share is not 0)."""
    rng = np.random.default_rng(11)
    tolerance = 1.0
    taken = refused = 0
    for seed in range(12):
        row = (rng.standard_normal(2_000) * 2).astype(np.float32)  # 2,000 tokens: the draw's blocks of 512 and more
        chosen = TemperatureSampler(temperature, seed).sample(row)
        for earlier in {*range(max(0, chosen - 4), chosen + 5), *rng.integers(0, len(row), 4).tolist()} - {chosen}:
            got = TemperatureSampler(temperature, seed).sample(row, earlier, tolerance)
            assert got in (earlier, chosen)
            ids = np.arange(len(row))
            # Towards the draw: the shares on its side of the earlier token down, the others up.
            up = ids >= earlier if earlier > chosen else ids <= earlier
            far = TemperatureSampler(temperature, seed).sample(
                (row + np.where(up, 1.0, -1.0) * tolerance / 2).astype(np.float32))
            moved = far >= earlier if earlier > chosen else far <= earlier
            assert (got == earlier) == moved, (seed, chosen, earlier)
            taken += got == earlier
            refused += got != earlier
    assert taken and refused  # both sides of the bound were met


def test_an_earlier_token_costs_the_draw_it_replaces_and_no_more() -> None:
    """Taken or not, the earlier token uses the one draw the token would have: the tokens after it are drawn as
    they would be (the seed's answer goes on as it did)."""
    rng = np.random.default_rng(5)
    rows = [(rng.standard_normal(N_VOCAB) * 3).astype(np.float32) for _ in range(6)]
    plain, replayed = TemperatureSampler(0.8, 9), TemperatureSampler(0.8, 9)
    first = [plain.sample(r) for r in rows]
    again = [replayed.sample(r, (t + 1) % N_VOCAB if i == 2 else t, 1e6 if i == 2 else 1.0)
             for i, (r, t) in enumerate(zip(rows, first))]
    assert again[2] == (first[2] + 1) % N_VOCAB  # a tolerance beyond any row: taken
    assert again[:2] == first[:2] and again[3:] == first[3:]


def test_a_seeded_draw_is_kept_under_its_seed_and_temperature() -> None:
    plain = GenerationParams(temperature=0.7, seed=3)
    assert draw_key(plain, None, 3) == draw_key(GenerationParams(temperature=0.7, seed=3), None, 3)
    assert len({draw_key(plain, None, 3), draw_key(plain, None, 4),
                draw_key(GenerationParams(temperature=0.8, seed=3), None, 3)}) == 3
    assert draw_key(GenerationParams(temperature=0.7), None, 3) is None  # no seed given: a random one each time
    assert draw_key(GenerationParams(temperature=0.7, seed=3, top_k=40), None, 3) is None  # llama.cpp's chain
    assert draw_key(plain, object(), 3) is None  # a grammar


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
