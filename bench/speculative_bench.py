"""Self-speculative decoding (issues 26, 45, 55): decode speed with drafts, without them, and llama-server's n-gram
modes.

    python bench/speculative_bench.py [--rounds 3] [--tokens 192] [--peers ngram-mod,ngram-simple]
                                      [--workloads copy,vocab,...] [--no-llama-server] [--draft-max N]
                                      [--fresh-seeds]
                                      [--versus GGUF_NAME=VALUE]
                                      [--model PATH] [--draft-model PATH]

One client at a time, ``ignore_eos`` (every answer the same length on every side). The sides, one request each
per workload and round, their order rotated: the service (its defaults: ``GGUF_SPECULATIVE=ngram``), the same
service with ``speculative: false`` in the request (one token a step), and llama-server built from the vendored
llama.cpp (``bench/llama_server.py``), once per ``--peers`` speculation type on its defaults: ``ngram-mod`` (a hash
pool of 24-token n-grams shared by the slots and kept across requests, drafts of 48 to 64 tokens chained one
lookup a token) and ``ngram-simple`` (a 12-token n-gram, up to 48 drafted tokens). Every request is made once
before the rounds, so that both servers' pools hold its answer as a client asking again would find them.
Workloads, the copy-heavy ones greedy and sampled (``NAME-s``, temperature 0.7, a fixed seed):

- ``copy``: a ~500-token text to rewrite with one word changed (the answer copies the prompt);
- ``json``: records in the prompt, one of them to repeat as JSON (the answer quotes the prompt);
- ``vocab``: 350 words drawn from 24 to copy (logs, tables and code repeat a small vocabulary: short keys are
  ambiguous);
- ``code``: a Python function to repeat under another name;
- ``csv``: a sales table of a few regions and products to copy;
- ``events``: a JSON array of log events with three keys of few values to copy;
- ``prose``: a paragraph of natural prose to copy word for word;
- ``plain``: free text on a topic, sampled (temperature 1, a seed never used before each round, the same on every
  side: the same seed asked again would be drafted whole from its earlier answer, ``service.engine.replay``, so
  each of the service's sides asks in a cache scope of its own), which repeats little: what drafting costs where
  it does not help. Greedy, the embedded base model soon repeats its own sentences, which
  drafting then copies.

The copy-heavy texts are asked again with the same seed (3), as a client retrying a request does; with
``--fresh-seeds`` each sampled one has a seed never used before (a first ask: the service has no earlier answer
to replay, and neither server's pool holds this draw's answer).

With ``--draft-model`` the drafts come from that model on both servers instead (the service's
``GGUF_DRAFT_MODEL``, llama-server's ``-md`` with ``--spec-type draft-simple``, which it needs for a draft
without MTP heads, and its defaults: up to 16 tokens, p-min 0.75).

Printed per workload: the median decode tokens/s of each side, the service's ratio with drafts to without
(targets: at least 0.97x on ``plain``) and to each llama-server and the best of them (target: at least 1.0x on
every copy-heavy workload), the share of drafted tokens kept on each side, and the load average before and
after (above 2 on the 2-core host: other work shared the cores).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import httpx

from harness import run_service
from llama_server import find_or_build, serve

STORY = ("The keeper of the lighthouse on the northern cape wrote in his log every evening. He noted the wind, the "
         "height of the waves, the ships that passed and the birds that rested on the gallery. In winter the storms "
         "came from the west and the lamp burned through the night; in summer the fog rolled in from the sea and the "
         "horn sounded every minute until dawn. His daughter brought bread and letters from the village on Sundays, "
         "and she read him the news while he mended the nets. When the supply boat was late he rationed the oil and "
         "trimmed the wick himself, counting the hours until the sky grew pale. The old charts on the wall showed "
         "the reefs and the wrecks of a hundred years, each marked in red ink by the keepers before him. ")
RECORDS = "\n".join(
    f'{{"id": {i}, "name": "{n}", "city": "{c}", "role": "{r}", "since": {1990 + 3 * i}}}'
    for i, (n, c, r) in enumerate([("Ada Lovelace", "London", "analyst"), ("Alan Turing", "Manchester", "engineer"),
                                   ("Grace Hopper", "Arlington", "admiral"), ("Edsger Dijkstra", "Austin", "professor"),
                                   ("Barbara Liskov", "Boston", "researcher"), ("Donald Knuth", "Stanford", "author")]))
WORDS = ("error warn info debug request response user admin server client timeout retry open close read write "
         "cache disk node queue start stop ok fail").split()
_rng = random.Random(7)
VOCAB_TEXT = " ".join(_rng.choice(WORDS) for _ in range(350))
"""350 words drawn from 24, as logs, tables and code repeat a few: a 2- or 3-token key occurs in many places."""
CODE = '''def parse_rows(path, sep=",", skip_blank=True):
    """Read a delimited file into a list of dictionaries keyed by the header."""
    rows = []
    with open(path, encoding="utf-8") as f:
        header = [name.strip() for name in f.readline().split(sep)]
        for number, line in enumerate(f, start=2):
            line = line.rstrip("\\n")
            if skip_blank and not line.strip():
                continue
            values = [value.strip() for value in line.split(sep)]
            if len(values) != len(header):
                raise ValueError(f"line {number}: {len(values)} values, {len(header)} expected")
            row = {}
            for name, value in zip(header, values):
                if value.isdigit():
                    row[name] = int(value)
                elif value in ("true", "false"):
                    row[name] = value == "true"
                else:
                    row[name] = value
            rows.append(row)
    return rows
'''
_rng = random.Random(11)
CSV = "date,region,product,units,price\n" + "\n".join(
    f"2024-0{1 + i // 9}-{10 + i % 9},{_rng.choice(['north', 'south', 'east', 'west'])},"
    f"{_rng.choice(['apples', 'pears', 'plums'])},{_rng.randrange(5, 60)},{_rng.choice(['1.20', '0.90', '2.10', '1.50'])}"
    for i in range(24))
_rng = random.Random(5)
EVENTS = "[\n" + ",\n".join(
    f'  {{"id": {i}, "level": "{_rng.choice(["info", "warn", "error"])}", "service": "{_rng.choice(["api", "db", "auth"])}", '
    f'"ok": {_rng.choice(["true", "false"])}}}' for i in range(1, 21)) + "\n]"
PROSE = ("Rivers shape the land they cross. Over thousands of years a stream cuts a valley into the hills, carries "
         "sand and stones down to the plain, and builds wide deltas where it meets the sea. People have always "
         "settled beside rivers, because they bring water for crops and animals, fish for food, and an easy road "
         "for boats. The first cities grew on the banks of great rivers, and their farmers learned to read the "
         "seasons of the floods. A good flood spread rich mud over the fields; a poor one meant a hungry year. "
         "Later, mills used the force of the current to grind grain and saw wood, and canals joined one river to "
         "another so that goods could travel far inland. Today dams hold back the water to make electricity and "
         "to store it for dry months, but they also stop the fish that swim upstream and the mud that once fed "
         "the plains. ")
PEER = "llama-server"
"""Each peer side is named ``llama-server <spec type>``."""
COPIES: dict[str, str] = {
    "copy": (f"Text:\n{STORY * 2}\nThe same text, with the word 'lighthouse' written as 'beacon':\n"
             f"{STORY[:24].replace('lighthouse', 'beacon')}"),
    "json": f"Records:\n{RECORDS}\n\nEvery record again, in the same order:\n{RECORDS[:20]}",
    "vocab": f"Log words:\n{VOCAB_TEXT}\n\nThe same words again, copied exactly:\n{' '.join(VOCAB_TEXT.split()[:3])}",
    "code": f"```python\n{CODE}```\n\nThe same function, renamed to load_rows:\n\n```python\ndef load_rows(",
    "csv": f"Sales:\n{CSV}\n\nThe same table again, copied exactly:\n{CSV[:40]}",
    "events": f"Events:\n{EVENTS}\n\nThe same events again, copied exactly:\n{EVENTS[:EVENTS.index(chr(10), 3) + 1]}",
    "prose": f"Text:\n{PROSE}\n\nThe same text, copied word for word:\n{PROSE[:30]}",
}
"""The copy-heavy texts (issues 26, 45, 55): each greedy, and sampled as ``NAME-s``."""
SAMPLED_COPY_TEMPERATURE = 0.7
"""The sampled copies' temperature: at 1 over the whole vocabulary the embedded 270M model leaves the copy within a
few lines (its code and prose become other text), which is ``plain``'s case, not a copy."""
WORKLOADS: dict[str, tuple[str, float]] = {
    **{w: (p, 0.0) for w, p in COPIES.items()},
    **{f"{w}-s": (p, SAMPLED_COPY_TEMPERATURE) for w, p in COPIES.items()},
    "plain": ("An essay on the history of bread, from the first farmers to the bakeries of today.\n\n", 1.0),
}
"""Each workload's prompt and temperature (0: greedy)."""


