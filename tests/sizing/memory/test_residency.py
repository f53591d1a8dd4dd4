"""The residency arithmetic (``sizing.plan.residency``): exact figures, and properties of the eviction search."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sizing.memory.context import ContextConfig
from sizing.plan.device import MIB, Device
from sizing.memory.kv import KvCells
from sizing.memory.estimate import DeviceMemory, MemoryEstimate
from sizing.plan.make import PlanRequest, make_plan
from sizing.plan.residency import (Holding, available, choose_eviction, decision_request, eviction_sets, held_bytes,
                              held_summary, held_whole, lru)

A = 477 * MIB  # the allowance a plan counts per card


def est(host: int = 0, host_weights: int = 0, **cards: int) -> MemoryEstimate:
    """An estimate holding ``cards[label]`` bytes of weights on each card (plus the allowance and a pool bound)."""
    gpus = tuple(DeviceMemory(label, weights_bytes=n, kv_bytes=3 * MIB, compute_bytes=5 * MIB, allowance_bytes=A,
                              pool_bytes=7 * MIB) for label, n in cards.items())
    return MemoryEstimate(ContextConfig(n_ctx=4096), True, KvCells(4096, 0),
                          DeviceMemory("CPU", weights_bytes=host_weights, kv_bytes=host, compute_bytes=MIB), gpus)


CARDS = [Device(0, "A", 10_000 * MIB, 24_000 * MIB), Device(1, "B", 6_000 * MIB, 24_000 * MIB)]
HOST = Device(0, "host", 20_000 * MIB, 64_000 * MIB, "host")


def test_a_resident_holds_its_plan_and_its_context_on_a_card_and_everything_on_the_host() -> None:
    """Each model runs in a runner process of its own, with its own CUDA context on each card it uses."""
    e = est(host=2 * MIB, host_weights=100 * MIB, CUDA0=1000 * MIB)
    held = held_bytes(e)
    assert held["CUDA0"] == 1000 * MIB + 3 * MIB + 5 * MIB + 7 * MIB + A  # weights, KV, compute, pool, context
    assert held["CUDA0"] == e.gpus[0].total_bytes
    assert held["CPU"] == 100 * MIB + 2 * MIB + MIB == e.host.total_bytes


def test_declared_cards_lose_what_the_kept_residents_hold_and_the_host_too() -> None:
    r1 = est(host=10 * MIB, host_weights=200 * MIB, CUDA0=3000 * MIB)
    r2 = est(host=20 * MIB, CUDA0=1000 * MIB, CUDA1=2000 * MIB)
    gpus, host = available(CARDS, HOST, [r1, r2], live=False)
    assert gpus[0].free_bytes == 10_000 * MIB - (3015 + 1015) * MIB - 2 * A
    assert gpus[1].free_bytes == 6_000 * MIB - 2015 * MIB - A
    assert host.free_bytes == 20_000 * MIB - (211 + 21) * MIB
    # Evicting r2 (freed) on a declared inventory gives nothing back: its figure excludes none of our models.
    assert available(CARDS, HOST, [r1], [r2], live=False)[0][0].free_bytes == 10_000 * MIB - 3015 * MIB - A
    # A plan on card 0 then counts its own allowance: residents + that plan fit exactly when <= the declared free.
    left = gpus[0].free_bytes
    assert (3015 + 1015) * MIB + 2 * A + left == CARDS[0].free_bytes


def test_live_cards_already_exclude_the_residents_and_get_back_the_evicted_with_their_contexts() -> None:
    r1 = est(CUDA0=3000 * MIB)
    r2 = est(CUDA0=1000 * MIB, CUDA1=2000 * MIB)
    # NVML after both loaded: each card lost its residents' bytes and one context per runner process on it.
    live = [Device(0, "A", (10_000 - 3015 - 1015) * MIB - 2 * A, 24_000 * MIB),
            Device(1, "B", (6_000 - 2015) * MIB - A, 24_000 * MIB)]
    gpus, _ = available(live, HOST, [r1, r2], live=True)
    # The new plan counts its own allowance: nothing of the residents' is added back.
    assert gpus[0].free_bytes == live[0].free_bytes
    assert gpus[1].free_bytes == live[1].free_bytes
    gpus, _ = available(live, HOST, [r1], [r2], live=True)
    assert gpus[0].free_bytes == live[0].free_bytes + 1015 * MIB + A  # r2's process ends: its context too
    assert gpus[1].free_bytes == live[1].free_bytes + 2015 * MIB + A
    free_card = [Device(2, "C", 5_000 * MIB, 24_000 * MIB)]
    assert available(free_card, HOST, [r1, r2], live=True)[0][0].free_bytes == 5_000 * MIB
    # Never beyond the card, never below zero.
    assert available([Device(0, "A", 23_900 * MIB, 24_000 * MIB)], HOST, [], [r1], live=True)[0][0].free_bytes \
        == 24_000 * MIB
    assert available(CARDS, HOST, [est(CUDA0=30_000 * MIB)], live=False)[0][0].free_bytes == 0


@settings(max_examples=200, deadline=None)
@given(free=st.lists(st.integers(0, 40_000), min_size=1, max_size=3),
       loads=st.lists(st.lists(st.integers(0, 9_000), min_size=3, max_size=3), min_size=1, max_size=6))
def test_loading_what_fits_beside_the_residents_never_exceeds_a_declared_cards_free_memory(
        free: list[int], loads: list[list[int]]) -> None:
    """Any sequence: a model is loaded when each of its cards' needs (allowance included) fits what ``available``
    leaves; then every card carries its residents' held bytes, each with its context, at most its free memory."""
    cards = [Device(i, f"c{i}", f * MIB, 48_000 * MIB) for i, f in enumerate(free)]
    residents: list[MemoryEstimate] = []
    for sizes in loads:
        new = est(**{f"CUDA{i}": n * MIB for i, n in enumerate(sizes[:len(cards)]) if n})
        gpus, _ = available(cards, HOST, residents, live=False)
        by = {g.label: g for g in gpus}
        if all(d.total_bytes <= by[d.device].free_bytes for d in new.gpus):
            residents.append(new)
        for card in cards:
            on = [r for r in residents if any(d.device == card.label for d in r.gpus)]
            used = sum(held_bytes(r)[card.label] for r in on)
            assert used >= len(on) * A  # every runner's context is counted
            assert used <= card.free_bytes


