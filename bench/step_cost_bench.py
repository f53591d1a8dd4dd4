"""A decode step's time by the rows in its batch: what a drafted token's row costs on this host (issue 55).

    .venv/bin/python bench/step_cost_bench.py [--model PATH] [--rounds 3] [--rows 1,2,3,4,8,16,32,48,64] [--no-repack]

The model (default: the embedded one) is loaded through llama-cpp-python alone, with the service's CPU defaults
(2 threads, flash attention, n_ubatch 512: ``service.engine.cpu_speed.Scratch``), a 1,000-token context in its KV cache; each step decodes that many
rows after it with logits for every row, as a drafted step does, then samples each row greedily, and is undone
(``llama_memory_seq_rm``). Printed per row count: the median decode and sampling time and the step's time in
one-row steps. ``service.engine.speculation.STEP_COST_PRIOR`` is this table for the embedded model on the 2-core
AVX2 host; the service measures its own steps at run time (``StepCosts``). Run it alone: both cores are the
benchmark's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import llama_cpp

from service.catalog.embedded import embedded_model_path
from service.engine.cpu_speed import Scratch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", default="1,2,3,4,8,16,32,48,64")
    ap.add_argument("--no-repack", action="store_true", help="the weights as the file has them (GGUF_CPU_REPACK=off)")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    path = args.model or str(embedded_model_path())
    scratch = Scratch(path, 2, n_ctx=4096, repack=not args.no_repack)
    context = [100 + (i * 7) % 5000 for i in range(1000)]
    scratch.decode(context[:500], 0)
    scratch.decode(context[500:], 500)
    sampler = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    llama_cpp.llama_sampler_chain_add(sampler, llama_cpp.llama_sampler_init_greedy())
    times: dict[int, list[tuple[float, float]]] = {n: [] for n in rows}
    for _ in range(args.rounds):
        for n in rows:  # the row counts interleaved: each round sees the same machine
            for _ in range(5):
                t0 = time.perf_counter()
                scratch.decode([200 + j for j in range(n)], 1000, every=True)
                t1 = time.perf_counter()
                for i in range(n):
                    llama_cpp.llama_sampler_sample(sampler, scratch.ctx, i)
                times[n].append((t1 - t0, time.perf_counter() - t1))
                scratch.undo(1000)
    one = statistics.median(d + s for d, s in times[rows[0]])
    print(f"{path}: a decode step after 1,000 tokens, median of {args.rounds} x 5")
    for n in rows:
        d = statistics.median(x for x, _ in times[n]) * 1000
        s = statistics.median(x for _, x in times[n]) * 1000
        print(f"rows {n:3d}: decode {d:6.1f} ms, sampling {s:5.1f} ms, {(d + s) / (one * 1000):5.2f} one-row steps")


if __name__ == "__main__":
    main()
