"""The app factory: ``create_app(settings, engine=None, engine_factory=None)``; state lives on the app, built in
the lifespan."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator

from fastapi import FastAPI

from ..catalog.models import ModelsFileError, Registry, is_hf_reference
from ..chat.sandbox import check_template
from ..engine.base import Engine
from ..errors import NotReady
from ..grammar import worker as grammar_worker
from ..residency import EngineFactory, ModelManager, default_engine
from ..settings import Settings
from . import anthropic, errors, infill, management, metrics, ollama, openai, ops, render, rerank, responses
from . import tokenize
from . import page, security
from .admission import Admission
from .response_store import ResponseStore

log = logging.getLogger(__name__)


SHUTDOWN_UNLOAD_TIMEOUT_S = 30.0


def create_app(settings: Settings, engine: Engine | None = None, engine_factory: EngineFactory | None = None) -> FastAPI:
    """Build the service. Each loaded model gets an engine from ``engine_factory`` (default: llama.cpp);
    tests may pass one fake ``engine`` instead, which then serves one model at a time.

    Raises ``security.ConfigurationError`` for settings it must not serve with (an unreadable key file, a models
    file with a mistake).
    """
    keys = security.load_keys(settings)
    cors = security.cors_options(settings)
    try:
        registry = Registry(settings)
    except ModelsFileError as exc:
        raise security.ConfigurationError(str(exc)) from exc
    try:
        check_template(settings.chat_template())
    except ValueError as exc:  # unreadable, or not a template: refused now, not at the first load
        raise security.ConfigurationError(str(exc)) from exc

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engines: Engine | EngineFactory = engine if engine is not None else (engine_factory or default_engine)
        manager = ModelManager(settings, registry, engines)
        app.state.settings = settings
        app.state.manager = manager
        app.state.admission = Admission()
        app.state.metrics.attach(manager)

        def drain_expired() -> None:
            for s in manager.loaded():
                if s.runner is not None:
                    s.runner.interrupt(NotReady("the server is shutting down: the drain timeout passed",
                                                state="draining", retry_after_s=1))

        app.state.drain.on_expire(asyncio.get_running_loop(), drain_expired)
        publisher = None
        events_task = None
        if settings.kv_events_endpoint:
            from ..residency.kv_events import KvEventPublisher

            publisher = KvEventPublisher.from_settings(settings)  # private unless told; logs where and how
            events_task = asyncio.create_task(publisher.run(manager))
        task = None
        at_start = list(dict.fromkeys([*([settings.default_model] if settings.default_model else []),
                                       *registry.pinned()]))
        if at_start:
            task = asyncio.create_task(_load_at_start(manager, at_start))
        try:
            yield
        finally:
            if events_task is not None:
                events_task.cancel()
            await _shut_down(app, manager, task)
            if publisher is not None:
                publisher.close()

    app = FastAPI(title="GGUF server", version="0.1.0", lifespan=lifespan)
    app.state.metrics = metrics.Metrics()
    app.state.api_keys = keys.all  # generation scopes cached prompts per key (service.api.generation.cache_scope)
    app.state.drain = security.DrainState()
    app.state.responses = ResponseStore(settings.responses_store_mib << 20)  # /v1/responses' stored responses
    _install(app, settings, keys, cors)
    return app


def _install(app: FastAPI, settings: Settings, keys: security.Keys, cors: dict[str, object] | None) -> None:
    """The error table, every API family's routes, the page, and the gates in front of them."""
    errors.install(app)
    for module in (ops, render, openai, responses, anthropic, ollama, management, metrics, tokenize, rerank, infill):
        app.include_router(module.router)
    page.install(app)
    # Added innermost first: the last one added sees a request first (order in service/api/security.py).
    app.add_middleware(security.BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    public = security.PUBLIC_PATHS | ({"/metrics"} if settings.metrics_public else set())
    app.add_middleware(security.ApiKeyMiddleware, keys=keys, public=public)
    app.add_middleware(security.DrainMiddleware, state=app.state.drain)
    app.add_middleware(metrics.MetricsMiddleware, metrics=app.state.metrics)
    if cors is not None:
        app.add_middleware(security.CORSMiddleware, **cors)  # type: ignore[arg-type]


async def _shut_down(app: FastAPI, manager: ModelManager, task: "asyncio.Task[None] | None") -> None:
    """The lifespan's end: the loads at start stopped, every model unloaded after its generations (within
    ``SHUTDOWN_UNLOAD_TIMEOUT_S``), the FIFOs, calibration workers, admission and grammar workers stopped."""
    if task is not None and not task.done():
        task.cancel()
    try:
        # On the workers, after whatever still runs there: never free a model under a generation.
        names = await asyncio.wait_for(manager.unload(limited=False), timeout=SHUTDOWN_UNLOAD_TIMEOUT_S)
        log.info("shutdown: model released: %s", ", ".join(names) or "none was loaded")
    except Exception:  # shutting down: nothing left to serve
        log.exception("unload at shutdown failed")
    for s in list(manager.models.values()):
        if s.runner is not None:
            s.runner.stop()
    manager.close()
    app.state.admission.close()
    grammar_worker.shutdown()  # the grammar zygote and its compilations (they also end with this process)


async def _load_at_start(manager: ModelManager, names: list[str]) -> None:
    """The default model, then the pinned ones, one after the other; a failure is logged and the next loads. A default
    model named by a Hugging Face reference (``hf.co/OWNER/REPO:QUANT``) is pulled first (its progress in the log)."""
    for name in names:
        try:
            if is_hf_reference(name):
                name = await manager.downloads.fetch_reference(name)
            await manager.load(name)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.error("loading %r at start failed: %s", name, exc)
