"""The service against llama-server, both on their defaults, side by side in one run.

    python bench/serving_bench.py [--rounds 3] [--tokens 128] [--llama-server PATH] [--scenarios ...]

Both load the embedded gemma-3-270m (or ``--model``): the service as ``make run`` starts it (``python -m
service``, nothing set but the port and a models directory holding the file), llama-server as ``llama-server
-m MODEL`` (its defaults: 4 slots, unified KV, prompt cache, threads = physical cores), built once from the
llama.cpp that llama-cpp-python vendors (``bench/llama_server.py``). Both are loaded the whole time and take
turns (order reversed every round), so neither runs while the other measures and a drifting machine load
falls on both alike. Figures are medians over the rounds.

Scenarios (``--scenarios``, comma-separated):

- ``one``: one client, ``--tokens`` greedy tokens (``ignore_eos``), a fresh prompt every run (a unique first
  word: no cached prefix on either side): tokens/s streamed (after the first token) and not streamed (the
  whole request), and the time to first token. Targets: tokens/s >= 0.95x llama-server's; TTFT overhead < 10 ms.
  With ``--in-process`` a third side runs the same generation on the service's engine in this process (the
  plan of ``make run``'s defaults, no HTTP): what the HTTP layer, the runner and the event loop add.
- ``four``: four concurrent streaming clients, fresh prompts: aggregate tokens/s (all tokens / wall time) against
  llama-server's and against one client's (the same measure with one client). Targets: >= 0.9x llama-server's,
  >= 1.32x one client's.
- ``turns``: a multi-turn chat (``/v1/chat/completions``; ``--turns-route completions`` for raw text) whose
  history is about ``--history-tokens`` tokens: the time to first token of the next turns against a cold prompt
  of the same length (a fresh first word) and against llama-server's next turns. Targets: <= 0.15x cold,
  <= 1.5x llama-server's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx

from harness import Run, med, request, run_service, together
from llama_server import find_or_build, serve

PROMPT = "Write a long story about a lighthouse keeper and the sea."
SENTENCES = (
    "The keeper climbed the stairs at dusk and lit the lamp.",
    "Ships passed far out on the grey water, their lights small and steady.",
    "He wrote the wind, the swell and the names of the boats in his log.",
    "In winter the storms came from the north and the windows rattled all night.",
    "His daughter brought bread and news from the village every Sunday.",
    "Once a fishing boat ran onto the rocks and he rowed out to fetch the crew.",
)
QUESTIONS = ("What did the keeper do at dusk?", "Who visited him?", "What happened in winter?",
             "Tell me about the rescue.", "What did he write in the log?")


def tag() -> str:
    """A word no earlier prompt began with."""
    return uuid.uuid4().hex[:8]


def fresh(text: str, word: str | None = None) -> str:
    """``text`` behind a word no earlier prompt began with (``word``, else a new one): no cached prefix to reuse,
    on either side. Sides compared in one round take the same word: greedy decoding then writes the same text on
    both, and an n-gram drafter accepts as much on each (a new word per side would make the drafts' luck part of
    the comparison: several percent on the embedded model)."""
    return f"[{word or tag()}] {text}"


def one_client(url: str, tokens: int, stream: bool, word: str | None = None) -> Run:
    body = {"prompt": fresh(PROMPT, word), "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    with httpx.Client(base_url=url, timeout=600) as c:
        return request(c, "/v1/completions", body)


def clients(url: str, n: int, tokens: int, words: list[str] | None = None) -> tuple[float, list[Run]]:
    """``n`` concurrent streaming clients with fresh prompts (client ``i`` behind ``words[i]`` when given): the wall
    time and each run."""
    def one(i: int) -> Run:
        body = {"prompt": fresh(PROMPT, words[i] if words else None), "max_tokens": tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=url, timeout=600) as c:
            return request(c, "/v1/completions", body)

    return together(n, one)


class InProcess:
    """The service's engine in this process, loaded with the plan the service makes on its defaults."""

    def __init__(self, model: str) -> None:
        from service.engine.llama import LlamaEngine
        from service.planning.planner import LoadOptions, plan_request
        from service.settings import Settings
        from service.text.served import ServedModel
        from sizing.plan.make import make_plan
        from sizing.probe import probe_path
        from sizing.probe.devices import host_memory

        settings = Settings()
        plan = make_plan(probe_path(model), [], host_memory(), plan_request(settings, LoadOptions()))
        self.engine = ServedModel.of(LlamaEngine(cache_prompt=settings.cache_prompt))
        self.engine.load(model, plan)

    def one_client(self, tokens: int) -> Run:
        from service.engine.base import Cancel, GenerationParams

        params = GenerationParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        first = None
        last = None
        for c in self.engine.complete(fresh(PROMPT), params, Cancel()):
            if c.text and first is None:
                first = time.perf_counter()
            last = c
        t1 = time.perf_counter()
        return Run(last.completion_tokens if last else 0, (first or t1) - t0, t1 - t0)

    def close(self) -> None:
        self.engine.unload()


