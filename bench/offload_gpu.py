"""Partial offload on a real GPU: predicted against measured speed, per candidate placement.

For a machine with an NVIDIA GPU and a CUDA build of llama-cpp-python
(``CMAKE_ARGS=-DGGML_CUDA=on pip install llama-cpp-python==0.3.36``, or a
prebuilt CUDA wheel). Loads the embedded gemma-3-270m with a shrunk VRAM budget
(``--budget-mib``, default 600) so only some layers fit, plans the partial
offload for that budget with the live card's name and bandwidth, then for each
listed candidate loads the model with that n_gpu_layers and measures decode and
prompt tokens/s. Prints predicted against measured and the llama.cpp
allocations beside the plan. Bounded: about 20 s per candidate.

    python bench/offload_gpu.py [--budget-mib 600] [--model PATH] [--candidates 6]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sizing.devices import MIB, Device, host_memory, nvml_devices  # noqa: E402
from sizing.gguf import probe_path  # noqa: E402
from sizing.plan import PlanRequest, make_plan  # noqa: E402
from sizing.report import plan_table  # noqa: E402


def measure(path: str, ngl: int, n_ctx: int, prompt_tokens: int, gen_tokens: int) -> tuple[float, float, list[str]]:
    from llama_cpp import Llama

    from service.engine.llama import _LogTap

    _LogTap.install()
    lines = _LogTap.start()
    llm = Llama(model_path=path, n_gpu_layers=ngl, n_ctx=n_ctx, n_batch=512, n_ubatch=512, flash_attn=True,
                swa_full=False, verbose=False, type_k=8, type_v=8)
    _LogTap.stop()
    try:
        prompt = list(range(1000, 1000 + prompt_tokens))
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        prompt_tps = prompt_tokens / (time.perf_counter() - t)
        t = time.perf_counter()
        n = 0
        for tok in llm.generate([2, 1000], temp=0.0, top_k=1):
            n += 1
            if n >= gen_tokens:
                break
        decode_tps = n / (time.perf_counter() - t)
    finally:
        llm.close()
    return decode_tps, prompt_tps, [ln for ln in lines if "buffer size" in ln or "offloaded" in ln]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-mib", type=float, default=600.0)
    ap.add_argument("--model", default=None)
    ap.add_argument("--candidates", type=int, default=6)
    ap.add_argument("--n-ctx", type=int, default=4096)
    args = ap.parse_args()
    gpus = nvml_devices()
    if not gpus:
        print("no NVIDIA GPU visible through NVML; this benchmark needs one", file=sys.stderr)
        return 2
    path = args.model
    if path is None:
        from service.models import embedded_model_path

        path = embedded_model_path()
    spec = probe_path(path)
    real = gpus[0]
    shrunk = Device(0, real.name, int(args.budget_mib * MIB), real.total_bytes)
    plan = make_plan(spec, [shrunk], host_memory(), PlanRequest(n_ctx=args.n_ctx, allowance_bytes=0))
    print(f"GPU {real.name}: {real.free_mib:.0f} MiB free, planning for a budget of {args.budget_mib:.0f} MiB")
    print(plan_table(plan))
    print()
    print(f"{'candidate':<62} {'ngl':>4} {'pred dec':>9} {'meas dec':>9} {'pred pp':>9} {'meas pp':>9}")
    rows = plan.candidates[: args.candidates] or ()
    for c in rows:
        dec, pp, lines = measure(path, c.placement.n_gpu_layers, args.n_ctx, 512, 64)
        print(f"{c.description:<62} {c.placement.n_gpu_layers:>4} {c.decode_tokens_per_s:9.1f} {dec:9.1f} "
              f"{c.prompt_tokens_per_s:9.1f} {pp:9.1f}")
        for ln in lines:
            print("    llama.cpp:", ln.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
