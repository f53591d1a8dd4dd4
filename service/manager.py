"""The loaded model's lifecycle: plan first, then load; state for /ready and /api/models.

States: unloaded -> loading -> loaded | failed. A new load is planned and
checked before anything is unloaded, so a refusal leaves the current model
serving. Planning itself (settings to a request, crediting the current model's
memory, calibration with llama.cpp's figures, the load's confirmation) is
``service.planning``; it runs off the event loop.
"""

from __future__ import annotations

import asyncio
import os
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Literal, Sequence

from sizing.device import MIB, Device
from sizing.devices import host_memory, inventory
from sizing.errors import ProbeError, SizingError, UnsupportedModelError
from sizing.gguf import probe_path
from sizing.plan import Plan
from sizing.report import plan_json, plan_table
from sizing.spec import ModelSpec

from .engine.base import Engine, LoadReport
from .engine.calibrate import Calibrator
from .errors import BadRequest, InsufficientMemory, ModelNotFound, ServiceError, SplitNotHonoured, Upstream
from .models import ModelEntry, Registry
from .planning import LoadOptions, Planner, credit, plan_request
from .runner import Runner
from .settings import Settings

__all__ = ["LoadOptions", "ModelManager", "ModelState", "credit_current", "default_engine", "plan_request",
           "raise_refusal", "remote_limits"]

log = logging.getLogger(__name__)

State = Literal["unloaded", "loading", "loaded", "failed"]


@dataclass
class ModelState:
    name: str
    state: State = "unloaded"
    plan: Plan | None = None
    report: LoadReport | None = None
    error: str | None = None
    since: float = field(default_factory=time.time)
    path: str | None = None
    confirmation: dict[str, Any] | None = None
    """llama.cpp's dry-run figures for the plan, beside the predicted ones."""


def remote_limits(settings: Settings) -> Any:
    """What a remote probe for a client may do (``sizing.gguf.remote.ProbeLimits``): public addresses only,
    unless ``remote_allow_hosts`` names them; one deadline and byte budget."""
    from sizing.gguf.remote import ProbeLimits, parse_allow_hosts

    return ProbeLimits(deadline_s=settings.remote_timeout_s, max_bytes=settings.remote_max_bytes, public_only=True,
                       allow_hosts=parse_allow_hosts(settings.remote_allow_hosts))


def default_engine(settings: Settings) -> Engine:
    """llama.cpp through llama-cpp-python: ``parallel`` slots decoded together, each keeping its prompt's KV."""
    from .engine.llama import LlamaEngine

    return LlamaEngine(n_threads=settings.n_threads, cache_prompt=settings.cache_prompt,
                       slot_prompt_similarity=settings.slot_prompt_similarity)


def credit_current(gpus: Sequence[Device], host: Device, current: "ModelState | None") -> tuple[list[Device], Device]:
    """Free memory as it will be once the loaded model is unloaded (``service.planning.credit``)."""
    if current is None or current.state != "loaded" or current.plan is None or current.plan.estimate is None:
        return list(gpus), host
    return credit(gpus, host, [current.plan.estimate])


@dataclass
class Download:
    """A GGUF file being fetched from Hugging Face into the models directory."""

    repo_id: str
    filename: str
    revision: str | None
    state: Literal["downloading", "done", "failed"] = "downloading"
    bytes_done: int = 0
    bytes_total: int | None = None
    error: str | None = None
    started: float = field(default_factory=time.time)

    @property
    def name(self) -> str:
        """The model name it is served under once downloaded."""
        return self.filename.rsplit("/", 1)[-1].removesuffix(".gguf")

    def to_json(self) -> dict[str, Any]:
        return {"repo_id": self.repo_id, "filename": self.filename, "revision": self.revision, "name": self.name,
                "state": self.state, "bytes_done": self.bytes_done, "bytes_total": self.bytes_total,
                "progress": round(self.bytes_done / self.bytes_total, 4) if self.bytes_total else None,
                "error": self.error}


