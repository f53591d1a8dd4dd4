"""Conversations beyond the slots (issue 24): the service against llama-server, both on their defaults, in one run.

    python bench/prompt_cache_bench.py [--conversations 12] [--rounds 2] [--history-tokens 1700] [--scenarios ...]

Both load the embedded gemma-3-270m (or ``--model``) on their defaults (4 slots each; llama-server keeps idle
prompts in host RAM, ``--cache-ram`` 8,192 MiB; the service its prompt cache beyond the slots), side by side
(``bench/harness.py``'s ``run_service``, ``bench/llama_server.py``'s ``serve``); each request goes to both, in
alternating order, so neither runs while the other measures.

Scenarios (``--scenarios``, comma-separated):

- ``rotation``: ``--conversations`` chat conversations with distinct ~``--history-tokens``-token histories (a
  system message) take turns: every one asks its first question, then, ``--rounds`` times, each asks its next
  question after all the others spoke. Reported: the median time to first token of those next turns. Target:
  at most 1.0x llama-server's.
- ``cold``: a fresh prompt of that length (a unique first word: nothing cached on either side), ``--cold-runs``
  times. Target: the service's time to first token at most 1.1x llama-server's.
- ``restart`` (the service alone, with ``GGUF_PROMPT_CACHE_DIR`` set to a temporary folder): a conversation's warm
  next turn, then the next turn after the service was restarted, and after the model was unloaded and loaded
  again, against a cold prompt of the same length. Targets: at most 1.5x the warm next turn, at most 0.15x cold.
- ``kill`` (the service alone, with ``GGUF_PROMPT_CACHE_DIR``): each conversation's first turn, then one second
  later SIGKILL to the service and its runner (what the OOM killer or a lost node does: no unload, no eviction),
  then the next turns on a new service, against a cold prompt of the same length. Target: at most 0.15x cold (the
  turns were written behind to the disk while the service was idle, ``service.engine.llama._write_behind``).
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import httpx

from harness import med, request, run_service, service_process
from llama_server import find_or_build, serve
from serving_bench import QUESTIONS, history_text


def _client(url: str) -> httpx.Client:
    # A new connection per request (llama-server closed kept-alive connections between turns; see serving_bench).
    return httpx.Client(base_url=url, timeout=600, limits=httpx.Limits(max_keepalive_connections=0))


class Conversation:
    """A chat with a history of its own; ``turn`` asks the next question and returns the time to first token."""

    def __init__(self, history_tokens: int, reply_tokens: int) -> None:
        self.messages: list[dict[str, str]] = [
            {"role": "system", "content": f"[{uuid.uuid4().hex[:8]}] {history_text(history_tokens)}"}]
        self.reply_tokens = reply_tokens
        self.n = 0

    def turn(self, url: str, model: str | None = None) -> float:
        q = QUESTIONS[self.n % len(QUESTIONS)]
        self.n += 1
        body: dict[str, Any] = {"messages": [*self.messages, {"role": "user", "content": q}], "temperature": 0,
                                "max_tokens": self.reply_tokens, "ignore_eos": True, "stream": True}
        if model:
            body["model"] = model
        with _client(url) as c:
            run = request(c, "/v1/chat/completions", body)
        self.messages += [{"role": "user", "content": q}, {"role": "assistant", "content": run.text}]
        return run.ttft_s

    def copy(self) -> "Conversation":
        other = Conversation.__new__(Conversation)
        other.messages = [dict(m) for m in self.messages]
        other.reply_tokens, other.n = self.reply_tokens, self.n
        return other


def cold(url: str, history_tokens: int) -> float:
    c = Conversation(history_tokens, 1)
    return c.turn(url)


def restart_scenario(model: str, history_tokens: int, reply_tokens: int, runs: int) -> dict[str, list[float]]:
    """The service alone with a disk cache: warm next turns, next turns after a restart and after a reload, cold."""
    out: dict[str, list[float]] = {"warm": [], "restart": [], "reload": [], "cold": []}
    kv = tempfile.mkdtemp(prefix="prompt-cache-bench-")
    convs = [Conversation(history_tokens, reply_tokens) for _ in range(runs)]
    with run_service(model, GGUF_PROMPT_CACHE_DIR=kv) as url:
        for c in convs:
            c.turn(url)
            out["warm"].append(c.turn(url))
            out["cold"].append(cold(url, history_tokens))
    with run_service(model, GGUF_PROMPT_CACHE_DIR=kv) as url:  # a new process: only the disk remembers
        for c in convs:
            out["restart"].append(c.turn(url))
        for c in convs:
            with httpx.Client(base_url=url, timeout=600) as h:
                h.post("/api/models/unload", json={"model": "bench"}).raise_for_status()
                h.post("/api/models/load", json={"model": "bench"}).raise_for_status()
            out["reload"].append(c.turn(url))
    return out


def kill_scenario(model: str, history_tokens: int, reply_tokens: int, runs: int) -> dict[str, list[float]]:
    """The service alone with a disk cache: first turns, SIGKILL one second after the last, next turns and cold
    prompts on a new service."""
    out: dict[str, list[float]] = {"killed": [], "cold": []}
    kv = tempfile.mkdtemp(prefix="prompt-cache-bench-")
    convs = [Conversation(history_tokens, reply_tokens) for _ in range(runs)]
    with service_process(model, GGUF_PROMPT_CACHE_DIR=kv) as (url, proc):
        for c in convs:
            c.turn(url)
        runner = httpx.get(f"{url}/api/models").json()["models"][0]["runner"]["pid"]
        time.sleep(1.0)
        for pid in (proc.pid, runner):
            os.kill(pid, signal.SIGKILL)
        proc.wait()
    with run_service(model, GGUF_PROMPT_CACHE_DIR=kv) as url:  # only the disk remembers
        for c in convs:
            out["killed"].append(c.turn(url))
            out["cold"].append(cold(url, history_tokens))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a GGUF path (default: the embedded gemma-3-270m)")
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2, help="next turns per conversation (rotation)")
    ap.add_argument("--history-tokens", type=int, default=1700)
    ap.add_argument("--reply-tokens", type=int, default=16)
    ap.add_argument("--cold-runs", type=int, default=5)
    ap.add_argument("--restart-runs", type=int, default=3)
    ap.add_argument("--scenarios", default="rotation,cold,restart,kill")
    ap.add_argument("--llama-server", help="a llama-server binary (default: built once into ~/.cache/gguf-bench)")
    ap.add_argument("--service-setting", action="append", default=[], metavar="GGUF_NAME=VALUE")
    args = ap.parse_args()
    from service.catalog.embedded import embedded_model_path

    model = args.model or embedded_model_path()
    scenarios = set(args.scenarios.split(","))
    settings = dict(kv.split("=", 1) for kv in args.service_setting)
    print(f"model {Path(model).name}; service settings {settings or 'defaults'}; load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    acc: dict[str, dict[str, list[float]]] = {"service": {}, "llama-server": {}}
    if scenarios & {"rotation", "cold"}:
        binary = find_or_build(args.llama_server)
        with run_service(model, **settings) as svc_url, serve(binary, model) as ls_url:
            sides = {"service": svc_url, "llama-server": ls_url}
            for url in sides.values():
                cold(url, 64)  # warm-up

            def both(i: int, step: Callable[[str, str], float], key: str) -> None:
                order = list(sides) if i % 2 == 0 else list(reversed(sides))
                for side in order:
                    acc[side].setdefault(key, []).append(step(side, sides[side]))

            if "cold" in scenarios:
                for i in range(args.cold_runs):
                    both(i, lambda side, url: cold(url, args.history_tokens), "cold_ttft_s")
            if "rotation" in scenarios:
                convs = {s: [Conversation(args.history_tokens, args.reply_tokens) for _ in range(args.conversations)]
                         for s in sides}
                for side in sides:  # the same histories on both sides
                    convs[side] = [c.copy() for c in convs["service"]]
                for r in range(args.rounds + 1):
                    for i in range(args.conversations):
                        key = "first_ttft_s" if r == 0 else "next_ttft_s"
                        both(i + r, lambda side, url: convs[side][i].turn(url), key)
                    print(f"  round {r}: service {med(acc['service'].get('next_ttft_s', acc['service']['first_ttft_s'])) * 1000:.0f} ms, "
                          f"llama-server {med(acc['llama-server'].get('next_ttft_s', acc['llama-server']['first_ttft_s'])) * 1000:.0f} ms",
                          flush=True)
    restart = (restart_scenario(model, args.history_tokens, args.reply_tokens, args.restart_runs)
               if "restart" in scenarios else None)
    killed = (kill_scenario(model, args.history_tokens, args.reply_tokens, args.restart_runs)
              if "kill" in scenarios else None)
    s, ls = acc["service"], acc["llama-server"]
    print(f"\nmodel {Path(model).name}, histories of ~{args.history_tokens} tokens, load average "
          f"{os.getloadavg()[0]:.2f} (medians; ms)")
    print(f"{'':52s} {'service':>9s} {'llama-server':>13s} {'ratio':>7s}   target")
    for label, key, target in (
            (f"{args.conversations} conversations on 4 slots: next turn TTFT", "next_ttft_s", "<= 1.0"),
            ("  (their first turns, cold)", "first_ttft_s", ""),
            ("cold prompt TTFT", "cold_ttft_s", "<= 1.1")):
        if key in s and key in ls:
            a, b = med(s[key]) * 1000, med(ls[key]) * 1000
            print(f"{label:52s} {a:9.0f} {b:13.0f} {a / b:7.3f}   {target}")
            print(f"  {'':50s} {' '.join(f'{x * 1000:.0f}' for x in s[key])}  |  "
                  f"{' '.join(f'{x * 1000:.0f}' for x in ls[key])}")
    if restart is not None:
        w, c = med(restart["warm"]) * 1000, med(restart["cold"]) * 1000
        print(f"\nthe service with GGUF_PROMPT_CACHE_DIR: warm next turn {w:.0f} ms, cold {c:.0f} ms")
        for key in ("restart", "reload"):
            x = med(restart[key]) * 1000
            print(f"  next turn after a {key:8s} {x:7.0f} ms = {x / w:5.2f}x warm (target <= 1.5), "
                  f"{x / c:5.3f}x cold (target <= 0.15)   runs: {' '.join(f'{v * 1000:.0f}' for v in restart[key])}")
    if killed is not None:
        k, c = med(killed["killed"]) * 1000, med(killed["cold"]) * 1000
        print(f"\nSIGKILL one second after a turn, then the next turn on a new service: {k:.0f} ms against a cold "
              f"prompt's {c:.0f} ms = {k / c:5.3f}x (target <= 0.15)   runs: "
              f"{' '.join(f'{v * 1000:.0f}' for v in killed['killed'])}  |  "
              f"{' '.join(f'{v * 1000:.0f}' for v in killed['cold'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
