"""Partial offload: serve a model the cards cannot hold, choosing the placement that generates fastest.

llama.cpp's partial offload already streams: the layers left on the host
run from host memory (or, past MemAvailable, from the mmapped file), and for
prompt batches ``op_offload`` copies their weights to the GPU. Candidates:
- whole layers on the GPUs, in llama.cpp's slot order (output first, then
  the top layers), for every ``n_gpu_layers`` that fits;
- for a MoE model, the expert tensors pinned to host memory first
  (``tensor_buft_overrides``), attention and shared weights on the GPU, then
  also whole layers.
Each gets the largest context and a predicted decode speed (with the KV cache of
the minimum context, so that a placement's speed does not depend on how much
more context it holds); the plan takes the fastest that holds the minimum context
and lists the others as the trade-off.
"""

from __future__ import annotations

from typing import Sequence

from ..units import MIB
from .fit import largest_fitting
from ..memory.estimate import MemoryEstimate
from ..memory.placement import Placement
from .sizer import CacheTypeOption, Candidate, Sizer
from .device import Device
from ..model.spec import ModelSpec
from .speed import (CPU_FLOPS_PER_CORE, CPU_GEMM_FLOPS_PER_CORE, TokenBytes, Tiers, gpu_bandwidth,
                    prompt_tokens_per_s, rpc_link_bytes, rpc_token_s)

def disk_bytes(sz: Sizer, est: MemoryEstimate) -> int:
    """Weight bytes that do not fit in MemAvailable and are read from the file (page cache misses)."""
    return max(est.host.total_bytes - sz.host.free_bytes, 0)


def fits(sz: Sizer, pl: Placement, n_ctx: int) -> bool:
    """The cards hold their share; the host holds everything but the weights that may spill to the file."""
    return sz.fits(pl, n_ctx, weights_may_spill=True)


def _placed(sz: Sizer, idx: Sequence[int], ngl: int, n_ctx: int, n_cpu_moe: int) -> Placement | None:
    """``ngl`` slots over the cards ``idx`` (rebalanced when one is short), or all on the CPU for ``ngl == 0``."""
    if ngl <= 0 or not idx:
        return Placement() if fits(sz, Placement(), n_ctx) else None
    return sz.balanced_split(idx, n_ctx, n_gpu_layers=ngl, n_cpu_moe=n_cpu_moe, weights_may_spill=True)


def token_bytes(sz: Sizer, pl: Placement, est: MemoryEstimate, n_ctx: int) -> tuple[TokenBytes, list[int]]:
    """Bytes a decoded token reads from GPU, host and disk, and per GPU (for per-card bandwidth)."""
    spec = sz.spec
    frac = spec.n_expert_used / spec.n_expert if spec.n_expert else 1.0

    def layer_read(il: int, experts_here: bool) -> int:
        layer = spec.layers[il]
        dense = layer.weights_bytes - layer.expert_bytes
        return dense + (int(layer.expert_bytes * frac) if experts_here else 0)

    slots = pl.slots(spec.n_layer_all)
    per_gpu = [0] * len(pl.gpus)
    host = 0
    for il in range(spec.n_layer):  # NextN/MTP blocks are not loaded (ModelSpec.nextn_weights_bytes)
        d = slots[il]
        layer = spec.layers[il]
        if d is None:
            host += layer_read(il, True)
        else:
            experts_on_host = il < pl.n_cpu_moe
            per_gpu[d] += layer_read(il, not experts_on_host)
            if experts_on_host:
                host += int(layer.expert_bytes * frac)
    head = spec.token_embd_bytes if spec.output_tied else spec.output_bytes
    out_dev = slots[spec.n_layer_all]
    if out_dev is None:
        host += head
    else:
        per_gpu[out_dev] += head
    # Attention reads the KV cache, on average half full.
    for p, dev in enumerate(est.gpus):
        per_gpu[p] += dev.kv_bytes // 2
    host += est.host.kv_bytes // 2
    disk = min(disk_bytes(sz, est), host)
    return TokenBytes(gpu=sum(per_gpu), host=host - disk, disk=disk), per_gpu


