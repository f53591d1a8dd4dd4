"""What the runner process costs: the service with each model's engine in a runner process (the default) against
the same service with the engine in the API process (``GGUF_RUNNER_PROCESS=false``), side by side in one run.

    .venv/bin/python bench/runner_bench.py [--rounds 5] [--tokens 128] [--starts 1] [--speculative ngram|off]
                                           [--control]

Both serve the embedded model on ``make run``'s defaults and stay loaded the whole time; they take turns (the
order reversed every round), so a drifting machine load falls on both alike, and each round's prompts are the same
on both (the same text written, the same drafts accepted). Figures are medians over the rounds, and the median of
each round's own ratio (its two sides ran the same prompts moments apart: on a noisy machine the steadier figure):

- one client, ``--tokens`` greedy tokens streamed (``ignore_eos``, a fresh prompt each time): decode tokens/s
  after the first token, and the time to first token. Targets: >= 0.97x in-process, TTFT at most +3 ms;
- four concurrent streaming clients: aggregate tokens/s (all tokens / wall time). Target: >= 1.0x in-process.

``--starts N`` starts both services afresh N times and shares the rounds among the starts: where a start puts a
process's memory, and which started first, moved one run's figures by several percent on the 2-core hosts, as
much as the boundary is meant to cost; each start's own paired figures are printed too.

Beside each paired figure, a 95% interval (bootstrap of the rounds' own ratios): what this many rounds resolve.
``--control`` runs the in-process service against another of itself: the same figures for two sides that differ
in nothing, the bench's own resolution on this machine (an interval that holds 1.0 by construction, and as wide
as the machine's noise).

And where the rounds' CPU went (Linux: ``/proc``), per token of the four-client rounds: llama.cpp's compute threads
(each thread that used at least a quarter of the round's wall time: ``llama_decode``'s team, the scheduler thread
with it) and everything else of the service's processes (the event loop, the HTTP workers; with a runner, its
socket threads and the API process's reader). That second figure is the boundary's cost in CPU, which the
wall-time ratios cannot resolve below their noise.

Run it alone: both cores are the benchmark's.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import random
import statistics
from typing import Any

from harness import run_service
from service.catalog.embedded import embedded_model_path
from serving_bench import clients, one_client, tag

COMPUTE_SHARE = 0.25
"""A thread that used at least this share of a round's wall time in CPU is counted as llama.cpp's compute."""


def four(url: str, tokens: int, words: list[str] | None = None) -> float:
    wall, runs = clients(url, 4, tokens, words)
    return sum(r.tokens for r in runs) / wall


def service_pids(url: str) -> list[int]:
    """The processes of the service at ``url`` (the API process and its runners): those whose environment holds its
    port setting, which ``serving_bench.service`` gives it and its runners inherit."""
    marker = f"GGUF_PORT={url.rsplit(':', 1)[1]}\0".encode()
    pids = []
    for path in glob.glob("/proc/[0-9]*/environ"):
        try:
            with open(path, "rb") as f:
                if marker in f.read():
                    pids.append(int(path.split("/")[2]))
        except OSError:  # gone, or not ours
            pass
    return pids


def thread_cpu(pids: list[int]) -> dict[tuple[int, str], float]:
    """CPU seconds (user + system) of every thread of ``pids``, by (pid, tid)."""
    tick = os.sysconf("SC_CLK_TCK")
    cpu = {}
    for pid in pids:
        for path in glob.glob(f"/proc/{pid}/task/*/stat"):
            try:
                with open(path) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # the thread ended
                continue
            cpu[(pid, path.split("/")[4])] = (int(fields[11]) + int(fields[12])) / tick
    return cpu


def cpu_split(before: dict[tuple[int, str], float], after: dict[tuple[int, str], float],
              wall: float) -> tuple[float, float]:
    """(compute, other) CPU seconds between two ``thread_cpu`` readings ``wall`` seconds apart."""
    compute = other = 0.0
    for key, t in after.items():
        used = t - before.get(key, 0.0)
        if used >= COMPUTE_SHARE * wall:
            compute += used
        else:
            other += used
    return compute, other


def interval(values: list[float], seed: int = 0) -> tuple[float, float]:
    """A 95% bootstrap interval of the median of ``values``."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(2000))
    return meds[49], meds[1950]


