"""Calibration: llama.cpp's own figures for a model, measured by long-lived dry-run workers and cached.

A ``Calibrator`` keeps a few ``DryRunWorker`` children (``service.engine.dryrun``:
the model loaded once with no_alloc and LLAMA_LOAD_MODE_NONE, contexts created and
freed per request; a child that dies is restarted, every request has a timeout)
and caches what they measured per (file identity, backend), as the pure core's
``sizing.memory.measured.Calibration`` value: per configuration (``ConfigKey``) and, on a
GPU backend, per placement, the samples taken. A second dry run of the same model
answers from the cache without a child.

Which points to sample is decided here (``points``): the minimum and the largest
context the plan may choose, the context where the sliding-window cache stops
growing, and one between; the plan's own choice is then confirmed by one more
sample (``service.planning.planner``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from sizing.memory import Calibrated, Calibration, ConfigKey, ContextConfig, kv_cells, mib_to_bytes, pad, Sample
from sizing.model import ModelSpec

from .dryrun import DryRunError, DryRunResult, DryRunWorker
from .params import ModelParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FileIdentity:
    """Which bytes a calibration belongs to: every shard's real path, size, mtime and inode."""

    files: tuple[tuple[str, int, int, int], ...]

    @classmethod
    def of(cls, paths: Sequence[str]) -> "FileIdentity":
        out = []
        for p in paths:
            st = os.stat(p)
            out.append((os.path.realpath(p), st.st_size, st.st_mtime_ns, st.st_ino))
        return cls(tuple(out))


def sample_of(result: DryRunResult, spec: ModelSpec) -> Sample | None:
    """A dry run's figures as a ``Sample`` (None when llama.cpp did not create the context)."""
    if not result.ok:
        return None
    cfg = result.cfg
    cells = kv_cells(spec, cfg)
    full = next((c for c in result.kv_caches if not c.swa), None)
    swa = next((c for c in result.kv_caches if c.swa), None)
    return Sample(
        n_ctx=result.n_ctx or cfg.n_ctx_padded,
        full_cells=full.cells if full is not None else cells.full,
        swa_cells=swa.cells if swa is not None else cells.swa,
        kv_full_bytes=mib_to_bytes(full.size_mib) if full is not None else 0,
        kv_swa_bytes=mib_to_bytes(swa.size_mib) if swa is not None else 0,
        state_bytes=mib_to_bytes(result.state_mib),
        compute_bytes={k: mib_to_bytes(v) for k, v in result.compute_mib.items()},
        output_bytes=mib_to_bytes(result.output_mib),
        state_device_bytes={k: mib_to_bytes(v) for k, v in result.state_buffer_mib.items()},
    )


def points(spec: ModelSpec, cfg: ContextConfig, floor: int, cap: int) -> list[ContextConfig]:
    """The contexts to sample for one configuration: ``floor``, ``cap`` and, with a sliding window, where its
    cache stops growing (the compute peak's kink); one per distinct cell count. Between them the chord bounds a
    convex peak; the plan's own choice is then measured and the pieces tightened (``service.planning.planner``)."""
    n_stream = 1 if cfg.kv_unified else max(cfg.n_seq_max, 1)
    wanted = {max(floor, 1), max(cap, 1)}
    if spec.swa_layer_count and not cfg.swa_full:
        n_seq = cfg.n_seq_max if cfg.kv_unified else 1
        kink = pad(spec.n_swa * n_seq + cfg.n_ubatch_effective) * n_stream
        if floor < kink < cap:
            wanted.add(kink)
    out: dict[tuple[int, int], ContextConfig] = {}
    for n in sorted(wanted):
        c = cfg.with_ctx(min(max(n, floor), cap))
        cells = kv_cells(spec, c)
        out.setdefault((cells.full, cells.swa), c)
    return list(out.values())


