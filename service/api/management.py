"""Management API: dry-run (one model, or a set), load, unload, model states, Hugging Face pulls (streamed
progress, cancel).

Every field is checked before anything is planned or fetched: numbers are finite (no ``1e999``,
``Infinity`` or ``NaN``), KV cache types are llama.cpp's, a ``gpu`` index or a ``tensor_split``
names only cards this machine (or the request's declared inventory) has, URLs and revisions hold
no whitespace or control characters. Remote probes (dry-run by URL or Hugging Face) run on their
own few threads (``GGUF_REMOTE_PROBES``; beyond them 429), so slow remote servers cannot hold up loads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from sizing.plan import plan_json

from ..catalog.downloads import (FILENAME_PATTERN, REPO_ID_PATTERN, REVISION_PATTERN, Download, Downloads,
                                 parse_hf_reference)
from ..errors import BadRequest, QueueFull
from ..keepalive import parse_keep_alive
from ..options import LoadOptions, ModelOptions
from ..planning.planner import prompt_cache_json
from ..residency import ModelManager
from .deps import DownloadsDep, ManagerDep, MetricsDep
from .paths import redact
from .security import is_admin
from .validation import KeepAlive

router = APIRouter(prefix="/api")

_NO_CONTROL = r"^[^\x00-\x20\x7f]+$"
"""No whitespace or control characters (a CR/LF in a URL or a revision would reach the HTTP request)."""


def _finite(default: Any = ..., **bounds: float) -> Any:
    return Field(default, allow_inf_nan=False, **bounds)  # type: ignore[call-overload]


class DeclaredGpu(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field("GPU", max_length=200)
    free_mib: float = _finite(ge=0, le=1 << 40)
    total_mib: float | None = _finite(None, ge=0, le=1 << 40)
    bandwidth_gbps: float | None = _finite(None, gt=0, le=1e6)


class PlanBody(ModelOptions):
    """A load's body: the model, its load options (``service.options.ModelOptions``, by their one name each), and
    how the load goes."""

    model_config = ConfigDict(extra="forbid", frozen=False)

    model: str = Field(max_length=200)
    force: bool = Field(False, description="Load even while generations run: they end with an error "
                        "(a stream's error event) instead of the load waiting for them (GGUF_LOAD_WAIT_S, then 409); "
                        "busy models may then be evicted too.")
    keep_alive: KeepAlive = None

    def load_options(self, gpus: list[DeclaredGpu] | None = None) -> LoadOptions:
        return LoadOptions(**self.options().model_dump(),
                           gpus=tuple(g.model_dump() for g in gpus) if gpus is not None else None)


class SetItem(PlanBody):
    """One model of a set dry-run: its name and options (as a load's)."""


class DryRunBody(PlanBody):
    model: str | None = Field(None, max_length=200)  # type: ignore[assignment]
    url: str | None = Field(None, max_length=2000, pattern=r"^[Hh][Tt][Tt][Pp][Ss]?://[^\x00-\x20\x7f]+$",
                            description="A GGUF file elsewhere, read by HTTP range requests (header only). Public "
                            "addresses only, unless GGUF_REMOTE_ALLOW_HOSTS names the host.")
    repo_id: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=200)
    filename: str | None = Field(None, max_length=500, pattern=r"^[^\x00-\x1f\x7f]*\.gguf$")
    revision: str | None = Field(None, max_length=200, pattern=_NO_CONTROL)
    gpus: list[DeclaredGpu] | None = Field(None, max_length=64, description="Hypothetical cards instead of the live ones.")
    force: bool = Field(False, description="Ignored by a dry run (nothing is loaded).")
    models: list[SetItem] | None = Field(None, min_length=1, max_length=16, description="Several models (each with "
                                         "its options): whether they fit together, and how, per card.")
    beside_residents: bool = Field(False, description="With models: plan the set beside the loaded models (default: "
                                   "as if none were loaded).")

    def location(self) -> str | None:
        if self.url:
            return self.url
        if self.repo_id and self.filename:
            return f"hf://{self.repo_id}/{self.filename}" + (f"@{self.revision}" if self.revision else "")
        return None


