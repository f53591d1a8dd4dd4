"""The same greedy (or seeded) request sent every way a client sends it (issue 55): the chats and the ways, for
bench/repeatability_bench.py (how many chats get more than one text, per setting) and
tests/reliability/test_batch_invariant.py (none, in batch-invariant mode).

Each of ``PROMPTS`` is sent at temperature 0 with seed 7 through the official openai client (``chat``): cold, again
(from its slot), streamed, four at a time (beside three others), from host memory once ``OTHERS`` took the slots
(``first_part``) and, after a restart, from its file on disk (``from_disk``).
"""

from __future__ import annotations

import concurrent.futures
import re
from typing import Any

import httpx
import openai

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


def chat(client: openai.OpenAI, model: str, prompt: str, *, stream: bool = False, temperature: float = 0.0) -> str:
    messages: list[Any] = [{"role": "user", "content": prompt}]
    if stream:
        chunks = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                temperature=temperature, seed=7, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                           temperature=temperature, seed=7)
    return whole.choices[0].message.content or ""


def restores(url: str) -> float:
    """Prompts given back from the prompt cache beyond the slots so far (``gguf_prompt_cache_hits_total``)."""
    text = httpx.get(url + "/metrics").text
    return sum(float(v) for v in re.findall(r"^gguf_prompt_cache_hits_total\{[^}]*\} (\S+)$", text, re.M))


def first_part(client: openai.OpenAI, model: str, texts: dict[str, dict[str, str]], url: str,
               temperature: float = 0.0) -> float:
    """Every way but the disk's, on the server at ``url``, in ``WAYS``' order (``texts``: prompt -> way -> text, for
    its prompts: ``PROMPTS`` or some of them);
    how many prompts came back from the prompt cache in host memory (``restores`` over the last way). Greedy, or
    drawn at ``temperature`` with the seed."""
    prompts = list(texts)
    for p in prompts:
        texts[p]["cold"] = chat(client, model, p, temperature=temperature)
        texts[p]["again"] = chat(client, model, p, temperature=temperature)
        texts[p]["streamed"] = chat(client, model, p, stream=True, temperature=temperature)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for i in range(0, len(prompts), 4):
            group = prompts[i:i + 4]
            for p, text in zip(group, pool.map(lambda q: chat(client, model, q, temperature=temperature), group)):
                texts[p]["beside three others"] = text
    for other in OTHERS:
        chat(client, model, other)
    before = restores(url)
    for p in prompts:
        texts[p]["from host memory"] = chat(client, model, p, temperature=temperature)
    return restores(url) - before


def from_disk(client: openai.OpenAI, model: str, texts: dict[str, dict[str, str]], temperature: float = 0.0) -> None:
    for p in texts:
        texts[p]["from disk"] = chat(client, model, p, temperature=temperature)


def differing(texts: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """The prompts with more than one text: the ways whose text is not the cold one's."""
    return {p: {k: v for k, v in t.items() if v != t["cold"]} for p, t in texts.items() if len(set(t.values())) > 1}
