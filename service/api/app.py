"""The app factory: ``create_app(settings, engine=None)``; state lives on the app, built in the lifespan."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI

from ..engine.base import Engine
from ..manager import ModelManager, default_engine
from ..models import Registry
from ..runner import Runner
from ..settings import Settings
from . import errors, management, metrics, openai, ops
from . import page

log = logging.getLogger(__name__)


def create_app(settings: Settings, engine: Engine | None = None) -> FastAPI:
    """Build the service. ``engine`` defaults to llama.cpp; tests may pass a fake."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        eng = engine if engine is not None else default_engine(settings)
        runner = Runner(max_waiting=settings.queue_size, workers=settings.parallel)
        manager = ModelManager(settings, Registry(settings), eng, runner)
        app.state.settings = settings
        app.state.manager = manager
        task = None
        if settings.default_model:
            task = asyncio.create_task(_load_default(manager, settings.default_model))
        try:
            yield
        finally:
            if task is not None and not task.done():
                task.cancel()
            runner.stop()
            try:
                eng.unload()
            except Exception:  # shutting down: nothing left to serve
                log.exception("unload at shutdown failed")

    app = FastAPI(title="GGUF server", version="0.1.0", lifespan=lifespan)
    app.state.metrics = metrics.Metrics()
    app.add_middleware(metrics.MetricsMiddleware, metrics=app.state.metrics)
    errors.install(app)
    app.include_router(ops.router)
    app.include_router(openai.router)
    app.include_router(management.router)
    app.include_router(metrics.router)
    page.install(app)
    return app


async def _load_default(manager: ModelManager, name: str) -> None:
    try:
        await manager.load(name)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.error("loading the default model %r failed: %s", name, exc)