def _check_body(body: PlanBody, manager: ModelManager, declared: list[DeclaredGpu] | None = None) -> None:
    """400 for a body's options that name what this machine does not have or may not give (``_check_cards``), or
    an ``mmproj`` outside the models directory (a client names files there, as models, never another path)."""
    manager.planner.projectors.inside_models_dir(body.mmproj)
    _check_cards(body, manager, declared)


def _check_cards(body: PlanBody, manager: ModelManager, declared: list[DeclaredGpu] | None = None) -> None:
    """400 for a ``gpu`` index or a ``tensor_split`` beyond the cards there are (declared, or this machine's)."""
    if not isinstance(body.gpu, int) and body.tensor_split is None:
        return
    if declared is not None:
        n = len(declared)
    else:
        try:
            n = len(manager.inventory()[0])  # the planner's own inventory (live, or GGUF_GPUS_*)
        except Exception as exc:  # the inventory itself is unreadable: a plan would say the same
            raise BadRequest(f"the GPU inventory cannot be read: {exc}", param="gpu") from exc
    if isinstance(body.gpu, int) and body.gpu >= n:
        raise BadRequest(f"gpu {body.gpu}: this machine has {n} GPU{'s' if n != 1 else ''}"
                         + (f" (0..{n - 1})" if n else ""), param="gpu")
    if body.tensor_split is not None and len(body.tensor_split) > max(n, 1):
        raise BadRequest(f"tensor_split has {len(body.tensor_split)} proportions for {n} GPUs", param="tensor_split")