def _holding(name: str, t: float, busy: bool = False, pinned: bool = False) -> Holding:
    return Holding(name, est(CUDA0=MIB), t, busy, pinned)


def test_eviction_sets_go_fewest_first_and_least_recently_used_first() -> None:
    hs = [_holding("c", 3.0), _holding("a", 1.0), _holding("b", 2.0)]
    got = [tuple(h.name for h in s) for s in eviction_sets(hs)]
    assert got == [("a",), ("b",), ("c",), ("a", "b"), ("a", "c"), ("b", "c"), ("a", "b", "c")]
    assert [h.name for h in lru([_holding("y", 1.0), _holding("x", 1.0)])] == ["x", "y"], "ties by name"


@settings(max_examples=300, deadline=None)
@given(held=st.lists(st.integers(1, 50), min_size=0, max_size=7), need=st.integers(0, 200),
       flags=st.lists(st.sampled_from(["idle", "idle", "busy", "pinned"]), min_size=7, max_size=7))
def test_choose_eviction_is_the_smallest_least_recently_used_idle_set_that_fits(
        held: list[int], need: int, flags: list[str]) -> None:
    """Against brute force: a model fits when the evicted hold at least ``need``."""
    hs = [Holding(f"m{i}", est(CUDA0=n * MIB), float(i), flags[i] == "busy", flags[i] == "pinned")
          for i, n in enumerate(held)]
    candidates = [h for h in hs if not h.busy and not h.pinned]
    mib = {h.name: n for h, n in zip(hs, held)}
    calls: list[tuple[str, ...]] = []

    def fits(s: tuple[Holding, ...]) -> bool:
        calls.append(tuple(h.name for h in s))
        return sum(mib[h.name] for h in s) >= need

    chosen = choose_eviction(candidates, fits)
    fitting = [s for k in range(1, len(candidates) + 1) for s in itertools.combinations(lru(candidates), k)
               if sum(mib[h.name] for h in s) >= need]
    if not fitting:
        assert chosen is None
        return
    assert chosen is not None
    assert all(not h.busy and not h.pinned for h in chosen)
    assert len(chosen) == min(len(s) for s in fitting), "no smaller set would do"
    assert chosen == fitting[0], "the first in least-recently-used order among the smallest"
    assert calls[0] == tuple(h.name for h in lru(candidates)), "all of them are tried first (none fit: stop)"


