"""The app factory: ``create_app(settings, engine=None)``; state lives on the app, built in the lifespan."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI

from ..engine.base import Engine
from ..errors import NotReady
from ..manager import ModelManager, default_engine
from ..models import Registry
from ..runner import Runner
from ..settings import Settings
from . import errors, management, metrics, openai, ops
from . import page, security

log = logging.getLogger(__name__)


SHUTDOWN_UNLOAD_TIMEOUT_S = 30.0


def create_app(settings: Settings, engine: Engine | None = None) -> FastAPI:
    """Build the service. ``engine`` defaults to llama.cpp; tests may pass a fake.

    Raises ``security.ConfigurationError`` for settings it must not serve with (an unreadable key file).
    """
    keys = security.load_api_keys(settings)
    cors = security.cors_options(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        eng = engine if engine is not None else default_engine(settings)
        runner = Runner(max_waiting=settings.queue_size, workers=settings.parallel)
        manager = ModelManager(settings, Registry(settings), eng, runner)
        app.state.settings = settings
        app.state.manager = manager
        app.state.metrics.attach(manager)
        app.state.drain.on_expire(asyncio.get_running_loop(), lambda: runner.interrupt(NotReady(
            "the server is shutting down: the drain timeout passed", state="draining", retry_after_s=1)))
        task = None
        if settings.default_model:
            task = asyncio.create_task(_load_default(manager, settings.default_model))
        try:
            yield
        finally:
            if task is not None and not task.done():
                task.cancel()
            try:
                # On the worker, after whatever still runs there: never free the model under a generation.
                await asyncio.wait_for(manager.unload(limited=False), timeout=SHUTDOWN_UNLOAD_TIMEOUT_S)
                log.info("shutdown: model released")
            except Exception:  # shutting down: nothing left to serve
                log.exception("unload at shutdown failed")
            runner.stop()
            manager.close()

    app = FastAPI(title="GGUF server", version="0.1.0", lifespan=lifespan)
    app.state.metrics = metrics.Metrics()
    app.state.drain = security.DrainState()
    errors.install(app)
    app.include_router(ops.router)
    app.include_router(openai.router)
    app.include_router(management.router)
    app.include_router(metrics.router)
    page.install(app)
    # Added innermost first: the last one added sees a request first (order in service/api/security.py).
    app.add_middleware(security.BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    public = security.PUBLIC_PATHS | ({"/metrics"} if settings.metrics_public else set())
    app.add_middleware(security.ApiKeyMiddleware, keys=keys, public=public)
    app.add_middleware(security.DrainMiddleware, state=app.state.drain)
    app.add_middleware(metrics.MetricsMiddleware, metrics=app.state.metrics)
    if cors is not None:
        app.add_middleware(security.CORSMiddleware, **cors)  # type: ignore[arg-type]
    return app


async def _load_default(manager: ModelManager, name: str) -> None:
    try:
        await manager.load(name)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.error("loading the default model %r failed: %s", name, exc)
