"""llama.cpp's no_alloc dry run: what a load would allocate, measured without allocating.

Model params ``no_alloc = True`` and ``load_mode = 0`` (LLAMA_LOAD_MODE_NONE;
with mmap llama.cpp aborts on ``GGML_ASSERT(!ml.no_alloc)``) make
``llama_model_load_from_file`` read only the header; ``llama_init_from_model``
then sizes the KV cache and runs ``sched_reserve`` as a real load does, and
logs the figures. Because an abort kills the process, the dry run always runs
in a child process (``python -m service.engine.dryrun``), with a timeout. A
sparse header-only file (``sizing.testing.fixtures``) is enough: no weight is read.

The API is small: ``dry_run(path, cfg) -> DryRunResult``; ``dry_run_many``
loads the model once and creates one context per configuration (the load,
mostly the vocabulary, is the slow part); ``DryRunWorker`` keeps the child and
its loaded model for many requests (calibration, ``service.engine.calibrate``):
one JSON line per request on its stdin, one per context on its stdout. A child
that dies (llama.cpp aborts) is restarted; a request that runs past its
timeout kills it and reports ``timeout``.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence

from sizing.memory import ContextConfig

from ..children import Child
from . import loglines as L
from .native import child_env
from .params import ContextParams, ModelParams, context_params

MIB = 1 << 20
LOG_TAIL_LINES = 40
log = logging.getLogger(__name__)

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
    """``sched_reserve`` compute buffer per buffer type (``CPU``, ``CUDA0``, ...): what the load allocates, i.e. the
    logged figure less ``overcount_mib``."""
    overcount_mib: dict[str, float] = field(default_factory=dict)
    """What the dry run's figure counts on a buffer type that the load does not allocate (``forced_norm_overcount``);
    empty where it counts nothing more."""
    output_mib: float = 0.0
    flash_attn: bool | None = None
    failure: DryRunFailure | None = None
    log_tail: tuple[str, ...] = ()
    state_mib: float = 0.0
    """The ``llama_memory_recurrent: size = ...`` line (recurrent and hybrid models), 0 without one."""
    state_layers: int = 0
    state_buffer_mib: dict[str, float] = field(default_factory=dict)
    """``RS buffer size`` per buffer (the recurrent state is allocated even in a dry run)."""
    layer_devices: dict[int, str] = field(default_factory=dict)
    """``load_tensors: layer N assigned to device D`` (debug lines of the load), when the load logged them."""

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


def forced_norm_overcount(lines: Sequence[str], n_embd: int) -> dict[str, int]:
    """Bytes per buffer type that a no_alloc context's ``compute buffer size`` counts and the real load does not.

    llama.cpp (``llama_context::graph_get_cb``) pins each layer's ``norm`` tensors to the layer's own device when
    everything is offloaded or the batch is under 32 tokens: otherwise the scheduler runs a layer's first norm on
    the previous layer's device and sends its output over as a second input beside the residual. The load sizes
    its buffers with ``ggml_backend_sched_reserve``, which keeps those pins; the dry run measures with
    ``ggml_backend_sched_reserve_size``, which resets the scheduler first (``ggml-backend.cpp``) and so drops them,
    in the one graph it measures (the first prompt graph; the later token and prompt graphs keep them). With
    pipeline parallelism each split input has ``sched copies`` copies allocated ahead of the graph and never
    freed, so every ``norm-<layer>`` input the measured graph has and the load's last graph has not costs the
    device ``copies x n_embd x n_tokens x 4`` bytes (measured: 5.00 MiB on the second of two ggml-rpc workers,
    n_embd 640, 512 tokens, 4 copies; the same figure with 256 tokens halved).

    Read from the scheduler's split headers (``GGML_SCHED_DEBUG``, ``loglines.parse_sched_graphs``); nothing is
    subtracted where the log does not show that shape (no copies, a norm of another size, fewer than the three
    graphs, unaligned sizes): the dry run's figure, above the load's, stands."""
    copies = next((int(m.group(1)) for ln in lines if (m := L.SCHED_COPIES.search(ln))), 1)
    graphs = L.parse_sched_graphs(lines)
    if copies < 2 or len(graphs) < 3 or n_embd <= 0:
        return {}
    measured, last = graphs[-3], graphs[-1]  # the prompt graph reserve_size measured; the one the load keeps
    if (measured.n_tokens, measured.n_seqs, measured.n_outputs) != (last.n_tokens, last.n_seqs, last.n_outputs):
        return {}
    norm = 4 * n_embd * measured.n_tokens  # F32
    if norm % 256:  # every backend's alignment divides it: the copies cost exactly their bytes
        return {}
    kept = {backend: {name for name, _ in inputs} for backend, inputs in last.splits}
    out: dict[str, int] = {}
    for backend, inputs in measured.splits:
        for name, size in inputs:
            if name in kept.get(backend, set()) or not L.SCHED_NORM_INPUT.fullmatch(name):
                continue
            if size != L.ggml_fmt_size(norm):
                return {}
            out[backend] = out.get(backend, 0) + copies * norm
    return out


def parse_context_log(cfg: ContextConfig, lines: Sequence[str], created: bool, n_embd: int = 0) -> DryRunResult:
    """The figures of one context creation's log lines (pure; exposed for tests); ``n_embd`` (the model's) lets
    ``forced_norm_overcount`` take out what the dry run counts and the load does not."""
    kv: list[KvCacheReport] = []
    compute: dict[str, float] = {}
    output = 0.0
    n_ctx = n_ctx_seq = 0
    fa: bool | None = None
    next_is_swa = False
    state_mib = 0.0
    state_layers = 0
    rs: dict[str, float] = {}
    for line in lines:
        if m := L.RECURRENT_STATE.search(line):
            state_mib += float(m.group(1))
            state_layers = int(m.group(3))
        elif m := L.RS_BUFFER.search(line):
            rs[m.group(1)] = rs.get(m.group(1), 0.0) + float(m.group(2))
        elif m := L.ISWA_CACHE.search(line):
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
    over = {b: round(n / MIB, 2) for b, n in forced_norm_overcount(lines, n_embd).items() if b in compute}
    for b, mib in over.items():
        compute[b] = round(compute[b] - mib, 2)
    tail = tuple(line for line in lines if not L.SCHED_SPLIT.search(line))[-LOG_TAIL_LINES:]
    failure = None
    if not created:
        errors = [ln for ln in lines if "error" in ln.lower() or "requires" in ln or "does not" in ln]
        failure = DryRunFailure("refused", errors[-1].strip() if errors else "llama_init_from_model returned NULL", tail)
    return DryRunResult(cfg, n_ctx, n_ctx_seq, tuple(kv), compute, over, output, fa, failure, tail,
                        state_mib=round(state_mib, 2), state_layers=state_layers, state_buffer_mib=rs)


WORKER_MODULE = "service.engine.dryrun"
"""The dry-run worker's module (``python -m``): this file's ``main``."""




class DryRunWorker:
    """A long-lived dry-run child: ``path`` loaded once (no_alloc, LLAMA_LOAD_MODE_NONE) with ``model``'s
    placement; ``measure`` creates and frees one context per configuration.

    llama.cpp may abort on a configuration: the child is then restarted (the model loaded again) and the
    next configuration measured; the one that killed it is reported ``crashed``. Thread-safe (one request
    at a time).
    """

    def __init__(self, path: str, model: ModelParams = ModelParams(), *, load_timeout_s: float = 120) -> None:
        if not os.path.exists(path):
            raise DryRunError(f"no such model file: {path}")
        self.path = path
        self.model = model
        self.load_timeout_s = load_timeout_s
        self._proc: Child | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._stderr: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self._lock = threading.Lock()
        self.load_log: tuple[str, ...] = ()
        """The load's log lines worth keeping (layer assignments, buffers, offload counts)."""
        self.devices: tuple[tuple[str, str], ...] = ()
        """(name, type) of every device ggml offered llama.cpp in the child (``CPU``/``cpu``, ``CUDA0``/``gpu``...)."""
        self.n_embd = 0
        """The model's n_embd (``llama_model_n_embd``), once loaded: ``parse_context_log`` needs it."""
        self.starts = 0
        self.timed_out = False
        self.last_used = time.monotonic()

    # -- the child's lifecycle

    def _spawn(self) -> None:
        try:
            proc = Child(WORKER_MODULE, name="dry-run worker", env=child_env(), stdin=True, stdout=True, text=True,
                         tail_lines=LOG_TAIL_LINES)
        except OSError as exc:
            raise DryRunError(f"could not start the dry run: {exc}") from exc
        self._proc, self._lines, self._stderr = proc, queue.Queue(), proc.tail
        self.starts += 1
        lines = self._lines

        def pump_out() -> None:
            assert proc.stdout is not None
            for raw in proc.stdout:
                lines.put(raw)
            lines.put(None)

        threading.Thread(target=pump_out, name="dryrun-out", daemon=True).start()

    def _send(self, obj: dict[str, Any]) -> bool:
        proc = self._proc
        if proc is None or proc.stdin is None or not proc.alive():
            return False
        try:
            proc.stdin.write(json.dumps(obj) + "\n")
            proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError):
            return False

    def _next(self, deadline: float) -> dict[str, Any] | None:
        """The child's next JSON message; None when it died or the deadline passed (``self.timed_out``)."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.timed_out = True
                return None
            try:
                raw = self._lines.get(timeout=left)
            except queue.Empty:
                self.timed_out = True
                return None
            if raw is None:
                return None
            if raw.startswith("{"):
                try:
                    msg: dict[str, Any] = json.loads(raw)
                    return msg
                except ValueError:
                    continue

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()

    def _ensure_loaded(self) -> DryRunFailure | None:
        if self._proc is not None and self._proc.alive():
            return None
        self._kill()
        self._spawn()
        self.timed_out = False
        if not self._send({"op": "load", "path": self.path, "model": self.model.to_json()}):
            return DryRunFailure("crashed", "dry run process exited before loading", tuple(self._stderr))
        msg = self._next(time.monotonic() + self.load_timeout_s)
        if msg is None:
            self._kill()
            kind: FailureKind = "timeout" if self.timed_out else "crashed"
            return DryRunFailure(kind, f"dry run load of {self.path} {'timed out' if self.timed_out else 'died'}",
                                 tuple(self._stderr))
        self.load_log = tuple(msg.get("log", ()))
        self.devices = tuple((str(d.get("name", "")), str(d.get("type", ""))) for d in msg.get("devices", ()))
        self.n_embd = int(msg.get("n_embd", 0))
        if not msg.get("ok"):
            self._kill()
            return DryRunFailure("load_failed", f"llama.cpp could not load {self.path}",
                                 tuple(msg.get("log", ())[-LOG_TAIL_LINES:]))
        return None

    # -- requests

    def start(self) -> DryRunFailure | None:
        """Start the child and load the model now (None when loaded; the failure otherwise)."""
        with self._lock:
            return self._ensure_loaded()

    def measure(self, cfgs: Sequence[ContextConfig], timeout_s: float = 60) -> list[DryRunResult]:
        """One result per configuration (a typed failure where llama.cpp refused, died or took too long).

        ``timeout_s`` bounds each context creation (and the load, when the child has to start)."""
        with self._lock:
            self.last_used = time.monotonic()
            out: list[DryRunResult] = []
            i = 0
            while i < len(cfgs):
                failure = self._ensure_loaded()
                if failure is not None:
                    out.extend(DryRunResult(c, failure=failure) for c in cfgs[i:])
                    break
                batch = cfgs[i:]
                self.timed_out = False
                if not self._send({"op": "contexts", "contexts": [context_params(c).to_json() for c in batch]}):
                    self._kill()
                    continue
                got = 0
                while got < len(batch):
                    msg = self._next(time.monotonic() + timeout_s)
                    if msg is None:
                        kind: FailureKind = "timeout" if self.timed_out else "crashed"
                        why = (f"dry run exceeded {timeout_s} s" if self.timed_out
                               else f"dry run process exited with {self._proc.proc.poll() if self._proc else '?'}")
                        out.append(DryRunResult(batch[got], failure=DryRunFailure(kind, why, tuple(self._stderr))))
                        got += 1
                        self._kill()
                        break
                    if msg.get("event") == "context":
                        out.append(parse_context_log(batch[got], msg["log"], msg["created"], self.n_embd))
                        got += 1
                i += got
            self.last_used = time.monotonic()
            return out

    def close(self) -> None:
        with self._lock:
            if self._proc is not None and self._proc.alive():
                self._send({"op": "quit"})
                self._proc.end(5.0)
            self._kill()

    @property
    def backend(self) -> str:
        """``CPU`` when llama.cpp sees no GPU (a CPU build, or none visible), else the first GPU's name prefix
        (``CUDA``, ``Vulkan``...). Known once the child has loaded."""
        gpus = [n for n, t in self.devices if t in ("gpu", "igpu")]
        return "CPU" if not gpus else gpus[0].rstrip("0123456789") or gpus[0]

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.alive()

    def __enter__(self) -> "DryRunWorker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def dry_run_many(
    path: str, cfgs: Sequence[ContextConfig], model: ModelParams = ModelParams(), timeout_s: float = 60
) -> list[DryRunResult]:
    """Load ``path`` once without allocating (with ``model``'s placement) and create one context per configuration.

    The parameters are the engine's (``service.engine.params``): what is measured is what would be loaded.
    ``timeout_s`` bounds the whole run."""
    deadline = time.monotonic() + timeout_s
    with DryRunWorker(path, model, load_timeout_s=timeout_s) as w:
        out: list[DryRunResult] = []
        for c in cfgs:
            left = deadline - time.monotonic()
            if left <= 0:
                out.append(DryRunResult(c, failure=DryRunFailure("timeout", f"dry run exceeded {timeout_s} s")))
                continue
            out.extend(w.measure([c], timeout_s=left))
        return out


def dry_run(path: str, cfg: ContextConfig, model: ModelParams = ModelParams(), timeout_s: float = 60) -> DryRunResult:
    """What llama.cpp would allocate for ``cfg`` (a failure, typed, when it refuses)."""
    return dry_run_many(path, [cfg], model=model, timeout_s=timeout_s)[0]


def load_layer_devices(lines: Sequence[str]) -> dict[int, str]:
    """``load_tensors: layer N assigned to device D`` lines as {N: D} (llama.cpp's own layer map)."""
    out: dict[int, str] = {}
    for ln in lines:
        if m := L.LAYER_DEVICE.search(ln):
            out[int(m.group(1))] = m.group(2)
    return out


# ---- the child process -----------------------------------------------------------------------


def _backend_devices() -> list[dict[str, Any]]:  # pragma: no cover - runs in the child
    """The devices ggml offers llama.cpp (``ggml_backend_dev_count/get/name/type``), from the shipped libggml."""
    from .native import GGML_BACKEND_DEVICE_TYPES as kinds
    from .native import libggml

    lib = libggml()
    if lib is None:
        return []
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        d = lib.ggml_backend_dev_get(i)
        out.append({"name": (lib.ggml_backend_dev_name(d) or b"").decode(), "type": kinds.get(lib.ggml_backend_dev_type(d), "other")})
    return out


_KEEP_LOAD_LINES = ("assigned to device", "offloaded", "model buffer size", "using device", "buffer type overridden",
                   "cannot be used with preferred buffer type")
"""The load lines a dry-run worker keeps; the last: the weights a device's backend refused (ggml-vulkan past its
``maxStorageBufferRange``), counted (``select_weight_buft``'s ``(and N others)``)."""


def _worker() -> int:  # pragma: no cover - runs in the child
    import llama_cpp

    from .loglines import LogCollector
    from .params import apply_context_params, apply_model_params

    os.environ.setdefault("GGML_SCHED_DEBUG", "1")  # the split headers forced_norm_overcount reads (read per context)
    llama_log = LogCollector()
    llama_cpp.llama_backend_init()

    def emit(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    devices = _backend_devices()
    model = None
    keep: list[Any] = []
    for raw in sys.stdin:
        if not raw.strip():
            continue
        req = json.loads(raw)
        op = req.get("op")
        if op == "quit":
            break
        if op == "load":
            if model:
                llama_cpp.llama_model_free(model)
            llama_log.lines.clear()
            mp = llama_cpp.llama_model_default_params()
            keep = apply_model_params(mp, ModelParams.from_json(req["model"]))
            mp.no_alloc = True
            mp.load_mode = 0  # LLAMA_LOAD_MODE_NONE: with mmap, no_alloc aborts
            model = llama_cpp.llama_model_load_from_file(req["path"].encode(), mp)
            lines = llama_log.text()
            emit({"event": "loaded", "ok": bool(model), "devices": devices,
                  "n_embd": llama_cpp.llama_model_n_embd(model) if model else 0,
                  "log": lines if not model else [ln for ln in lines if any(k in ln for k in _KEEP_LOAD_LINES)]})
            if not model:
                return 1
        elif op == "contexts":
            for i, c in enumerate(req["contexts"]):
                llama_log.lines.clear()
                cp = llama_cpp.llama_context_default_params()
                apply_context_params(cp, ContextParams.from_json(c), n_threads=1)
                ctx = llama_cpp.llama_init_from_model(model, cp)
                emit({"event": "context", "index": i, "created": bool(ctx),
                      "log": llama_log.text()})
                if ctx:
                    llama_cpp.llama_free(ctx)
    if model:
        llama_cpp.llama_model_free(model)
    del keep
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(_worker())