def _progress_class(dl: Download) -> type:
    """A tqdm class for huggingface_hub that records progress on ``dl`` and logs every 10%."""
    from tqdm.std import tqdm

    class Progress(tqdm):  # type: ignore[misc,type-arg]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)
            total = kwargs.get("total")
            if isinstance(total, (int, float)) and total:
                dl.bytes_total = int(total)
            dl.bytes_done = int(kwargs.get("initial") or 0)
            self._logged = -1

        def update(self, n: float | None = 1) -> bool | None:
            dl.bytes_done += int(n or 0)
            if dl.bytes_total:
                tenth = int(10 * dl.bytes_done / dl.bytes_total)
                if tenth != self._logged:
                    self._logged = tenth
                    log.info("downloading %s/%s: %d%% of %.1f MiB", dl.repo_id, dl.filename, 10 * tenth,
                             dl.bytes_total / MIB)
            return None

    return Progress


class ModelManager:
    """Owns the engine, the current model's state and plan."""

    def __init__(self, settings: Settings, registry: Registry, engine: Engine, runner: Runner,
                 devices: Callable[[], tuple[list[Device], Device]] | None = None) -> None:
        self.settings = settings
        self.registry = registry
        self.engine = engine
        self.runner = runner
        self.current: ModelState | None = None
        self.last_failed: ModelState | None = None
        self._devices = devices or self._live_devices
        self._load_lock = asyncio.Lock()
        self.downloads: dict[str, Download] = {}
        self.host_bandwidth_bytes_per_s: float | None = None
        if settings.host_bandwidth_gbps is None:
            from sizing.devices import measure_host_bandwidth

            self.host_bandwidth_bytes_per_s = measure_host_bandwidth()
        self.planner = Planner(settings, lambda: self._devices(), Calibrator(timeout_s=settings.calibrate_timeout_s),
                               self.host_bandwidth_bytes_per_s)

    def _live_devices(self) -> tuple[list[Device], Device]:
        gpus = inventory(declared_path=self.settings.gpus_file, declared_json=self.settings.gpus_json)
        return gpus, host_memory()

    @property
    def ready(self) -> bool:
        return self.current is not None and self.current.state == "loaded"

    def probe(self, entry: ModelEntry) -> ModelSpec:
        try:
            return probe_path(entry.path)
        except (ProbeError, UnsupportedModelError) as exc:
            raise BadRequest(f"model '{entry.name}' cannot be read: {exc}", param="model") from exc

    async def plan(self, name: str, opts: LoadOptions) -> tuple[ModelEntry, Plan]:
        """Plan a model on the live (or declared, or hypothetical) devices; nothing is loaded. Off the event loop
        (probing, and llama.cpp's dry runs where the plan is calibrated)."""
        return await asyncio.to_thread(self.plan_blocking, name, opts)

    def plan_blocking(self, name: str, opts: LoadOptions) -> tuple[ModelEntry, Plan]:
        entry = self.registry.resolve(name)
        return entry, self.plan_spec(self.probe(entry), opts, path=entry.path)

    def plan_remote(self, location: str, opts: LoadOptions) -> Plan:
        """Plan a model that is not here: an http(s) URL or ``hf://owner/repo/file.gguf``, read by its header only.

        Blocking (network): call from a thread.
        """
        from sizing.errors import RemoteError
        from sizing.gguf.remote import probe_location

        try:
            spec = probe_location(location, remote_limits(self.settings))
        except RemoteError as exc:
            raise Upstream(f"{location[:300]}: {exc.reason}") from exc
        except (ProbeError, UnsupportedModelError) as exc:
            raise BadRequest(f"{location[:300]} cannot be read: {exc}", param="url") from exc
        return self.plan_spec(spec, opts)

    def plan_spec(self, spec: ModelSpec, opts: LoadOptions, *, path: str | None = None) -> Plan:
        """The plan for a probed model (calibrated by llama.cpp when ``path`` is given and the model needs it),
        as if the current model were unloaded (live figures include it); a refusal still leaves it serving."""
        current = self.current
        replacing = ([current.plan.estimate] if current is not None and current.state == "loaded"
                     and current.plan is not None and current.plan.estimate is not None else [])
        return self.planner.plan(spec, opts, path=path, replacing=replacing)

    async def load(self, name: str, opts: LoadOptions = LoadOptions(), *, force: bool = False) -> ModelState:
        """Plan, refuse with figures if it cannot fit, confirm with llama.cpp, then load (replacing the current model).

        The load waits up to ``load_wait_s`` for running generations (then ``Busy``, 409, and the current
        model keeps serving); ``force`` ends them instead."""
        async with self._load_lock:
            previous = self.current
            serving = previous is not None and previous.state == "loaded"
            if not serving:
                # /ready says loading from the start; planning (probe, calibration) runs in a thread
                self.current = ModelState(name=str(name)[:200], state="loading")
            try:
                entry, plan = await self.plan(name, opts)
                raise_refusal(plan)
            except BaseException:
                if not serving:
                    self.current = previous  # a refusal changes nothing
                raise
            state = ModelState(name=entry.name, state="loading", plan=plan, path=entry.path)
            if not serving:
                self.current = state  # /ready: loading (a loaded model keeps serving until the swap itself)
            if opts.confirm if opts.confirm is not None else self.settings.confirm_loads:
                try:
                    conf = await asyncio.to_thread(self.planner.confirm, plan, entry.path, entry.name)
                    state.confirmation = conf.to_json()
                    if conf.status == "replanned":
                        plan = state.plan = conf.plan
                        raise_refusal(plan)
                except ServiceError as exc:
                    state.state, state.error = "failed", exc.message
                    self.last_failed = state
                    if not serving:
                        self.current = state
                    raise
            # The dry-run workers hold no model, but on a GPU build a device context each: gone before the load.
            await asyncio.to_thread(self.planner.release)
            # With the plan counting on the current model's memory, it must go first.
            must_unload_first = serving and previous is not None and not _fits_beside(plan, previous)
            self.current = state
            log.info("loading %s with plan:\n%s", entry.name, plan_table(plan))

            def do_load() -> LoadReport:
                if must_unload_first:
                    self.engine.unload()
                return self.engine.load(entry.path, plan)

            try:
                report = await self.runner.exclusive(do_load, wait_s=self.settings.load_wait_s, force=force)
            except Exception as exc:
                state.state = "failed"
                state.error = exc.message if isinstance(exc, ServiceError) else str(exc)
                self.last_failed = state
                self.current = state
                if serving and previous is not None:
                    if must_unload_first:
                        await self._restore(previous)
                    else:
                        self.current = previous
                raise
            state.report = report
            state.state = "loaded"
            state.since = time.time()
            log.info(
                "loaded %s: n_ctx %d in %.2f s; llama.cpp allocated %s",
                entry.name, report.n_ctx, report.load_seconds,
                ", ".join(f"{a.device} {a.total_bytes / MIB:.1f} MiB" for a in report.allocations),
            )
            return state

    async def _restore(self, previous: ModelState) -> None:
        """Reload the model a failed swap unloaded, so the service keeps what it served."""
        if previous.path is None or previous.plan is None:
            return
        plan, path = previous.plan, previous.path
        try:
            report = await self.runner.call(lambda: self.engine.load(path, plan), exclusive=True)
        except Exception as exc:  # nothing left to serve: /ready says so
            log.error("could not reload %s after a failed load: %s", previous.name, exc)
            return
        self.current = replace(previous, report=report, since=time.time())

    def close(self) -> None:
        """Stop the calibration workers (at shutdown)."""
        self.planner.close()

    async def unload(self, *, force: bool = False, limited: bool = True) -> None:
        """Unload, after the running generations (up to ``load_wait_s``, then ``Busy``; ``force`` ends them).
        ``limited=False``: wait as long as they run (shutdown, which has its own limit)."""
        async with self._load_lock:
            wait_s = self.settings.load_wait_s if limited else None
            await self.runner.exclusive(self.engine.unload, wait_s=wait_s, force=force)
            if self.current is not None:
                self.current = replace(self.current, state="unloaded", report=None)

    def pull(self, repo_id: str, filename: str, revision: str | None = None) -> Download:
        """Start fetching a GGUF from Hugging Face into the models directory (a background thread).

        ``huggingface_hub`` honours HF_ENDPOINT, HF_TOKEN and, with HF_HUB_OFFLINE=1, answers from
        the files already there. Progress shows in the log and in ``GET /api/models``.
        """
        import os
        import threading

        if "/" in filename or "\\" in filename or not filename.endswith(".gguf") or filename.startswith("."):
            raise BadRequest("filename must be a .gguf file at the top of the repo", param="filename")
        key = f"{repo_id}/{filename}@{revision or 'main'}"
        running = self.downloads.get(key)
        if running is not None and running.state == "downloading":
            return running
        dl = Download(repo_id, filename, revision)
        self.downloads[key] = dl
        models_dir = self.settings.models_dir

        def fetch() -> None:
            from huggingface_hub import hf_hub_download

            try:
                os.makedirs(models_dir, exist_ok=True)
                path = hf_hub_download(repo_id, filename, revision=revision, local_dir=models_dir,
                                       endpoint=os.environ.get("HF_ENDPOINT") or None, tqdm_class=_progress_class(dl))
                self.registry.resolve(dl.name)  # the file is a GGUF the registry will serve
                dl.bytes_done = dl.bytes_total = os.path.getsize(str(path))
                dl.state = "done"
                log.info("downloaded %s/%s as model '%s'", repo_id, filename, dl.name)
            except ServiceError as exc:
                dl.state, dl.error = "failed", f"the downloaded file is not a servable GGUF: {exc.message}"
                try:  # leave nothing behind that looks like a model
                    os.remove(os.path.join(models_dir, filename))
                except OSError:
                    pass
            except Exception as exc:  # the hub's and the network's errors end here, reported in the status
                dl.state, dl.error = "failed", f"{type(exc).__name__}: {exc}"
                log.warning("download of %s/%s failed: %s", repo_id, filename, dl.error)

        threading.Thread(target=fetch, name=f"download-{filename}", daemon=True).start()
        return dl

    def hf_files(self, repo_id: str, revision: str | None = None) -> dict[str, Any]:
        """Each GGUF of a Hugging Face repo: its size and what it would get on these devices, before any download.

        Blocking (network): call from a thread. Headers only (``sizing.gguf.remote.probe_hf``:
        range requests); a split model is probed and planned once, from its first shard.
        """
        import re as _re

        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled, RepositoryNotFoundError

        from sizing.errors import RemoteError
        from sizing.gguf.remote import probe_hf

        try:
            info = HfApi().model_info(repo_id, revision=revision, files_metadata=True)
        except RepositoryNotFoundError as exc:
            raise ModelNotFound(f"no Hugging Face repo '{repo_id}'", param="repo_id") from exc
        except (OfflineModeIsEnabled, HfHubHTTPError, OSError) as exc:
            raise Upstream(f"the Hugging Face hub did not answer for '{repo_id}': {exc}") from exc
        except Exception as exc:  # huggingface_hub's transport errors (httpx2) are not ours: convert them here
            raise Upstream(f"the Hugging Face hub could not be reached for '{repo_id}': {type(exc).__name__}: {exc}") from exc
        groups: dict[str, list[tuple[str, int]]] = {}
        for sib in info.siblings or []:
            if not sib.rfilename.endswith(".gguf"):
                continue
            key = _re.sub(r"-\d{5}-of-\d{5}\.gguf$", ".gguf", sib.rfilename)
            groups.setdefault(key, []).append((sib.rfilename, int(sib.size or 0)))
        gpus, host = self._devices()
        req = self.planner.request(LoadOptions())
        files = []
        for key, parts in sorted(groups.items()):
            parts.sort()
            entry: dict[str, Any] = {"file": parts[0][0], "shards": len(parts), "size_bytes": sum(n for _, n in parts)}
            try:
                spec = probe_hf(repo_id, parts[0][0], revision, limits=remote_limits(self.settings))
                entry["plan"] = plan_json(self.planner.plan_on(spec, gpus, host, req))
            except (RemoteError, ProbeError, UnsupportedModelError, SizingError) as exc:
                entry["error"] = str(exc)
            files.append(entry)
        return {"repo_id": repo_id, "revision": revision, "files": files}

    def describe(self, state: ModelState | None) -> dict[str, Any] | None:
        if state is None:
            return None
        out: dict[str, Any] = {"name": state.name, "state": state.state, "error": state.error}
        if state.plan is not None:
            out["plan"] = plan_json(state.plan)
        if state.confirmation is not None:
            out["confirmation"] = state.confirmation
        if state.report is not None:
            predicted = {d.device: d for d in state.plan.estimate.devices} if state.plan and state.plan.estimate else {}
            out["n_ctx"] = state.report.n_ctx
            out["load_seconds"] = round(state.report.load_seconds, 3)
            out["memory"] = [
                {
                    "device": a.device,
                    "allocated_mib": round(a.total_bytes / MIB, 2),
                    "allocated": {
                        "weights_mib": round(a.weights_bytes / MIB, 2),
                        "kv_mib": round(a.kv_bytes / MIB, 2),
                        "compute_mib": round(a.compute_bytes / MIB, 2),
                        "output_mib": round(a.output_bytes / MIB, 2),
                    },
                    "predicted_mib": round((predicted[a.device].total_bytes - predicted[a.device].allowance_bytes
                                            - predicted[a.device].pool_bytes) / MIB, 2)
                    if a.device in predicted else None,
                }
                for a in state.report.allocations
            ]
        return out