class _ProbeSlots:
    """The remote probes' own threads: at most ``n`` at once, beyond them 429; loads never wait behind them."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.busy = 0
        self.lock = threading.Lock()
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=n, thread_name_prefix="remote-probe")

    async def run(self, fn: Any, *args: Any) -> Any:
        with self.lock:
            if self.busy >= self.n:
                raise QueueFull(f"{self.busy} remote probes are running; retry shortly", retry_after_s=2)
            self.busy += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        finally:
            with self.lock:
                self.busy -= 1


def _probe_slots(request: Request, n: int) -> _ProbeSlots:
    slots = getattr(request.app.state, "probe_slots", None)
    if slots is None:
        slots = request.app.state.probe_slots = _ProbeSlots(n)
    return slots


@router.post("/dry-run")
async def dry_run(request: Request, body: DryRunBody, manager: ManagerDep) -> dict[str, Any]:
    """What a load would do, per cache type, without loading anything: a model by name, by URL or on Hugging Face,
    beside the loaded models (and whom it would evict); or a set of models, whether they fit together."""
    sources = [bool(body.model), bool(body.url), bool(body.repo_id or body.filename), body.models is not None]
    if sum(sources) != 1 or (body.repo_id is None) != (body.filename is None):
        raise BadRequest("give exactly one of: model, url, repo_id with filename, or models", param="model")
    _check_body(body, manager, body.gpus)
    opts = body.load_options(body.gpus)
    if body.models is not None:
        for item in body.models:
            _check_body(item, manager, body.gpus)
        items = [(item.model, item.load_options(body.gpus)) for item in body.models]
        answer = (await manager.plan_set(items, opts, beside_residents=body.beside_residents)).to_json()
        return answer if is_admin(request) else redact(answer)
    location = body.location()
    if location is not None:
        slots = _probe_slots(request, manager.settings.remote_probes)
        placed = await manager.plan_remote(location, opts, run=lambda work: slots.run(work))
    else:
        assert body.model is not None
        _, placed = await manager.plan(body.model, opts)
    out = plan_json(placed.plan)
    out["prompt_cache"] = prompt_cache_json(manager.settings, placed.plan)
    out["residency"] = placed.to_json()
    return out if is_admin(request) else redact(out)


@router.post("/models/load")
async def load(body: PlanBody, manager: ManagerDep) -> dict[str, Any]:
    """Load a model beside the loaded ones (evicting idle ones if it must), or reload it with new options."""
    _check_body(body, manager)
    keep_alive = parse_keep_alive(body.keep_alive) if body.keep_alive is not None else None
    state = await manager.load(body.model, body.load_options(), force=body.force, keep_alive_s=keep_alive)
    out = manager.describe(state)
    assert out is not None
    return out


class UnloadBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, max_length=200, description="The model to unload (a name or an alias); "
                              "none: every loaded model.")
    force: bool = Field(False, description="Unload even while generations run: they end with an error "
                        "instead of the unload waiting for them (GGUF_LOAD_WAIT_S, then 409).")


@router.post("/models/unload")
async def unload(manager: ManagerDep, body: UnloadBody | None = None) -> dict[str, Any]:
    names = await manager.unload(body.model if body is not None else None,
                                 force=body.force if body is not None else False)
    return {"status": "unloaded", "models": names}


@router.get("/models")
async def models(request: Request, manager: ManagerDep, metrics: MetricsDep, downloads: DownloadsDep) -> dict[str, Any]:
    """Every model with its state; each loaded one with its devices, plan, predicted and allocated memory. Host
    paths (the model's file, the prompt cache's folder) for admins only."""
    out = []
    for entry in manager.registry.list():
        st = manager.models.get(entry.name)
        if st is not None and (st.state != "unloaded" or st.unloaded_why is not None):
            described = manager.describe(st)
            assert described is not None
            if st.serving:
                predicted = (described.get("plan") or {}).get("predicted_speed")
                described["speed"] = {"predicted": predicted, "measured": metrics.measured_speeds(st.name)}
            out.append(described)
        elif manager.last_failed is not None and manager.last_failed.name == entry.name:
            out.append(manager.describe(manager.last_failed) or {})
        else:
            out.append({"name": entry.name, "state": "unloaded", "origin": entry.origin,
                        "aliases": manager.registry.aliases_of(entry.name), "pinned": entry.config.pinned})
    devices = await asyncio.to_thread(manager.devices_json)
    answer = {"models": out, "devices": devices, "downloads": [d.to_json() for d in downloads.downloads.values()]}
    if manager.rpc_workers:  # each worker: up (serving a model or not) or missing, since when, why
        answer["workers"] = manager.worker_watch.json()
    return answer if is_admin(request) else redact(answer)


@router.get("/kv-cache")
async def kv_cache(manager: ManagerDep) -> dict[str, Any]:
    """The prompts each loaded model holds now (its slots', its prompt cache's in memory and on disk), each with the
    block hashes its KV events name (``service.residency.kv_events``): what a router following the events should
    believe."""
    from ..residency.kv_events import MEDIA, blocks_of

    size = manager.settings.kv_events_block_size
    out = []
    for st in manager.loaded():
        engine = st.engine
        assert engine is not None
        prompts = await asyncio.to_thread(engine.cached_prompts)
        out.append({"model": st.name, "prompts": [
            {"medium": MEDIA[p.medium], "tokens": len(p.tokens), "block_hashes": [b.hash for b in blocks_of(p, size)]}
            for p in prompts]})
    return {"block_size": size, "models": out}


class PullBody(BaseModel):
    """A file of a Hugging Face repo (``service.api.ollama`` checks its names with it too)."""

    model_config = ConfigDict(extra="forbid")

    repo_id: str = Field(pattern=REPO_ID_PATTERN, max_length=200)
    filename: str = Field(max_length=300, pattern=FILENAME_PATTERN)
    revision: str | None = Field(None, max_length=200, pattern=REVISION_PATTERN)


class PullStartBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, min_length=1, max_length=600, description="hf.co/OWNER/REPO:QUANT (the repo's one "
                              "model file named with QUANT, and its vision projector) or hf.co/OWNER/REPO/FILE.gguf, "
                              "@REVISION optional: instead of repo_id and filename.")
    repo_id: str | None = Field(None, pattern=REPO_ID_PATTERN, max_length=200)
    filename: str | None = Field(None, max_length=300, pattern=FILENAME_PATTERN)
    revision: str | None = Field(None, max_length=200, pattern=REVISION_PATTERN)
    stream: bool = Field(False, description="Answer with the pull's progress as server-sent events until it ends "
                         "(each event a download as GET /api/models lists it: bytes, rate, time left, state).")


class PullCancelBody(PullBody):
    """The download to cancel: its repo, file and revision, as its events name them."""


PULL_EVENT_EVERY_S = 1.0
"""A pull's stream sends an event when its bytes or state change (looked at every 0.25 s), and at least this often:
the rate and the time left move, and a proxy sees the stream is alive."""


async def pull_events(downloads: Downloads, first: Download, more: list[str]) -> AsyncIterator[bytes]:
    """Server-sent events of a pull: ``data: {download}`` as it runs, the file's last one in its final state
    (``done``, ``failed`` or ``cancelled``), then the next file's (a projector pulled with its model); the stream
    ends after the last file, or after the first that did not end ``done``. The download goes on if the client
    leaves (``POST /api/models/pull/cancel`` stops it)."""
    files = len(more) + 1
    for i in range(files):
        dl = first if i == 0 else downloads.pull(first.repo_id, more[i - 1], first.revision)
        seen: tuple[str, int] | None = None
        sent_at = 0.0
        while True:
            now = time.monotonic()
            if (dl.state, dl.bytes_done) != seen or now - sent_at >= PULL_EVENT_EVERY_S:
                seen, sent_at = (dl.state, dl.bytes_done), now
                event = {**dl.to_json(), "file_index": i, "files": files}
                yield f"data: {json.dumps(event)}\n\n".encode()
            if dl.state != "downloading":
                break
            await asyncio.sleep(0.25)
        if dl.state != "done":
            return


@router.post("/models/pull", status_code=202)
async def pull(body: PullStartBody, downloads: DownloadsDep) -> Any:
    """Download a GGUF from Hugging Face into the models directory: named by ``repo_id`` and ``filename``, or by
    ``model`` (``hf.co/OWNER/REPO:QUANT``: the file found by listing the repo, its vision projector pulled after it).
    202 with the download (follow it in GET /api/models); with ``stream``, its progress as server-sent events."""
    projector = None
    if body.model is not None:
        if body.repo_id is not None or body.filename is not None:
            raise BadRequest("give model, or repo_id with filename, not both", param="model")
        ref = parse_hf_reference(body.model)
        repo_id, revision = ref.repo_id, ref.revision
        filename, projector = await asyncio.to_thread(downloads.resolve_reference, ref)
    elif body.repo_id is not None and body.filename is not None:
        repo_id, filename, revision = body.repo_id, body.filename, body.revision
    else:
        raise BadRequest("give model (hf.co/OWNER/REPO:QUANT), or repo_id with filename", param="model")
    first = downloads.pull(repo_id, filename, revision)
    more = [projector] if projector else []
    if body.stream:
        return StreamingResponse(pull_events(downloads, first, more), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    for name in more:
        downloads.pull(repo_id, name, revision)
    return first.to_json()


@router.post("/models/pull/cancel")
async def pull_cancel(body: PullCancelBody, downloads: DownloadsDep) -> dict[str, Any]:
    """Stop a running download and remove its partial file; 404 when none of that file runs."""
    return downloads.cancel(body.repo_id, body.filename, body.revision).to_json()


class HfFilesBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    repo_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=200)
    revision: str | None = Field(None, max_length=200, pattern=_NO_CONTROL)


@router.post("/hf/files")
async def hf_files(request: Request, body: HfFilesBody, manager: ManagerDep, downloads: DownloadsDep) -> dict[str, Any]:
    """The GGUF files of a Hugging Face repo, each with its size and plan on these devices; downloads nothing."""
    slots = _probe_slots(request, manager.settings.remote_probes)
    return await slots.run(downloads.hf_files, body.repo_id, body.revision)  # type: ignore[no-any-return]
