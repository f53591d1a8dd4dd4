"""Several models on the same devices: what each loaded one holds, what is left beside them, whom to evict.

Pure: values in, values out. The service (``service.planning.planner``) plans a new model on ``available(...)`` and
``decide_placement`` chooses, with that planning passed in, whether it goes beside the residents or which of
them it evicts first (``choose_eviction``: the smallest set of idle, unpinned residents whose memory makes it
fit), before anything is unloaded.

What a loaded model holds (``held_bytes``), by llama.cpp's device names: its whole plan on every device.
On a card that is weights, KV, recurrent state, compute, output, the CUDA pool bound and the allowance
(``gpu_allowance_mib``, the CUDA context): each model runs in a runner process of its own
(``service.runner.process``), and CUDA creates one primary context per device and process, which lives as long
as the process (ggml's CUDA backend never resets the device), so every model pays its own context on each card
it uses and gives it back when its process ends. In host memory it is the whole host share: weights (mmapped
file pages), KV, state, compute and output. (With ``GGUF_RUNNER_PROCESS=false`` the engines share the API
process's context: the arithmetic then counts a context per model where one is held, never too little.)

What is free beside the residents (``available``), for a plan that counts its own allowance per card:

- a **live** card (NVML): its free memory already excludes what the residents hold, contexts included; each
  resident to evict gives back what it holds;
- a **declared** card (``GGUF_GPUS_*``: a fixed figure, the card's free memory with none of this server's
  models on it): the residents kept hold their bytes, subtracted;
- a live card whose backend **cannot report free memory** (Vulkan without ``VK_EXT_memory_budget``: ggml gives
  its total as free, ``Device.free_memory``): a fixed figure too, the total less a margin, with the residents kept
  subtracted as on a declared card;
- **host memory**: ``MemAvailable`` counts the residents' mmapped weights as available (they are page
  cache) and not always their buffers (llama.cpp's compute buffers are not touched before a first decode),
  so it cannot say what they hold: the residents kept have their whole predicted host share subtracted and
  the ones to evict give nothing back. Never over-committed; at worst a resident's KV cache (written at
  context creation, so already out of ``MemAvailable``) is counted twice.

Hence the invariant the tests check: on each declared card, the residents' held bytes (each with its context)
never exceed its declared free memory; on the host, the residents' predicted bytes never exceed the memory
available at their load times (less the weights a partial offload reads from the file).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Sequence

from .device import Device
from ..memory.estimate import MemoryEstimate
from .make import Plan
from .request import AUTO_CACHE_TYPE, PlanRequest, ctx_cap, ctx_floor
from .sizer import held_whole_verdict
from ..model.spec import ModelSpec

EXHAUSTIVE_CANDIDATES = 12
"""Up to this many idle residents every set is tried (smallest first); beyond it, least recently used prefixes."""


def held_bytes(est: MemoryEstimate) -> dict[str, int]:
    """What a loaded model holds on each device (``CPU``, ``CUDA<n>``): its plan's bytes, its runner process's
    CUDA context (the allowance) included."""
    out = {"CPU": est.host.total_bytes}
    for g in est.gpus:
        out[g.device] = g.total_bytes
    return out


def available(gpus: Sequence[Device], host: Device, kept: Sequence[MemoryEstimate],
              freed: Sequence[MemoryEstimate] = (), *, live: bool) -> tuple[list[Device], Device]:
    """The devices as a new plan sees them beside the residents ``kept``, once those in ``freed`` are unloaded.

    ``live``: the cards' figures are NVML's or ggml's (they already exclude every resident); otherwise they are a
    declared inventory (they exclude none). A card whose backend cannot report free memory
    (``Device.free_memory`` ``unreported``: its figure is its total less a margin, whatever is allocated there) is
    counted as a declared one, live or not. See the module's docstring for the arithmetic.
    """
    out: list[Device] = []
    for g in gpus:
        label = g.label
        if g.kind == "rpc" and any(held_bytes(est).get(label, 0) for est in kept):
            # A worker serves one client: a resident on it leaves nothing to another model.
            out.append(replace(g, free_bytes=0))
            continue
        if (live and g.free_memory != "unreported") or g.kind == "rpc":  # a worker's /status is live too
            free = g.free_bytes + sum(held_bytes(est).get(label, 0) for est in freed)
        else:
            free = g.free_bytes - sum(held_bytes(est).get(label, 0) for est in kept)
        out.append(replace(g, free_bytes=max(0, min(g.total_bytes, free))))
    host_free = host.free_bytes - sum(est.host.total_bytes for est in kept)
    return out, replace(host, free_bytes=max(0, min(host.total_bytes, host_free)))


def decision_request(spec: ModelSpec, req: PlanRequest) -> PlanRequest:
    """The request that decides whether a model fits: its chosen cache type alone, at the smallest context
    that counts. ``make_plan`` settles the placement (and so the verdict) at that context before it searches
    for a larger one, so this plan's verdict is the full plan's, without the searches.

    ``auto`` stays ``auto`` (``make_plan`` then sizes its candidates alone): at the floor it picks the most
    precise type that fits there, preferring one held whole, so it fits (held whole) exactly when the full
    plan's choice does, the full plan's rows holding the same placements at that floor."""
    cap = ctx_cap(spec, req)
    types = () if req.cache_type == AUTO_CACHE_TYPE else (req.cache_type,)
    return replace(req, n_ctx=ctx_floor(spec, req, cap), cache_types=types)


@dataclass(frozen=True)
class Holding:
    """A resident as eviction sees it: its plan's estimate, when it was last used, whether it may go."""

    name: str
    estimate: MemoryEstimate
    last_used: float = 0.0
    """Monotonic seconds of its last request (or load): the smaller, the earlier it goes."""
    busy: bool = False
    """Requests queued or running: never evicted."""
    pinned: bool = False
    """Configured to stay: never evicted."""


