"""A 2-token completion's latency while oversized prompts arrive (issue 29): refused unread, or tokenized in their own
lane, they must not hold the short request.

    .venv/bin/python bench/admission_bench.py [--rounds 5]

The service on ``make run``'s defaults (the embedded model, its 32,768-token context). Scenarios, each with a
2-token completion sent while the load runs (its latency; medians over the rounds, and the worst):

- ``idle``: nothing else;
- ``oversized``: 8 completions of a 6.9 MB prompt at once (more than 32,768 x 48 characters: refused unread);
- ``count``: 4 Anthropic ``count_tokens`` of 7 MB at once (the same);
- ``long``: 8 completions of a 1.4 MB prompt that might fit by its characters (about 350k tokens: tokenized in the
  long-text lane, two at a time, then refused by the context check).

Before this change (issue 29's figures): 32.8 s behind the 8 oversized prompts, 43.8 s behind the 4 counts.
Target: under 1 s. Run it alone: both cores are the benchmark's.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any, Callable

import httpx

from harness import run_service
from service.catalog.embedded import embedded_model_path

OVERSIZED = "lighthouse keeper " * 383_000  # 6.9 MB
LONG = "sea " * 350_000  # 1.4 MB: fewer characters than 32,768 x 48


def short(url: str) -> float:
    t0 = time.perf_counter()
    with httpx.Client(timeout=300) as c:
        r = c.post(url + "/v1/completions", json={"prompt": "The sea is", "max_tokens": 2, "temperature": 0})
    r.raise_for_status()
    return time.perf_counter() - t0


def during(url: str, n: int, send: Callable[[httpx.Client], Any]) -> tuple[float, float]:
    """The short request's latency while ``n`` ``send`` run at once; and how long the ``n`` took."""
    done: list[float] = []

    def one() -> None:
        with httpx.Client(timeout=300) as c:
            send(c)
        done.append(time.perf_counter())

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    latency = short(url)
    for t in threads:
        t.join()
    return latency, max(done) - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    scenarios: dict[str, tuple[int, Callable[[httpx.Client], Any]]] = {
        "oversized": (8, lambda c: c.post(url + "/v1/completions", json={"prompt": OVERSIZED, "max_tokens": 2})),
        "count": (4, lambda c: c.post(url + "/v1/messages/count_tokens", json={
            "model": "bench", "messages": [{"role": "user", "content": OVERSIZED}]})),
        "long": (8, lambda c: c.post(url + "/v1/completions", json={"prompt": LONG, "max_tokens": 2})),
    }
    got: dict[str, list[tuple[float, float]]] = {"idle": [], **{k: [] for k in scenarios}}
    with run_service(embedded_model_path()) as url:
        short(url)
        for _ in range(args.rounds):
            got["idle"].append((short(url), 0.0))
            for name, (n, send) in scenarios.items():
                got[name].append(during(url, n, send))
    print(f"{args.rounds} rounds; a 2-token completion's latency (s) while the load runs; target < 1 s")
    print(f"{'scenario':<12} {'median':>8} {'worst':>8} {'load took (median s)':>22}")
    for name, runs in got.items():
        lat = [r[0] for r in runs]
        took = statistics.median(r[1] for r in runs)
        print(f"{name:<12} {statistics.median(lat):>8.3f} {max(lat):>8.3f} {took:>22.2f}")


if __name__ == "__main__":
    main()
