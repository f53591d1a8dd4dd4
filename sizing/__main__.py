"""Command line: ``python -m sizing probe|plan|memory PATH``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Sequence

from .errors import SizingError

if TYPE_CHECKING:
    from .memory import Projector


def _probe(args: argparse.Namespace) -> int:
    from .probe import probe_location
    from .plan.report import spec_json

    # PATH may also be an http(s) URL or hf://owner/repo/file.gguf[@revision] (header bytes only).
    spec = probe_location(args.path)
    data = spec_json(spec)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        for k, v in data.items():
            print(f"{k:<18} {v}")
    return 0


def _devices(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from .probe.devices import host_memory, inventory

    return inventory(declared_path=args.gpus), host_memory()


def _projector(args: argparse.Namespace) -> "Projector | None":
    """The ``--mmproj`` file as the plan's projector, with mtmd's compute buffer measured on the CPU backend (a
    child process) unless ``--no-measure``; on a card the bound stands in (``sizing.memory.projector``)."""
    if not args.mmproj:
        return None
    from .memory import Projector, mib_to_bytes
    from .probe.projector import probe_projector

    spec = probe_projector(args.mmproj)
    figures: dict[tuple[str, bool], int] = {}
    cap = None
    if not args.no_measure:
        from .probe.mtmd import measure_projector

        for fa in (True, False):
            measured = measure_projector(args.mmproj, fa)
            figures[("CPU", fa)] = mib_to_bytes(measured.compute_mib.get("CPU", 0.0))
            cap = measured.image_max_tokens
    return Projector(spec, offload=not args.no_mmproj_offload, figures=figures, image_max_tokens=cap)


def _plan(args: argparse.Namespace) -> int:
    from .probe.devices import ggml_features
    from .probe import probe_location
    from .plan.make import PlanRequest, make_plan
    from .memory.repack import auto_reason, auto_repack
    from .memory import DraftModel
    from .plan.report import plan_json, plan_table

    spec = probe_location(args.path)
    gpus, host = _devices(args)
    features = ggml_features()
    req = PlanRequest(
        n_ctx=args.ctx,
        cache_type=args.cache_type.lower(),
        cache_types=tuple(args.cache_types.split(",")),
        flash_attn=args.flash_attn,
        context_length=args.context_length,
        min_ctx=args.min_ctx,
        n_ubatch=args.ubatch,
        n_batch=max(args.ubatch, 512),
        n_seq_max=args.parallel,
        kv_unified=not args.no_kv_unified,
        embedding_tokens=args.embedding_tokens,
        embedding_gpu=args.embedding_gpu,
        draft_rows=args.draft_rows,
        draft=DraftModel(probe_location(args.draft_model), path=args.draft_model) if args.draft_model else None,
        draft_squeeze=args.draft_squeeze,
        projector=_projector(args),
        swa_full=args.swa_full,
        allow_offload=not args.no_offload,
        cpu_cores=os.cpu_count() or 1,
        # The service's default (GGUF_CPU_REPACK=auto), with the features of the ggml it would load.
        cpu_repack=auto_repack(features), cpu_repack_reason=auto_reason(features), cpu_features=features,
    )
    plan = make_plan(spec, gpus, host, req)
    print(json.dumps(plan_json(plan), indent=2) if args.json else plan_table(plan))
    return 0 if plan.fits else 3


def _memory(args: argparse.Namespace) -> int:
    from .memory.context import ContextConfig
    from .probe import probe_path
    from .memory.estimate import estimate

    spec = probe_path(args.path)
    cfg = ContextConfig(
        n_ctx=args.ctx,
        type_k=args.cache_type_k,
        type_v=args.cache_type_v,
        flash_attn=args.flash_attn,
        n_ubatch=args.ubatch,
        n_batch=max(args.ubatch, args.batch),
        n_seq_max=args.parallel,
        swa_full=args.swa_full,
        kv_unified=args.kv_unified,
    )
    est = estimate(spec, cfg)
    h = est.host
    data = {
        "weights_bytes": h.weights_bytes,
        "kv_bytes": h.kv_bytes,
        "kv_cells": {"full": est.kv_cells.full, "swa": est.kv_cells.swa},
        "compute_bytes": h.compute_bytes,
        "output_bytes": h.output_bytes,
        "total_bytes": h.total_bytes,
        "flash_attn": est.flash_attn,
    }
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        for k, v in data.items():
            print(f"{k:<14} {v}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sizing", description="Probe GGUF files and plan their memory.")
    sub = p.add_subparsers(dest="cmd", required=True)

    pr = sub.add_parser("probe", help="read a GGUF header")
    pr.add_argument("path")
    pr.add_argument("--json", action="store_true")
    pr.set_defaults(fn=_probe)

    pl = sub.add_parser("plan", help="largest context per KV cache type on these devices")
    pl.add_argument("path", help="a local file, an http(s) URL or hf://owner/repo/file.gguf[@revision]")
    pl.add_argument("--gpus", help="JSON file: [{name, free_mib, total_mib}, ...] (default: NVML, else host memory)")
    pl.add_argument("--ctx", type=int, default=None, help="requested n_ctx (default: largest that fits)")
    pl.add_argument("--cache-type", default="auto",
                    help="cache type to choose (default auto: the most precise whose context reaches the ceiling)")
    pl.add_argument("--cache-types", default="f16,q8_0,q4_0", help="cache types to report")
    pl.add_argument("--flash-attn", choices=["on", "off", "auto"], default="auto")
    pl.add_argument("--context-length", "--ctx-ceiling", dest="context_length", type=int, default=None,
                    help="ceiling on n_ctx (GGUF_CONTEXT_LENGTH)")
    pl.add_argument("--min-ctx", type=int, default=4096)
    pl.add_argument("--ubatch", type=int, default=512)
    pl.add_argument("--parallel", type=int, default=4, help="slots (default 4 with a unified cache: the service's)")
    pl.add_argument("--no-kv-unified", action="store_true", help="a stream of n_ctx / parallel cells per slot")
    pl.add_argument("--swa-full", action="store_true")
    pl.add_argument("--embedding-tokens", type=int, default=512,
                    help="tokens of the /v1/embeddings context (default 512, the service's; 0: none)")
    pl.add_argument("--embedding-gpu", action="store_true",
                    help="size the embedding context on GPU plans too (the service's GGUF_EMBEDDINGS=on)")
    pl.add_argument("--draft-rows", type=int, default=63,
                    help="logits rows for self-speculation's drafts (default 63, the service's GGUF_DRAFT_MAX with "
                    "GGUF_SPECULATIVE=ngram; 0: none)")
    pl.add_argument("--draft-model", metavar="PATH_OR_URL", help="a draft model for speculative decoding, sized beside "
                    "the model (whole on the card of its output layer, or the host; the same context)")
    pl.add_argument("--draft-squeeze", action="store_true",
                    help="keep the draft even where it costs the model context (else it is left out, with figures)")
    pl.add_argument("--mmproj", metavar="PATH", help="a vision projector (mmproj GGUF) loaded beside the model: its "
                    "weights and compute buffer on the card of the output layer (or the host)")
    pl.add_argument("--no-mmproj-offload", action="store_true", help="keep the projector in host memory")
    pl.add_argument("--no-measure", action="store_true",
                    help="do not run mtmd to measure the projector's compute buffer (its bound is used)")
    pl.add_argument("--no-offload", action="store_true", help="refuse instead of keeping layers in host memory")
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(fn=_plan)

    me = sub.add_parser("memory", help="predicted bytes with everything on the host (CPU backend)")
    me.add_argument("path")
    me.add_argument("--ctx", type=int, required=True)
    me.add_argument("--cache-type-k", default="f16")
    me.add_argument("--cache-type-v", default="f16")
    me.add_argument("--flash-attn", choices=["on", "off", "auto"], default="auto")
    me.add_argument("--ubatch", type=int, default=512)
    me.add_argument("--batch", type=int, default=512)
    me.add_argument("--parallel", type=int, default=1)
    me.add_argument("--swa-full", action="store_true")
    me.add_argument("--kv-unified", action="store_true")
    me.add_argument("--json", action="store_true")
    me.set_defaults(fn=_memory)

    args = p.parse_args(argv)
    try:
        return int(args.fn(args))
    except SizingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
