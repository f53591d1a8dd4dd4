"""Accuracy of the memory model against llama.cpp's no_alloc dry run, and its speed.

    .venv/bin/python bench/memory_accuracy.py [--models Qwen3-14B,gemma-3-27b] [--dir /tmp/gguf-fixtures]

Prints one row per case of ``tests/sizing/test_memory_vs_llama.py``'s matrix (predicted,
llama.cpp, error) for the KV cache and the compute buffer, per-model and overall worst
errors, and the time one prediction takes: first (no cache: the graphs built and traced), cold
(a context length not seen before: the allocator trace of that graph structure replayed), cached.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from service.engine.dryrun import dry_run_many  # noqa: E402
from sizing.compute import _program, _simulate, compute_bytes  # noqa: E402
from sizing.config import ContextConfig  # noqa: E402
from sizing.gguf import probe_path  # noqa: E402
from sizing.gguf.fixtures import FIXTURES, write_fixture  # noqa: E402
from sizing.kv import kv_split_bytes  # noqa: E402
from sizing.memory import estimate  # noqa: E402

MIB = 1 << 20


CACHE_PAIRS = [("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "f16"), ("f16", "q4_0")]


def cases(swa: bool) -> list[ContextConfig]:
    """The matrix of tests/sizing/test_memory_vs_llama.py."""
    out = []
    for n_ctx, (tk, tv), fa, n_ub, par, swa_full in itertools.product(
        [1000, 4096, 16384, 50000], CACHE_PAIRS, ["on", "off"], [512, 2048], [1, 4], [False, True] if swa else [False]
    ):
        out.append(ContextConfig(n_ctx, tk, tv, fa, n_ub, max(n_ub, 512), par, swa_full=swa_full))  # type: ignore[arg-type]
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join([*FIXTURES, "embedded"]))
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "gguf-fixtures"))
    args = ap.parse_args()
    worst_kv = (0.0, "")
    summary: list[str] = []
    all_errs: list[tuple[float, str]] = []
    print(f"{'case':<74} {'kv pred':>9} {'kv llama':>9} {'err':>5}   {'cmp pred':>9} {'cmp llama':>9} {'err%':>6}")
    for name in args.models.split(","):
        if name == "embedded":
            from service.models import embedded_model_path

            path = embedded_model_path()
        else:
            path = write_fixture(name, args.dir)
        spec = probe_path(path)
        cfgs = cases(spec.swa_layer_count > 0)
        errs: list[tuple[float, str]] = []
        for cfg, r in zip(cfgs, dry_run_many(path, cfgs, timeout_s=600)):
            case = (f"{name} ctx={cfg.n_ctx} {cfg.type_k}/{cfg.type_v} fa={cfg.flash_attn} ub={cfg.n_ubatch} "
                    f"par={cfg.n_seq_max}{' swa_full' if cfg.swa_full else ''}")
            if not r.ok:
                continue
            flash = cfg.flash_attn != "off"
            # each cache is logged rounded to 0.01 MiB: compare the sum of the rounded figures
            kv = round(sum(round(b / MIB, 2) for b in kv_split_bytes(spec, cfg, flash)), 2)
            c = compute_bytes(spec, cfg, flash) / MIB
            measured = r.compute_mib.get("CPU", r.compute_total_mib)
            kv_err = abs(round(kv, 2) - r.kv_mib)
            c_err = (c - measured) / measured * 100
            worst_kv = max(worst_kv, (kv_err, case))
            errs.append((c_err, f"{case}: {c:.2f} vs {measured:.2f} MiB"))
            print(f"{case:<74} {kv:9.2f} {r.kv_mib:9.2f} {kv_err:5.2f}   {c:9.2f} {measured:9.2f} {c_err:+6.1f}")
        if errs:
            errs.sort()
            n5 = sum(abs(e) > 5 for e, _ in errs)
            summary.append(f"{name:<18} {len(errs):4d} cases  worst under {errs[0][0]:+6.1f}%  worst over {errs[-1][0]:+6.1f}%  over 5%: {n5}")
            all_errs += errs
    all_errs.sort()
    print("\nper model (compute buffer):")
    print("\n".join(summary))
    print(f"\nworst KV error: {worst_kv[0]:.2f} MiB ({worst_kv[1]})")
    if all_errs:
        print(f"worst compute under-prediction: {all_errs[0][0]:+.1f}% ({all_errs[0][1]})")
        print(f"worst compute over-prediction: {all_errs[-1][0]:+.1f}% ({all_errs[-1][1]})")
        print(f"compute cases beyond 5%: {sum(abs(e) > 5 for e, _ in all_errs)} of {len(all_errs)}")
    spec = probe_path(write_fixture("Qwen3-14B", args.dir))
    cfgs = [ContextConfig(40960, t, t) for t in ("f16", "q8_0", "q4_0")]
    n = 10
    t0 = time.perf_counter()
    for i in range(n):
        _simulate.cache_clear()
        _program.cache_clear()
        for cfg in cfgs:
            estimate(spec, cfg.with_ctx(40960 - 256 * i))
    first = (time.perf_counter() - t0) / n
    n = 50
    t0 = time.perf_counter()
    for i in range(n):
        _simulate.cache_clear()
        for cfg in cfgs:
            estimate(spec, cfg.with_ctx(40960 - 256 * i))
    cold = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _ in range(200):
        for cfg in cfgs:
            estimate(spec, cfg)
    warm = (time.perf_counter() - t0) / 200
    print(f"Qwen3-14B, estimate() for f16+q8_0+q4_0: {cold * 1000:.2f} ms cold (new n_ctx, trace replayed; target < 5 ms), "
          f"{warm * 1000:.2f} ms cached, {first * 1000:.2f} ms first (graphs built and traced)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
