"""JSON and table renderings of specs and plans: the one place figures are formatted."""

from __future__ import annotations

from ..model import arch as archs
from ..memory.compute import compute_mirrored
from .device import Device, free_memory_note
from ..units import mib
from ..memory.estimate import MemoryEstimate
from ..memory.placement import Placement
from .make import CacheTypeOption, Candidate, Plan
from ..model.spec import ModelSpec


def spec_json(spec: ModelSpec) -> dict[str, object]:
    """The probe's answer: the file's shape, read from the header."""
    main = spec.layers[: spec.n_layer]
    return {
        "architecture": spec.architecture,
        "name": spec.name,
        "source": spec.source.display,
        "shards": list(spec.source.shards),
        "n_ctx_train": spec.n_ctx_train,
        "block_count": spec.n_layer_all,
        "n_layer": spec.n_layer,
        "n_embd": spec.n_embd,
        "n_vocab": spec.n_vocab,
        "head_count": sorted({layer.n_head for layer in main}),
        "head_count_kv": sorted({layer.n_head_kv for layer in main}),
        "key_length": sorted({layer.n_embd_head_k for layer in main}),
        "value_length": sorted({layer.n_embd_head_v for layer in main}),
        "sliding_window": spec.n_swa,
        "sliding_layers": [layer.index for layer in main if layer.is_swa],
        "expert_count": spec.n_expert,
        "expert_used_count": spec.n_expert_used,
        "mla": None if spec.mla is None else vars(spec.mla),
        "ssm": None if spec.ssm is None else vars(spec.ssm),
        "state": None if spec.state is None else vars(spec.state),
        "kv_layers": [layer.index for layer in spec.layers if layer.has_kv],
        "state_layers": [layer.index for layer in main if layer.has_state],
        "memory": archs.traits(spec.architecture).memory,
        "architecture_known": spec.arch_known,
        "compute_model": "simulated (mirrored graph)" if compute_mirrored(spec) else "phase model (plans calibrated)",
        "quantization": spec.quantization,
        "file_type": spec.file_type,
        "file_size_bytes": spec.file_size_bytes,
        "weights_bytes": spec.weights_bytes,
        "nextn_layers": spec.n_layer_all - spec.n_layer,
        "nextn_weights_bytes": spec.nextn_weights_bytes,
        # NextN/MTP blocks: not loaded, not counted, unless a plan loads the MTP head (its ``mtp`` line)
        "nextn_loaded": False,
        "n_tensors": len(spec.tensors),
        "gguf_version": spec.version,
        "alignment": spec.alignment,
        "data_offset": spec.data_offset,
    }


def device_json(dev: Device) -> dict[str, object]:
    """A device as the answers show it; a card's backend and whether its free memory was read
    (``free_memory``: ``reported``, ``unreported`` with the margin and ``free_note`` saying what was planned on,
    ``shared`` for an integrated GPU)."""
    out: dict[str, object] = {"index": dev.index, "name": dev.name, "kind": dev.kind, "label": dev.label,
                              "free_mib": mib(dev.free_bytes), "total_mib": mib(dev.total_bytes)}
    if dev.endpoint is not None:  # a worker's device: the host it is on, and what it is there
        out.update(host=dev.endpoint, remote_kind=dev.remote_kind)
    if dev.kind == "gpu":
        out.update(backend=dev.backend.prefix, gpu_type=dev.gpu_type, free_memory=dev.free_memory)
        if dev.device_id:
            out["device_id"] = dev.device_id
        if dev.free_memory != "reported":
            out.update(free_margin_mib=mib(dev.free_margin_bytes), free_note=free_memory_note(dev))
    return out


def estimate_json(est: MemoryEstimate, plan: Plan) -> dict[str, object]:
    by_label = {g.label: g for g in plan.gpus}
    devices = []
    for d in est.devices:
        entry = d.to_json()
        dev = plan.host if d.device == "CPU" else by_label.get(d.device)
        if dev is not None:
            entry["name"] = dev.name
            entry["free_mib"] = mib(dev.free_bytes)
            entry["free_memory"] = dev.free_memory
            entry["free_after_mib"] = mib(dev.free_bytes - d.total_bytes)
            entry["missing_mib"] = mib(max(d.total_bytes - dev.free_bytes, 0))
        devices.append(entry)
    return {
        "n_ctx": est.cfg.n_ctx,
        "type_k": est.cfg.type_k,
        "type_v": est.cfg.type_v,
        "flash_attn": est.flash_attn,
        "kv_cells": {"full": est.kv_cells.full, "swa": est.kv_cells.swa},
        "kv_mib": mib(est.kv_bytes),
        "state_mib": mib(est.state_bytes),
        "total_mib": mib(est.total_bytes),
        "sources": est.sources.to_json(),
        "embedding": None if est.embedding is None else est.embedding.to_json(),
        "devices": devices,
    }


