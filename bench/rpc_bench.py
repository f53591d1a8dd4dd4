"""Decode speed over ggml-rpc workers against one host, predicted and measured, in one run.

    .venv/bin/python bench/rpc_bench.py [--rounds 3] [--tokens 64] [--model PATH] [--delays-ms 0,0.2,1,5] [--tls]

Two workers per link (``python -m service worker``, ``--threads`` each) and the model (default: the embedded one)
run by ``service.testing.rpc`` in a child process per side and round: on the host alone (``--threads`` threads),
with every layer on one worker, and split over both. Every round runs every side at every link, in an order that
alternates, so a drifting machine load falls on all alike. Printed per link and side: greedy tokens/s (median over
rounds), the planner's prediction and measured over predicted, the time a token takes over the first link's
(measured: the median of each round's difference; predicted), whether the text equals the host's; the buffers
llama.cpp placed per device.

Without ``--delays-ms`` the workers listen on loopback. With it (root: network namespaces), two workers per delay run
on hosts of their own (``service.testing.netns``), all up at once, each linked to this one by a relay that adds that
round trip in milliseconds (0: a veth pair, no relay). The planner reads the workers as the service does
(``service.rpc.client.worker_devices``: the round trip is a TCP handshake through the link). With ``--tls`` two
more sides per link go through a TLS tunnel pair per worker (``python -m service tunnel``), and the tunnels' cost
per token is printed. Run it alone: the workers, the relays, the tunnels and the client share this machine's cores.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterator

from harness import ROOT

from service.catalog.embedded import embedded_model_path
from service.testing import netns, tls
from service.testing.ports import worker_ports
from service.testing.rpc import worker_process

if TYPE_CHECKING:
    from sizing.plan import Device

MIB = 1 << 20

os.environ.setdefault("GOMP_SPINCOUNT", "2000")
"""Inherited by the workers and the runs (libgomp reads it when llama.cpp loads): the workers and the client stand for
machines of their own but share this one's cores, and by default each process's idle OpenMP threads spin 300,000
rounds through the others' work (tests/conftest.py: two llama.cpp processes side by side took 10 times as long).
Measured on 2 cores with the default, two workers gave 2.7 tokens/s in one round and 56.8 in the next."""


@contextlib.contextmanager
def workers(n: int, threads: int, delay_s: float | None = None) -> Iterator[list[tuple[str, list[str]]]]:
    """``n`` workers (``service.testing.rpc.worker_process``), their endpoints and the command prefix that runs a
    process on their host: on loopback, or with ``delay_s`` each on a namespaced host whose link adds that round
    trip (``service.testing.netns``)."""
    ports = worker_ports(n)
    with contextlib.ExitStack() as stack:
        if delay_s is None:
            for p in ports:
                stack.enter_context(worker_process(p, threads=threads, cwd=str(ROOT)))
            yield [(f"127.0.0.1:{p}", []) for p in ports]
            return
        hosts = stack.enter_context(netns.hosts(n, delay_s=delay_s))
        for p, h in zip(ports, hosts):
            stack.enter_context(worker_process(p, threads=threads, cwd=str(ROOT), host=h.address,
                                               prefix=h.command([])))
        yield [(f"{h.address}:{p}", h.command([])) for h, p in zip(hosts, ports)]


@contextlib.contextmanager
def tunnels(eps: list[tuple[str, list[str]]], certs_dir: Path) -> Iterator[list[str]]:
    """A ``python -m service tunnel`` pair in front of each worker (``serve`` on its host, ``connect`` here on
    loopback), with certificates made as docs/deployment.md shows; the endpoints to use instead."""
    certs = tls.make_certs(certs_dir, sorted({ep.rsplit(":", 1)[0] for ep, _ in eps}))
    out = []
    with contextlib.ExitStack() as stack:
        for (ep, prefix), serve, connect in zip(eps, worker_ports(len(eps)), worker_ports(len(eps))):
            host = ep.rsplit(":", 1)[0]
            stack.enter_context(tls.tunnel_process("serve", f"{host}:{serve}", ep, certs.worker, certs.ca,
                                                   cwd=str(ROOT), prefix=prefix))
            stack.enter_context(tls.tunnel_process("connect", f"127.0.0.1:{connect}", f"{host}:{serve}",
                                                   certs.client, certs.ca, cwd=str(ROOT)))
            out.append(f"127.0.0.1:{connect}")
        yield out


def side(model: str, endpoints: list[str], tokens: int) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-m", "service.testing.rpc", "--tokens", str(tokens), model, *endpoints],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"run over {endpoints or 'the host'} failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@functools.lru_cache(maxsize=1)
def host_bandwidth() -> float:
    from sizing.probe import measure_host_bandwidth

    return measure_host_bandwidth()


def predictions(model: str, gpus: list[Device], threads: int) -> dict[str, float]:
    """The planner's decode speed for each side's placement on these devices (``sizing.plan.offload.speed``)."""
    from sizing.memory import Placement
    from sizing.plan import PlanRequest
    from sizing.plan.offload import speed
    from sizing.plan.sizer import Sizer
    from sizing.plan.speed import Tiers
    from sizing.probe import host_memory, probe_path

    from service.engine.cpu import host_repack
    from service.engine.cpu_speed import decode_flops_per_core

    spec = probe_path(model)
    req = PlanRequest(n_ctx=512, host_bandwidth_bytes_per_s=host_bandwidth(), cpu_cores=threads,
                      cpu_flops_per_core=decode_flops_per_core(threads, host_repack("auto").on))
    full = spec.n_layer_all + 1
    sides = {"host": Placement(), "one worker": Placement(gpus=(0,), n_gpu_layers=full, tensor_split=(1.0,)),
             "two workers": Placement(gpus=(0, 1), n_gpu_layers=full, tensor_split=(1.0, 1.0))}
    sz = Sizer(spec, gpus, host_memory(), req, "f16")
    return {name: speed(sz, pl, sz.estimate(pl, 512), 512, Tiers.for_request(req))[0] for name, pl in sides.items()}


def read_workers(endpoints: list[str]) -> list[Device]:
    """The workers' devices as the service reads them (their /status, their links timed)."""
    from service.rpc.client import worker_devices

    gpus, absent = worker_devices(endpoints)
    if absent:
        raise SystemExit(f"workers not available: {absent}")
    return gpus


