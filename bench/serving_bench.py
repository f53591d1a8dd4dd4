"""Serving overhead: a 256-token generation streamed over HTTP vs the same generation on ``llama_cpp.Llama``.

    .venv/bin/python bench/serving_bench.py [--runs 5] [--tokens 256] [--model PATH]

Both sides load the embedded model with the same n_ctx, cache type, flash
attention and thread count, greedy sampling from an empty cache, and an
end-of-generation token ignored so that every run is exactly ``--tokens`` long.
Prints the median tokens/s of each, their ratio (target >= 0.97) and the
time-to-first-token overhead of the server (target < 10 ms).

The server runs in a subprocess (``python -m service``), so the two never share
the CPU at the same time: the in-process runs happen first, then the model is
closed and the server started.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Write a long story about a lighthouse keeper and the sea."


def _inprocess(model: str, n_ctx: int, threads: int, tokens: int, runs: int) -> tuple[list[float], list[float]]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=model, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                          n_threads_batch=threads, type_k=8, type_v=8, flash_attn=True, swa_full=False,
                          verbose=False)  # as the service plans it: q8_0 cache, flash attention, swa_full off
    prompt = llm.tokenize(PROMPT.encode(), add_bos=True, special=True)
    rates, ttfts = [], []
    for _ in range(runs + 1):  # the first run warms up
        llm.reset()
        t0 = time.perf_counter()
        first = None
        n = 0
        for tok in llm.generate(prompt, top_k=0, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            llm.detokenize([tok])
            n += 1
            if first is None:
                first = time.perf_counter()
            if n >= tokens:
                break
        t1 = time.perf_counter()
        assert first is not None
        rates.append((n - 1) / (t1 - first))
        ttfts.append(first - t0)
    llm.close()
    return rates[1:], ttfts[1:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _served(model_name: str, models_dir: str, n_ctx: int, threads: int, tokens: int, runs: int) -> tuple[list[float], list[float]]:
    port = _free_port()
    env = {**os.environ, "GGUF_PORT": str(port), "GGUF_DEFAULT_MODEL": "", "GGUF_MODELS_DIR": models_dir,
           "GGUF_N_THREADS": str(threads), "GGUF_LOG_LEVEL": "warning"}
    proc = subprocess.Popen([sys.executable, "-m", "service"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as c:
            for _ in range(300):
                try:
                    if c.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.1)
            r = c.post("/api/models/load", json={"model": model_name, "n_ctx": n_ctx, "cache_type": "q8_0", "flash_attn": "on"})
            r.raise_for_status()
            body = {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": True}
            rates, ttfts = [], []
            for _ in range(runs + 1):
                t0 = time.perf_counter()
                first = None
                n = 0
                with c.stream("POST", "/v1/completions", json=body) as resp:
                    for line in resp.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        ev = json.loads(line[6:])
                        if ev["choices"] and ev["choices"][0]["text"]:
                            if first is None:
                                first = time.perf_counter()
                            n += 1
                t1 = time.perf_counter()
                assert first is not None
                # n text events ~ tokens (a multi-byte character may join two): rate from the usage-free count
                rates.append((tokens - 1) / (t1 - first))
                ttfts.append(first - t0)
        return rates[1:], ttfts[1:]
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--model", default=None, help="a GGUF path (default: the embedded gemma-3-270m)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from service.models import embedded_model_path

    model = args.model or embedded_model_path()
    models_dir = Path(tempfile.mkdtemp(prefix="serving-bench-"))
    link = models_dir / "bench.gguf"
    try:
        os.link(model, link)
    except OSError:
        shutil.copyfile(model, link)

    direct, direct_ttft = _inprocess(model, args.n_ctx, args.threads, args.tokens, args.runs)
    try:
        http, http_ttft = _served("bench", str(models_dir), args.n_ctx, args.threads, args.tokens, args.runs)
    finally:
        shutil.rmtree(models_dir, ignore_errors=True)
    d, h = statistics.median(direct), statistics.median(http)
    dt, ht = statistics.median(direct_ttft), statistics.median(http_ttft)
    print(f"model {model}, {args.tokens} tokens, n_ctx {args.n_ctx}, {args.threads} threads, median of {args.runs} runs")
    print(f"in-process llama_cpp.Llama : {d:8.2f} tokens/s   first token {dt * 1000:7.2f} ms   runs {[round(x, 1) for x in direct]}")
    print(f"HTTP streaming (service)   : {h:8.2f} tokens/s   first token {ht * 1000:7.2f} ms   runs {[round(x, 1) for x in http]}")
    print(f"ratio HTTP / in-process    : {h / d:8.3f}   (target >= 0.97)")
    print(f"time-to-first-token overhead: {(ht - dt) * 1000:7.2f} ms (target < 10 ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
