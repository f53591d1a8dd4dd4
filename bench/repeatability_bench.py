"""The same greedy or seeded request, sent every way a client sends it (issue 55): how many prompts get more than
one text.

    python bench/repeatability_bench.py [--model PATH] [--setting GGUF_NAME=VALUE ...] [--sides default,invariant]
                                        [--temperature T]

Each side is the service as ``make run`` starts it (the embedded model, or ``--model``), with a disk prompt cache
of its own, plus its settings: ``default`` (nothing more), ``invariant`` (``GGUF_BATCH_INVARIANT=true``) and
``no-replay`` (``GGUF_REPLAY_TOLERANCE=0``: no earlier answer kept). Each of ``PROMPTS`` (20 short chats) is sent
at temperature 0 (or ``--temperature``) with seed 7 through the official openai client: cold, again (from its
slot), streamed, four at a time (beside three others), from host memory (after four other chats took the slots)
and, after a restart, from its file on disk. Printed per side: how many prompts had more than one text, and by
which way the text differed from the cold one; with ``--show``, the texts that differed.
tests/reliability/test_batch_invariant.py asserts the ``invariant`` side's 0 with the same prompts.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections import Counter

import openai
from harness import run_service

from service.testing.repeatability import MAX_TOKENS, PROMPTS, WAYS, differing, first_part, from_disk, restores

SIDES = {"default": {}, "invariant": {"GGUF_BATCH_INVARIANT": "true"}, "no-replay": {"GGUF_REPLAY_TOLERANCE": "0"}}


def side(model_path: str | None, settings: dict[str, str],
         temperature: float = 0.0) -> tuple[dict[str, dict[str, str]], float, float]:
    """The texts of one side, and its restores from memory and from disk."""
    texts: dict[str, dict[str, str]] = {p: {} for p in PROMPTS}
    env = {**settings, "GGUF_PROMPT_CACHE_DIR": tempfile.mkdtemp(prefix="bench-repeat-")}
    with run_service(model_path, **env) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=600, max_retries=0)
        model = client.models.list().data[0].id
        memory = first_part(client, model, texts, url, temperature)
    with run_service(model_path, **env) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=600, max_retries=0)
        from_disk(client, model, texts, temperature)
        disk = restores(url)
    return texts, memory, disk


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a GGUF path (default: the embedded default model, SmolLM2-135M-Instruct)")
    ap.add_argument("--sides", default="default,invariant")
    ap.add_argument("--setting", action="append", default=[], metavar="GGUF_NAME=VALUE", help="for every side")
    ap.add_argument("--show", action="store_true", help="print the texts that differed")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="draw at this temperature with the seed instead of greedy (OpenAI's seed: the same result)")
    args = ap.parse_args()
    common = dict(kv.split("=", 1) for kv in args.setting)
    how = f"temperature {args.temperature}, seed 7" if args.temperature else "greedy"
    print(f"{len(PROMPTS)} prompts x {len(WAYS)} ways, {how}, {MAX_TOKENS} tokens; load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    for name in args.sides.split(","):
        texts, memory, disk = side(args.model, {**common, **SIDES[name]}, args.temperature)
        d = differing(texts)
        by_way = Counter(w for ways in d.values() for w in ways)
        print(f"{name:10s} prompts with more than one text: {len(d)} of {len(PROMPTS)}; differing from cold by way: "
              f"{dict(by_way) or 'none'}; restores from memory {memory:.0f}, from disk {disk:.0f}", flush=True)
        if args.show:
            for p, ways in d.items():
                print(f"  {p[:40]!r}: cold {texts[p]['cold']!r}; " + "; ".join(f"{w} {t!r}" for w, t in ways.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