def speed(sz: Sizer, pl: Placement, est: MemoryEstimate, n_ctx: int, tiers: Tiers) -> tuple[float, float, TokenBytes]:
    """(decode tokens/s, prompt tokens/s, bytes per token) of a placement.

    Decoding a token: each GPU streams its share at its bandwidth; the host streams its
    share from RAM (and disk), or computes it, whichever is slower (a small model with a
    large vocabulary is compute-bound on a CPU); plus a fixed per-token cost (graph
    launch, sampling).
    """
    tb, per_gpu = token_bytes(sz, pl, est, n_ctx)
    spec = sz.spec
    params_per_byte = spec.n_params / max(spec.weights_bytes, 1)
    gpu_s = 0.0
    out_pos = pl.slots(spec.n_layer_all)[spec.n_layer_all]  # the position of the device holding the output layer
    for pos, (b, i) in enumerate(zip(per_gpu, pl.gpus)):
        dev = sz.gpus[i]
        stream_s = b / gpu_bandwidth(dev.name, dev.bandwidth_bytes_per_s)
        # A worker's CPU computes its share as the host computes its own: the slower of reading and computing.
        per_core = dev.cpu_flops_per_core or CPU_FLOPS_PER_CORE
        compute_s = 2.0 * b * params_per_byte / (dev.cpu_threads * per_core) if _cpu_worker(dev) else 0.0
        gpu_s += max(stream_s, compute_s)
        if b and dev.kind == "rpc":
            # A worker's device adds its link: a round trip, the bytes a token moves over it, and the graph ggml-rpc
            # sends and runs there.
            gpu_s += rpc_token_s(dev.link_latency_s, rpc_link_bytes(spec.n_embd, spec.n_vocab, pos == out_pos),
                                 dev.link_bandwidth_bytes_per_s)
    host_stream_s = tb.host / tiers.host + tb.disk / tiers.disk
    host_compute_s = 2.0 * (tb.host + tb.disk) * params_per_byte / tiers.cpu_flops
    seconds = gpu_s + max(host_stream_s, host_compute_s) + tiers.token_overhead_s
    decode = 1.0 / seconds
    frac = spec.n_expert_used / spec.n_expert if spec.n_expert else 1.0
    head = spec.token_embd_bytes if spec.output_tied else spec.output_bytes
    active_bytes = head + sum(layer.weights_bytes - layer.expert_bytes * (1 - frac)
                              for layer in spec.layers[:spec.n_layer])
    active_params = active_bytes * params_per_byte
    host_w = max(est.host.weights_bytes - spec.token_embd_bytes, 0)
    total_w = max(sum(d.weights_bytes for d in est.gpus) + host_w, 1)
    # Workers' CPUs evaluate their share of a prompt at a CPU's matrix-matrix speed, not a card's.
    cpu_workers = {sz.gpus[i].label: sz.gpus[i] for i in pl.gpus if _cpu_worker(sz.gpus[i])}
    workers = [(d.weights_bytes / total_w, cpu_workers[d.device].cpu_threads * CPU_GEMM_FLOPS_PER_CORE)
               for d in est.gpus if d.device in cpu_workers]
    cards_w = sum(d.weights_bytes for d in est.gpus if d.device not in cpu_workers)
    # Host layers go to a card for a prompt (op_offload) only where there is a local card.
    local_card = any(sz.gpus[i].kind != "rpc" for i in pl.gpus)
    if pl.cpu_only:
        prompt = prompt_tokens_per_s(active_params, 0.0, host_w, sz.req.n_ubatch, tiers, op_offload=False)
    else:
        prompt = prompt_tokens_per_s(active_params, min(cards_w / total_w, 1.0), host_w, sz.req.n_ubatch, tiers,
                                     op_offload=local_card, workers=workers)
    return decode, prompt, tb


