"""Management API: dry-run, load, unload, model states."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from sizing.report import plan_json

from ..errors import BadRequest
from ..manager import LoadOptions
from .deps import ManagerDep, MetricsDep

router = APIRouter(prefix="/api")


class DeclaredGpu(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field("GPU", max_length=200)
    free_mib: float = Field(ge=0)
    total_mib: float | None = Field(None, ge=0)
    bandwidth_gbps: float | None = Field(None, gt=0)


class PlanBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(max_length=200)
    n_ctx: int | None = Field(None, ge=1, le=1 << 24)
    cache_type: str | None = Field(None, max_length=16)
    flash_attn: Literal["on", "off", "auto"] | None = None
    gpu: int | Literal["auto", "all"] | None = None
    tensor_split: list[float] | None = Field(None, max_length=64)
    n_seq_max: int | None = Field(None, ge=1, le=256)
    swa_full: bool | None = None
    confirm: bool | None = Field(None, description="Confirm the plan with llama.cpp's dry run before loading "
                                 "(default: GGUF_CONFIRM_LOADS, on).")

    def options(self, gpus: list[DeclaredGpu] | None = None) -> LoadOptions:
        return LoadOptions(
            n_ctx=self.n_ctx,
            cache_type=self.cache_type,
            flash_attn=self.flash_attn,
            gpu=self.gpu,
            tensor_split=tuple(self.tensor_split) if self.tensor_split else None,
            n_seq_max=self.n_seq_max,
            swa_full=self.swa_full,
            gpus=[g.model_dump() for g in gpus] if gpus is not None else None,
            confirm=self.confirm,
        )


class DryRunBody(PlanBody):
    model: str | None = Field(None, max_length=200)  # type: ignore[assignment]
    url: str | None = Field(None, max_length=2000, pattern=r"^https?://",
                            description="A GGUF file elsewhere, read by HTTP range requests (header only).")
    repo_id: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=200)
    filename: str | None = Field(None, max_length=500, pattern=r"^[^\x00]*\.gguf$")
    revision: str | None = Field(None, max_length=200)
    gpus: list[DeclaredGpu] | None = Field(None, max_length=64, description="Hypothetical cards instead of the live ones.")

    def location(self) -> str | None:
        if self.url:
            return self.url
        if self.repo_id and self.filename:
            return f"hf://{self.repo_id}/{self.filename}" + (f"@{self.revision}" if self.revision else "")
        return None


@router.post("/dry-run")
async def dry_run(body: DryRunBody, manager: ManagerDep) -> dict[str, Any]:
    """What a load would do, per cache type, without loading anything: a model by name, by URL or on Hugging Face."""
    sources = [bool(body.model), bool(body.url), bool(body.repo_id or body.filename)]
    if sum(sources) != 1 or (body.repo_id is None) != (body.filename is None):
        raise BadRequest("give exactly one of: model, url, or repo_id with filename", param="model")
    opts = body.options(body.gpus)
    location = body.location()
    if location is not None:
        plan = await asyncio.to_thread(manager.plan_remote, location, opts)
    else:
        assert body.model is not None
        _, plan = manager.plan(body.model, opts)
    return plan_json(plan)


@router.post("/models/load")
async def load(body: PlanBody, manager: ManagerDep) -> dict[str, Any]:
    state = await manager.load(body.model, body.options())
    out = manager.describe(state)
    assert out is not None
    return out


@router.post("/models/unload")
async def unload(manager: ManagerDep) -> dict[str, Any]:
    await manager.unload()
    return {"status": "unloaded"}


@router.get("/models")
async def models(manager: ManagerDep, metrics: MetricsDep) -> dict[str, Any]:
    cur = manager.current
    out = []
    for entry in manager.registry.list():
        if cur is not None and cur.name == entry.name:
            described = manager.describe(cur)
            if described is not None and cur.state == "loaded":
                predicted = (described.get("plan") or {}).get("predicted_speed")
                described["speed"] = {"predicted": predicted, "measured": metrics.measured_speeds()}
            out.append(described)
        elif manager.last_failed is not None and manager.last_failed.name == entry.name:
            out.append(manager.describe(manager.last_failed))
        else:
            out.append({"name": entry.name, "state": "unloaded", "origin": entry.origin})
    return {"models": out, "downloads": [d.to_json() for d in manager.downloads.values()]}


class PullBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    repo_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=200)
    filename: str = Field(max_length=300, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*\.gguf$")
    revision: str | None = Field(None, max_length=200, pattern=r"^[A-Za-z0-9._/-]+$")


@router.post("/models/pull", status_code=202)
async def pull(body: PullBody, manager: ManagerDep) -> dict[str, Any]:
    """Download a GGUF from Hugging Face into the models directory; follow it in GET /api/models."""
    return manager.pull(body.repo_id, body.filename, body.revision).to_json()


class HfFilesBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    repo_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$", max_length=200)
    revision: str | None = Field(None, max_length=200)


@router.post("/hf/files")
async def hf_files(body: HfFilesBody, manager: ManagerDep) -> dict[str, Any]:
    """The GGUF files of a Hugging Face repo, each with its size and plan on these devices; downloads nothing."""
    return await asyncio.to_thread(manager.hf_files, body.repo_id, body.revision)
