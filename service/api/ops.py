"""Liveness and readiness."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from .deps import ManagerDep
from .errors import envelope

router = APIRouter()


@router.get("/health")
async def health() -> dict[str, str]:
    """200 while the process is alive."""
    return {"status": "ok"}


@router.get("/ready")
async def ready(manager: ManagerDep) -> Any:
    """200 once a model is loaded; 503 while loading, after a failed load, or with none."""
    cur = manager.current
    if manager.ready and cur is not None:
        return {"status": "ready", "model": cur.name, "n_ctx": manager.engine.n_ctx}
    state = "no model" if cur is None else cur.state
    message = {"loading": "Loading model", "failed": f"model load failed: {cur.error if cur else ''}"}.get(state, state)
    return JSONResponse(envelope(message, "unavailable_error", "model_not_ready", state=state), status_code=503)
