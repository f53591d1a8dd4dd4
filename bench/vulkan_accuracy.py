"""Predicted against allocated on Vulkan cards, per device and part: the table of issue 56's closing note.

    make vulkan && .venv-vulkan/bin/python bench/vulkan_accuracy.py [--models gemma,smollm2] [--scenarios ...]
                                                                    [--n-ctx 512] [--no-generate]

Needs the Vulkan build (``make vulkan``) and a Vulkan device: with no GPU, Mesa's lavapipe (``GGML_VK_VISIBLE_DEVICES=0``
for one device, ``0,0`` for two: the scenarios set it). For each scenario the service runs as ``make run-vulkan``
runs it (its own models directory with the embedded gemma-3-270m and SmolLM2-135M-Instruct), loads each model with
each cache type and flash attention setting through ``POST /api/models/load`` (the service's plan: calibrated by
llama.cpp's dry run with the Vulkan backend, confirmed, loaded), and prints per device what the plan predicted
and what llama.cpp allocated, part by part (``service.testing.vulkan.rows_of``); then, unless ``--no-generate``,
evaluates a prompt of ``--prompt-tokens`` (128; ``n_ctx - 8`` fills the context, where the scratch is largest) and
reads ggml-vulkan's scratch buffers from ``GGML_VK_MEMORY_LOGGER=1``'s lines against the plan's bound
(``gpu_pool_mib``; ``sizing.memory.gpu.vulkan_scratch``).

Scenarios: ``one`` (Vulkan0, every layer), ``one-partial`` (Vulkan0 planned on 10 % of its heap: layers on the
host), ``two`` (Vulkan0 and Vulkan1, the layers split), ``two-partial`` (split, and layers on the host). A quantized
V cache with flash attention off is refused by llama.cpp (and a quantized K by this service), so the cache and
flash-attention pairs are f16/on, f16/off and q8_0/on.

lavapipe is slow: a prompt of 128 tokens takes half a minute to several minutes on 2 busy cores (its first graphs
compile their pipelines, cached by Mesa for the next runs), so the whole table takes an hour or more;
``--no-generate`` leaves the scratch out (3 minutes).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import httpx

from harness import ROOT, free_port, stop, wait_until_answers
from service.catalog.embedded import embedded_model_path, instruct_model_path
from service.testing.vulkan import MODELS, PAIRS, SCENARIOS, Row, rows_of, scenario_env, scratch_of

def service_env(models: Path, port: int, n_ctx: int, settings: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GGUF_", "GGML_VK_"))}
    env.update(GGUF_PORT=str(port), GGUF_MODELS_DIR=str(models), GGUF_LOG_LEVEL="warning",
               GGUF_DEFAULT_MODEL=MODELS["smollm2"], GGUF_CONTEXT_LENGTH=str(n_ctx), GGUF_MIN_CONTEXT=str(n_ctx),
               GGUF_PARALLEL="1", GGUF_EMBEDDINGS="off", GGUF_SPECULATIVE="off", GGUF_RUNNER_STALL_S="0",
               GGUF_MTP="off", GGML_VK_MEMORY_LOGGER="1")
    env.update(settings)
    return env


@contextlib.contextmanager
def vulkan_service(n_ctx: int, settings: dict[str, str]) -> Iterator[tuple[str, Path]]:
    """The service over the scenario's Vulkan devices, both embedded models in its models directory; yields its URL
    and its log (the runners' stderr: the memory logger's lines)."""
    models = Path(tempfile.mkdtemp(prefix="bench-vulkan-"))
    for src, name in ((embedded_model_path(), MODELS["gemma"]), (instruct_model_path(), MODELS["smollm2"])):
        dst = models / f"{name}.gguf"
        try:
            os.link(src, dst)
        except OSError:
            shutil.copyfile(src, dst)
    port = free_port()
    log_path = models / "service.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "service"], cwd=ROOT, env=service_env(models, port, n_ctx, settings),
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_answers(proc, f"{url}/health", 120, f"the service (log: {log_path})")
        yield url, log_path
    finally:
        stop(proc)
        log.close()
        shutil.rmtree(models, ignore_errors=True)


def fill_prompt(c: httpx.Client, model: str, n_tokens: int) -> str:
    """A text of at most ``n_tokens`` tokens of ``model`` (close to it)."""
    unit = " the sea"
    n = len(c.post("/tokenize", json={"model": model, "content": unit * 100}).json()["tokens"])
    text = unit * max(1, (n_tokens * 100) // max(n, 1))
    while len(c.post("/tokenize", json={"model": model, "content": text}).json()["tokens"]) > n_tokens:
        text = text[: -len(unit)]
    return text


def model_entry(c: httpx.Client, name: str) -> dict[str, Any]:
    return {m["name"]: m for m in c.get("/api/models").json()["models"]}[name]  # type: ignore[no-any-return]


def run(model: str, cache: str, fa: str, url: str, log_path: Path, body: dict[str, Any], prompt_tokens: int
        ) -> tuple[dict[str, Any], list[Row], float]:
    """Load ``model`` with this cache and flash attention (unloading the one before), and its rows."""
    with httpx.Client(base_url=url, timeout=900) as c:
        c.post("/api/models/unload", json={"force": True})
        start = log_path.stat().st_size
        t = time.perf_counter()
        r = c.post("/api/models/load", json={"model": model, "cache_type": cache, "flash_attn": fa, **body})
        if r.status_code != 200:
            raise SystemExit(f"load of {model} {cache}/{fa} {body}: {r.status_code} {r.text[:2000]}")
        m = model_entry(c, model)
        scratch = None
        if prompt_tokens > 0:
            prompt = fill_prompt(c, model, prompt_tokens)
            g = c.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0})
            if g.status_code != 200:
                raise SystemExit(f"completion: {g.status_code} {g.text[:2000]}")
            with open(log_path, "rb") as f:
                f.seek(start)
                scratch = scratch_of(f.read().decode("utf-8", "replace").splitlines())
        return m, rows_of(m, scratch), time.perf_counter() - t


def markdown(collected: list[tuple[str, str, str, str, list[Row]]]) -> str:
    """A line per device of each load: each part predicted / allocated in MiB (``=``: within 0.01 MiB; a scratch
    buffer: allocated / its bound)."""
    out = ["| arrangement | model | cache/FA | verdict | device | weights | KV | compute | output | scratch (alloc/bound) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for sname, key, pair, verdict, rows in collected:
        by: dict[str, dict[str, Row]] = {}
        for r in rows:
            by.setdefault(r.device, {})[r.part] = r
        for dev, parts in by.items():
            def cell(part: str) -> str:
                r = parts.get(part)
                if r is None:
                    return "-"
                if r.bound:
                    return f"{r.allocated_mib:.2f} / {r.predicted_mib:.2f}"
                if r.status == "exact":
                    return f"{r.allocated_mib:.2f} =" if r.allocated_mib else "0"
                return f"{r.predicted_mib:.2f} / {r.allocated_mib:.2f} ({r.status})"
            out.append(f"| {sname} | {key} | {pair} | {verdict} | {dev} | {cell('weights')} | {cell('kv')} | "
                       f"{cell('compute')} | {cell('output')} | {cell('scratch')} |")
    return "\n".join(out)


def describe(m: dict[str, Any]) -> str:
    chosen = m["plan"]["chosen"]
    devs = {d["device"]: d for d in m["plan"]["estimate"]["devices"]}
    layers = ", ".join(f"{d} {len(v.get('layers', []))}" for d, v in devs.items() if v.get("layers"))
    return (f"{m['plan']['verdict']}, n_ctx {chosen['n_ctx']}, n_gpu_layers {chosen['n_gpu_layers']}, layers: "
            f"{layers}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--models", default="gemma,smollm2")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--no-generate", action="store_true", help="loads only: no scratch rows")
    ap.add_argument("--markdown", action="store_true", help="then the table in short: a line per device, each part "
                    "predicted / allocated (MiB)")
    ap.add_argument("--prompt-tokens", type=int, default=128,
                    help="the prompt evaluated for the scratch rows (n_ctx - 8 fills the context: the largest scratch)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the services stopped on the way out
    total = bad = 0
    print(f"{'scenario':<12} {'model':<8} {'cache/fa':<9} {'device':<10} {'part':<8} {'predicted':>10} {'allocated':>10}"
          f" {'error':>7}  status")
    runs = [(sname, key, cache, fa) for sname in args.scenarios.split(",") for key in args.models.split(",")
            for cache, fa in PAIRS]
    collected: list[tuple[str, str, str, str, list[Row]]] = []
    with contextlib.ExitStack() as stack:
        current: dict[str, str] | None = None
        for sname, key, cache, fa in runs:
            scenario = SCENARIOS[sname]
            settings = scenario_env(scenario, key, cache, fa)
            if settings != current:  # one service while the settings stay
                stack.close()
                url, log_path = stack.enter_context(vulkan_service(args.n_ctx, settings))
                current = settings
            m, rows, took = run(MODELS[key], cache, fa, url, log_path, scenario["body"],
                                0 if args.no_generate else min(args.prompt_tokens, args.n_ctx - 8))
            print(f"# {sname} {key} {cache}/{fa}: {describe(m)} ({took:.0f} s)", flush=True)
            collected.append((sname, key, f"{cache}/{fa}", m["plan"]["verdict"], rows))
            for row in rows:
                total += 1
                bad += not row.ok
                mark = row.status
                print(f"{sname:<12} {key:<8} {cache + '/' + fa:<9} {row.device:<10} {row.part:<8} "
                      f"{row.predicted_mib:>10.2f} {row.allocated_mib:>10.2f} {row.error_mib:>+7.2f}  {mark}",
                      flush=True)
    print(f"rows: {total}; not exact, not rounded up and not within their bound: {bad}")
    if args.markdown:
        print(markdown(collected))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
