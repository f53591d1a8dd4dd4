"""This host's decode speed as llama.cpp's own CPU kernels give it, for the planner's speed model.

The speed model (``sizing.plan.offload.speed``) computes a CPU's share of a token at ``cpu_flops`` (matrix-vector
products of quantized weights). One constant per core was 2x off between two hosts of this project (the AMX host:
gemma-3-270m 21 ms a token on 2 cores; the AVX2 EPYC host: 11.6 ms): the plan predicted 49.5 tokens/s where the
host decoded 91.1, and every side over ggml-rpc workers 1.3 to 1.8x slow (issue 58). So the figure is measured
once per machine: the embedded model (always on the machine: it is the default) decodes one-row steps with the
service's threads, in a process of its own (llama.cpp's OpenMP team is not the server's), and the flops per core
are what make the speed model's own prediction for that model equal the measured step. Kept in
``~/.cache/gguf-fit-server/cpu-speed.json`` by CPU name, threads, llama-cpp-python version and weight layout
(about 1 s the first time; ``GGUF_CPU_GFLOPS_PER_CORE`` sets it instead). A worker measures its own for its
``/status`` (``service.rpc.worker``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gguf-fit-server" / "cpu-speed.json"
STEPS = 16
"""One-row steps timed after two untimed ones; their median is the step."""
CONTEXT_TOKENS = 64
"""Tokens in the KV cache before the timed steps."""


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _key(threads: int, repack: bool) -> str:
    from importlib.metadata import version

    return f"{_cpu_name()}|threads={threads}|llama-cpp-python={version('llama_cpp_python')}|repack={repack}"


def decode_flops_per_core(threads: int, repack: bool, *, timeout_s: float = 120.0) -> float | None:
    """The host's decode FLOP/s per thread for the speed model (cached per machine); None where it could not be
    measured (no embedded model, the process failed or timed out): the planner's constant stands."""
    key = _key(threads, repack)
    try:
        kept = json.loads(CACHE.read_text())
    except (OSError, ValueError):
        kept = {}
    if isinstance(kept.get(key), (int, float)):
        return float(kept[key])
    cmd = [sys.executable, "-m", "service.engine.cpu_speed", "--threads", str(threads)] + (
        [] if repack else ["--no-repack"])
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                           cwd=Path(__file__).resolve().parents[2])
        got = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
        log.warning("the CPU's decode speed could not be measured (%s): the planner's constant is used", exc)
        return None
    if not got:
        log.warning("the CPU's decode speed could not be measured (exit %s: %s): the planner's constant is used",
                    r.returncode, (r.stderr or "").strip()[-300:])
        return None
    flops = float(got["flops_per_core"])
    log.info("measured the CPU's decode speed in %.1f s: %.1f ms a token of the embedded model on %d threads, "
             "%.1f GFLOP/s per thread", time.perf_counter() - t0, got["step_s"] * 1e3, threads, flops / 1e9)
    kept[key] = flops
    try:
        CACHE.parent.mkdir(parents=True, exist_ok=True)
        tmp = CACHE.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(kept, indent=1))
        os.replace(tmp, CACHE)
    except OSError as exc:
        log.warning("could not keep the CPU's decode speed in %s: %s", CACHE, exc)
    return flops


def flops_for_step(path: str, step_s: float, threads: int) -> float:
    """The FLOP/s per thread with which the speed model predicts ``step_s`` a token for the model at ``path``
    decoding alone on the host (``sizing.plan.cpu_flops_for_step``)."""
    from sizing.plan import cpu_flops_for_step
    from sizing.probe import probe_path

    return cpu_flops_for_step(probe_path(path), step_s, threads)


class Scratch:
    """A model's sequences in a context of their own, on the CPU, for timing decode steps (this module's
    measurement, bench/step_cost_bench.py, bench/kernel_invariance.py): decode tokens at positions, then take them
    back. ``cache_types``: ggml's type numbers for K and V (None: llama.cpp's f16); ``seqs`` more than one: that
    many sequences in one unified cache."""

    def __init__(self, path: str, threads: int, *, repack: bool = True, n_ctx: int = 512, n_batch: int = 512,
                 cache_types: tuple[int, int] | None = None, seqs: int = 1) -> None:
        import llama_cpp

        self._llama = llama_cpp
        llama_cpp.llama_backend_init()
        mp = llama_cpp.llama_model_default_params()
        mp.use_extra_bufts = repack
        self.model = llama_cpp.llama_model_load_from_file(path.encode(), mp)
        if not self.model:
            raise SystemExit(f"could not load {path}")
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, n_batch, n_batch
        cp.n_threads = cp.n_threads_batch = threads
        cp.flash_attn_type = 1
        if cache_types is not None:
            cp.type_k, cp.type_v = cache_types
        if seqs > 1:
            cp.n_seq_max, cp.kv_unified = seqs, True
        self.ctx = llama_cpp.llama_init_from_model(self.model, cp)
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self._memory = llama_cpp.llama_get_memory(self.ctx)

    def decode(self, tokens: list[int], pos0: int, *, every: bool = False, seq: int = 0) -> None:
        """``tokens`` of sequence ``seq`` at ``pos0`` on, with logits for the last row (``every``: for each row, as
        a drafted step)."""
        batch = self._batch
        batch.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, pos0 + i, 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = every or i == len(tokens) - 1
        if self._llama.llama_decode(self.ctx, batch) != 0:
            raise SystemExit("llama_decode failed")

    def undo(self, pos: int, seq: int = 0) -> None:
        """The positions from ``pos`` on of sequence ``seq`` taken back (-1: of every sequence)."""
        self._llama.llama_memory_seq_rm(self._memory, seq, pos, -1)


def _measure(threads: int, repack: bool) -> dict[str, float]:
    from service.catalog.embedded import embedded_model_path

    path = str(embedded_model_path())
    scratch = Scratch(path, threads, repack=repack)
    scratch.decode([100 + i for i in range(CONTEXT_TOKENS)], 0)
    times = []
    for i in range(STEPS + 2):
        t0 = time.perf_counter()
        scratch.decode([200 + i], CONTEXT_TOKENS)
        times.append(time.perf_counter() - t0)
        scratch.undo(CONTEXT_TOKENS)
    step = statistics.median(times[2:])
    return {"step_s": step, "flops_per_core": flops_for_step(path, step, threads)}


def main() -> None:
    ap = argparse.ArgumentParser(description="Measure the CPU's decode speed (prints one JSON line).")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--no-repack", action="store_true")
    args = ap.parse_args()
    print(json.dumps(_measure(args.threads, not args.no_repack)))


if __name__ == "__main__":
    main()
