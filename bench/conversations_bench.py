"""Many conversations on few slots (issue 55): the service against llama-server, both on their defaults, in one run.

    python bench/conversations_bench.py [--conversations 12] [--rounds 2] [--history-tokens 1700] [--load [N]] [--runs 1]

``--conversations`` chat conversations, each with a ~``--history-tokens``-token history of its own (a system
message behind a word of its own), take turns on 4 slots: every one asks its first question, then, ``--rounds``
times, each asks its next question after all the others spoke. The client sends back an assistant turn it wrote
itself (``--assistant``, "It is a word."), not the text the model generated, as clients that edit, trim or
summarise the history do: the cached tokens (prompt and generated text) are then not a prefix of the next prompt,
only their common prefix is, which the cache must trim to.

Both load the embedded gemma-3-270m (or ``--model``), a sliding-window model, on their defaults: the service as
``make run`` starts it (``bench/harness.py``), llama-server as ``llama-server -m MODEL`` (``bench/llama_server.py``:
4 slots, ``--cache-ram`` 8,192 MiB, context checkpoints). Each turn goes to both, in alternating order, so neither
runs while the other measures and a drifting load falls on both alike.

Reported: the median time to first token of the next turns on each side and their ratio (target: at most 1.0),
each side's warm next turns (those whose reply says most of the prompt came from a cache:
``usage.prompt_tokens_details.cached_tokens`` at least half the prompt), and the service's prompt-cache lookups
from ``/metrics`` (``gguf_prompt_cache_lookups_total``, by result) over the next turns. Target: every next turn
warm (lookup hits = next turns).

``--load N``: N processes spinning on the CPU for the whole run beside both servers (a second process loading the
cores: a store or a restore that depended on timing shows here). ``--runs N``: the whole run N times, each on
new servers and new conversations, then one line per run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import httpx

from harness import med, run_service
from llama_server import find_or_build, serve
from serving_bench import QUESTIONS, history_text

ASSISTANT = "It is a word."


@dataclass
class Turn:
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int

    @property
    def warm(self) -> bool:
        return self.prompt_tokens > 0 and 2 * self.cached_tokens >= self.prompt_tokens


def turn(url: str, messages: list[dict[str, str]], reply_tokens: int) -> Turn:
    """One streamed chat turn: the time to its first content, and its usage (prompt and cached tokens)."""
    body = {"messages": messages, "temperature": 0, "max_tokens": reply_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = None
    prompt = cached = 0
    # A new connection per request (llama-server closed kept-alive connections between turns; see serving_bench).
    with httpx.Client(base_url=url, timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                usage = ev.get("usage")
                if usage:
                    prompt = int(usage.get("prompt_tokens", 0))
                    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
                if first is None and any((ch.get("delta") or {}).get("content") for ch in ev.get("choices") or ()):
                    first = time.perf_counter()
    return Turn((first or time.perf_counter()) - t0, prompt, cached)


@dataclass
class Conversation:
    history_tokens: int
    assistant: str
    messages: list[dict[str, str]] = field(default_factory=list)
    n: int = 0

    def __post_init__(self) -> None:
        if not self.messages:  # a new conversation (a copy keeps its history: the same on both sides)
            self.messages = [{"role": "system",
                              "content": f"[{uuid.uuid4().hex[:8]}] {history_text(self.history_tokens)}"}]

    def ask(self) -> list[dict[str, str]]:
        """The next turn's messages (the conversation so far and the next question)."""
        return [*self.messages, {"role": "user", "content": QUESTIONS[self.n % len(QUESTIONS)]}]

    def answered(self, asked: list[dict[str, str]]) -> None:
        """The turn is over: the client keeps its own assistant text, whatever the model said."""
        self.messages = [*asked, {"role": "assistant", "content": self.assistant}]
        self.n += 1


LOOKUP = re.compile(r'^gguf_prompt_cache_lookups_total\{[^}]*result="(\w+)"[^}]*\}\s+([0-9.e+]+)', re.M)