def _refusal_message(plan: Plan) -> str:
    est = plan.estimate
    parts = [f"model '{plan.model.name}' does not fit at {plan.cfg.n_ctx} tokens ({plan.cfg.type_k} cache)"]
    if est is not None:
        by_label = {g.label: g for g in plan.gpus}
        for d in est.devices:
            dev = plan.host if d.device == "CPU" else by_label.get(d.device)
            free = dev.free_bytes if dev is not None else 0
            missing = max(d.total_bytes - free, 0)
            label = f"{d.device} ({dev.name})" if dev is not None and d.device != "CPU" else d.device
            parts.append(
                f"{label}: needs {d.total_bytes / MIB:.0f} MiB (weights {d.weights_bytes / MIB:.0f}, KV {d.kv_bytes / MIB:.0f}, "
                f"compute {d.compute_bytes / MIB:.0f}, allowance {d.allowance_bytes / MIB:.0f}), free {free / MIB:.0f} MiB"
                + (f", missing {missing / MIB:.0f} MiB" if missing else "")
            )
    return "; ".join(parts)


def _fits_beside(plan: Plan, current: ModelState) -> bool:
    """Whether the new plan fits without the current model's memory being given back (CPU-only plans always do:
    host weights are mmapped and the kernel evicts them as needed)."""
    if plan.placement.cpu_only and (current.plan is None or current.plan.placement.cpu_only):
        return True
    return current.plan is None or current.plan.estimate is None or not current.plan.estimate.gpus


def raise_refusal(plan: Plan) -> None:
    """A plan that does not fit becomes the domain error its refusal names (one place decides the status)."""
    if plan.fits:
        return
    reason = "; ".join(plan.reasons) or "the model does not fit"
    if plan.refusal == "SPLIT_NOT_HONOURED":
        raise SplitNotHonoured(reason, param="gpu", plan=plan_json(plan))
    if plan.refusal == "INVALID_CONFIG":
        param = "gpu" if "gpu" in reason or "tensor_split" in reason else "cache_type"
        raise BadRequest(reason, param=param)
    raise InsufficientMemory(_refusal_message(plan), plan=plan_json(plan))
