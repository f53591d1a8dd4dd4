"""The largest context that fits: a search over n_ctx using the memory model.

Memory is monotone in n_ctx (KV and compute only grow), so the largest
multiple of 256 that fits is found by bisection: about 10 evaluations of the
pure memory model for a 262,144-token model, no trial loads.
"""

from __future__ import annotations

from typing import Callable

from ..memory.context import N_CTX_PAD


def largest_fitting(fits: Callable[[int], bool], lo: int, hi: int, step: int = N_CTX_PAD) -> int:
    """Largest n in [lo, hi] (hi itself, or a multiple of ``step``) with ``fits(n)``; 0 when none.

    ``fits`` must be monotone: true up to some n, false after.
    """
    if hi < lo or hi <= 0:
        return 0
    if fits(hi):
        return hi
    if not fits(lo):
        return 0
    # Invariant: fits(a) and not fits(b); candidates are multiples of step in (a, b).
    a, b = lo, hi
    while True:
        first = (a // step + 1) * step
        last = (b - 1) // step * step
        if first > last:
            return a
        mid = (first // step + (last - first) // step // 2) * step
        if fits(mid):
            a = mid
        else:
            b = mid
