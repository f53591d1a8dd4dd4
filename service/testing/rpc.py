"""A model run over ggml-rpc workers, for tests and benches: ``python -m service.testing.rpc [--hold] [--tokens N]
[--n-ctx N] [--flash-attn] MODEL [ENDPOINT ...]`` loads MODEL in this process with every layer on the workers' devices (split evenly over them), or
on the host with no endpoint, generates greedily and prints one JSON line: the devices llama.cpp used, the
buffers it allocated per device (its log lines), the text and the decode speed; ``--hold`` keeps the model loaded
after that line until a line arrives on stdin.

A child process of its own: registering a worker that cannot be reached aborts (ggml-rpc's ``GGML_ABORT``), and
ggml-rpc keeps a process's registrations for its life. llama.cpp's extra CPU buffers stay off, as the service's
default on AMX hosts keeps them (``service.engine.cpu``: the AMX kernel crashes this llama.cpp).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from typing import Any, Iterator, Sequence

PROMPT = "The capital of France is"


@contextlib.contextmanager
def worker_process(port: int, *args: str, threads: int = 1, cwd: str | None = None, host: str = "127.0.0.1",
                   prefix: Sequence[str] = ()) -> Iterator[subprocess.Popen[bytes]]:
    """``python -m service worker`` on ``host``:``port`` (``args`` added; ``prefix`` before the command, such as
    ``ip netns exec NS``, which execs it: the process is the worker's), yielded once its ``/status`` answers
    (SystemExit when it exits first or takes over 60 s); killed and reaped on the way out, whatever happened."""
    import httpx

    public = () if host == "127.0.0.1" else ("--allow-public",)
    proc = subprocess.Popen([*prefix, sys.executable, "-m", "service", "worker", "--listen", f"{host}:{port}",
                             "--threads", str(threads), *public, *args], cwd=cwd, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"http://{host}:{port + 1}/status", timeout=2)
                break
            except httpx.TransportError:
                if proc.poll() is not None:
                    raise SystemExit(f"the worker exited with {proc.returncode}: "
                                     f"{proc.stderr.read().decode() if proc.stderr else ''}")
                if time.monotonic() > deadline:
                    raise SystemExit(f"the worker on port {port} did not answer /status within 60 s")
                time.sleep(0.1)
        yield proc
    finally:
        proc.kill()
        proc.wait()


def run(model: str, endpoints: list[str], *, tokens: int = 24, n_ctx: int = 512, flash_attn: bool = False,
        hold: bool = False) -> dict[str, Any]:
    import llama_cpp
    import llama_cpp.llama_cpp as capi

    from ..engine.loglines import LogCollector, parse_allocations
    from ..engine.rpc import rpc_library

    lib = rpc_library()
    if lib is None:
        raise SystemExit("llama-cpp-python was built without ggml-rpc")
    names = [name for e in endpoints for name in lib.add_server(e)]
    defaults = capi.llama_model_default_params

    def no_extra_buffers() -> Any:
        mp = defaults()
        mp.use_extra_bufts = False
        return mp

    capi.llama_model_default_params = no_extra_buffers
    kw: dict[str, Any] = {"n_ctx": n_ctx, "n_threads": 2, "verbose": False, "n_gpu_layers": 0,
                          "flash_attn": flash_attn}
    if names:
        kw.update(n_gpu_layers=999, tensor_split=[1.0] * len(names))
    log = LogCollector()
    m = llama_cpp.Llama(model, **kw)
    allocations, _ = parse_allocations(log.text())
    buffers = {a.device: {"weights": a.weights_bytes, "kv": a.kv_bytes, "compute": a.compute_bytes,
                          "output": a.output_bytes} for a in allocations}
    m.create_completion(PROMPT, max_tokens=1, temperature=0)  # warm: the graphs are built once
    t0 = time.perf_counter()
    out: Any = m.create_completion(PROMPT, max_tokens=tokens, temperature=0, seed=1)
    seconds = time.perf_counter() - t0
    n = int(out["usage"]["completion_tokens"])
    result = {"devices": names, "buffers": buffers, "text": out["choices"][0]["text"], "tokens": n,
              "tokens_per_s": n / seconds}
    if hold:  # the figures now, the model kept loaded until a line comes on stdin (a test reads the workers then)
        print(json.dumps(result), flush=True)
        sys.stdin.readline()
    m.close()  # while the workers still answer: freeing their buffers is a call to them
    return result


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m service.testing.rpc", description=__doc__)
    ap.add_argument("--hold", action="store_true")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--flash-attn", action="store_true",
                    help="flash attention on (llama-cpp-python's default is off; the service's plans turn it on)")
    ap.add_argument("model")
    ap.add_argument("endpoints", nargs="*")
    args = ap.parse_args(argv)
    result = run(args.model, args.endpoints, tokens=args.tokens, n_ctx=args.n_ctx, flash_attn=args.flash_attn,
                 hold=args.hold)
    if not args.hold:
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
