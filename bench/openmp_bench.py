"""Two engines in one process: generation speed of one beside the other idle, with and without the idle one's
scheduler thread ending (service/engine/llama.py, "One compute thread").

llama.cpp's CPU backend computes each graph on an OpenMP team that belongs to the calling thread and lives as long
as that thread. Once libgomp manages more threads than the machine has CPUs it spins only briefly at its barriers,
so an idle engine whose thread (and team) lives on slows the busy one. Modes take turns within each round:

- ``alone``: engine A, nothing else loaded;
- ``beside``: A with engine B loaded and idle, B's thread ended after ``SCHEDULER_IDLE_EXIT_S`` (the service);
- ``kept``: the same with B's thread kept alive (what the engine did before).

Also the cost of the thread's end: a one-token request on an engine whose thread ended, against one whose thread
is alive. Run it alone (``.venv/bin/python bench/openmp_bench.py [--rounds 5] [--tokens 64]``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import service.engine.llama.scheduler as llama_engine
from service.catalog.embedded import embedded_model_path
from service.engine.base import Cancel, GenerationParams
from service.engine.llama import LlamaEngine
from service.text.served import ServedModel
from sizing.plan import PlanRequest, make_plan
from sizing.probe import host_memory, probe_path


def tokens_per_s(eng: LlamaEngine, n: int) -> float:
    params = GenerationParams(max_tokens=n, temperature=0.0, cache_prompt=False, ignore_eos=True)
    t0 = time.perf_counter()
    done = 0
    for c in eng.complete("Once upon a time", params, Cancel()):
        done = c.completion_tokens
    return done / (time.perf_counter() - t0)


def request_ms(eng: LlamaEngine) -> float:
    t0 = time.perf_counter()
    list(eng.complete("Once upon a time", GenerationParams(max_tokens=1, temperature=0.0, cache_prompt=False), Cancel()))
    return (time.perf_counter() - t0) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: the physical cores)")
    args = ap.parse_args()
    path = embedded_model_path()
    plan = make_plan(probe_path(path), [], host_memory(), PlanRequest(n_ctx=4096, n_seq_max=4, min_ctx=256))
    idle_s = llama_engine.SCHEDULER_IDLE_EXIT_S + 0.5
    a = ServedModel.of(LlamaEngine(n_threads=args.threads))
    a.load(path, plan)
    tokens_per_s(a, 8)
    b: LlamaEngine | None = None
    park = LlamaEngine._park
    figures: dict[str, list[float]] = {"alone": [], "beside": [], "kept": []}

    def with_b(kept: bool) -> LlamaEngine:
        LlamaEngine._park = (lambda self, inbox: False) if kept else park  # type: ignore[method-assign]
        eng = ServedModel.of(LlamaEngine(n_threads=args.threads))
        eng.load(path, plan)
        tokens_per_s(eng, 8)  # B's thread computes once: its OpenMP team exists
        time.sleep(idle_s)
        return eng

    try:
        for rnd in range(args.rounds):
            order = ["alone", "beside", "kept"] if rnd % 2 == 0 else ["kept", "beside", "alone"]
            for mode in order:
                if mode != "alone":
                    b = with_b(mode == "kept")
                time.sleep(idle_s)
                figures[mode].append(tokens_per_s(a, args.tokens))
                if b is not None:
                    b.unload()
                    b = None
                LlamaEngine._park = park  # type: ignore[method-assign]
            print(f"  round {rnd + 1}: " + "  ".join(f"{m} {v[-1]:.1f}" for m, v in figures.items()), flush=True)
        alone = statistics.median(figures["alone"])
        print(f"\nengine A, {args.tokens} greedy tokens, medians of {args.rounds} rounds (tokens/s):")
        for mode, label in (("alone", "alone"), ("beside", "beside an idle engine whose thread ended"),
                            ("kept", "beside an idle engine whose thread stayed")):
            m = statistics.median(figures[mode])
            print(f"  {label:45s} {m:6.1f}   {m / alone:.3f}x alone")
        b = with_b(False)
        warm: list[float] = []
        cold: list[float] = []
        for _ in range(args.rounds):
            time.sleep(idle_s)
            cold.append(request_ms(a))
            warm.append(request_ms(a))
        print(f"one-token request, thread ended while idle: {statistics.median(cold):.1f} ms; "
              f"thread alive: {statistics.median(warm):.1f} ms (medians of {args.rounds})")
    finally:
        LlamaEngine._park = park  # type: ignore[method-assign]
        if b is not None:
            b.unload()
        a.unload()


if __name__ == "__main__":
    main()