def placement_json(pl: Placement, plan: Plan) -> dict[str, object]:
    """Where a row's layers go: llama.cpp's n_gpu_layers over which devices (``gpus``: positions in the plan's
    ``devices``, the workers' first: a card's index where no worker is named, unambiguous where both are), the
    split, expert blocks on the host."""
    return {
        "n_gpu_layers": pl.n_gpu_layers,
        "gpus": list(pl.gpus),
        "tensor_split": list(pl.tensor_split),
        "n_cpu_moe": pl.n_cpu_moe,
        "description": describe_placement(pl, plan),
    }


def describe_placement(pl: Placement, plan: Plan) -> str:
    """A placement in a few words: ``CPU``, ``CUDA0``, ``CUDA0+CUDA1``, ``20/33 layers on CUDA0``, experts on host."""
    if pl.cpu_only:
        return "CPU only"
    full = plan.model.n_layer_all + 1
    cards = "+".join(plan.gpus[i].label for i in pl.gpus)
    out = cards if pl.n_gpu_layers >= full else f"{pl.n_gpu_layers}/{full} layers on {cards}"
    if pl.n_cpu_moe:
        out += f", experts of {pl.n_cpu_moe} blocks on the host"
    return out


def option_json(o: CacheTypeOption, plan: Plan) -> dict[str, object]:
    """One cache type's row: its context, its placement, its predicted speed, where its figures came from."""
    return {
        "cache_type": o.cache_type,
        "n_ctx": o.n_ctx,
        "largest_n_ctx": o.largest_n_ctx or o.n_ctx,
        "verdict": o.verdict,
        "refusal": o.refusal,
        "error": o.error,
        "n_gpu_layers": o.placement.n_gpu_layers,
        "placement": placement_json(o.placement, plan),
        "decode_tokens_per_s": None if o.decode_tokens_per_s is None else round(o.decode_tokens_per_s, 2),
        "prompt_tokens_per_s": None if o.prompt_tokens_per_s is None else round(o.prompt_tokens_per_s, 1),
        "kv_mib": None if o.estimate is None else mib(o.estimate.kv_bytes),
        "state_mib": None if o.estimate is None else mib(o.estimate.state_bytes),
        "total_mib": None if o.estimate is None else mib(o.estimate.total_bytes),
        "sources": None if o.estimate is None else o.estimate.sources.to_json(),
    }


