"""llama.cpp's no_alloc dry run: what a load would allocate, measured without allocating.

Model params ``no_alloc = True`` and ``load_mode = 0`` (LLAMA_LOAD_MODE_NONE;
with mmap llama.cpp aborts on ``GGML_ASSERT(!ml.no_alloc)``) make
``llama_model_load_from_file`` read only the header; ``llama_init_from_model``
then sizes the KV cache and runs ``sched_reserve`` as a real load does, and
logs the figures. Because an abort kills the process, the dry run always runs
in a child process (``python -m service.engine.dryrun``), with a timeout. A
sparse header-only file (``sizing.gguf.fixtures``) is enough: no weight is read.

The API is small: ``dry_run(path, cfg) -> DryRunResult``; ``dry_run_many``
loads the model once and creates one context per configuration (the load,
mostly the vocabulary, is the slow part).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

from sizing.config import ContextConfig

from . import loglines as L
from .params import ContextParams, ModelParams, context_params

MIB = 1 << 20
LOG_TAIL_LINES = 40

FailureKind = Literal["refused", "load_failed", "timeout", "crashed"]


@dataclass(frozen=True)
class KvCacheReport:
    """One ``llama_kv_cache: size = ...`` line: a cache (the full one, or the SWA one of an iSWA pair)."""

    size_mib: float
    cells: int
    layers: int
    seqs: int
    n_seq_max: int
    type_k: str
    k_mib: float
    type_v: str
    v_mib: float
    swa: bool = False


@dataclass(frozen=True)
class DryRunFailure:
    """llama.cpp refused the configuration (or the child died): why, and the end of its log."""

    kind: FailureKind
    message: str
    log_tail: tuple[str, ...] = ()


@dataclass(frozen=True)
class DryRunResult:
    """What llama.cpp would allocate for one context configuration (MiB at the log's 0.01 resolution)."""

    cfg: ContextConfig
    n_ctx: int = 0
    """n_ctx after llama.cpp's padding (``llama_n_ctx``)."""
    n_ctx_seq: int = 0
    kv_caches: tuple[KvCacheReport, ...] = ()
    compute_mib: dict[str, float] = field(default_factory=dict)
    """``sched_reserve`` compute buffer per buffer type (``CPU``, ``CUDA0``, ...)."""
    output_mib: float = 0.0
    flash_attn: bool | None = None
    failure: DryRunFailure | None = None
    log_tail: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.failure is None

    @property
    def kv_mib(self) -> float:
        """Sum of the logged cache sizes (each rounded to 0.01 MiB by the log)."""
        return round(sum(c.size_mib for c in self.kv_caches), 2)

    @property
    def compute_total_mib(self) -> float:
        return round(sum(self.compute_mib.values()), 2)

    def cells(self, swa: bool = False) -> int:
        """Cells per stream of the full (or SWA) cache; 0 when there is none."""
        return next((c.cells for c in self.kv_caches if c.swa == swa), 0)


class DryRunError(Exception):
    """The dry run could not be run at all (bad arguments, no Python, unreadable file)."""


def parse_context_log(cfg: ContextConfig, lines: Sequence[str], created: bool) -> DryRunResult:
    """The figures of one context creation's log lines (pure; exposed for tests)."""
    kv: list[KvCacheReport] = []
    compute: dict[str, float] = {}
    output = 0.0
    n_ctx = n_ctx_seq = 0
    fa: bool | None = None
    next_is_swa = False
    for line in lines:
        if m := L.ISWA_CACHE.search(line):
            next_is_swa = m.group(1) == "SWA"
        elif m := L.KV_CACHE.search(line):
            g = m.groups()
            kv.append(KvCacheReport(float(g[0]), int(g[1]), int(g[2]), int(g[3]), int(g[4]), g[5], float(g[6]), g[7], float(g[8]), next_is_swa))
            next_is_swa = False
        elif m := L.COMPUTE_BUFFER.search(line):
            compute[m.group(1)] = compute.get(m.group(1), 0.0) + float(m.group(2))
        elif m := L.OUTPUT_BUFFER.search(line):
            output += float(m.group(2))
        elif m := L.N_CTX.search(line):
            n_ctx = int(m.group(1))
        elif m := L.N_CTX_SEQ.search(line):
            n_ctx_seq = int(m.group(1))
        elif m := L.FLASH_ATTN.search(line):
            fa = {"enabled": True, "disabled": False}.get(m.group(1))
        elif m := L.FLASH_ATTN_RESOLVED.search(line):
            fa = m.group(1).lower() == "enabled"
    tail = tuple(lines[-LOG_TAIL_LINES:])
    failure = None
    if not created:
        errors = [ln for ln in lines if "error" in ln.lower() or "requires" in ln or "does not" in ln]
        failure = DryRunFailure("refused", errors[-1].strip() if errors else "llama_init_from_model returned NULL", tail)
    return DryRunResult(cfg, n_ctx, n_ctx_seq, tuple(kv), compute, output, fa, failure, tail)


def _worker_command() -> list[str]:
    return [sys.executable, "-m", "service.engine.dryrun"]


def dry_run_many(
    path: str, cfgs: Sequence[ContextConfig], model: ModelParams = ModelParams(), timeout_s: float = 60
) -> list[DryRunResult]:
    """Load ``path`` once without allocating (with ``model``'s placement) and create one context per configuration.

    The parameters are the engine's (``service.engine.params``): what is measured is what would be loaded."""
    if not os.path.exists(path):
        raise DryRunError(f"no such model file: {path}")
    request = json.dumps({"path": path, "model": model.to_json(),
                          "contexts": [context_params(c).to_json() for c in cfgs]})
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        proc = subprocess.run(
            _worker_command(), input=request, capture_output=True, text=True, timeout=timeout_s, env=env, check=False
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        tail = tuple(out.splitlines()[-LOG_TAIL_LINES:])
        return [DryRunResult(c, failure=DryRunFailure("timeout", f"dry run exceeded {timeout_s} s", tail)) for c in cfgs]
    except OSError as exc:
        raise DryRunError(f"could not start the dry run: {exc}") from exc
    results: dict[int, DryRunResult] = {}
    load_failure: DryRunFailure | None = None
    log: list[str] = []
    for raw in proc.stdout.splitlines():
        if not raw.startswith("{"):
            continue
        msg = json.loads(raw)
        if msg.get("event") == "context":
            lines = msg["log"]
            log = lines
            results[msg["index"]] = parse_context_log(cfgs[msg["index"]], lines, msg["created"])
        elif msg.get("event") == "load_failed":
            load_failure = DryRunFailure("load_failed", f"llama.cpp could not load {path}", tuple(msg["log"][-LOG_TAIL_LINES:]))
    out: list[DryRunResult] = []
    for i, c in enumerate(cfgs):
        if i in results:
            out.append(results[i])
        elif load_failure is not None:
            out.append(DryRunResult(c, failure=load_failure))
        else:
            tail = tuple((proc.stderr or "").splitlines()[-LOG_TAIL_LINES:]) or tuple(log[-LOG_TAIL_LINES:])
            out.append(DryRunResult(c, failure=DryRunFailure("crashed", f"dry run process exited with {proc.returncode}", tail)))
    return out


def dry_run(path: str, cfg: ContextConfig, model: ModelParams = ModelParams(), timeout_s: float = 60) -> DryRunResult:
    """What llama.cpp would allocate for ``cfg`` (a failure, typed, when it refuses)."""
    return dry_run_many(path, [cfg], model=model, timeout_s=timeout_s)[0]


# ---- the child process -----------------------------------------------------------------------


def _worker() -> int:  # pragma: no cover - runs in the child
    import ctypes

    import llama_cpp

    from .params import apply_context_params, apply_model_params

    req = json.loads(sys.stdin.read())
    buf: list[str] = []
    partial = [""]

    @llama_cpp.llama_log_callback  # type: ignore[misc]
    def _cb(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        s = partial[0] + (text.decode("utf-8", "replace") if text else "")
        *lines, partial[0] = s.split("\n")
        buf.extend(lines)

    llama_cpp.llama_log_set(_cb, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()

    def emit(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    mp = llama_cpp.llama_model_default_params()
    keep = apply_model_params(mp, ModelParams.from_json(req["model"]))
    mp.no_alloc = True
    mp.load_mode = 0  # LLAMA_LOAD_MODE_NONE: with mmap, no_alloc aborts
    model = llama_cpp.llama_model_load_from_file(req["path"].encode(), mp)
    if not model:
        emit({"event": "load_failed", "log": buf + [partial[0]]})
        return 1
    for i, c in enumerate(req["contexts"]):
        buf.clear()
        cp = llama_cpp.llama_context_default_params()
        apply_context_params(cp, ContextParams.from_json(c), n_threads=1)
        ctx = llama_cpp.llama_init_from_model(model, cp)
        emit({"event": "context", "index": i, "created": bool(ctx), "log": buf + ([partial[0]] if partial[0] else [])})
        if ctx:
            llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    del keep
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(_worker())
