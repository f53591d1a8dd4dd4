"""Serving overhead: a 256-token generation streamed over HTTP vs the same generation on ``llama_cpp.Llama``.

    .venv/bin/python bench/serving_bench.py [--runs 5] [--tokens 256] [--model PATH]

Both sides load the embedded model with the same n_ctx, cache type, flash
attention and thread count, greedy sampling from an empty cache, and an
end-of-generation token ignored so that every run is exactly ``--tokens`` long.
Prints the median tokens/s of each, their ratio (target >= 0.97) and the
time-to-first-token overhead of the server (target < 10 ms).

The server runs in a subprocess (``python -m service``); both sides are loaded
and their runs alternate (order flipped every round), so the two never share the
CPU at the same time and a drifting load slows both alike.
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


class InProcess:
    """The same generation on ``llama_cpp.Llama`` directly, as the service plans it."""

    def __init__(self, model: str, n_ctx: int, threads: int, tokens: int) -> None:
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=model, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                                   n_threads_batch=threads, type_k=8, type_v=8, flash_attn=True, swa_full=False,
                                   verbose=False)  # as the service plans it: q8_0 cache, flash attention, swa_full off
        self.prompt = self.llm.tokenize(PROMPT.encode(), add_bos=True, special=True)
        self.tokens = tokens

    def run(self) -> tuple[float, float]:
        llm = self.llm
        llm.reset()
        t0 = time.perf_counter()
        first = None
        n = 0
        for tok in llm.generate(self.prompt, top_k=0, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            llm.detokenize([tok])
            n += 1
            if first is None:
                first = time.perf_counter()
            if n >= self.tokens:
                break
        t1 = time.perf_counter()
        assert first is not None
        return (n - 1) / (t1 - first), first - t0

    def close(self) -> None:
        self.llm.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    """The service in a subprocess, streaming the same generation over HTTP."""

    def __init__(self, model_name: str, models_dir: str, n_ctx: int, threads: int, tokens: int) -> None:
        port = _free_port()
        env = {**os.environ, "GGUF_PORT": str(port), "GGUF_DEFAULT_MODEL": "", "GGUF_MODELS_DIR": models_dir,
               "GGUF_N_THREADS": str(threads), "GGUF_LOG_LEVEL": "warning"}
        self.proc = subprocess.Popen([sys.executable, "-m", "service"], cwd=ROOT, env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300)
        for _ in range(300):
            try:
                if self.client.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        r = self.client.post("/api/models/load", json={"model": model_name, "n_ctx": n_ctx, "cache_type": "q8_0",
                                                       "flash_attn": "on"})
        r.raise_for_status()
        self.body = {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": True}
        self.tokens = tokens

    def run(self) -> tuple[float, float]:
        t0 = time.perf_counter()
        first = None
        with self.client.stream("POST", "/v1/completions", json=self.body) as resp:
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if ev["choices"] and ev["choices"][0]["text"] and first is None:
                    first = time.perf_counter()
        t1 = time.perf_counter()
        assert first is not None
        # every run is exactly ``tokens`` long (ignore_eos): the rate over the tokens after the first
        return (self.tokens - 1) / (t1 - first), first - t0

    def close(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(30)


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

    # Both loaded, runs interleaved (the idle side uses no CPU), so that a machine whose load drifts
    # during the benchmark slows both alike; the first run of each warms up.
    direct_side = InProcess(model, args.n_ctx, args.threads, args.tokens)
    served_side = Served("bench", str(models_dir), args.n_ctx, args.threads, args.tokens)
    direct: list[float] = []
    direct_ttft: list[float] = []
    http: list[float] = []
    http_ttft: list[float] = []
    try:
        for i in range(args.runs + 1):
            order = [(direct_side, direct, direct_ttft), (served_side, http, http_ttft)]
            if i % 2:
                order.reverse()
            for side, rates, ttfts in order:
                rate, ttft = side.run()
                if i:
                    rates.append(rate)
                    ttfts.append(ttft)
    finally:
        served_side.close()
        direct_side.close()
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
