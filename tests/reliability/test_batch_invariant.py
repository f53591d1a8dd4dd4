"""Batch-invariant outputs as a setting (issues 29 and 55): with ``GGUF_BATCH_INVARIANT`` a greedy request gives the
same text cold, again from its slot, streamed, beside three other requests, from the prompt cache in host memory
and, after a restart, from its files on disk; and the plan, which knows the engine then loads without repacked
weights, a quantized cache and a KV stream per slot, still equals what llama.cpp allocates.

Each way of sending rounded a step otherwise before issue 55 on an AVX2 host (repacked weights, CPU flash
attention over an f16 cache, a generated token beside a prompt chunk or in a long draft, new cells below a
sequence's older ones): on that code 14 of these 20 prompts had more than one text by default, 12 with
``GGUF_BATCH_INVARIANT=true``."""

from __future__ import annotations

import concurrent.futures
import re
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import EMBEDDED_NAME, ServiceProcess, loaded_model

pytestmark = pytest.mark.slow

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


def _restores(svc: ServiceProcess) -> float:
    """Prompts given back from the prompt cache beyond the slots so far (``gguf_prompt_cache_hits_total``)."""
    text = svc.client.get("/metrics").text
    return sum(float(v) for v in re.findall(r"^gguf_prompt_cache_hits_total\{[^}]*\} (\S+)$", text, re.M))


def _chat(client: openai.OpenAI, prompt: str, *, stream: bool = False) -> str:
    messages: list[Any] = [{"role": "user", "content": prompt}]
    if stream:
        chunks = client.chat.completions.create(model=EMBEDDED_NAME, messages=messages, max_tokens=MAX_TOKENS,
                                                temperature=0, seed=7, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(model=EMBEDDED_NAME, messages=messages, max_tokens=MAX_TOKENS,
                                           temperature=0, seed=7)
    return whole.choices[0].message.content or ""


def test_greedy_text_is_the_same_however_the_request_is_sent(tmp_path: Path) -> None:
    """Each prompt cold, again (its slot, the same prompt's logits), streamed (the official client, against the
    same request not streamed), beside three others (4 slots decoding together), restored from host memory once
    four other chats took the slots, and after a restart restored from disk (``GGUF_PROMPT_CACHE_DIR``): one text."""
    models = tmp_path / "models"
    models.mkdir()
    env = {"GGUF_MODELS_DIR": str(models), "GGUF_BATCH_INVARIANT": "true", "GGUF_CONFIRM_LOADS": "false",
           "GGUF_PROMPT_CACHE_DIR": str(tmp_path / "prompt-cache")}
    texts: dict[str, dict[str, str]] = {p: {} for p in PROMPTS}
    with ServiceProcess(env, tmp_path / "service.log").running() as svc:
        model = loaded_model(svc.client)
        chosen = model["plan"]["chosen"]
        assert (chosen["cpu_repack"], chosen["cache_type"], chosen["kv_unified"]) == (False, "q8_0", False)
        rows = {m["device"]: m for m in model["memory"]}
        assert set(rows) == {"CPU"}, "no repacked copies: the engine loads without them, and the plan knows"
        assert rows["CPU"]["allocated_mib"] == pytest.approx(rows["CPU"]["predicted_mib"], abs=0.011)
        client = openai.OpenAI(base_url=svc.url + "/v1", api_key="none", timeout=600, max_retries=0)
        for p in PROMPTS:
            texts[p]["cold"] = _chat(client, p)
            texts[p]["again"] = _chat(client, p)
            texts[p]["streamed"] = _chat(client, p, stream=True)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            for i in range(0, len(PROMPTS), 4):
                group = PROMPTS[i:i + 4]
                for p, text in zip(group, pool.map(lambda q: _chat(client, q), group)):
                    texts[p]["beside three others"] = text
        for other in OTHERS:
            _chat(client, other)
        before = _restores(svc)
        for p in PROMPTS:
            texts[p]["from host memory"] = _chat(client, p)
        assert _restores(svc) - before == len(PROMPTS), "every prompt came back from the prompt cache"
    with ServiceProcess(env, tmp_path / "restarted.log").running() as svc:
        client = openai.OpenAI(base_url=svc.url + "/v1", api_key="none", timeout=600, max_retries=0)
        for p in PROMPTS:
            texts[p]["from disk"] = _chat(client, p)
        assert _restores(svc) == len(PROMPTS), "every prompt came back from its file"
    differ = {p[:40]: {k: v for k, v in t.items() if v != t["cold"]} for p, t in texts.items()
              if len(set(t.values())) > 1}
    assert not differ, f"{len(differ)} of {len(PROMPTS)} prompts had more than one text: {differ}"