class Calibrator:
    """Dry-run workers and the calibrations they measured. Thread-safe; blocking (call from a thread).

    A worker on a GPU build holds a device context (hundreds of MiB of VRAM) while it lives: idle workers
    are closed after ``idle_s`` by a reaper thread, and the service closes them all before a real load
    (``release``), so that neither the load nor the next plan's free-memory figures pay for them.
    """

    def __init__(self, *, timeout_s: float = 60.0, idle_s: float = 30.0, max_workers: int = 2) -> None:
        self.timeout_s = timeout_s
        self.idle_s = idle_s
        self.max_workers = max_workers
        self._workers: OrderedDict[tuple[str, ModelParams], DryRunWorker] = OrderedDict()
        self._cache: dict[tuple[FileIdentity, str], Calibration] = {}
        self._backends: dict[FileIdentity, str] = {}
        self._lock = threading.Lock()
        self._reaper: threading.Thread | None = None
        self._closed = threading.Event()
        self.dry_runs = 0
        """Contexts measured so far (for reports and tests: a cached answer measures none)."""

    def _reap_idle(self) -> None:
        while not self._closed.wait(max(self.idle_s / 4, 0.5)):
            now = time.monotonic()
            with self._lock:
                idle = [(k, w) for k, w in self._workers.items() if now - w.last_used > self.idle_s]
                for k, _ in idle:
                    del self._workers[k]
            for _, w in idle:
                w.close()

    def _start_reaper(self) -> None:
        if self._reaper is None:
            self._reaper = threading.Thread(target=self._reap_idle, name="calibration-reaper", daemon=True)
            self._reaper.start()

    def _worker(self, path: str, model: ModelParams) -> DryRunWorker:
        key = (path, model)
        now = time.monotonic()
        for k, idle in list(self._workers.items()):
            if k != key and now - idle.last_used > self.idle_s:
                idle.close()
                del self._workers[k]
        if model.rpc_workers:
            # A ggml-rpc worker serves one client: another dry run connected to it would make this one wait.
            for k, other in list(self._workers.items()):
                if k != key and set(k[1].rpc_workers) & set(model.rpc_workers):
                    other.close()
                    del self._workers[k]
        w = self._workers.get(key)
        if w is None:
            while len(self._workers) >= self.max_workers:
                _, old = self._workers.popitem(last=False)
                old.close()
            w = DryRunWorker(path, model, load_timeout_s=self.timeout_s)
            self._workers[key] = w
        self._workers.move_to_end(key)
        w.last_used = now  # handed out: not idle (the reaper checks under the same lock)
        return w

    def measure(self, path: str, model: ModelParams, cfgs: Sequence[ContextConfig]) -> list[DryRunResult]:
        """llama.cpp's figures for each configuration, from the worker that holds ``path`` with ``model``."""
        if not cfgs:
            return []
        with self._lock:
            self._start_reaper()
            w = self._worker(path, model)
        t = time.perf_counter()
        out = w.measure(cfgs, timeout_s=self.timeout_s)
        with self._lock:
            self.dry_runs += len(cfgs)
        log.debug("measured %d contexts of %s in %.3f s", len(cfgs), path, time.perf_counter() - t)
        return out

    def layer_devices(self, path: str, model: ModelParams) -> dict[int, str]:
        """llama.cpp's layer assignment as the worker holding ``path`` with ``model`` logged it at its load."""
        from .dryrun import load_layer_devices

        with self._lock:
            w = self._workers.get((path, model))
        return load_layer_devices(w.load_log) if w is not None else {}

    def load_lines(self, path: str, model: ModelParams) -> tuple[str, ...]:
        """The load's kept log lines of the worker holding ``path`` with ``model`` (``dryrun._KEEP_LOAD_LINES``:
        layer assignments, buffers, the weights a device's backend refused); empty where no worker holds it."""
        with self._lock:
            w = self._workers.get((path, model))
        return w.load_log if w is not None else ()

    def model_buffers(self, path: str, model: ModelParams) -> dict[str, float]:
        """llama.cpp's weight buffers (rows: CPU, CPU_REPACK, AMX, CUDA0...) as the worker holding ``path`` with
        ``model`` logged them at its load, in MiB (a no_alloc load logs 0.00: it names the buffers, not their
        sizes)."""
        from .loglines import model_buffers_mib

        with self._lock:
            w = self._workers.get((path, model))
        return model_buffers_mib(w.load_log) if w is not None else {}

    def backend(self, ident: FileIdentity, path: str) -> str:
        """The backend llama.cpp runs ``path`` on here: ``CPU`` on a CPU build (asks a worker once)."""
        with self._lock:
            known = self._backends.get(ident)
        if known is not None:
            return known
        with self._lock:
            w = self._worker(path, ModelParams())
        failure = w.start()
        if failure is not None:
            raise DryRunError(f"{failure.kind}: {failure.message}")
        backend = w.backend
        with self._lock:
            self._backends[ident] = backend
        return backend

    def cached(self, ident: FileIdentity, backend: str) -> Calibration:
        with self._lock:
            return self._cache.get((ident, backend)) or Calibration(backend)

    def store(self, ident: FileIdentity, cal: Calibration) -> None:
        with self._lock:
            self._cache[(ident, cal.backend)] = cal

    def forget(self, ident: FileIdentity) -> None:
        with self._lock:
            for k in [k for k in self._cache if k[0] == ident]:
                del self._cache[k]

    def release(self) -> None:
        """Close every worker now (before a real load); the calibrations stay cached."""
        with self._lock:
            workers, self._workers = list(self._workers.values()), OrderedDict()
        for w in workers:
            w.close()

    def release_rpc(self) -> None:
        """Close the workers whose model is placed on ggml-rpc workers: while one waits for its next dry run it
        keeps its connections to them, and a ggml-rpc worker serves one client at a time (the next plan's read of
        the workers would find them busy, and a load over them wait). One measuring finishes first."""
        with self._lock:
            keys = [k for k in self._workers if k[1].rpc_workers]
            workers = [self._workers.pop(k) for k in keys]
        for w in workers:
            w.close()

    def close(self) -> None:
        self._closed.set()
        self.release()


def add_samples(cal: Calibration, spec: ModelSpec, key: ConfigKey, results: Sequence[DryRunResult],
                placement: str | None = None) -> tuple[Calibration, list[DryRunResult]]:
    """``cal`` with the successful results added under ``key``; the failures returned beside it."""
    failed = []
    current = cal.get(key, placement)
    for r in results:
        s = sample_of(r, spec)
        if s is None:
            failed.append(r)
            continue
        current = Calibrated(key, (s,)) if current is None else current.with_sample(s)
    if current is not None:
        cal = cal.with_config(current, placement)
    return cal, failed


__all__ = ["Calibrator", "DryRunError", "FileIdentity", "add_samples", "points", "sample_of"]
