"""Accuracy of the memory model against llama.cpp's no_alloc dry run, and its speed.

    .venv/bin/python bench/memory_accuracy.py [--models Qwen3-14B,gemma-3-27b] [--dir /tmp/gguf-fixtures]

Prints one row per case (predicted, llama.cpp, error) for the KV cache and the
compute buffer, the worst errors, and the time one prediction takes.
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
from sizing.compute import compute_bytes  # noqa: E402
from sizing.config import ContextConfig  # noqa: E402
from sizing.gguf import probe_path  # noqa: E402
from sizing.gguf.fixtures import FIXTURES, write_fixture  # noqa: E402
from sizing.kv import kv_bytes  # noqa: E402
from sizing.memory import estimate  # noqa: E402

MIB = 1 << 20


def cases() -> list[ContextConfig]:
    out = []
    for n_ctx, (tk, tv), fa, n_ub in itertools.product(
        [4000, 32768], [("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0")], ["on", "off"], [512, 2048]
    ):
        if fa == "off" and tv != "f16":
            continue
        out.append(ContextConfig(n_ctx, tk, tv, fa, n_ub, n_ub))  # type: ignore[arg-type]
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(FIXTURES))
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "gguf-fixtures"))
    args = ap.parse_args()
    worst_kv = (0.0, "")
    worst_c = (0.0, "")
    print(f"{'case':<62} {'kv pred':>9} {'kv llama':>9} {'err':>6}   {'cmp pred':>9} {'cmp llama':>9} {'err%':>6}")
    for name in args.models.split(","):
        path = write_fixture(name, args.dir)
        spec = probe_path(path)
        cfgs = cases()
        for cfg, r in zip(cfgs, dry_run_many(path, cfgs, timeout_s=300)):
            case = f"{name} ctx={cfg.n_ctx} {cfg.type_k}/{cfg.type_v} fa={cfg.flash_attn} ub={cfg.n_ubatch}"
            if not r.ok:
                print(f"{case:<62} refused: {r.failure.message if r.failure else ''}")
                continue
            flash = cfg.flash_attn != "off"
            kv = kv_bytes(spec, cfg, flash) / MIB
            c = compute_bytes(spec, cfg, flash) / MIB
            kv_err = abs(kv - r.kv_mib)
            c_err = (c - r.compute_total_mib) / r.compute_total_mib * 100
            worst_kv = max(worst_kv, (kv_err, case))
            worst_c = max(worst_c, (abs(c_err), case))
            print(f"{case:<62} {kv:9.2f} {r.kv_mib:9.2f} {kv_err:6.2f}   {c:9.2f} {r.compute_total_mib:9.2f} {c_err:+6.1f}")
    print(f"\nworst KV error: {worst_kv[0]:.2f} MiB ({worst_kv[1]})")
    print(f"worst compute error: {worst_c[0]:.1f}% ({worst_c[1]})")
    spec = probe_path(write_fixture("Qwen3-14B", args.dir))
    cfgs = [ContextConfig(40960, t, t) for t in ("f16", "q8_0", "q4_0")]
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        for cfg in cfgs:
            estimate(spec, cfg)
    dt = (time.perf_counter() - t0) / n
    print(f"Qwen3-14B, estimate() for f16+q8_0+q4_0 at 40960: {dt * 1000:.2f} ms (target < 5 ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