def plan_json(plan: Plan) -> dict[str, object]:
    """The dry-run answer: per cache type the largest context, the chosen placement, the verdict."""
    spec = plan.model
    return {
        "model": {
            "name": spec.name,
            "architecture": spec.architecture,
            "n_ctx_train": spec.n_ctx_train,
            "n_layer": spec.n_layer,
            "block_count": spec.n_layer_all,
            "file_size_mib": mib(spec.file_size_bytes),
            "quantization": spec.quantization,
        },
        "devices": [device_json(g) for g in plan.gpus],
        "host": device_json(plan.host),
        "ctx_cap": plan.ctx_cap,
        "verdict": plan.verdict,
        "refusal": plan.refusal,
        "reasons": list(plan.reasons),
        "warnings": list(plan.warnings),
        "chosen": {
            "cache_type": plan.cfg.type_k,
            "cache_type_reason": plan.cache_type_reason,
            "n_ctx": plan.cfg.n_ctx,
            "flash_attn": plan.cfg.flash_attn,
            "n_ubatch": plan.cfg.n_ubatch,
            "n_seq_max": plan.cfg.n_seq_max,
            "kv_unified": plan.cfg.kv_unified,
            "swa_full": plan.cfg.swa_full,
            "embedding_tokens": plan.cfg.embedding_tokens,
            "draft_rows": plan.cfg.draft_rows,
            "n_gpu_layers": plan.placement.n_gpu_layers,
            "tensor_split": list(plan.placement.tensor_split),
            "gpus": list(plan.placement.gpus),
            "n_cpu_moe": plan.placement.n_cpu_moe,
            "cpu_repack": plan.request.cpu_repack,
            "cpu_repack_reason": plan.request.cpu_repack_reason,
        },
        "draft": None if plan.estimate is None or plan.estimate.draft is None else plan.estimate.draft.to_json(),
        "draft_refusal": plan.draft_refusal,
        "mtp": None if plan.estimate is None or plan.estimate.mtp is None else plan.estimate.mtp.to_json(),
        "mtp_refusal": plan.mtp_refusal,
        "projector": None if plan.estimate is None or plan.estimate.projector is None
        else plan.estimate.projector.to_json(),
        "candidates": [candidate_json(c, plan) for c in plan.candidates],
        "predicted_speed": None if plan.predicted_decode_tokens_per_s is None else {
            "decode_tokens_per_s": round(plan.predicted_decode_tokens_per_s, 2),
            "prompt_tokens_per_s": round(plan.predicted_prompt_tokens_per_s or 0.0, 1),
        },
        "estimate": None if plan.estimate is None else estimate_json(plan.estimate, plan),
        "cache_types": [option_json(o, plan) for o in plan.options],
        "figures": None if plan.estimate is None else plan.estimate.sources.to_json(),
        "calibration": None if plan.calibration is None else {
            "backend": plan.calibration.backend,
            "samples": plan.calibration.n_samples,
        },
    }


def candidate_json(c: Candidate, plan: Plan) -> dict[str, object]:
    return {
        "description": c.description,
        "n_ctx": c.n_ctx,
        "n_gpu_layers": c.placement.n_gpu_layers,
        "gpus": list(c.placement.gpus),
        "tensor_split": list(c.placement.tensor_split),
        "n_cpu_moe": c.placement.n_cpu_moe,
        "gpu_weights_mib": mib(c.gpu_weights_bytes),
        "host_weights_mib": mib(c.host_weights_bytes),
        "disk_weights_mib": mib(c.disk_weights_bytes),
        "decode_tokens_per_s": round(c.decode_tokens_per_s, 2),
        "prompt_tokens_per_s": round(c.prompt_tokens_per_s, 1),
    }


def _on_off(flag: bool | None) -> str:
    return "host default" if flag is None else "on" if flag else "off"


