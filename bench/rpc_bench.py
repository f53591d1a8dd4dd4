"""Decode speed over loopback ggml-rpc workers against one host, in one run.

    .venv/bin/python bench/rpc_bench.py [--rounds 3] [--tokens 64] [--model PATH]

Two workers (``python -m service worker`` on loopback, ``--threads`` each) and the model (default: the embedded
one) run by ``service.testing.rpc`` in a child process per side and round: on the host alone (``--threads``
threads), with every layer on one worker, and split over both. The sides alternate within each round, so a
drifting machine load falls on all alike. Printed: greedy tokens/s per side (median over rounds), the ratio to
the host, whether the text equals the host's, and the buffers llama.cpp placed per device. Run it alone: the
workers and the client share this machine's cores, so loopback measures the protocol's cost, not a network's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
from typing import Any, Iterator

from harness import ROOT

from service.catalog.embedded import embedded_model_path
from service.testing.ports import worker_ports
from service.testing.rpc import worker_process

MIB = 1 << 20


@contextlib.contextmanager
def workers(n: int, threads: int) -> Iterator[list[str]]:
    """``n`` workers on loopback (``service.testing.rpc.worker_process``), their endpoints."""
    ports = worker_ports(n)
    with contextlib.ExitStack() as stack:
        for p in ports:
            stack.enter_context(worker_process(p, threads=threads, cwd=str(ROOT)))
        yield [f"127.0.0.1:{p}" for p in ports]


def side(model: str, endpoints: list[str], tokens: int) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-m", "service.testing.rpc", "--tokens", str(tokens), model, *endpoints],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"run over {endpoints or 'the host'} failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def predict(model: str, endpoints: list[str], threads: int) -> dict[str, float]:
    """The planner's decode speed for each side's placement, on the workers' devices as the service reads them."""
    from service.rpc.client import worker_devices
    from sizing.memory import Placement
    from sizing.plan import PlanRequest
    from sizing.plan.offload import speed
    from sizing.plan.sizer import Sizer
    from sizing.plan.speed import Tiers
    from sizing.probe import host_memory, measure_host_bandwidth, probe_path

    spec = probe_path(model)
    gpus, absent = worker_devices(endpoints)
    if absent:
        raise SystemExit(f"workers not available: {absent}")
    req = PlanRequest(n_ctx=512, host_bandwidth_bytes_per_s=measure_host_bandwidth(), cpu_cores=threads)
    full = spec.n_layer_all + 1
    sides = {"host": Placement(), "one worker": Placement(gpus=(0,), n_gpu_layers=full, tensor_split=(1.0,)),
             "two workers": Placement(gpus=(0, 1), n_gpu_layers=full, tensor_split=(1.0, 1.0))}
    sz = Sizer(spec, gpus, host_memory(), req, "f16")
    return {name: speed(sz, pl, sz.estimate(pl, 512), 512, Tiers.for_request(req))[0] for name, pl in sides.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of each worker")
    ap.add_argument("--model", default=None, help="a GGUF path (default: the embedded model)")
    args = ap.parse_args()
    model = args.model or embedded_model_path()
    speeds: dict[str, list[float]] = {"host": [], "one worker": [], "two workers": []}
    last: dict[str, dict[str, Any]] = {}
    with workers(2, args.threads) as eps:
        plan = {"host": [], "one worker": eps[:1], "two workers": eps}
        predicted = predict(model, eps, args.threads)
        for r in range(args.rounds):
            order = list(plan) if r % 2 == 0 else list(reversed(plan))
            for name in order:
                out = side(model, plan[name], args.tokens)
                speeds[name].append(out["tokens_per_s"])
                last[name] = out
            print(f"  round {r + 1}: " + ", ".join(f"{n} {speeds[n][-1]:.1f} tok/s" for n in plan), flush=True)
    host = statistics.median(speeds["host"])
    print(f"\nmodel {model}, {args.tokens} greedy tokens, medians of {args.rounds} rounds, loopback, "
          f"{args.threads} threads per worker")
    print(f"{'side':<14}{'tokens/s':>10}{'vs host':>9}{'predicted':>11}  text as host's  buffers per device "
          "(MiB: weights/KV/compute)")
    for name in plan:
        s = statistics.median(speeds[name])
        bufs = "; ".join(f"{d} {b['weights'] / MIB:.2f}/{b['kv'] / MIB:.2f}/{b['compute'] / MIB:.2f}"
                         for d, b in last[name]["buffers"].items())
        same = "yes" if last[name]["text"] == last["host"]["text"] else "NO"
        print(f"{name:<14}{s:>10.1f}{s / host:>9.3f}{predicted[name]:>11.1f}  {same:<15} {bufs}")
    print("predicted: the planner's decode speed for the side's placement (sizing.plan.offload.speed), each worker's "
          "device at the memory bandwidth its /status gave or its threads' CPU speed, whichever is slower, with its "
          "network round trip and ggml-rpc's cost per token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