def lookups(url: str) -> dict[str, int]:
    """The service's prompt-cache lookups so far, by result (``/metrics``)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out: dict[str, int] = {}
    for result, value in LOOKUP.findall(text):
        out[result] = out.get(result, 0) + int(float(value))
    return out


def _spin(stop: Any) -> None:
    while not stop.is_set():
        for _ in range(100_000):
            pass


@contextlib.contextmanager
def cpu_load(n: int) -> Iterator[None]:
    """``n`` processes spinning on the CPU until the block ends."""
    if n <= 0:
        yield
        return
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    procs = [ctx.Process(target=_spin, args=(stop,), daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        stop.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


@dataclass
class Result:
    next_ms: dict[str, float]
    warm: dict[str, int]
    lookups: dict[str, int]
    n_next: int


def run(model: str, args: argparse.Namespace, settings: dict[str, str], wanted: list[str]) -> Result:
    """One run: both servers started, the conversations' turns interleaved, the servers stopped."""
    with contextlib.ExitStack() as stack:
        sides: dict[str, str] = {}
        if "service" in wanted:
            sides["service"] = stack.enter_context(run_service(model, **settings))
        if "llama-server" in wanted:
            sides["llama-server"] = stack.enter_context(serve(find_or_build(args.llama_server), model))
        for url in sides.values():  # warm-up: a short prompt of no conversation's
            turn(url, [{"role": "user", "content": "Hello."}], 1)
        stack.enter_context(cpu_load(args.load))
        base = [Conversation(args.history_tokens, args.assistant) for _ in range(args.conversations)]
        convs = {s: [Conversation(c.history_tokens, c.assistant, [dict(m) for m in c.messages]) for c in base]
                 for s in sides}
        got: dict[str, dict[str, list[Turn]]] = {s: {"first": [], "next": []} for s in sides}
        before: dict[str, int] = {}
        for r in range(args.rounds + 1):
            if r == 1 and "service" in sides:
                before = lookups(sides["service"])
            for i in range(args.conversations):
                order = list(sides) if (i + r) % 2 == 0 else list(reversed(sides))
                for side in order:
                    conv = convs[side][i]
                    asked = conv.ask()
                    got[side]["first" if r == 0 else "next"].append(turn(sides[side], asked, args.reply_tokens))
                    conv.answered(asked)
            print(f"  round {r}: " + ", ".join(
                f"{s} {med([t.ttft_s for t in got[s]['next' if r else 'first']]) * 1000:.0f} ms, "
                f"{sum(t.warm for t in got[s]['next' if r else 'first'])} warm" for s in sides), flush=True)
        after = lookups(sides["service"]) if "service" in sides else {}
    n_next = args.conversations * args.rounds
    print(f"\n{args.conversations} conversations x {args.rounds} next turns (medians, ms; load average "
          f"{os.getloadavg()[0]:.2f}, CPU load {args.load})")
    print(f"{'':30s} {'first (cold)':>13s} {'next turn':>10s} {'warm next':>10s}")
    for s in sides:
        first, nxt = got[s]["first"], got[s]["next"]
        print(f"{s:30s} {med([t.ttft_s for t in first]) * 1000:13.0f} {med([t.ttft_s for t in nxt]) * 1000:10.0f} "
              f"{sum(t.warm for t in nxt):5d}/{n_next}")
        print(f"  next turns: {' '.join(f'{t.ttft_s * 1000:.0f}' for t in nxt)}")
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in sorted(set(after) | set(before))}
    if "service" in sides:
        print(f"service prompt-cache lookups over the next turns: {delta or 'none counted'} "
              f"(target: hit = {n_next})")
    next_ms = {s: med([t.ttft_s for t in got[s]["next"]]) * 1000 for s in sides}
    if len(sides) == 2:
        print(f"next-turn TTFT ratio service / llama-server: "
              f"{next_ms['service'] / next_ms['llama-server']:.3f} (target <= 1.0)")
    return Result(next_ms, {s: sum(t.warm for t in got[s]["next"]) for s in sides}, delta, n_next)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a GGUF path (default: the embedded gemma-3-270m)")
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2, help="next turns per conversation")
    ap.add_argument("--history-tokens", type=int, default=1700)
    ap.add_argument("--reply-tokens", type=int, default=16)
    ap.add_argument("--assistant", default=ASSISTANT, help="the assistant turn the client sends back")
    ap.add_argument("--load", type=int, nargs="?", const=1, default=0, metavar="N",
                    help="N processes spinning on the CPU during the run (default with the flag: 1)")
    ap.add_argument("--runs", type=int, default=1, help="the whole run this many times (new servers each)")
    ap.add_argument("--sides", default="service,llama-server", help="comma-separated: service, llama-server")
    ap.add_argument("--llama-server", help="a llama-server binary (default: built once into ~/.cache/gguf-bench)")
    ap.add_argument("--service-setting", action="append", default=[], metavar="GGUF_NAME=VALUE")
    args = ap.parse_args()
    from service.catalog.embedded import embedded_model_path

    model = args.model or embedded_model_path()
    settings = dict(kv.split("=", 1) for kv in args.service_setting)
    wanted = args.sides.split(",")
    print(f"model {Path(model).name}; {args.conversations} conversations of ~{args.history_tokens} tokens on 4 slots, "
          f"client-written assistant turns; service settings {settings or 'defaults'}; CPU load {args.load} "
          f"process(es); load average {os.getloadavg()[0]:.2f}", flush=True)
    results = []
    for i in range(args.runs):
        if args.runs > 1:
            print(f"\nrun {i + 1} of {args.runs}", flush=True)
        results.append(run(model, args, settings, wanted))
    if args.runs > 1:
        print(f"\n{args.runs} runs, CPU load {args.load} (next-turn median TTFT, ms; warm next turns; service lookups)")
        for i, res in enumerate(results, 1):
            ratio = (f"  ratio {res.next_ms['service'] / res.next_ms['llama-server']:.3f}"
                     if len(res.next_ms) == 2 else "")
            print(f"  run {i}: " + ", ".join(f"{s} {ms:.0f} ms {res.warm[s]}/{res.n_next} warm"
                                             for s, ms in res.next_ms.items())
                  + f"{ratio}  lookups {res.lookups}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