def cpu_flops_for_step(spec: ModelSpec, step_s: float, threads: int, n_ctx: int = 512) -> float:
    """The decode FLOP/s per thread with which ``speed`` predicts ``step_s`` a token for ``spec`` decoding alone on
    the host at ``n_ctx`` (the prediction is linear in 1 / flops: read at one figure, solved for the measured
    step; ``service.engine.cpu_speed`` measures the step)."""
    from .request import PlanRequest

    req = PlanRequest(n_ctx=n_ctx, cpu_cores=threads)
    room = 1 << 50
    sz = Sizer(spec, [], Device(index=0, name="host memory", free_bytes=room, total_bytes=room, kind="host"), req,
               "f16")
    probe = 1e12
    tiers = Tiers(host=1e18, disk=1e18, cpu_flops=probe)
    work = (1.0 / speed(sz, Placement(), sz.estimate(Placement(), n_ctx), n_ctx, tiers)[0]
            - tiers.token_overhead_s) * probe
    return work / max(step_s - tiers.token_overhead_s, 1e-4) / threads


def _cpu_worker(dev: Device) -> bool:
    """A worker's CPU device whose threads its ``/status`` reported."""
    return dev.kind == "rpc" and dev.remote_kind == "cpu" and dev.cpu_threads > 0


def plan_offload(sz: Sizer, idx: list[int], floor: int, cap: int) -> CacheTypeOption | None:
    """The fastest partial-offload placement that holds ``floor`` tokens, with the trade-off listed."""
    spec = sz.spec
    tiers = Tiers.for_request(sz.req)
    full = spec.n_layer_all + 1
    candidates: list[Candidate] = []

    def add(ngl: int, n_cpu_moe: int) -> bool:
        pl = _placed(sz, idx, ngl, floor, n_cpu_moe)
        if pl is None:
            return False
        best_ctx = largest_fitting(lambda c: _placed(sz, idx, ngl, c, n_cpu_moe) is not None, floor, cap)
        pl = _placed(sz, idx, ngl, best_ctx, n_cpu_moe) or pl
        est = sz.estimate(pl, best_ctx)
        at_floor = _placed(sz, idx, ngl, floor, n_cpu_moe) or pl
        dec, pro, _ = speed(sz, at_floor, sz.estimate(at_floor, floor), floor, tiers)
        if not ngl:
            what = "all layers on the CPU"
        elif n_cpu_moe:
            what = f"all {full} slots on the GPU, experts of {n_cpu_moe} blocks in host memory"
        else:
            what = f"{ngl} of {full} slots on the GPU"
        disk = disk_bytes(sz, est)
        candidates.append(Candidate(pl, best_ctx, dec, pro, sum(d.weights_bytes for d in est.gpus),
                                    est.host.weights_bytes - disk, disk, what))
        return True

    if idx and spec.n_expert and any(layer.expert_bytes for layer in spec.layers[: spec.n_layer_all]):
        # Experts of the first blocks in host memory, everything else on the GPU: the fewest that fit first.
        n_moe = spec.n_layer_all
        lo, hi = 1, n_moe
        if add(full, n_moe):
            candidates.pop()
            while lo < hi:
                mid = (lo + hi) // 2
                if _placed(sz, idx, full, floor, mid) is not None:
                    hi = mid
                else:
                    lo = mid + 1
            for k in sorted({lo, min(lo + 4, n_moe), min(lo + 12, n_moe), n_moe}):
                add(full, k)
    # Whole layers: the most that fit first, then a few fewer for more context.
    listed = 0
    for ngl in (range(full - 1, -1, -1) if idx else (0,)):
        if add(ngl, 0):
            listed += 1
            if listed >= 6:
                break
    if idx and listed and not any(c.placement.cpu_only for c in candidates):
        add(0, 0)
    if not candidates:
        return None
    candidates.sort(key=lambda c: (-c.decode_tokens_per_s, -c.n_ctx))
    chosen = candidates[0]
    est = sz.estimate(chosen.placement, chosen.n_ctx)
    warnings = []
    if chosen.disk_weights_bytes:
        warnings.append(
            f"{chosen.disk_weights_bytes / MIB:.0f} MiB of weights exceed available host memory and are read from "
            "the mmapped file (disk tier): expect slow generation"
        )
    return CacheTypeOption(sz.cache, chosen.n_ctx, "cpu" if chosen.placement.cpu_only else "partial_offload",
                           chosen.placement, est, candidates=tuple(candidates), warnings=tuple(warnings))