def test_held_summary_lists_each_cards_residents() -> None:
    hs = [Holding("a", est(host=MIB, CUDA0=100 * MIB), 0.0), Holding("b", est(CUDA0=10 * MIB, CUDA1=5 * MIB), 1.0)]
    s = held_summary(hs)
    assert s["CUDA0"] == {"a": 115 * MIB + A, "b": 25 * MIB + A} and s["CUDA1"] == {"b": 20 * MIB + A}
    assert s["CPU"] == {"a": 2 * MIB, "b": MIB}


@settings(max_examples=40, deadline=None)
@given(free=st.lists(st.integers(200, 40_000), min_size=0, max_size=3), host_mib=st.integers(500, 30_000),
       cache=st.sampled_from(["f16", "q8_0", "q4_0", "auto"]), offload=st.booleans(),
       n_ctx=st.sampled_from([None, 8192]))
def test_the_decision_request_reaches_the_full_plans_verdict(embedded_model: str, free: list[int], host_mib: int,
                                                             cache: str, offload: bool, n_ctx: int | None) -> None:
    """Eviction decides on one cache type at the smallest context; its verdict and placement are the full plan's.
    With ``auto`` the type may differ (the full plan may quantize for context the floor does not need), so the
    verdict may be a split at the floor and one card in full; what eviction asks of it, whether the model fits
    and whether it is held whole (``held_whole``), is the full plan's."""
    from sizing.probe import probe_path

    spec = probe_path(embedded_model)
    cards = [Device(i, f"c{i}", f * MIB, 48_000 * MIB) for i, f in enumerate(free)]
    host = Device(0, "host", host_mib * MIB, 64_000 * MIB, "host")
    req = PlanRequest(cache_type=cache, allow_offload=offload, n_ctx=n_ctx, min_ctx=2048)
    full = make_plan(spec, cards, host, req)
    quick = make_plan(spec, cards, host, decision_request(spec, req))
    assert (held_whole(quick), quick.fits) == (held_whole(full), full.fits)
    assert quick.cfg.type_k != "auto" and full.cfg.type_k != "auto"
    if cache == "auto":
        return
    assert (quick.verdict, quick.fits) == (full.verdict, full.fits)
    if full.fits and full.verdict != "partial_offload":
        assert quick.placement.gpus == full.placement.gpus


@pytest.mark.parametrize("need, held, want", [(10, [4, 6, 12], ("m2",)), (10, [4, 6], ("m0", "m1")), (11, [4, 6], None)])
def test_choose_eviction_examples(need: int, held: list[int], want: tuple[str, ...] | None) -> None:
    hs = [Holding(f"m{i}", est(CUDA0=n * MIB), float(i)) for i, n in enumerate(held)]
    chosen = choose_eviction(hs, lambda s: sum(held[int(h.name[1:])] for h in s) >= need)
    assert (tuple(h.name for h in chosen) if chosen else None) == want
