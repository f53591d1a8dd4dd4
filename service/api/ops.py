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
    """200 once a model is loaded and its runner serves (``model``: the default one if loaded, else the first; ``models``: every loaded
    one), or at once with ``GGUF_LOAD_ON_DEMAND`` (a request loads what it names); otherwise 503 while loading, after
    a failed load, or with none. A model that a reload is replacing still counts (``reloading``: new requests for it
    wait for the reload and are answered by the new model, while the old one finishes its generations). A model whose
    runner process is restarting (it died, or the watchdog ended it) is listed with ``restarting`` (and, while its
    restart waits for a ggml-rpc worker, ``waiting_for_workers``: why, since when); when every loaded model is, 503
    (state ``restarting``). ``workers_missing``: the workers of ``GGUF_RPC_WORKERS`` that do not answer now, since
    when and why (``service.rpc.health``)."""
    loaded = manager.loaded()
    reloading = [n for n in manager.reloading() if not any(s.name == n for s in loaded)]
    if not loaded and not reloading and manager.settings.load_on_demand:
        return {"status": "ready", "model": None, "n_ctx": 0, "models": [], "load_on_demand": True}
    restarting = [s.name for s in loaded if _runner_state(s.engine) not in (None, "loaded")]
    missing = _workers_missing(manager)
    if loaded and len(restarting) == len(loaded) and not reloading:
        # Every loaded model's runner is down (died, or ended by the watchdog) and restarting: nothing answers now.
        body = envelope(f"restarting the runner of {', '.join(restarting)[:200]}", "unavailable_error",
                        "model_not_ready", state="restarting")
        if missing:
            body["workers_missing"] = missing
        return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})
    if loaded or reloading:
        models: list[dict[str, Any]] = [{"name": s.name, "n_ctx": s.engine.n_ctx if s.engine else 0,
                                         **(_restarting(s.engine) if s.name in restarting else {})} for s in loaded]
        for name in reloading:
            st = manager.models.get(name)
            models.append({"name": name, "n_ctx": st.engine.n_ctx if st is not None and st.engine else 0,
                           "reloading": True})
        default = manager.registry.canonical(manager.settings.default_model) if manager.settings.default_model else None
        first = next((m for m in models if m["name"] == default), models[0])
        out = {"status": "ready", "model": first["name"], "n_ctx": first["n_ctx"], "models": models}
        if reloading:
            out["reloading"] = reloading
        if missing:
            out["workers_missing"] = missing
        return out
    state, error = manager.not_ready_state()
    message = {"loading": "Loading model", "failed": f"model load failed: {error or ''}"}.get(state, state)
    return JSONResponse(envelope(message, "unavailable_error", "model_not_ready", state=state), status_code=503)


def _workers_missing(manager: Any) -> list[dict[str, Any]]:
    """The ggml-rpc workers that do not answer now (``service.rpc.health.WorkerWatch``)."""
    watch = getattr(manager, "worker_watch", None)
    if watch is None:
        return []
    return [w for w in watch.json() if w.get("state") == "missing"]


def _restarting(engine: Any) -> dict[str, Any]:
    """A restarting model's entry: ``restarting``, and what its restart waits for (a worker) if anything."""
    waiting = engine.runner_json().get("waiting_for_workers")
    return {"restarting": True, **({"waiting_for_workers": waiting} if waiting else {})}


def _runner_state(engine: Any) -> str | None:
    """The state of a model's runner process (``ProcessEngine.state``), None for an engine in this process."""
    runner_json = getattr(engine, "runner_json", None)
    return runner_json().get("state") if runner_json is not None else None
