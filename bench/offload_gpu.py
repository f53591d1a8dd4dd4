"""GPU memory truth: the plan's figures against llama.cpp's allocations and the card's peak (NVML), per device.

For a machine with an NVIDIA GPU and a CUDA build of llama-cpp-python 0.3.36
(``CMAKE_ARGS=-DGGML_CUDA=on pip install llama-cpp-python==0.3.36``). One short run, four cases:

- ``one-card``: the embedded gemma-3-270m (or ``--model``), every layer on the card;
- ``split-like``: the card declared as two halves, the plan split over them, loaded on the one card
  with the plan's translated parameters (what two cards would hold, summed: both allowances and pool
  bounds, pipeline-parallel copies);
- ``partial-offload``: the card shrunk to ``--budget-mib`` so only some layers fit;
- ``moe-override``: a MoE header-only fixture (OLMoE-1B-7B, Q4_K_M, written sparse: its weights read
  as zeros) with the experts of half its blocks pinned to host memory (``tensor_buft_overrides``).

For each: the plan (pure, with the live card's name and free memory), then a real load with exactly
the plan's parameters (``service.engine.params``), a prompt of ``--prompt-tokens`` and a few decoded
tokens, while a thread samples NVML's used memory every 2 ms. Printed per device: predicted (weights,
KV + state, compute, allowance + CUDA pool bound), llama.cpp's allocations (its log), NVML's growth
after the load and at the peak. The plan holds where ``peak <= predicted``.

    python bench/offload_gpu.py [--budget-mib 600] [--model PATH] [--n-ctx 4096] [--cases one-card,split-like,...]

Not run in this project yet (no GPU machine was available): the figures it prints are the first
measurement of ``sizing.memory.gpu``'s bound.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable

from sizing.plan import Device, Plan, PlanRequest, make_plan, plan_table
from sizing.probe import host_memory, probe_path
from sizing.probe.devices import nvml_devices
from sizing.units import MIB

CASES = ("one-card", "split-like", "partial-offload", "moe-override")


class NvmlPeak:
    """Used memory of one GPU, sampled in a thread: the baseline, the last and the highest figure."""

    def __init__(self, index: int = 0, period_s: float = 0.002) -> None:
        import pynvml  # type: ignore[import-untyped]

        self.nvml = pynvml
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        self.period_s = period_s
        self.base = self.used()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def used(self) -> int:
        return int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.used())
            time.sleep(self.period_s)

    def __enter__(self) -> "NvmlPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.used())


@dataclass
class Measured:
    allocations: dict[str, dict[str, float]]
    """llama.cpp's log: per buffer name, weights / kv / compute MiB."""
    after_load_mib: float
    peak_mib: float
    log: list[str]


def load_and_run(path: str, plan: Plan, prompt_tokens: int, gen_tokens: int) -> Measured:
    """Load with the plan's exact parameters, evaluate a prompt, decode a few tokens; NVML around it all."""
    import llama_cpp

    from service.engine import loglines as L
    from service.engine.params import (
        apply_context_params,
        apply_model_params,
        plan_params,
    )

    lines = L.LogCollector().lines
    llama_cpp.llama_backend_init()
    mp_values, cp_values = plan_params(plan)
    with NvmlPeak() as nv:
        mp = llama_cpp.llama_model_default_params()
        keep = apply_model_params(mp, mp_values)
        model = llama_cpp.llama_model_load_from_file(path.encode(), mp)
        if not model:
            raise RuntimeError("llama.cpp could not load the model:\n" + "\n".join(lines[-10:]))
        cp = llama_cpp.llama_context_default_params()
        apply_context_params(cp, cp_values)
        ctx = llama_cpp.llama_init_from_model(model, cp)
        if not ctx:
            raise RuntimeError("llama.cpp could not create the context:\n" + "\n".join(lines[-10:]))
        after_load = nv.used()
        vocab = llama_cpp.llama_model_get_vocab(model)
        n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        tokens = [(1000 + i) % max(n_vocab - 1, 1) for i in range(prompt_tokens)]
        n_batch = cp_values.n_batch
        pos = 0
        for start in range(0, len(tokens), n_batch):
            chunk = tokens[start:start + n_batch]
            arr = (llama_cpp.llama_token * len(chunk))(*chunk)
            batch = llama_cpp.llama_batch_get_one(arr, len(chunk))
            if llama_cpp.llama_decode(ctx, batch) != 0:
                break
            pos += len(chunk)
        for _ in range(gen_tokens):
            arr = (llama_cpp.llama_token * 1)(2)
            if llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(arr, 1)) != 0:
                break
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
        del keep
    allocations: dict[str, dict[str, float]] = {}
    for ln in lines:
        for kind, rx in (("weights", L.MODEL_BUFFER), ("kv", L.KV_BUFFER), ("compute", L.COMPUTE_BUFFER),
                         ("state", L.RS_BUFFER)):
            if m := rx.search(ln):
                allocations.setdefault(m.group(1), {}).setdefault(kind, 0.0)
                allocations[m.group(1)][kind] += float(m.group(2))
    return Measured(allocations, (after_load - nv.base) / MIB, (nv.peak - nv.base) / MIB, lines)