def history_text(n_tokens: int) -> str:
    """About ``n_tokens`` tokens of a story (about 14 tokens a sentence)."""
    return " ".join(SENTENCES[i % len(SENTENCES)] for i in range(max(1, n_tokens // 14)))


@dataclass
class Turns:
    next_ttft_s: list[float] = field(default_factory=list)
    cold_ttft_s: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)


def conversation(url: str, route: str, history_tokens: int, turns: int, reply_tokens: int) -> Turns:
    """A conversation: a ~``history_tokens`` history, then ``turns`` questions, each answered in ``reply_tokens``;
    every next turn's TTFT, and a cold prompt of the same length's (the same text behind a fresh word)."""
    out = Turns()
    history = fresh(history_text(history_tokens))
    messages: list[dict[str, str]] = [{"role": "system", "content": history}]
    text = history
    # A new connection per request, on both sides: llama-server (cpp-httplib) closed a kept-alive connection
    # between turns, and a request sent on it got "Server disconnected without sending a response".
    with httpx.Client(base_url=url, timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as c:
        for i in range(turns + 1):
            q = QUESTIONS[i % len(QUESTIONS)]
            body: dict[str, Any] = {"max_tokens": reply_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
            if route == "chat":
                messages.append({"role": "user", "content": q})
                body["messages"] = messages
            else:
                text += f"\nUser: {q}\nAssistant:"
                body["prompt"] = text
            turn = request(c, f"/v1/{'chat/completions' if route == 'chat' else 'completions'}", body)
            reply = turn.text
            if i:  # turn 0 is the history's cold start
                out.next_ttft_s.append(turn.ttft_s)
            if route == "chat":
                messages.append({"role": "assistant", "content": reply})
            else:
                text += reply
        # The last turn's prompt, cold: the same messages (up to the user's question, without the reply that
        # followed) behind a fresh word.
        body = {"max_tokens": 1, "temperature": 0, "stream": True}
        if route == "chat":
            cold_messages = [dict(m) for m in messages[:-1]]
            cold_messages[0]["content"] = fresh(cold_messages[0]["content"])
            body["messages"] = cold_messages
            out.cold_ttft_s.append(request(c, "/v1/chat/completions", body).ttft_s)
        else:
            body["prompt"] = fresh(text[:len(text) - len(reply)])
            out.cold_ttft_s.append(request(c, "/v1/completions", body).ttft_s)
        usage_body = dict(body, stream=False)
        r = c.post("/v1/chat/completions" if route == "chat" else "/v1/completions", json=usage_body)
        out.prompt_tokens.append(int(r.json()["usage"]["prompt_tokens"]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a GGUF path (default: the embedded gemma-3-270m)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128, help="tokens per request (one and four clients)")
    ap.add_argument("--scenarios", default="one,four,turns")
    ap.add_argument("--history-tokens", type=int, default=1500)
    ap.add_argument("--turns", type=int, default=3, help="next turns per conversation")
    ap.add_argument("--reply-tokens", type=int, default=32)
    ap.add_argument("--turns-route", choices=("chat", "completions"), default="chat")
    ap.add_argument("--llama-server", help="a llama-server binary (default: built once into ~/.cache/gguf-bench)")
    ap.add_argument("--llama-server-args", default="", help="extra llama-server arguments (default: none)")
    ap.add_argument("--service-setting", action="append", default=[], metavar="GGUF_NAME=VALUE",
                    help="a setting for the service (default: none; e.g. GGUF_CACHE_TYPE=f16, llama-server's cache type)")
    ap.add_argument("--versus", action="append", default=[], metavar="GGUF_NAME=VALUE",
                    help="compare the service with itself under these settings instead of llama-server (the second "
                    "side, 'versus'; repeat for several): a default's cost, paired and interleaved in one run")
    ap.add_argument("--in-process", action="store_true", help="also run 'one' on the engine in this process")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    from service.catalog.embedded import embedded_model_path

    model = args.model or embedded_model_path()
    scenarios = set(args.scenarios.split(","))
    versus = dict(kv.split("=", 1) for kv in args.versus)
    other = "versus" if versus else "llama-server"
    figures: dict[str, dict[str, Any]] = {"service": {}, other: {}}
    engine = InProcess(model) if args.in_process and "one" in scenarios else None
    settings = dict(kv.split("=", 1) for kv in args.service_setting)
    print(f"model {Path(model).name}; {args.rounds} rounds; service settings {settings or 'defaults'}"
          + (f"; versus the service with {versus}" if versus else "") + f"; load average {os.getloadavg()[0]:.2f}",
          flush=True)
    second = (run_service(model, **{**settings, **versus}) if versus
              else serve(find_or_build(args.llama_server), model, *args.llama_server_args.split()))
    with run_service(model, **settings) as svc_url, second as ls_url:
        sides = {"service": svc_url, other: ls_url}
        for url in sides.values():  # warm-up
            one_client(url, 8, True)
        acc: dict[str, dict[str, list[float]]] = {s: {} for s in sides}

        def add(side: str, key: str, value: float) -> None:
            acc[side].setdefault(key, []).append(value)

        for rnd in range(args.rounds):
            order = list(sides) if rnd % 2 == 0 else list(reversed(sides))
            word, plain_word, words = tag(), tag(), [tag() for _ in range(4)]  # the same prompts on both sides
            if engine is not None:
                e = engine.one_client(args.tokens)
                acc.setdefault("engine", {}).setdefault("one_stream_tok_s", []).append(e.decode_tokens_per_s)
                acc["engine"].setdefault("one_ttft_ms", []).append(e.ttft_s * 1000)
                print(f"  round {rnd + 1} {'engine':12s} one_stream_tok_s {e.decode_tokens_per_s:.1f}  "
                      f"one_ttft_ms {e.ttft_s * 1000:.1f}", flush=True)
            for side in order:
                url = sides[side]
                if "one" in scenarios or "four" in scenarios:
                    s = one_client(url, args.tokens, True, word)
                    add(side, "one_stream_tok_s", s.decode_tokens_per_s)
                    add(side, "one_ttft_ms", s.ttft_s * 1000)
                    add(side, "one_stream_total_tok_s", s.tokens_per_s)
                    if "one" in scenarios:
                        add(side, "one_plain_tok_s", one_client(url, args.tokens, False, plain_word).tokens_per_s)
                if "four" in scenarios:
                    wall, runs = clients(url, 4, args.tokens, words)
                    add(side, "four_tok_s", sum(r.tokens for r in runs) / wall)
                    add(side, "four_ttft_ms", statistics.mean(r.ttft_s for r in runs) * 1000)
                if "turns" in scenarios:
                    t = conversation(url, args.turns_route, args.history_tokens, args.turns, args.reply_tokens)
                    add(side, "turn_next_ttft_ms", med(t.next_ttft_s) * 1000)
                    add(side, "turn_cold_ttft_ms", med(t.cold_ttft_s) * 1000)
                    add(side, "turn_prompt_tokens", float(t.prompt_tokens[0]))
                print(f"  round {rnd + 1} {side:12s} " + "  ".join(f"{k} {v[-1]:.1f}" for k, v in acc[side].items()),
                      flush=True)
    if engine is not None:
        engine.close()
    for side in acc:
        figures[side] = {k: round(med(v), 2) for k, v in acc[side].items()}
        figures[side]["rounds"] = {k: [round(x, 1) for x in v] for k, v in acc[side].items()}
    s, ls = figures["service"], figures[other]

    def row(label: str, key: str, target: str = "", ratio: Callable[[float, float], float] = lambda a, b: a / b) -> None:
        if key in s and key in ls:
            print(f"{label:42s} {s[key]:10.1f} {ls[key]:14.1f} {ratio(s[key], ls[key]):8.3f}   {target}")

    print(f"\nmodel {Path(model).name}, {args.tokens} tokens per request, medians of {args.rounds} rounds, "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"{'':42s} {'service':>10s} {other:>14s} {'ratio':>8s}   " + ("" if versus else "target"))
    row("one client, streamed tokens/s", "one_stream_tok_s", ">= 0.95")
    row("one client, not streamed tokens/s", "one_plain_tok_s", ">= 0.95")
    row("one client, time to first token ms", "one_ttft_ms", "overhead < 10 ms (difference)",
        ratio=lambda a, b: a - b)
    if "engine" in figures:
        e = figures["engine"]
        print(f"  in-process engine (no HTTP): {e['one_stream_tok_s']:.1f} tokens/s, first token "
              f"{e['one_ttft_ms']:.1f} ms; service / engine = {s['one_stream_tok_s'] / e['one_stream_tok_s']:.3f}, "
              f"TTFT +{s['one_ttft_ms'] - e['one_ttft_ms']:.1f} ms")
    row("four clients, aggregate tokens/s", "four_tok_s", ">= 0.9")
    for side, f in (("service", s), (other, ls)):
        if "four_tok_s" in f and "one_stream_total_tok_s" in f:
            print(f"  {side}: four clients / one client = {f['four_tok_s'] / f['one_stream_total_tok_s']:.3f}"
                  + ("   (target >= 1.32)" if side == "service" else ""))
    row("next turn, time to first token ms", "turn_next_ttft_ms", "<= 1.5")
    row("cold prompt of that length, TTFT ms", "turn_cold_ttft_ms")
    for side, f in (("service", s), (other, ls)):
        if "turn_next_ttft_ms" in f:
            print(f"  {side}: next turn / cold = {f['turn_next_ttft_ms'] / f['turn_cold_ttft_ms']:.3f} "
                  f"({f['turn_prompt_tokens']:.0f} prompt tokens)" + ("   (target <= 0.15)" if side == "service" else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
