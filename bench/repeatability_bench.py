"""The same greedy request, sent every way a client sends it (issue 55): how many prompts get more than one text.

    python bench/repeatability_bench.py [--model PATH] [--setting GGUF_NAME=VALUE ...] [--sides default,invariant]

Each side is the service as ``make run`` starts it (the embedded model, or ``--model``), with a disk prompt cache of its own, plus
its settings: ``default`` (nothing more) and ``invariant`` (``GGUF_BATCH_INVARIANT=true``). Each of ``PROMPTS``
(20 short chats) is sent at temperature 0 with seed 7 through the official openai client: cold, again (from its
slot), streamed, four at a time (beside three others), from host memory (after four other chats took the slots)
and, after a restart, from its file on disk. Printed per side: how many prompts had more than one text, and by
which way the text differed from the cold one; with ``--show``, the texts that differed.
tests/reliability/test_batch_invariant.py asserts the ``invariant`` side's 0 with the same prompts.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import tempfile
from collections import Counter
from typing import Any

import httpx
import openai
from harness import run_service

QUESTIONS = (
    "Count to five out loud.", "Count from one to ten.", "Name three colors you like.", "List the days of the week.",
    "Spell the word banana.", "Write the alphabet from A to J.", "Name the four seasons.", "Count down from ten to one.",
    "List the planets of the solar system.", "Name five fruits you like.", "Write the even numbers up to twenty.",
    "Name the months of the year.", "Repeat the word echo five times.", "List three prime numbers.",
    "Name four animals that live in the sea.", "Write the numbers one to five in French.", "What is 12 times 7?",
    "Write a haiku about rain.", "Name the colors of the rainbow.", "Write a JavaScript loop that prints 1 to 3.",
)
PROMPTS = [f"{q} Answer in plain text, on one line, without a title, a list, a greeting or any explanation before or "
           "after it." for q in QUESTIONS]
"""20 chats of 40 to 47 tokens: long enough that each goes to the prompt cache when its slot is taken, and that the
8 tokens batch-invariant mode evaluates again leave more than the 32 a restore needs."""
OTHERS = ("Describe the sea in winter.", "What is a lighthouse?", "Tell me about trains.", "Why is grass green?")
"""Four more chats: the 20 leave the slots for the prompt cache."""
MAX_TOKENS = 48
WAYS = ("cold", "again", "streamed", "beside three others", "from host memory", "from disk")
SIDES = {"default": {}, "invariant": {"GGUF_BATCH_INVARIANT": "true"}}


def chat(client: openai.OpenAI, model: str, prompt: str, *, stream: bool = False) -> str:
    messages: list[Any] = [{"role": "user", "content": prompt}]
    if stream:
        chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                temperature=0, seed=7, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                           seed=7)
    return whole.choices[0].message.content or ""


def restores(url: str) -> float:
    """Prompts given back from the prompt cache beyond the slots so far (``gguf_prompt_cache_hits_total``)."""
    text = httpx.get(url + "/metrics").text
    return sum(float(v) for v in re.findall(r"^gguf_prompt_cache_hits_total\{[^}]*\} (\S+)$", text, re.M))


def first_part(client: openai.OpenAI, model: str, texts: dict[str, dict[str, str]]) -> None:
    """Every way but the disk's, on one running server, in ``WAYS``' order (``texts``: prompt -> way -> text)."""
    for p in PROMPTS:
        texts[p]["cold"] = chat(client, model, p)
        texts[p]["again"] = chat(client, model, p)
        texts[p]["streamed"] = chat(client, model, p, stream=True)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for i in range(0, len(PROMPTS), 4):
            group = PROMPTS[i:i + 4]
            for p, text in zip(group, pool.map(lambda q: chat(client, model, q), group)):
                texts[p]["beside three others"] = text
    for other in OTHERS:
        chat(client, model, other)
    for p in PROMPTS:
        texts[p]["from host memory"] = chat(client, model, p)


def from_disk(client: openai.OpenAI, model: str, texts: dict[str, dict[str, str]]) -> None:
    for p in PROMPTS:
        texts[p]["from disk"] = chat(client, model, p)


def differing(texts: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """The prompts with more than one text: the ways whose text is not the cold one's."""
    return {p: {k: v for k, v in t.items() if v != t["cold"]} for p, t in texts.items() if len(set(t.values())) > 1}


def side(model_path: str | None, settings: dict[str, str]) -> tuple[dict[str, dict[str, str]], float, float]:
    """The texts of one side, and its restores from memory and from disk."""
    texts: dict[str, dict[str, str]] = {p: {} for p in PROMPTS}
    env = {**settings, "GGUF_PROMPT_CACHE_DIR": tempfile.mkdtemp(prefix="bench-repeat-")}
    with run_service(model_path, **env) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=600, max_retries=0)
        model = client.models.list().data[0].id
        first_part(client, model, texts)
        memory = restores(url)
    with run_service(model_path, **env) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=600, max_retries=0)
        from_disk(client, model, texts)
        disk = restores(url)
    return texts, memory, disk


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a GGUF path (default: the embedded default model, SmolLM2-135M-Instruct)")
    ap.add_argument("--sides", default=",".join(SIDES))
    ap.add_argument("--setting", action="append", default=[], metavar="GGUF_NAME=VALUE", help="for every side")
    ap.add_argument("--show", action="store_true", help="print the texts that differed")
    args = ap.parse_args()
    common = dict(kv.split("=", 1) for kv in args.setting)
    print(f"{len(PROMPTS)} prompts x {len(WAYS)} ways, greedy, {MAX_TOKENS} tokens; load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    for name in args.sides.split(","):
        texts, memory, disk = side(args.model, {**common, **SIDES[name]})
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
