"""What the runner process costs: the service with each model's engine in a runner process (the default) against
the same service with the engine in the API process (``GGUF_RUNNER_PROCESS=false``), side by side in one run.

    .venv/bin/python bench/runner_bench.py [--rounds 5] [--tokens 128]

Both serve the embedded model on ``make run``'s defaults and stay loaded the whole time; they take turns (the
order reversed every round), so a drifting machine load falls on both alike, and each round's prompts are the same
on both (the same text written, the same drafts accepted). Figures are medians over the rounds, and the median of
each round's own ratio (its two sides ran the same prompts moments apart: on a noisy machine the steadier figure):

- one client, ``--tokens`` greedy tokens streamed (``ignore_eos``, a fresh prompt each time): decode tokens/s
  after the first token, and the time to first token. Targets: >= 0.97x in-process, TTFT at most +3 ms;
- four concurrent streaming clients: aggregate tokens/s (all tokens / wall time). Target: >= 1.0x in-process.

Run it alone: both cores are the benchmark's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from serving_bench import clients, one_client, service, tag  # noqa: E402

from service.models import embedded_model_path  # noqa: E402


def four(url: str, tokens: int, words: list[str] | None = None) -> float:
    wall, runs = clients(url, 4, tokens, words)
    return sum(r.tokens for r in runs) / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--speculative", choices=("ngram", "off"), default="ngram",
                    help="GGUF_SPECULATIVE on both sides (default the service's: ngram)")
    args = ap.parse_args()
    model = embedded_model_path()
    spec = {"GGUF_SPECULATIVE": args.speculative}
    sides = {"runner process": {"GGUF_RUNNER_PROCESS": "true", **spec},
             "in process": {"GGUF_RUNNER_PROCESS": "false", **spec}}
    results: dict[str, dict[str, list[float]]] = {s: {"decode": [], "ttft": [], "four": []} for s in sides}
    with service(model, **sides["runner process"]) as a, service(model, **sides["in process"]) as b:
        urls = {"runner process": a, "in process": b}
        for url in urls.values():  # warm-up: the first request of a fresh engine
            one_client(url, 8, True)
            four(url, 8)
        order = list(sides)
        for r in range(args.rounds):
            word, words = tag(), [tag() for _ in range(4)]  # the same prompts on both sides (serving_bench.fresh)
            for side in (order if r % 2 == 0 else order[::-1]):
                run = one_client(urls[side], args.tokens, True, word)
                results[side]["decode"].append(run.decode_tokens_per_s)
                results[side]["ttft"].append(run.ttft_s * 1000)
                results[side]["four"].append(four(urls[side], args.tokens, words))
    med: dict[str, dict[str, float]] = {s: {k: statistics.median(v) for k, v in m.items()} for s, m in results.items()}
    rp, ip = med["runner process"], med["in process"]
    rr, ir = results["runner process"], results["in process"]
    print(f"{args.rounds} rounds, {args.tokens} tokens, GGUF_SPECULATIVE={args.speculative}, medians; 'paired': the "
          "median of the rounds' own ratios (differences for the TTFT), the same prompts moments apart")
    print(f"{'':<34} {'runner process':>15} {'in process':>11} {'ratio':>8} {'paired':>8}  target")
    rows: list[tuple[str, str, Any]] = [
        ("one client decode tok/s", "decode", ">= 0.97"),
        ("time to first token ms", "ttft", "<= +3 ms"),
        ("four clients aggregate tok/s", "four", ">= 1.0"),
    ]
    for label, key, target in rows:
        if key == "ttft":
            ratio = f"{rp[key] - ip[key]:+.1f} ms"
            paired = f"{statistics.median(a - b for a, b in zip(rr[key], ir[key])):+.1f} ms"
        else:
            ratio = f"{rp[key] / ip[key]:.3f}"
            paired = f"{statistics.median(a / b for a, b in zip(rr[key], ir[key])):.3f}"
        print(f"{label:<34} {rp[key]:>15.1f} {ip[key]:>11.1f} {ratio:>8} {paired:>8}  {target}")


if __name__ == "__main__":
    main()