def plan_table(plan: Plan) -> str:
    """A short human rendering of a plan, for the command line and the log."""
    spec = plan.model
    lines = [
        f"model {spec.name} ({spec.architecture}, {spec.quantization}, {mib(spec.file_size_bytes)} MiB, "
        f"n_ctx_train {spec.n_ctx_train}, {spec.n_layer} layers)",
        "devices: " + (", ".join(f"{g.label} {g.name} {mib(g.free_bytes)}/{mib(g.total_bytes)} MiB free"
                                 + {"reported": "", "unreported": " (not reported: the total less a margin)",
                                    "shared": " (the host's memory)"}[g.free_memory] for g in plan.gpus)
                       or f"none (CPU; host {mib(plan.host.free_bytes)} MiB available)"),
        f"{'cache type':<10} {'n_ctx':>8} {'largest':>8} {'KV MiB':>10} {'total MiB':>10} {'decode t/s':>10}  "
        f"{'figures':<9} verdict, placement",
    ]
    for o in plan.options:
        kv = f"{mib(o.estimate.kv_bytes + o.estimate.state_bytes):>10}" if o.estimate else f"{'-':>10}"
        tot = f"{mib(o.estimate.total_bytes):>10}" if o.estimate else f"{'-':>10}"
        dec = f"{o.decode_tokens_per_s:>10.1f}" if o.decode_tokens_per_s is not None else f"{'-':>10}"
        src = ("measured" if o.estimate and o.estimate.sources.compute == "measured" else "simulated") if o.estimate else "-"
        where = describe_placement(o.placement, plan) if o.estimate is not None and o.verdict != "refused" else ""
        lines.append(f"{o.cache_type:<10} {o.n_ctx:>8} {o.largest_n_ctx or o.n_ctx:>8} {kv} {tot} {dec}  {src:<9} "
                     f"{o.verdict}{', ' + where if where else ''}{' (' + o.error + ')' if o.error else ''}")
    c = plan.cfg
    lines.append(
        f"chosen: {plan.verdict}, n_ctx {c.n_ctx}, type_k {c.type_k}, type_v {c.type_v}, flash_attn {c.flash_attn}, "
        f"n_gpu_layers {plan.placement.n_gpu_layers}, swa_full {c.swa_full}, "
        f"cpu_repack {_on_off(plan.request.cpu_repack)}"
        + (f" ({plan.request.cpu_repack_reason})" if plan.request.cpu_repack_reason else "")
    )
    if plan.estimate is not None:
        by_label = {g.label: g for g in plan.gpus}
        for d in plan.estimate.devices:
            dev = plan.host if d.device == "CPU" else by_label.get(d.device)
            free = dev.free_bytes if dev is not None else 0
            lines.append(
                f"  {d.device:<6} layers {len(d.layers):>3}  weights {mib(d.weights_bytes):>9}  "
                + "".join(f"+ {b} {mib(n)}  " for b, n in d.extra_weights)
                + f"KV {mib(d.kv_bytes):>8}  "
                + (f"state {mib(d.state_bytes):>7}  " if d.state_bytes else "")
                + f"compute {mib(d.compute_bytes):>8}  "
                + (f"draft model {mib(d.draft_model_bytes)}  " if d.draft_model_bytes else "")
                + (f"projector {mib(d.projector_bytes)}  " if d.projector_bytes else "")
                + f"allowance {mib(d.allowance_bytes + d.pool_bytes):>6}  "
                f"free {mib(free):>9}  "
                + (f"missing {mib(d.total_bytes - free)}" if d.total_bytes > free else f"spare {mib(free - d.total_bytes)}")
            )
    if plan.estimate is not None and plan.estimate.embedding is not None:
        e = plan.estimate.embedding
        lines.append(f"embedding context: {e.n_ubatch} tokens a batch, {e.n_seq_max} inputs; KV {mib(e.kv_bytes)}, "
                     f"compute {mib(e.compute_bytes)}, output {mib(e.output_bytes)} MiB (logits and embeddings of "
                     f"every token), total {mib(e.total_bytes)} MiB")
    if plan.estimate is not None and plan.estimate.draft is not None:
        dm = plan.estimate.draft
        j = dm.to_json()
        lines.append(f"draft model {dm.name} on {dm.device}: weights {j['weights_mib']}, KV {j['kv_mib']}, compute "
                     f"{j['compute_mib']}, output {j['output_mib']} MiB (n_ctx {j['n_ctx']}), total {j['total_mib']} MiB")
    if plan.estimate is not None and plan.estimate.mtp is not None:
        mm = plan.estimate.mtp
        lines.append(f"MTP head: NextN weights {mib(mm.weights_bytes)}, its context's KV {mib(mm.kv_bytes)}, compute "
                     f"{mib(mm.compute_bytes)}, output {mib(mm.output_bytes)}, hidden rows {mib(mm.rows_bytes)} MiB "
                     f"(llama.cpp's dry run of the MTP context), total {mib(mm.total_bytes)} MiB")
    if plan.estimate is not None and plan.estimate.projector is not None:
        pm = plan.estimate.projector
        lines.append(f"vision projector {pm.projector_type} ({pm.path}) on {pm.device}: weights {mib(pm.weights_bytes)}, "
                     f"compute {mib(pm.compute_bytes)} MiB ({pm.compute_source}, flash attention "
                     f"{'on' if pm.flash_attn else 'off'}); {pm.tokens_per_image or 'varying'} tokens an image")
    if plan.candidates:
        lines.append("partial-offload candidates (fastest first):")
        for cand in plan.candidates[:8]:
            lines.append(f"  {cand.description:<62} n_ctx {cand.n_ctx:>7}  decode {cand.decode_tokens_per_s:8.2f} "
                         f"tok/s  prompt {cand.prompt_tokens_per_s:8.1f} tok/s")
    if plan.predicted_decode_tokens_per_s is not None:
        lines.append(f"predicted speed: decode {plan.predicted_decode_tokens_per_s:.1f} tok/s, "
                     f"prompt {plan.predicted_prompt_tokens_per_s or 0:.0f} tok/s")
    lines.extend(f"note: {r}" for r in plan.reasons)
    lines.extend(f"warning: {w}" for w in plan.warnings)
    return "\n".join(lines)
