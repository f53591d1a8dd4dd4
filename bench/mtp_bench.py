"""What MTP drafting costs and keeps, on the one model with an MTP head that runs here: the tiny GLM-4.5 of
``write_mtp_fixture`` (a few MiB, its head guessing exactly what its trunk predicts).

    .venv/bin/python bench/mtp_bench.py [--rounds 5] [--tokens 128]

The engine in this process (``LlamaEngine``) with the service's plan for the model (its planner and llama.cpp's
dry runs: the head is in the plan), greedy answers of ``--tokens`` tokens (``ignore_eos``), with the head's drafts
and without speculation, taking turns each round. Prints tokens/s of each side (medians), their ratio, and the
drafted and kept tokens.

What this measures is the machinery, not a speedup to expect: the model is so small that a step is mostly the
engine's own Python, the MTP context's calls among it; every guess is kept here, which no real head does. A real
head (GLM-4.5-Air is 110B parameters) does not run on this machine. Run it alone: both cores are the benchmark's.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace

from service.engine.base import Cancel, GenerationParams
from service.engine.calibrate import Calibrator
from service.engine.llama import LlamaEngine
from service.planning.planner import LoadOptions, Planner
from service.settings import Settings
from service.text.served import ServedModel
from sizing.probe import probe_path
from sizing.probe.devices import host_memory
from sizing.testing.fixtures import write_mtp_fixture


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_mtp_fixture(tmp)
        cal = Calibrator()
        try:
            plan = Planner(Settings(cpu_repack="off"), lambda: ([], host_memory()), cal).plan(
                probe_path(path), LoadOptions(n_ctx=2048), path=path)
        finally:
            cal.close()
        assert plan.cfg.mtp, plan.mtp_refusal
        eng = ServedModel.of(LlamaEngine())
        eng.load(path, plan)
        try:
            params = GenerationParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True, cache_prompt=False)
            sides = {"off": replace(params, speculative=False), "mtp": params}
            speed: dict[str, list[float]] = {k: [] for k in sides}
            drafted = kept = 0
            for r in range(args.rounds):
                order = list(sides) if r % 2 == 0 else list(sides)[::-1]
                for name in order:
                    prompt = f"Round {r}: the sea"
                    t0 = time.perf_counter()
                    chunks = list(eng.complete(prompt, sides[name], Cancel()))
                    wall = time.perf_counter() - t0
                    last = chunks[-1]
                    speed[name].append(last.completion_tokens / wall)
                    if name == "mtp":
                        drafted += last.drafted_tokens
                        kept += last.accepted_tokens
        finally:
            eng.unload()
    off, on = statistics.median(speed["off"]), statistics.median(speed["mtp"])
    print(f"tiny GLM-4.5 with an MTP head, {args.tokens} greedy tokens, {args.rounds} rounds, n_ctx {plan.cfg.n_ctx}")
    print(f"  no speculation: {off:8.1f} tokens/s")
    print(f"  MTP drafts:     {on:8.1f} tokens/s  ({on / off:.2f}x); drafted {drafted}, kept {kept} "
          f"({kept / max(drafted, 1):.0%})")


if __name__ == "__main__":
    main()