def _print_case(name: str, plan: Plan, m: Measured) -> None:
    est = plan.estimate
    assert est is not None
    print(f"\n== {name}: {plan.verdict}, n_ctx {plan.cfg.n_ctx}, {plan.cfg.type_k}, n_gpu_layers "
          f"{plan.placement.n_gpu_layers}, n_cpu_moe {plan.placement.n_cpu_moe}")
    print(f"{'device':<10} {'pred weights':>12} {'pred kv+st':>10} {'pred comp':>9} {'pred allow':>10} "
          f"{'pred total':>10} | {'llama weights':>13} {'kv':>8} {'compute':>8} | {'nvml load':>9} {'nvml peak':>9}  holds")
    gpu_devs = [d for d in est.gpus]
    planned_total = sum(d.total_bytes for d in gpu_devs) / MIB
    cuda = {k: v for k, v in m.allocations.items() if k.startswith("CUDA") and not k.endswith("_Host")}
    for d in gpu_devs:
        a = cuda.get(d.device, {}) if d.device in cuda else {}
        print(f"{d.device:<10} {d.weights_bytes / MIB:12.1f} {(d.kv_bytes + d.state_bytes) / MIB:10.1f} "
              f"{d.compute_bytes / MIB:9.1f} {(d.allowance_bytes + d.pool_bytes) / MIB:10.1f} {d.total_bytes / MIB:10.1f} | "
              f"{a.get('weights', 0.0):13.1f} {a.get('kv', 0.0) + a.get('state', 0.0):8.1f} {a.get('compute', 0.0):8.1f} |")
    llama_gpu = sum(sum(v.values()) for v in cuda.values())
    print(f"{'all cards':<10} {'':>12} {'':>10} {'':>9} {'':>10} {planned_total:10.1f} | {llama_gpu:13.1f} {'':>8} {'':>8} | "
          f"{m.after_load_mib:9.1f} {m.peak_mib:9.1f}  {'yes' if m.peak_mib <= planned_total else 'NO'}")
    host = m.allocations.get("CPU", {})
    print(f"{'host':<10} {est.host.weights_bytes / MIB:12.1f} {(est.host.kv_bytes + est.host.state_bytes) / MIB:10.1f} "
          f"{est.host.compute_bytes / MIB:9.1f} {'':>10} {est.host.total_bytes / MIB:10.1f} | "
          f"{host.get('weights', 0.0):13.1f} {host.get('kv', 0.0):8.1f} {host.get('compute', 0.0):8.1f} |")


def _plan_on(spec_path: str, gpus: list[Device], req: PlanRequest) -> Plan:
    return make_plan(probe_path(spec_path), gpus, host_memory(), req)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-mib", type=float, default=600.0, help="card size for the partial-offload case")
    ap.add_argument("--model", default=None, help="GGUF for the dense cases (default: the embedded gemma-3-270m)")
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=8)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the MoE fixture is written (sparse)")
    args = ap.parse_args()
    gpus = nvml_devices()
    if not gpus:
        print("no NVIDIA GPU visible through NVML; this benchmark needs one (and a CUDA build of llama-cpp-python)",
              file=sys.stderr)
        return 2
    real = gpus[0]
    path = args.model
    if path is None:
        from service.catalog.embedded import embedded_model_path

        path = embedded_model_path()
    req = PlanRequest(n_ctx=args.n_ctx, cache_types=("q8_0",), cache_type="q8_0")
    print(f"GPU {real.name}: {real.free_mib:.0f} MiB free of {real.total_mib:.0f}")
    cases: dict[str, Callable[[], tuple[str, Plan]]] = {
        "one-card": lambda: (path, _plan_on(path, [real], req)),
        "split-like": lambda: (path, _split_like(path, real, req)),
        "partial-offload": lambda: (path, _plan_on(
            path, [Device(0, real.name, int(args.budget_mib * MIB), real.total_bytes)], replace(req, allowance_bytes=0))),
        "moe-override": lambda: _moe(args.dir, real, req),
    }
    failed = 0
    for name in args.cases.split(","):
        model_path, plan = cases[name]()
        if not plan.fits:
            print(f"\n== {name}: the plan refuses ({'; '.join(plan.reasons)}); skipped")
            continue
        try:
            m = load_and_run(model_path, plan, args.prompt_tokens, args.gen_tokens)
        except RuntimeError as exc:
            print(f"\n== {name}: {exc}")
            failed += 1
            continue
        _print_case(name, plan, m)
        if "--verbose" in sys.argv:
            print(plan_table(plan))
    return 1 if failed else 0


def _split_like(path: str, real: Device, req: PlanRequest) -> Plan:
    """The card as two halves: the plan splits over them; the load puts both halves on the one card (the
    translation maps the plan's second device to index 1, which llama.cpp does not have, so it is folded back)."""
    half = real.free_bytes // 2
    halves = [Device(0, real.name, half, real.total_bytes // 2), Device(1, real.name, half, real.total_bytes // 2)]
    plan = _plan_on(path, halves, replace(req, gpu="all"))
    if plan.fits:
        # one real device: the same layers, all on it (the figures to compare are the two halves' sum)
        plan = replace(plan, gpus=(real,), placement=replace(plan.placement, gpus=(0,), tensor_split=(1.0,)))
    return plan


def _moe(directory: str, real: Device, req: PlanRequest) -> tuple[str, Plan]:
    from sizing.testing.fixtures import write_fixture

    path = write_fixture("OLMoE-1B-7B", directory, "q4_k_m")
    spec = probe_path(path)
    plan = make_plan(spec, [real], host_memory(), req)
    if plan.fits and plan.placement.n_gpu_layers:
        from sizing.plan.sizer import Sizer

        # the experts of half the blocks in host memory, whatever fits: the override case itself
        pinned = replace(plan.placement, n_cpu_moe=spec.n_layer // 2)
        sz = Sizer(spec, [real], host_memory(), req, plan.cfg.type_k)
        plan = replace(plan, placement=pinned, estimate=sz.estimate(pinned, plan.cfg.n_ctx))
    return path, plan


if __name__ == "__main__":
    sys.exit(main())