def lru(holdings: Sequence[Holding]) -> list[Holding]:
    """Least recently used first (the name breaks ties, so the order is total)."""
    return sorted(holdings, key=lambda h: (h.last_used, h.name))


def eviction_sets(candidates: Sequence[Holding]) -> Iterator[tuple[Holding, ...]]:
    """Sets of ``candidates`` to try, fewest models first and, among sets of one size, those holding the least
    recently used first (combinations of the LRU order, in order). Beyond ``EXHAUSTIVE_CANDIDATES`` only the
    LRU prefixes (one set per size)."""
    order = lru(candidates)
    if len(order) > EXHAUSTIVE_CANDIDATES:
        for k in range(1, len(order) + 1):
            yield tuple(order[:k])
        return
    for k in range(1, len(order) + 1):
        yield from itertools.combinations(order, k)


def choose_eviction(candidates: Sequence[Holding], fits: Callable[[tuple[Holding, ...]], bool]
                    ) -> tuple[Holding, ...] | None:
    """The first of ``eviction_sets(candidates)`` whose memory makes ``fits`` true, or None when even all of
    them would not (checked first: more memory never makes a model fit less, so no smaller set can then)."""
    if not candidates or not fits(tuple(lru(candidates))):
        return None
    for chosen in eviction_sets(candidates):
        if fits(chosen):
            return chosen
    return None  # pragma: no cover - the full set fitted, and it is among the sets tried


@dataclass(frozen=True)
class Decision:
    """Where a load goes beside the residents (``decide_placement``): its plan and whom it evicts first."""

    plan: Plan
    evicted: tuple[Holding, ...] = ()
    """Residents to unload before the load (idle and unpinned, unless forced)."""
    busy: tuple[Holding, ...] = ()
    """The plan fits only with the memory of residents generating now, least recently used first."""
    count_limited: bool = False
    """The plan fits in memory but the models-loaded limit is reached and none of them may go."""


def held_whole(p: Plan) -> bool:
    """Held whole where it runs best (``sizing.plan.sizer.held_whole_verdict``: on the cards, or on a machine
    without cards)."""
    return held_whole_verdict(p.verdict, bool(p.gpus))


def decide_placement(others: Sequence[Holding], plan_with: Callable[[tuple[Holding, ...], PlanRequest], Plan],
                     req: PlanRequest, dreq: PlanRequest, *, max_models: int | None = None,
                     force: bool = False) -> Decision:
    """Whether a load goes beside the residents ``others`` or evicts some first; ``plan_with(evicted, request)``
    plans it on the memory left once ``evicted`` are gone (``available``), ``dreq`` is the request that decides
    (``decision_request``), ``req`` the one the load is planned with.

    Beside the others when it fits there (and ``max_models`` allows one more) held whole, or when no idle
    resident could make it whole; else the smallest set of idle, unpinned residents whose memory makes it fit
    (whole on the cards, when evicting every idle one would make it so), least recently used first; else beside
    them partly offloaded if it fits so. Busy residents are candidates only with ``force`` (without it the
    decision names them, ``busy``); pinned ones never."""
    def count_ok(evicted: tuple[Holding, ...]) -> bool:
        return max_models is None or len(others) - len(evicted) + 1 <= max_models

    beside = plan_with((), req)
    idle = [h for h in others if not h.busy and not h.pinned]
    if beside.fits and count_ok(()) and (held_whole(beside) or not idle):
        return Decision(beside)
    everything = tuple(idle)
    wanted: Callable[[Plan], bool] = (held_whole if idle and held_whole(plan_with(everything, dreq))
                                      else (lambda p: p.fits))
    if wanted(beside) and count_ok(()):
        return Decision(beside)
    chosen = choose_eviction(idle, lambda s: count_ok(s) and wanted(plan_with(s, dreq)))
    if chosen is not None:
        return Decision(plan_with(chosen, req), chosen)
    if beside.fits and count_ok(()):
        return Decision(beside)  # partly offloaded, and no set of idle residents keeps it whole
    unpinned = [h for h in others if not h.pinned]
    busy = [h for h in unpinned if h.busy]
    if busy and count_ok(tuple(unpinned)) and plan_with(tuple(unpinned), dreq).fits:
        if force:
            chosen = choose_eviction(unpinned, lambda s: count_ok(s) and plan_with(s, dreq).fits)
            if chosen is not None:
                return Decision(plan_with(chosen, req), chosen)
        return Decision(beside, busy=tuple(lru(busy)))
    return Decision(beside, count_limited=beside.fits)


def held_summary(holdings: Sequence[Holding]) -> dict[str, dict[str, int]]:
    """Device label -> resident name -> bytes it holds there (what a refusal and the page show)."""
    out: dict[str, dict[str, int]] = {}
    for h in holdings:
        for label, n in held_bytes(h.estimate).items():
            if n:
                out.setdefault(label, {})[h.name] = n
    return out


__all__ = ["EXHAUSTIVE_CANDIDATES", "Decision", "Holding", "available", "choose_eviction", "decide_placement",
           "decision_request", "eviction_sets", "held_bytes", "held_summary", "held_whole", "lru"]
