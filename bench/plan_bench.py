"""Time the planner and print the worked cases of docs/placement.md.

    .venv/bin/python bench/plan_bench.py

Writes the sparse fixtures it needs under a temporary directory (no weights),
then prints: the time of a whole dry-run answer (three cache types) for
several models and card sets, median of repeated runs; the Qwen2.5-14B split
of the second source document; the Qwen3-14B laptop case of the first.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from sizing.plan import Device, PlanRequest, make_plan, plan_table
from sizing.probe import probe_path
from sizing.testing.fixtures import write_fixture

GIB = 1 << 30
MB = 1000 * 1000
HOST = Device(0, "host memory", 48 * GIB, 64 * GIB, "host")


def timed(fn, repeat: int = 20) -> float:  # type: ignore[no-untyped-def]
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1000


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    d = tempfile.mkdtemp(prefix="plan-bench-")
    specs = {n: probe_path(write_fixture(n, d, q)) for n, q in
             [("Qwen2.5-14B", "bf16"), ("Qwen3-14B", "bf16"), ("Llama-3.1-8B", "q4_k_m"), ("Qwen3-30B-A3B", "q4_k_m"),
              ("gemma-3-27b", "q4_k_m")]}
    cases = [
        ("Llama-3.1-8B Q4_K_M, one 24 GiB card", "Llama-3.1-8B", [Device(0, "RTX 4090", 23 * GIB, 24 * GIB)], PlanRequest()),
        ("gemma-3-27b Q4_K_M, one 24 GiB card", "gemma-3-27b", [Device(0, "RTX 4090", 23 * GIB, 24 * GIB)], PlanRequest()),
        ("Qwen2.5-14B BF16, four cards (split)", "Qwen2.5-14B", [Device(i, "RTX 3090", (8 + i) * GIB, 24 * GIB) for i in range(4)], PlanRequest()),
        ("Qwen3-14B BF16, 8.6 GB laptop (offload)", "Qwen3-14B", [Device(0, "RTX 3080 Laptop GPU", int(6.4e9), int(8.6e9))], PlanRequest(n_ctx=4096, cache_type="f16")),
        ("Qwen3-30B-A3B Q4_K_M, 12 GiB (MoE offload)", "Qwen3-30B-A3B", [Device(0, "RTX 3060", 12 * GIB - 300 * (1 << 20), 12 * GIB)], PlanRequest(n_ctx=8192)),
    ]
    print("time of a whole plan (f16, q8_0, q4_0), median of 20 runs")
    print(f"{'case':<48} {'ms':>8}  verdict")
    for label, name, gpus, req in cases:
        ms = timed(lambda: make_plan(specs[name], gpus, HOST, req))
        print(f"{label:<48} {ms:8.2f}  {make_plan(specs[name], gpus, HOST, req).verdict}")
    print()
    cards = [Device(0, "RTX 3080 Ti", 11_500 * MB, 12 * GIB), Device(1, "RTX 3090", 23_500 * MB, 24 * GIB)]
    for n in (4096, 8192, 32768):
        print(f"== Qwen2.5-14B BF16, f16 cache, n_ctx {n}, RTX 3080 Ti 11,500 MB + RTX 3090 23,500 MB free")
        print(plan_table(make_plan(specs["Qwen2.5-14B"], cards, HOST, PlanRequest(n_ctx=n, cache_type="f16", allow_offload=False))))
        print()
    laptop = [Device(0, "NVIDIA GeForce RTX 3080 Laptop GPU", int(8.6e9 - 2.2e9), int(8.6e9))]
    host = Device(0, "host memory", int(32e9 * 0.85), int(32e9), "host")
    print("== Qwen3-14B BF16, f16 cache, 4096 tokens, 8.6 GB laptop card with 2.2 GB used, 32 GB host")
    print(plan_table(make_plan(specs["Qwen3-14B"], laptop, host, PlanRequest(n_ctx=4096, cache_type="f16"))))
    print()
    print("== Qwen3-30B-A3B Q4_K_M, 8192 tokens, 12 GiB card")
    print(plan_table(make_plan(specs["Qwen3-30B-A3B"], cases[4][2], Device(0, "host memory", 28 * GIB, 32 * GIB, "host"), PlanRequest(n_ctx=8192))))


if __name__ == "__main__":
    main()