def _run(url: str, prompt: str, tokens: int, extra: dict[str, Any], temperature: float,
         seed: int = 3) -> tuple[float, int, int]:
    """One streamed completion: decode tokens/s (first token to last), drafted and kept tokens (0, 0 where the
    server does not say)."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": temperature, "seed": seed, "top_p": 1.0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "cache_prompt": False, **extra}
    if temperature:
        # The same distribution on every side: llama-server's own defaults (top_k 40, min_p 0.05) would sample
        # another, cheaper one than the service's (OpenAI's: the whole vocabulary), so both are given the whole one.
        # Greedy, the two change no token, but llama-server's verification of drafts slows down with them (copy
        # 130 against 160 tokens/s): there they are left out.
        body.update(top_k=0, min_p=0.0)
    first = last = 0.0
    n = 0
    drafted = kept = 0
    with httpx.Client(base_url=url, timeout=900) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                usage = ev.get("usage") or {}
                details = usage.get("completion_tokens_details") or {}
                if usage:
                    n = int(usage.get("completion_tokens", n))
                    kept = int(details.get("accepted_prediction_tokens") or 0)
                    drafted = kept + int(details.get("rejected_prediction_tokens") or 0)
                if any(c.get("text") for c in ev.get("choices") or ()):
                    now = time.perf_counter()
                    first = first or now
                    last = now
                timings = ev.get("timings") or {}
                if timings.get("draft_n"):
                    drafted, kept = int(timings["draft_n"]), int(timings.get("draft_n_accepted", 0))
    return ((n - 1) / (last - first) if n > 1 and last > first else 0.0), drafted, kept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=192)
    ap.add_argument("--model", default=None)
    ap.add_argument("--no-llama-server", action="store_true")
    ap.add_argument("--peers", default="ngram-mod,ngram-simple",
                    help="llama-server's --spec-type values to run beside the service (comma-separated)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help=f"the workloads to run (comma-separated; default all: {', '.join(WORKLOADS)})")
    ap.add_argument("--draft-max", type=int, default=None, help="GGUF_DRAFT_MAX for the service (default its own)")
    ap.add_argument("--draft-model", default=None, help="a draft model's file (bench/make_draft.py writes one)")
    ap.add_argument("--fresh-seeds", action="store_true",
                    help="every sampled request with a seed never used before (a first ask: nothing to replay, no "
                    "earlier answer in a pool) instead of the same seed each round")
    ap.add_argument("--versus", action="append", default=[], metavar="GGUF_NAME=VALUE",
                    help="a second service with these settings beside the first, as a side of its own ('versus'; "
                    "repeat for several): a default's effect, paired and interleaved in one run")
    args = ap.parse_args()
    from service.catalog.embedded import embedded_model_path

    workloads = {w: WORKLOADS[w] for w in args.workloads.split(",") if w}
    model = args.model or embedded_model_path()
    load_before = os.getloadavg()
    with contextlib.ExitStack() as stack:
        sides: dict[str, Callable[[str, float, int], tuple[float, int, int]]] = {}
        settings = {"GGUF_DRAFT_MAX": str(args.draft_max)} if args.draft_max else {}
        beside: tuple[str, ...] = ()
        peers: dict[str, tuple[str, ...]] = {f"{PEER} {t}": ("--spec-type", t) for t in args.peers.split(",") if t}
        if args.draft_model:
            beside = (args.draft_model,)
            peers = {f"{PEER} draft-simple": ("-md", args.draft_model, "--spec-type", "draft-simple")}
            settings["GGUF_DRAFT_MODEL"] = Path(args.draft_model).stem
        url = stack.enter_context(run_service(model, beside=beside, **settings))
        # Each of the service's sides in a cache scope of its own (``cache_salt``): with a fresh seed, one side's
        # answer is not replayed to the other (``service.engine.replay``).
        sides["service"] = lambda p, t, s: _run(url, p, args.tokens, {"cache_salt": "with drafts"}, t, s)
        sides["service, no drafts"] = lambda p, t, s: _run(url, p, args.tokens, {"speculative": False,
                                                                                 "cache_salt": "without"}, t, s)
        if args.versus:
            versus = dict(kv.split("=", 1) for kv in args.versus)
            vurl = stack.enter_context(run_service(model, beside=beside, **{**settings, **versus}))
            sides["versus"] = lambda p, t, s: _run(vurl, p, args.tokens, {"cache_salt": "with drafts"}, t, s)
            print(f"versus: the service with {versus}", flush=True)
        if not args.no_llama_server:
            binary = find_or_build()
            for name, peer_args in peers.items():
                lurl = stack.enter_context(serve(binary, model, *peer_args, log_name=f"{name.split()[-1]}.log"))
                sides[name] = functools.partial(lambda u, p, t, s: _run(u, p, args.tokens, {}, t, s), lurl)
        names = list(sides)
        fresh = itertools.count(1000)

        def seed(w: str) -> int:
            """3 each time (a request asked again), or one never used before, the same for every side of a round:
            always for ``plain`` (what drafting costs where nothing repeats: the same seed would be replayed,
            ``service.engine.replay``)."""
            return next(fresh) if w == "plain" or (args.fresh_seeds and WORKLOADS[w][1]) else 3

        for w, (prompt, temp) in workloads.items():  # warm-up: every side's first request of each workload
            s = seed(w)
            for name in names:
                sides[name](prompt, temp, s)
        speed: dict[tuple[str, str], list[float]] = {}
        drafts: dict[tuple[str, str], list[tuple[int, int]]] = {}
        for rnd in range(args.rounds):
            for w, (prompt, temp) in workloads.items():
                order = names[rnd % len(names):] + names[:rnd % len(names)]
                round_seed = seed(w)
                for name in order:
                    s, d, k = sides[name](prompt, temp, round_seed)
                    speed.setdefault((w, name), []).append(s)
                    drafts.setdefault((w, name), []).append((d, k))
        load_after = os.getloadavg()
        print(f"decode tokens/s, median of {args.rounds} rounds, {args.tokens} tokens, one client; greedy but "
              f"NAME-s (temperature {SAMPLED_COPY_TEMPERATURE}) and plain (temperature 1); load average "
              f"{load_before[0]:.1f} before, {load_after[0]:.1f} after (others' work on the cores where above 2)")
        for w in workloads:
            med = {n: statistics.median(speed[(w, n)]) for n in names}
            parts = [f"{n} {med[n]:.1f}" for n in names]
            d = sum(x for x, _ in drafts[(w, "service")])
            k = sum(y for _, y in drafts[(w, "service")])
            ratio = med["service"] / med["service, no drafts"] if med["service, no drafts"] else 0.0
            line = f"{w:8s} " + " | ".join(parts) + f" | with/without drafts {ratio:.2f}x"
            peers_run = [n for n in names if n.startswith(PEER) and med[n]]
            for peer in peers_run:
                ld = sum(x for x, _ in drafts[(w, peer)])
                lk = sum(y for _, y in drafts[(w, peer)])
                line += f" | service/{peer} {med['service'] / med[peer]:.2f}x (it kept {lk}/{ld})"
            if peers_run:
                line += f" | service/best {med['service'] / max(med[n] for n in peers_run):.2f}x"
            line += f" | service kept {k}/{d} drafted tokens"
            if "versus" in med:
                vd = sum(x for x, _ in drafts[(w, "versus")])
                vk = sum(y for _, y in drafts[(w, "versus")])
                line += (f" | versus/service {med['versus'] / med['service']:.2f}x (kept {vk}/{vd})"
                         + "".join(f", versus/{p} {med['versus'] / med[p]:.2f}x" for p in peers_run))
            print(line, flush=True)


if __name__ == "__main__":
    main()
