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
    """200 once a model is loaded (``model``: the default one if loaded, else the first; ``models``: every loaded
    one), or at once with ``GGUF_LOAD_ON_DEMAND`` (a request loads what it names); otherwise 503 while loading, after
    a failed load, or with none."""
    loaded = manager.loaded()
    if not loaded and manager.settings.load_on_demand:
        return {"status": "ready", "model": None, "n_ctx": 0, "models": [], "load_on_demand": True}
    if loaded:
        default = manager.resident(manager.settings.default_model) if manager.settings.default_model else None
        first = default or loaded[0]
        return {"status": "ready", "model": first.name, "n_ctx": first.engine.n_ctx if first.engine else 0,
                "models": [{"name": s.name, "n_ctx": s.engine.n_ctx if s.engine else 0} for s in loaded]}
    state, error = manager.not_ready_state()
    message = {"loading": "Loading model", "failed": f"model load failed: {error or ''}"}.get(state, state)
    return JSONResponse(envelope(message, "unavailable_error", "model_not_ready", state=state), status_code=503)