def run_rounds(urls: dict[str, str], rounds: int, tokens: int, results: dict[str, dict[str, list[float]]]) -> None:
    """``rounds`` rounds on the services at ``urls``, the sides taking turns (the order reversed every round)."""
    pids = {side: service_pids(url) for side, url in urls.items()}
    for url in urls.values():  # warm-up: the first request of a fresh engine
        one_client(url, 8, True)
        four(url, 8)
    order = list(urls)
    for r in range(rounds):
        word, words = tag(), [tag() for _ in range(4)]  # the same prompts on both sides (serving_bench.fresh)
        for side in (order if r % 2 == 0 else order[::-1]):
            res = results[side]
            run = one_client(urls[side], tokens, True, word)
            res["decode"].append(run.decode_tokens_per_s)
            res["ttft"].append(run.ttft_s * 1000)
            before = thread_cpu(pids[side])
            wall, runs = clients(urls[side], 4, tokens, words)
            compute, other = cpu_split(before, thread_cpu(pids[side]), wall)
            n = sum(x.tokens for x in runs)
            res["four"].append(n / wall)
            res["tokens"].append(n)
            res["compute"].append(compute)
            res["other"].append(other)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--speculative", choices=("ngram", "off"), default="ngram",
                    help="GGUF_SPECULATIVE on both sides (default the service's: ngram)")
    ap.add_argument("--starts", type=int, default=1,
                    help="start both services afresh this many times, the rounds shared among the starts (default 1)")
    ap.add_argument("--control", action="store_true",
                    help="both sides in process: what the bench resolves on this machine (see above)")
    args = ap.parse_args()
    model = embedded_model_path()
    spec = {"GGUF_SPECULATIVE": args.speculative}
    first = "in process (2)" if args.control else "runner process"
    sides = {first: {"GGUF_RUNNER_PROCESS": "false" if args.control else "true", **spec},
             "in process": {"GGUF_RUNNER_PROCESS": "false", **spec}}
    keys = ("decode", "ttft", "four", "tokens", "compute", "other")
    results: dict[str, dict[str, list[float]]] = {s: {k: [] for k in keys} for s in sides}
    per_start: list[tuple[float, float]] = []
    for start in range(args.starts):
        rounds = args.rounds // args.starts + (start < args.rounds % args.starts)
        begin = {k: len(v) for k, v in results[first].items()}
        with contextlib.ExitStack() as stack:
            # Both sides' services start afresh each time, in turn first (what a start settles, where the
            # process's memory lies, falls on both alike).
            names = list(sides) if start % 2 == 0 else list(sides)[::-1]
            urls = {side: stack.enter_context(run_service(model, **sides[side])) for side in names}
            run_rounds(urls, rounds, args.tokens, results)
        mine, other = ({k: v[begin[k]:] for k, v in results[side].items()} for side in (first, "in process"))
        per_start.append((statistics.median(a / b for a, b in zip(mine["decode"], other["decode"])),
                          statistics.median(a / b for a, b in zip(mine["four"], other["four"]))))
    rp, ip = results[first], results["in process"]
    med = {s: {k: statistics.median(v) for k, v in m.items()} for s, m in results.items()}
    print(f"{args.rounds} rounds ({args.starts} start{'s' if args.starts > 1 else ''}), {args.tokens} tokens, GGUF_SPECULATIVE={args.speculative}, medians; 'paired': the "
          "median of the rounds' own ratios (differences for the TTFT), the same prompts moments apart, with its 95% "
          "interval")
    print(f"{'':<30} {first:>15} {'in process':>11} {'ratio':>8} {'paired':>8} {'95% interval':>17}  target")
    rows: list[tuple[str, str, Any]] = [
        ("one client decode tok/s", "decode", ">= 0.97"),
        ("time to first token ms", "ttft", "<= +3 ms"),
        ("four clients aggregate tok/s", "four", ">= 1.0"),
    ]
    for label, key, target in rows:
        if key == "ttft":
            diffs = [x - y for x, y in zip(rp[key], ip[key])]
            lo, hi = interval(diffs)
            ratio = f"{med[first][key] - med['in process'][key]:+.1f} ms"
            paired = f"{statistics.median(diffs):+.1f} ms"
            span = f"[{lo:+.1f}, {hi:+.1f}]"
        else:
            ratios = [x / y for x, y in zip(rp[key], ip[key])]
            lo, hi = interval(ratios)
            ratio = f"{med[first][key] / med['in process'][key]:.3f}"
            paired = f"{statistics.median(ratios):.3f}"
            span = f"[{lo:.3f}, {hi:.3f}]"
        print(f"{label:<30} {med[first][key]:>15.1f} {med['in process'][key]:>11.1f} {ratio:>8} {paired:>8} "
              f"{span:>17}  {target}")
    if args.starts > 1:
        print("paired, each start's rounds: one client " + ", ".join(f"{d:.3f}" for d, _ in per_start)
              + "; four clients " + ", ".join(f"{f:.3f}" for _, f in per_start))
    if all(results[s]["compute"] for s in sides) and any(rp["compute"]):
        print("CPU per token of the four-client rounds, ms (sum over the rounds / tokens):")
        for label, key in (("llama.cpp's compute threads", "compute"), ("the rest of the service", "other")):
            a_ms, b_ms = (1000 * sum(m[key]) / sum(m["tokens"]) for m in (rp, ip))
            print(f"{label:<30} {a_ms:>15.3f} {b_ms:>11.3f} {a_ms - b_ms:>+8.3f}")
    else:
        print("(no CPU figures: /proc is not readable here)")


if __name__ == "__main__":
    main()
