"""Prompt and decode speed with llama.cpp's repacked CPU weights (CPU_REPACK) and without, on this host.

    .venv/bin/python bench/repack_bench.py [--rounds 3] [--prompt-tokens 1000] [--tokens 64] [--model zero-llama]

The two engines (the embedded model loaded with ``use_extra_bufts`` on and off) take turns in each round, so
both see the same machine. ``--model``: the embedded model (default; llama.cpp repacks only its Q4_K
matrices, 12.7 of 235 MiB: its largest tensor is the tied embedding, read by GET_ROWS), a GGUF path, or
``zero-llama``: a llama-shaped Q4_K_M model of zeros (1024 wide, 8 layers, written as a sparse file), whose
matrices are nearly all repacked, to show the kernels themselves (the output of zeros is meaningless; the
arithmetic takes the time real weights take). This is the figure behind ``GGUF_CPU_REPACK=auto`` keeping repacking on where it is
safe (service/engine/cpu.py). On a host where llama.cpp reports AMX_INT8 the "on" side would use the AMX kernel
that crashes (llama.cpp#20824): it is skipped unless ``--crash-ok``. Run it alone: both cores are the benchmark's.
"""

from __future__ import annotations

import argparse
import statistics
import time

from service.catalog.embedded import embedded_model_path
from service.engine.base import Cancel, GenerationParams
from service.engine.cpu import host_repack
from service.engine.llama import LlamaEngine
from service.text.served import ServedModel
from sizing.plan import PlanRequest, make_plan
from sizing.probe import host_memory, probe_path
from sizing.testing.fixtures import FixtureShape, write_fixture

ZERO_LLAMA = FixtureShape("llama", 1024, 8, 16, 4, 64, 2816, 32000, 4096, tokenizer="llama")

TEXT = ("The keeper of the lighthouse on the northern cape wrote in his log every evening. He noted the wind, the "
        "height of the waves, the ships that passed and the birds that rested on the gallery rail. ")


def run(eng: LlamaEngine, prompt: list[int], tokens: int) -> tuple[float, float]:
    """(prompt tokens/s, decode tokens/s) of one cold request."""
    last = None
    params = GenerationParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, cache_prompt=False)
    t0 = time.perf_counter()
    for c in eng.generate(prompt, params, Cancel()):
        last = c
    assert last is not None and last.finish_reason == "length", last
    if not last.prompt_seconds:
        raise SystemExit(f"no timings measured ({time.perf_counter() - t0:.2f} s)")
    n_prompt = last.prompt_tokens - last.cached_tokens
    return n_prompt / last.prompt_seconds, (last.completion_tokens - 1) / last.decode_seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=1000, help="about this many prompt tokens")
    ap.add_argument("--tokens", type=int, default=64, help="decoded tokens per request")
    ap.add_argument("--model", default="embedded", help="embedded, zero-llama, or a GGUF path")
    ap.add_argument("--crash-ok", action="store_true", help="run the repacked side even where AMX crashes")
    args = ap.parse_args()

    if args.model == "embedded":
        path = embedded_model_path()
    elif args.model == "zero-llama":
        import tempfile

        path = write_fixture("zero-llama", tempfile.mkdtemp(prefix="repack-bench-"), "q4_k_m", shape=ZERO_LLAMA)
    else:
        path = args.model
    spec = probe_path(path)
    sides = [True, False]
    auto = host_repack("auto")
    if not auto.on and not args.crash_ok:
        print(f"repacking on is skipped here: {auto.reason}")
        sides = [False]
    engines = {}
    for on in sides:
        eng = ServedModel.of(LlamaEngine())
        plan = make_plan(spec, [], host_memory(), PlanRequest(n_ctx=4096, min_ctx=256, n_seq_max=1, cpu_repack=on))
        report = eng.load(path, plan)
        engines[on] = eng
        print(f"repack {'on ' if on else 'off'}: " + ", ".join(f"{a.device} {a.total_bytes / (1 << 20):.1f} MiB"
                                                         for a in report.allocations))
    first = engines[sides[0]]
    prompt = first._tokenize(TEXT * max(1, args.prompt_tokens // 10), add_bos=True)[:args.prompt_tokens]
    got: dict[bool, list[tuple[float, float]]] = {on: [] for on in sides}
    for on in sides:  # warm-up
        run(engines[on], prompt[:8], 4)
    for _ in range(args.rounds):
        for on in sides:
            got[on].append(run(engines[on], prompt, args.tokens))
    print(f"{'repack':<8} {'prompt tok/s':>13} {'decode tok/s':>13}   ({args.rounds} rounds, medians, "
          f"{len(prompt)} prompt tokens)")
    med = {}
    for on in sides:
        p = statistics.median(x[0] for x in got[on])
        d = statistics.median(x[1] for x in got[on])
        med[on] = (p, d)
        print(f"{'on' if on else 'off':<8} {p:>13.1f} {d:>13.1f}")
    if len(sides) == 2:
        print(f"on/off   {med[True][0] / med[False][0]:>13.3f} {med[True][1] / med[False][1]:>13.3f}")
    for eng in engines.values():
        eng.unload()


if __name__ == "__main__":
    main()
