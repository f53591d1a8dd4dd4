"""Several models on one node: the eviction decision's time, and load-on-demand latency on the real engine.

    .venv/bin/python bench/residency_bench.py            # both parts
    .venv/bin/python bench/residency_bench.py --quick    # fewer repeats (a smoke run, not figures)
    .venv/bin/python bench/residency_bench.py --part decision|demand

decision: ``Planner.place`` for a model that fits only after evicting residents, with 2 to 16 idle residents
  on two declared 24 GiB cards (header-only llama-shaped files, no weights): the whole decision (the plan beside
  them, the plan with every idle one evicted, the search for the smallest least-recently-used set, the final
  plan), median of repeated runs, and how many plans the search made. Up to 12 candidates every set is tried,
  fewest first; beyond, the LRU prefixes.
demand: the real service in this process (llama.cpp, uvicorn over loopback) with GGUF_LOAD_ON_DEMAND: the
  first request for a model that is not loaded (its load included) against a warm one; 20 concurrent requests
  for a model that is not loaded (one load: the figure is the spread of their latencies); and, with
  GGUF_MAX_LOADED_MODELS=1, requests alternating between two models (each one an eviction and a load).
  Models: the embedded gemma-3-270m and TINY_LLAMA (zero weights).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness import free_port

MIB = 1 << 20


def decision(repeat: int) -> None:
    from service.planning.planner import LoadOptions, Planner
    from service.settings import Settings
    from sizing.plan.device import Device
    from sizing.plan.residency import Holding
    from sizing.probe import probe_path
    from sizing.testing.fixtures import FixtureShape, write_fixture

    d = tempfile.mkdtemp(prefix="residency-bench-")

    def shape(n_layer: int) -> FixtureShape:
        return FixtureShape("llama", 2048, n_layer, 16, 4, 128, 5632, 32000, 4096, tokenizer="llama")

    small = probe_path(write_fixture("small", d, shape=shape(6)))
    big = probe_path(write_fixture("big", d, shape=shape(18)))
    host = Device(0, "host", 64 * 1024 * MIB, 128 * 1024 * MIB, "host")
    settings = Settings(context_length=4096, min_context=2048, calibrate=False, host_bandwidth_gbps=20,
                        allow_offload=False, gpus_json="[]")
    probe_cards = [Device(0, "card", 24576 * MIB, 24576 * MIB)]
    planner = Planner(settings, lambda: (probe_cards, host), live=False)
    one = planner.place(small, LoadOptions()).plan.estimate
    assert one is not None
    held_small = one.gpus[0].total_bytes - one.gpus[0].allowance_bytes
    print("eviction decision: an 18-layer model beside N idle 6-layer ones on two cards that just hold the N")
    print(f"{'residents':>9} {'decision ms':>12} {'plans':>6} {'evicts':>7}")
    for n in (2, 4, 8, 12, 16):
        per_card = (n + 1) // 2 * held_small + one.gpus[0].allowance_bytes + 200 * MIB
        cards = [Device(0, "card 0", per_card, 48 * 1024 * MIB), Device(1, "card 1", per_card, 48 * 1024 * MIB)]
        planner = Planner(settings, lambda cards=cards: (cards, host), live=False)  # type: ignore[misc]
        # Residents packed as loads pack them: each planned on what the ones before it left.
        holdings: list[Holding] = []
        for i in range(n):
            p = planner.place(small, LoadOptions(), residents=holdings).plan
            if not p.fits or p.estimate is None:
                break
            holdings.append(Holding(f"r{i}", p.estimate, float(i)))
        count = [0]
        original = planner.plan_on

        def counting(*a, **k):  # type: ignore[no-untyped-def]
            count[0] += 1
            return original(*a, **k)

        planner.plan_on = counting  # type: ignore[method-assign]
        ts = []
        placed = None
        for _ in range(repeat):
            count[0] = 0
            t = time.perf_counter()
            placed = planner.place(big, LoadOptions(), residents=holdings)
            ts.append(time.perf_counter() - t)
        planner.plan_on = original  # type: ignore[method-assign]
        assert placed is not None
        print(f"{len(holdings):>9} {statistics.median(ts) * 1000:>12.2f} {count[0]:>6} {len(placed.evict):>7}"
              + ("" if placed.plan.fits else "  (refused)"))
    print()


def demand(quick: bool) -> None:
    import httpx
    import uvicorn

    from service.api.app import create_app
    from service.settings import GEMMA_MODEL_NAME, Settings
    from sizing.testing.fixtures import TINY_LLAMA, write_fixture

    models = Path(tempfile.mkdtemp(prefix="residency-bench-models-"))
    tiny = Path(write_fixture("tiny-llama", models, shape=TINY_LLAMA)).stem

    def serve(**over: object) -> tuple[str, uvicorn.Server, threading.Thread]:
        port = free_port()
        s = Settings(host="127.0.0.1", port=port, models_dir=str(models), default_model="", context_length=2048,
                     confirm=False, load_on_demand=True, queue_size=64, **over)  # type: ignore[arg-type]
        server = uvicorn.Server(uvicorn.Config(create_app(s), host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        return url, server, thread

    def ask(c: httpx.Client, model: str) -> float:
        t = time.perf_counter()
        r = c.post("/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 1, "seed": 1})
        assert r.status_code == 200, r.text
        return time.perf_counter() - t

    url, server, thread = serve()
    with httpx.Client(base_url=url, timeout=300) as c:
        print("load on demand (real llama.cpp, this machine), seconds")
        for model in (GEMMA_MODEL_NAME, tiny):
            cold = ask(c, model)
            warm = statistics.median(ask(c, model) for _ in range(3 if quick else 10))
            print(f"  {model:<24} first request (load + answer) {cold:7.3f}   loaded {warm:7.3f}")
        for _ in range(1 if quick else 3):
            c.post("/api/models/unload", json={"model": GEMMA_MODEL_NAME})
            with ThreadPoolExecutor(max_workers=20) as pool:
                lat = sorted(pool.map(lambda _: ask(httpx.Client(base_url=url, timeout=300), GEMMA_MODEL_NAME),
                                      range(20)))
            print(f"  20 concurrent requests for {GEMMA_MODEL_NAME} (not loaded): fastest {lat[0]:.3f}, "
                  f"median {statistics.median(lat):.3f}, slowest {lat[-1]:.3f}")
    server.should_exit = True
    thread.join(60)

    url, server, thread = serve(max_loaded_models=1)
    with httpx.Client(base_url=url, timeout=300) as c:
        ask(c, tiny)
        times = [ask(c, (GEMMA_MODEL_NAME, tiny)[i % 2]) for i in range(4 if quick else 10)]
        print(f"  GGUF_MAX_LOADED_MODELS=1, alternating two models (evict + load + answer): "
              f"median {statistics.median(times):.3f}, slowest {max(times):.3f}")
    server.should_exit = True
    thread.join(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--part", choices=["decision", "demand"])
    args = ap.parse_args()
    if args.part in (None, "decision"):
        decision(3 if args.quick else 20)
    if args.part in (None, "demand"):
        demand(args.quick)


if __name__ == "__main__":
    main()
