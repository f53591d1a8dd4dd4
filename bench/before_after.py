"""The service at this checkout against the service at another commit, both on their defaults, in one run.

    git worktree add /tmp/before a8e854f
    python bench/before_after.py --before /tmp/before [--rounds 5] [--tokens 128]

What a structural change must not cost (issue 46: no slower than before). Both services load the embedded model
(``python -m service`` from each checkout, with this checkout's environment and packages), both stay loaded and
take turns, the order reversed every round, each pair of runs given the same fresh first word (the same greedy
text on both sides). Per round: one streaming client (decode tokens/s after the first token, time to first
token), four concurrent streaming clients (aggregate tokens/s), and a conversation's next turn (time to first
token over a cached history of about 1,500 tokens). Printed: the medians, and the ratio of after to before with
the paired ratios' range over the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from harness import ROOT, service_process
from service.catalog.embedded import embedded_model_path
from serving_bench import clients, conversation, one_client, tag


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, type=Path, help="a checkout of the commit to compare against")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    model = embedded_model_path()
    sides = {"before": args.before.resolve(), "after": ROOT}
    figures: dict[str, dict[str, list[float]]] = {s: {"one": [], "ttft": [], "four": [], "turn": []} for s in sides}
    with service_process(model, root=sides["before"]) as (before_url, _), \
            service_process(model, root=sides["after"]) as (after_url, _):
        urls = {"before": before_url, "after": after_url}
        for url in urls.values():  # warm-up
            one_client(url, 16, True)
            clients(url, 4, 16)
        for rnd in range(args.rounds):
            order = list(sides) if rnd % 2 == 0 else list(reversed(sides))
            word, words = tag(), [tag() for _ in range(4)]
            for side in order:
                run = one_client(urls[side], args.tokens, True, word)
                figures[side]["one"].append(run.decode_tokens_per_s)
                figures[side]["ttft"].append(run.ttft_s * 1000)
            for side in order:
                wall, runs = clients(urls[side], 4, args.tokens, words)
                figures[side]["four"].append(sum(r.tokens for r in runs) / wall)
            for side in order:
                turns = conversation(urls[side], "chat", 1500, 2, 16)
                figures[side]["turn"].append(statistics.median(turns.next_ttft_s) * 1000)
            print(f"round {rnd + 1}: " + ", ".join(f"{s} one {figures[s]['one'][-1]:.1f} tok/s four "
                                                   f"{figures[s]['four'][-1]:.1f} tok/s" for s in order), flush=True)
    print(f"\n{'measure':<34}{'before':>10}{'after':>10}{'after/before':>14}  paired range")
    for key, label, higher in (("one", "one client, decode tok/s", True), ("ttft", "one client, TTFT ms", False),
                               ("four", "four clients, tok/s", True), ("turn", "next turn TTFT ms", False)):
        b, a = figures["before"][key], figures["after"][key]
        pairs = sorted(x / y for x, y in zip(a, b) if y)
        print(f"{label:<34}{statistics.median(b):>10.1f}{statistics.median(a):>10.1f}"
              f"{statistics.median(a) / statistics.median(b):>13.3f}x  [{pairs[0]:.3f}, {pairs[-1]:.3f}]"
              f"{'' if higher else '  (lower is better)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