@dataclass(frozen=True)
class Group:
    """The workers at one link (a delay, or loopback): the sides run over them and what the planner predicts."""

    link: str
    delay_s: float | None
    sides: dict[str, list[str]]
    predicted: dict[str, float]
    gpus: list[Device]
    """The workers' devices as the planner read them: the link's round trip and transfer rate, the memory bandwidth
    and threads of each."""

    def links_on(self, base: "Group") -> list[Device]:
        """``base``'s devices with this group's links: what the speed model charges for the link alone, the rest of
        the prediction (a worker's memory bandwidth, measured at its start on a loaded machine) held equal."""
        return [replace(b, link_latency_s=g.link_latency_s, link_bandwidth_bytes_per_s=g.link_bandwidth_bytes_per_s)
                for b, g in zip(base.gpus, self.gpus)]


def group(stack: contextlib.ExitStack, model: str, threads: int, delay_s: float | None, with_tls: bool) -> Group:
    hosted = stack.enter_context(workers(2, threads, delay_s))
    eps = [ep for ep, _ in hosted]
    link = ("loopback" if delay_s is None else f"+{delay_s * 1e3:g} ms ({'relay' if delay_s else 'veth'})")
    sides = {"one worker": eps[:1], "two workers": eps}
    gpus = read_workers(eps)
    predicted = predictions(model, gpus, threads)
    if with_tls:
        tunnelled = stack.enter_context(tunnels(hosted, Path(stack.enter_context(tempfile.TemporaryDirectory()))))
        sides.update({"one, TLS": tunnelled[:1], "two, TLS": tunnelled})
        over_tls = predictions(model, read_workers(tunnelled), threads)  # the service's, configured with them
        predicted.update({"one, TLS": over_tls["one worker"], "two, TLS": over_tls["two workers"]})
    return Group(link, delay_s, sides, predicted, gpus)


