"""The service in-process with the fake engine, served by uvicorn in a thread over real loopback HTTP."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest
import uvicorn

from service.api.app import create_app
from service.testing.fake import FakeEngine
from service.settings import Settings
from tests.conftest import free_port


@dataclass
class FakeService:
    url: str
    engine: FakeEngine
    client: httpx.Client
    app: Any
    engines: list[FakeEngine] | None = None
    """With an engine factory: every engine it built, in order (one per model load)."""


@pytest.fixture
def fake_factory(tmp_path: Path, embedded_model: str) -> Iterator[Callable[..., FakeService]]:
    """Start the real app on a ``FakeEngine`` (the embedded model's real plan, no llama.cpp)."""
    servers: list[tuple[uvicorn.Server, threading.Thread, httpx.Client]] = []

    def start(engine: FakeEngine | None = None, wait_ready: bool = True, models: list[str] = (),  # type: ignore[assignment]
              engine_factory: Callable[[Settings], FakeEngine] | None = None, **overrides: Any) -> FakeService:
        """``models``: GGUF files to hard-link into the models directory under their own names.
        ``engine_factory``: one fake engine per loaded model (several models at once) instead of ``engine``."""
        engine = engine or FakeEngine()
        built: list[FakeEngine] = []

        def factory(s: Settings) -> FakeEngine:
            assert engine_factory is not None
            e = engine_factory(s)
            built.append(e)
            return e

        # The fake engine runs no llama.cpp: confirming its plans with llama.cpp's dry run only costs time.
        overrides.setdefault("confirm_loads", False)
        # One generation at a time, as the fake engine serves (the real engine's default is 4 slots).
        overrides.setdefault("parallel", 1)
        port = free_port()
        models_dir = tmp_path / f"models-{port}"
        models_dir.mkdir()
        for m in models:
            os.link(m, models_dir / Path(m).name)  # a hard link: the registry refuses links out of the dir
        settings = Settings(host="127.0.0.1", port=port, models_dir=str(models_dir), **overrides)
        app = create_app(settings, engine=None if engine_factory else engine,
                         engine_factory=factory if engine_factory else None)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
        servers.append((server, thread, client))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                r = client.get("/ready" if wait_ready else "/health")
                if r.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        else:
            raise TimeoutError("fake service did not become ready")
        return FakeService(f"http://127.0.0.1:{port}", engine, client, app, built if engine_factory else None)

    yield start
    for server, thread, client in servers:
        client.close()
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
def fake(fake_factory: Callable[..., FakeService]) -> FakeService:
    return fake_factory()


@pytest.fixture(scope="session")
def big_fixture(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A sparse header-only gemma-3-27b bf16 GGUF (50 GiB apparent, nothing written): too big for these hosts."""
    from sizing.testing.fixtures import write_fixture

    return write_fixture("gemma-3-27b", tmp_path_factory.mktemp("fixtures"))
