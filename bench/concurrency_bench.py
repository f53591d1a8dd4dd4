"""Throughput under concurrency: 1, 2, 4, 8 streaming clients against three servers of one model.

    (a) single   this service's engine with one slot (``parallel = 1``), requests one after another
                 as the service's runner serialises them;
    (b) batched  the same engine with one slot per client: the clients' sequences decoded together;
    (c) server   llama.cpp's ``llama-server`` built from the same vendored llama.cpp source, over HTTP.

(a) and (b) run in-process through the Engine API; with ``--service-url`` they are driven over HTTP instead
(the OpenAI streaming route), for a running service. ``GGUF_PARALLEL`` gives (b)'s slot count here (default:
the largest client count). All three shapes are set alike (per-slot context, non-unified cache, threads, flash
attention) and every request is evaluated whole (``cache_prompt`` off on every side): this measures decoding
under concurrency, not prompt reuse (``bench/serving_bench.py`` compares both servers on their defaults).
Prints aggregate completion tokens/s and per-request time to first token.

    python bench/concurrency_bench.py [--llama-server PATH] [--clients 1,2,4,8] [--max-tokens 64]

Without ``--llama-server`` it builds one into ``~/.cache/gguf-bench/llama-server`` from the llama.cpp source
vendored in the llama-cpp-python sdist (``bench/llama_server.py``; many minutes on few cores).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

from harness import free_port, request, stop, together, wait_until_answers
from llama_server import CACHE, find_or_build

TOPICS = ("a lighthouse keeper", "a dragon who hates gold", "the first city on Mars", "a lost violin",
          "a robot learning to cook", "two rival bakers", "a storm at sea", "an old library")


@dataclass
class Result:
    completion_tokens: int
    ttft_s: float
    total_s: float


def prompt_for(i: int) -> str:
    return f"Write a long story about {TOPICS[i % len(TOPICS)]}. Once upon a time,"


def engine_client(engine: Any, params: Any, lock: threading.Lock | None) -> Callable[[int], Result]:
    from service.engine.base import Cancel

    def one(i: int) -> Result:
        t0 = time.perf_counter()
        ttft = None
        ctx = lock if lock is not None else _null()
        with ctx:  # the single-sequence service runs one generation at a time (service/residency/fifo.py)
            last = None
            for c in engine.complete(prompt_for(i), params, Cancel()):
                if ttft is None and c.text:
                    ttft = time.perf_counter() - t0
                last = c
        total = time.perf_counter() - t0
        return Result(last.completion_tokens if last else 0, ttft if ttft is not None else total, total)

    return one


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: Any) -> None:
        return None


def http_client(url: str, max_tokens: int, model: str | None) -> Callable[[int], Result]:
    import httpx

    def one(i: int) -> Result:
        body: dict[str, Any] = {"prompt": prompt_for(i), "max_tokens": max_tokens, "temperature": 0.0,
                                "stream": True, "cache_prompt": False}
        if model:
            body["model"] = model
        with httpx.Client(base_url=url, timeout=600) as c:
            run = request(c, "/v1/completions", body)
        return Result(run.tokens, run.ttft_s, run.total_s)

    return one


def report(label: str, n: int, wall: float, res: list[Result], quiet: bool = False) -> dict[str, Any]:
    toks = sum(r.completion_tokens for r in res)
    row = {"mode": label, "clients": n, "tokens": toks, "wall_s": round(wall, 2),
           "tokens_per_s": round(toks / wall, 1),
           "ttft_mean_s": round(statistics.mean(r.ttft_s for r in res), 3),
           "ttft_max_s": round(max(r.ttft_s for r in res), 3), "load_avg": round(os.getloadavg()[0], 2)}
    print("  " if quiet else "", end="")
    print(f"{label:8s} clients={n}  {row['tokens_per_s']:7.1f} tok/s  ({toks} tokens in {wall:.2f} s)  "
          f"TTFT mean {row['ttft_mean_s']:.3f} s max {row['ttft_max_s']:.3f} s  load {row['load_avg']:.2f}", flush=True)
    return row


@contextlib.contextmanager
def llama_server(args: Any, path: str, slots: int) -> Iterator[str]:
    """llama-server on a free port with the same model, slots, context per slot, threads and flash attention."""
    binary = find_or_build(args.llama_server, args.llama_src, args.threads)
    port = free_port()
    cmd = [str(binary), "-m", path, "--host", "127.0.0.1", "--port", str(port), "-c", str(args.ctx_per_slot * slots),
           "-np", str(slots), "-t", str(args.threads), "-tb", str(args.threads), "-fa", args.flash_attn,
           "-ngl", "0", "-b", "512", "-ub", "512", "--no-webui", "-ctxcp", "0", "-cram", "0", "--no-warmup"]
    log = open(CACHE / "llama-server.log", "wb") if CACHE.exists() else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_answers(proc, f"http://127.0.0.1:{port}/health", 120, f"llama-server ({' '.join(cmd)})")
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF file (default: the embedded gemma-3-270m)")
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ctx-per-slot", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--flash-attn", choices=("on", "off"), default="off")
    ap.add_argument("--modes", default="single,batched,server")
    ap.add_argument("--batch-invariant", action="store_true", help="(b) without repacked CPU weights")
    ap.add_argument("--llama-server", help="a llama-server binary (else built into ~/.cache/gguf-bench)")
    ap.add_argument("--llama-src", help="llama.cpp sources to build llama-server from (default: the vendored ones)")
    ap.add_argument("--service-url", help="drive (a)/(b) over HTTP: a running service (GGUF_PARALLEL decides which)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of every mode per client count, interleaved")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()

    from service.catalog.embedded import embedded_model_path
    from service.engine.base import GenerationParams
    from sizing.plan.make import PlanRequest, make_plan
    from sizing.probe import probe_path
    from sizing.probe.devices import host_memory

    path = args.model or embedded_model_path()
    clients = [int(x) for x in args.clients.split(",")]
    slots = int(os.environ.get("GGUF_PARALLEL", "0") or 0) or max(clients)
    modes = args.modes.split(",")
    params = GenerationParams(max_tokens=args.max_tokens, temperature=0.0, cache_prompt=False)
    spec = probe_path(path)

    def plan(n_seq: int) -> Any:
        p = make_plan(spec, [], host_memory(), PlanRequest(n_ctx=args.ctx_per_slot * n_seq, n_seq_max=n_seq,
                                                          cache_type="f16", min_ctx=256, flash_attn=args.flash_attn))
        return replace(p, cfg=replace(p.cfg, flash_attn=args.flash_attn))

    print(f"model {Path(path).name}; {args.max_tokens} tokens per request, greedy; threads {args.threads}; "
          f"flash attention {args.flash_attn}; {slots} slots of {args.ctx_per_slot} tokens; "
          f"{args.rounds} interleaved round(s), median reported; load average {os.getloadavg()[0]:.2f}", flush=True)
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        runners: dict[str, Callable[[int], tuple[float, list[Result]]]] = {}
        if args.service_url:
            svc = f"svc-{os.environ.get('GGUF_PARALLEL', '1')}"
            runners[svc] = lambda n: together(n, http_client(args.service_url, args.max_tokens, None))
            modes = [m for m in modes if m == "server"]
        from service.engine.llama import LlamaEngine
        from service.text.served import ServedModel

        if "single" in modes:
            eng = ServedModel.of(LlamaEngine(n_threads=args.threads))
            eng.load(path, plan(1))
            stack.callback(eng.unload)
            lock = threading.Lock()
            together(1, engine_client(eng, replace(params, max_tokens=8), lock))  # warm-up
            runners["single"] = lambda n: together(n, engine_client(eng, params, lock))
        if "batched" in modes:
            beng = ServedModel.of(LlamaEngine(n_threads=args.threads, batch_invariant=args.batch_invariant))
            beng.load(path, plan(slots))
            stack.callback(beng.unload)
            together(1, engine_client(beng, replace(params, max_tokens=8), None))
            runners["batched"] = lambda n: together(n, engine_client(beng, params, None))
        if "server" in modes:
            url = stack.enter_context(llama_server(args, path, slots))
            together(1, http_client(url, 8, None))
            runners["server"] = lambda n: together(n, http_client(url, args.max_tokens, None))
        # Modes take turns within each round, so a change in the machine's load (other jobs on shared
        # cores) falls on all of them alike instead of on whichever ran last.
        for n in clients:
            runs: dict[str, list[dict[str, Any]]] = {m: [] for m in runners}
            for rnd in range(args.rounds):
                order = list(runners) if rnd % 2 == 0 else list(reversed(runners))
                for mode in order:
                    runs[mode].append(report(mode, n, *runners[mode](n), quiet=args.rounds > 1))
            for mode, got in runs.items():
                row = dict(sorted(got, key=lambda r: r["tokens_per_s"])[len(got) // 2])
                row["rounds_tokens_per_s"] = [r["tokens_per_s"] for r in got]
                rows.append(row)
                if args.rounds > 1:
                    print(f"{mode:8s} clients={n}  {row['tokens_per_s']:7.1f} tok/s median of "
                          f"{row['rounds_tokens_per_s']}  TTFT mean {row['ttft_mean_s']:.3f} s  "
                          f"load {row['load_avg']:.2f}", flush=True)
    by = {(r["mode"], r["clients"]): r["tokens_per_s"] for r in rows}
    for n in clients:
        if ("batched", n) in by and ("server", n) in by:
            print(f"clients={n}: batched / llama-server = {by[('batched', n)] / by[('server', n)]:.2f}x; "
                  f"batched / single = {by[('batched', n)] / by.get(('single', n), float('nan')):.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