def bench(model: str, threads: int, rounds: int, tokens: int, delays: list[float | None], with_tls: bool) -> None:
    """Every side at every link, ``rounds`` times: the links all up at once and every round running them all, in an
    order that alternates, so a drifting machine load falls on all alike; a delay's cost per token is each round's
    difference with the first link's, its median over the rounds."""
    with contextlib.ExitStack() as stack:
        groups = [group(stack, model, threads, d, with_tls) for d in delays]
        runs: list[tuple[str, Group | None, list[str]]] = [("host", None, [])]
        runs += [(name, g, eps) for g in groups for name, eps in g.sides.items()]
        times: dict[tuple[str, str], list[float]] = {}
        last: dict[tuple[str, str], dict[str, Any]] = {}
        for r in range(rounds):
            order = runs if r % 2 == 0 else list(reversed(runs))
            for name, g, eps in order:
                out = side(model, eps, tokens)
                key = (g.link if g is not None else "", name)
                times.setdefault(key, []).append(1 / out["tokens_per_s"])
                last[key] = out
            print(f"  round {r + 1}: host {1 / times[('', 'host')][-1]:.1f} tok/s; " + "; ".join(
                f"{g.link}: " + ", ".join(f"{n} {1 / times[(g.link, n)][-1]:.1f}" for n in g.sides) for g in groups),
                flush=True)
    host_s = statistics.median(times[("", "host")])
    print(f"\nmodel {model}, {tokens} greedy tokens, medians of {rounds} rounds, {threads} threads per worker; "
          f"host {1 / host_s:.1f} tokens/s (predicted {groups[0].predicted['host']:.1f})")
    print("the workers as read: memory GB/s, link MB/s: " + "; ".join(
        f"{g.link} " + ", ".join(f"{(d.bandwidth_bytes_per_s or 0) / 1e9:.1f}, {(d.link_bandwidth_bytes_per_s or 0) / 1e6:.0f}"
                                 for d in g.gpus) for g in groups))
    print(f"{'link':<16}{'side':<13}{'RTT ms':>10}{'tokens/s':>9}{'predicted':>10}{'meas/pred':>10}"
          f"{'+ms/token':>10}{'predicted':>10}  text as host's")
    base = groups[0]
    for g in groups:
        for name in g.sides:
            t = times[(g.link, name)]
            s = 1 / statistics.median(t)
            pred = g.predicted[name]
            # The link's cost: this round's time a token less the first link's in the same round.
            added = statistics.median(a - b for a, b in zip(t, times[(base.link, name)])) * 1e3
            # The speed model's link terms alone: the base link's workers with this link (the rest of the prediction,
            # a worker's memory bandwidth measured at its start on a loaded machine, moves from one to the next).
            plain = name.replace(", TLS", " worker" + ("s" if name.startswith("two") else ""))
            want = (1 / predictions(model, g.links_on(base), threads)[plain] - 1 / base.predicted[plain]) * 1e3
            if "TLS" in name:
                want = float("nan")  # the planner sees the tunnel's loopback end, not the link behind it
            same = "yes" if last[(g.link, name)]["text"] == last[("", "host")]["text"] else "NO"
            rtt = " ".join(f"{d.link_latency_s * 1e3:.2f}" for d in g.gpus)
            print(f"{g.link:<16}{name:<13}{rtt:>10}{s:>9.1f}{pred:>10.1f}{s / pred:>10.3f}{added:>10.2f}{want:>10.2f}  "
                  f"{same}", flush=True)
    if with_tls:
        for g in groups:
            for n, plain in (("one, TLS", "one worker"), ("two, TLS", "two workers")):
                cost = statistics.median(a - b for a, b in zip(times[(g.link, n)], times[(g.link, plain)])) * 1e3
                print(f"{g.link}: the TLS tunnels cost {cost:.2f} ms a token over {plain}")
    print("buffers per device (MiB: weights/KV/compute), last round: " + "; ".join(
        f"{k[1]}: " + ", ".join(f"{d} {b['weights'] / MIB:.2f}/{b['kv'] / MIB:.2f}/{b['compute'] / MIB:.2f}"
                                for d, b in v["buffers"].items())
        for k, v in last.items() if k[0] in ("", base.link) and "TLS" not in k[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of each worker")
    ap.add_argument("--model", default=None, help="a GGUF path (default: the embedded model)")
    ap.add_argument("--tls", action="store_true", help="also through a TLS tunnel pair per worker (python -m "
                    "service tunnel): its cost per token")
    ap.add_argument("--delays-ms", default=None, help="round trips the workers' links add, comma-separated "
                    "milliseconds (0: a veth pair): two workers on namespaced hosts per delay, all up at once, every "
                    "round running every link (needs root)")
    args = ap.parse_args()
    # SIGTERM (timeout's, a kill) unwinds like Ctrl-C: the workers, relays and namespaces are removed on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    model = args.model or embedded_model_path()
    delays: list[float | None] = [None]
    if args.delays_ms is not None:
        why = netns.unavailable()
        if why is not None:
            raise SystemExit(f"--delays-ms: {why}")
        delays = [float(x) / 1e3 for x in args.delays_ms.split(",") if x.strip()]
    bench(model, args.threads, args.rounds, args.tokens, delays, args.tls)
    print("predicted: the planner's decode speed for the side's placement (sizing.plan.offload.speed), each worker's "
          "device at the memory bandwidth its /status gave or its threads' CPU speed, whichever is slower, with its "
          "network round trip (RTT, read as the service reads it) and ggml-rpc's cost per token; +ms/token: the "
          "time a token takes over the first link's, measured (the median of each round's difference) and predicted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
