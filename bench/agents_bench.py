"""What the agents' API costs, on the embedded model over real HTTP (the service in a subprocess):

1. tool calls: a required call (grammar-constrained, generic format) against a plain chat of the same length:
   seconds and milliseconds per generated token;
2. n choices: one request with n=3 against three requests one after another (prompt evaluations: the
   ``gguf_prompt_tokens_evaluated`` gauge; wall time);
3. embeddings: inputs per second for batches of 1 and 8 short texts.

Run it alone on an idle machine (figures from a loaded one measure the neighbours):

    .venv/bin/python bench/agents_bench.py              # about two minutes
    .venv/bin/python bench/agents_bench.py --runs 1     # a quick look
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx

from harness import run_service

MODEL = "gemma-3-270m-q4_k_m"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _evaluated(c: httpx.Client) -> float:
    for line in c.get("/metrics").text.splitlines():
        if line.startswith("gguf_prompt_tokens_evaluated{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    with run_service(GGUF_CONFIRM_LOADS="false", GGUF_CONTEXT_LENGTH="4096", GGUF_EMBEDDING_TOKENS="128") as url:
        c = httpx.Client(base_url=url, timeout=300)
        chat = {"model": MODEL, "messages": ASK, "temperature": 0}
        tool = {**chat, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 60}
        c.post("/v1/chat/completions", json=tool)  # warm: llguidance's tokenizer, the prompt's slot
        rows = []
        for label, body in (("tool call (required)", tool), ("plain chat", None)):
            secs, per_token, tokens = [], [], 0
            for _ in range(args.runs):
                if body is None:  # the same number of tokens as the call took
                    body = {**chat, "max_tokens": tokens or 30, "ignore_eos": True}
                t0 = time.perf_counter()
                r = c.post("/v1/chat/completions", json=body).json()
                dt = time.perf_counter() - t0
                tokens = r["usage"]["completion_tokens"]
                secs.append(dt)
                per_token.append(dt / max(tokens, 1))
            rows.append(f"{label:<22} {tokens:>4} tokens  {statistics.median(secs):6.2f} s  "
                        f"{statistics.median(per_token) * 1e3:7.1f} ms/token")
        print("FIGURE tool calls (median of %d):\n  " % args.runs + "\n  ".join(rows))
        story = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story about the sea."}],
                 "max_tokens": 16, "temperature": 1.0, "ignore_eos": True, "cache_prompt": False}
        e0 = _evaluated(c)
        t0 = time.perf_counter()
        c.post("/v1/chat/completions", json={**story, "n": 3})
        t_n = time.perf_counter() - t0
        e1 = _evaluated(c)
        t0 = time.perf_counter()
        for _ in range(3):
            c.post("/v1/chat/completions", json=story)
        t_seq = time.perf_counter() - t0
        e2 = _evaluated(c)
        print(f"FIGURE n choices: n=3 in one request {t_n:.2f} s, {e1 - e0:.0f} prompt tokens evaluated; "
              f"three requests {t_seq:.2f} s, {e2 - e1:.0f} evaluated")
        texts = [f"Sentence number {i} about ships, harbours and the weather at sea." for i in range(8)]
        for batch in (1, 8):
            t0 = time.perf_counter()
            n = 0
            for _ in range(args.runs):
                c.post("/v1/embeddings", json={"model": MODEL, "input": texts[:batch]})
                n += batch
            dt = time.perf_counter() - t0
            print(f"FIGURE embeddings: batches of {batch}: {n / dt:.1f} inputs/s ({dt / args.runs * 1e3:.0f} ms a request)")


if __name__ == "__main__":
    main()
