"""Which llama.cpp CPU settings make a sequence's logits independent of its step's shape and of the other
sequences' cells (issue 55: the same greedy answer twice), and what each costs.

    python bench/kernel_invariance.py [--model PATH] [--configs default,invariant,...]

Each configuration runs in a process of its own (``GGML_CPU_TILED_MM`` is read once a process): a 700-token
prompt (bench/speculative_bench.py's texts), then 70 given tokens decoded one a step, the reference; then the same
70 tokens in steps of 2, 1+5, 8, 16 and 65 rows, one a step after 600 cells of another sequence in the unified
cache (``F1``), in 8-row steps after them (``F8``), and the prompt's last row evaluated in its chunk against
alone (``last``). Printed: how many of the 70 logits rows are bit-identical to the reference's (a token
computed otherwise changes its cells, so every later row differs too), the time of a step of 1, 8 and 64 rows
(logits read included) and of a 2,048-token prompt.

Configurations (K and V: the cache's types; repack: llama.cpp's repacked CPU weight layouts, ``use_extra_bufts``):

- ``default``: repack, f16/f16, as the service loads;
- ``mixed``: repack, f16/bf16: ggml-cpu's flash attention takes its split-KV path (one-row steps over 512 cells
  or more: halves whose boundary moves with the cache's used length, so other slots' cells change a result)
  and its 64-row tiled path only where K and V are one type; with two types it takes one row at a time over
  the sequence's own cells (ggml-cpu/ops.cpp ``ggml_compute_forward_flash_attn_ext_f16``);
- ``norepack``: no repack, f16/bf16: one row computes as in a step of 2 to 7, not as in one of 8 or more
  (ggml-cpu's tiled K-quant matrix product, ggml-cpu/tiled/tiled.cpp, "profitable at rows >= 8");
- ``invariant``: no repack, f16/bf16, ``GGML_CPU_TILED_MM=0``: every row as alone.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Any

CONFIGS = {"default": (True, "f16", "f16", "1"), "mixed": (True, "f16", "bf16", "1"),
           "norepack": (False, "f16", "bf16", "1"), "invariant": (False, "f16", "bf16", "0")}
TYPES = {"f16": 1, "f32": 0, "bf16": 30, "q8_0": 8}
"""ggml's type numbers for the cache."""
SHAPES = {"2": [2] * 35, "1+5": [1, 5] * 11 + [4], "8": [8] * 8 + [6], "16": [16] * 4 + [6], "65": [65, 5]}


def measure(model_path: str, repack: bool, tk: str, tv: str) -> str:
    import llama_cpp as L
    import numpy as np

    from service.engine.cpu_speed import Scratch
    from speculative_bench import COPIES

    scratch = Scratch(model_path, min(2, os.cpu_count() or 1), repack=repack, n_ctx=4096,
                      cache_types=(TYPES[tk], TYPES[tv]), seqs=4)
    vocab = L.llama_model_get_vocab(scratch.model)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    text = "".join(COPIES.values()).encode()
    buf = (L.llama_token * 8192)()
    toks = list(buf[:L.llama_tokenize(vocab, text, len(text), buf, 8192, True, False)])
    prompt, cont = toks[:700], toks[700:770]

    def decode(batch: list[int], pos0: int, seq: int = 0) -> list[Any]:
        """The batch's logits rows, copied (every row's)."""
        scratch.decode(batch, pos0, every=True, seq=seq)
        return [np.ctypeslib.as_array(L.llama_get_logits_ith(scratch.ctx, i), shape=(n_vocab,)).copy()
                for i in range(len(batch))]

    def fill(filler: int = 0, upto: int = len(prompt)) -> None:
        """A clear cache, ``filler`` cells of sequence 1, then the prompt's first ``upto`` tokens."""
        scratch.undo(0, seq=-1)
        for i in range(0, filler, 512):
            scratch.decode([prompt[j % len(prompt)] for j in range(i, min(filler, i + 512))], i, seq=1)
        for i in range(0, upto, 512):
            scratch.decode(prompt[i:min(upto, i + 512)], i)

    def run(shape: list[int], filler: int = 0) -> Any:
        fill(filler)
        rows, at = [], 0
        for s in shape:
            rows += decode(cont[at:at + s], len(prompt) + at)
            at += s
        return np.stack(rows)

    base = run([1] * 70)
    out = []
    for name, shape in [*SHAPES.items(), ("F1", [1] * 70), ("F8", [8] * 8 + [6])]:
        r = run(shape, filler=600 if name.startswith("F") else 0)
        out.append(f"{name} {int((r == base).all(axis=1).sum())}")
    fill(upto=512)
    last = decode(prompt[512:700], 512)[-1]
    fill(upto=699)
    alone = decode(prompt[699:700], 699)[0]
    out.append(f"last {'same' if (last == alone).all() else 'differs'}")

    def step_ms(rows: int, reps: int) -> float:
        fill()
        t, at = time.perf_counter(), len(prompt)
        for _ in range(reps):
            decode(cont[:rows], at)
            at += rows
        return (time.perf_counter() - t) / reps * 1000

    t1, t8, t64 = step_ms(1, 40), step_ms(8, 10), step_ms(64, 3)
    scratch.undo(0, seq=-1)
    t = time.perf_counter()
    for i in range(0, 2048, 512):
        scratch.decode((toks * 2)[i:i + 512], i)
    prompt_tps = 2048 / (time.perf_counter() - t)
    return (f"rows equal of 70: {', '.join(out)} | step ms: 1 row {t1:.1f}, 8 rows {t8:.1f}, 64 rows {t64:.1f} | "
            f"prompt {prompt_tps:.0f} tokens/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a configuration in this process
    args = ap.parse_args()
    if args.model is None:
        from service.catalog.embedded import embedded_model_path
        args.model = embedded_model_path()
    if args.one:
        repack, tk, tv, _ = CONFIGS[args.one]
        print(measure(args.model, repack, tk, tv), flush=True)
        return
    for name in args.configs.split(","):
        repack, tk, tv, tiled = CONFIGS[name]
        env = {**os.environ, "GGML_CPU_TILED_MM": tiled}
        r = subprocess.run([sys.executable, __file__, "--model", args.model, "--one", name], env=env,
                           capture_output=True, text=True, check=True)
        print(f"{name:9s} (repack {'on' if repack else 'off'}, K {tk}, V {tv}, GGML_CPU_TILED_MM={tiled}): "
              f"{r.stdout.strip()}", flush=True)


if __name__ == "__main__":
    main()
