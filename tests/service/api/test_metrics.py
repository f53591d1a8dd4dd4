"""``/metrics``: bounded labels, the Model Server Protocol gauges, and (slow) those gauges against the real
engine's state under load, read at the same moment as the scrape."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

from service.api.app import create_app
from service.api.metrics import HTTP_METHODS, MSP_GAUGES, OTHER_METHOD, UNMATCHED_ROUTE
from service.testing.fake import FakeEngine
from service.settings import Settings
from tests.conftest import EMBEDDED_NAME, free_port, in_process_service
from tests.prom import families, series, value

from tests.service.conftest import FakeService

KEY = "metrics-test-key"


def _scrape(client: httpx.Client, key: str | None = None) -> str:
    r = client.get("/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return r.text


def test_made_up_methods_and_paths_add_no_series(fake_factory: Callable[..., FakeService]) -> None:
    """A client inventing methods and paths (with or without a key) cannot grow the series: they fold into
    ``other`` and ``unmatched``, and are still counted."""
    svc = fake_factory(api_keys=KEY)
    before = len(series(_scrape(svc.client, KEY), "gguf_requests_total"))
    invented = [f"X{i}METHOD" for i in range(20)] + ["PROPFIND", "MKCOL", "PURGE", "SEARCH", "BREW"]
    for i, method in enumerate(invented):
        svc.client.request(method, f"/nowhere/{i}")                                  # no key: 401
        svc.client.request(method, f"/nowhere/{i}", headers={"X-Api-Key": KEY})     # a key: 404/405
        svc.client.request(method, "/v1/completions", headers={"X-Api-Key": KEY})   # a route, a wrong method
    for i in range(20):
        svc.client.get(f"/v1/made-up-{i}?q={i}")
    text = _scrape(svc.client, KEY)
    got = series(text, "gguf_requests_total")
    assert {s["method"] for s in got} <= HTTP_METHODS | {OTHER_METHOD}
    templates = set(svc.app.openapi()["paths"])  # the app's route templates
    assert {s["route"] for s in got} <= templates | {UNMATCHED_ROUTE}
    # 95 made-up requests added a handful of series (one per method label, route and status), not 95.
    assert len(got) - before <= 6, got
    counted = sum(value(text, "gguf_requests_total", **s) for s in got if s["method"] == OTHER_METHOD)
    assert counted == 3 * len(invented), "folded, not dropped"
    assert value(text, "gguf_requests_total", method="GET", route=UNMATCHED_ROUTE, status="401") == 20


def test_metrics_need_a_key_unless_made_public(fake_factory: Callable[..., FakeService]) -> None:
    svc = fake_factory(api_keys=KEY)
    assert svc.client.get("/metrics").status_code == 401
    public = fake_factory(api_keys=KEY, metrics_public=True)
    assert public.client.get("/metrics").status_code == 200
    assert public.client.get("/v1/models").status_code == 401, "only /metrics is opened"
    assert public.client.post("/v1/completions", json={"prompt": "x"}).status_code == 401


def test_model_server_protocol_gauges_name_the_served_model(fake: FakeService) -> None:
    r = fake.client.post("/v1/completions", json={"prompt": "one two three", "max_tokens": 5})
    assert r.status_code == 200
    text = _scrape(fake.client)
    types = families(text)
    for own, alias, _ in MSP_GAUGES:
        assert types[own] == "gauge" and types[alias] == "gauge"
        assert series(text, own) == [{"model_name": EMBEDDED_NAME}]
        assert value(text, own, model_name=EMBEDDED_NAME) == value(text, alias, model_name=EMBEDDED_NAME)
    eng = fake.engine
    assert eng.kv_cells_used == 9 and eng.kv_cells_allocated > 0  # 4 prompt tokens (BOS included) + 5 generated
    assert value(text, "gguf_kv_cache_usage_ratio", model_name=EMBEDDED_NAME) == pytest.approx(
        eng.kv_cells_used / eng.kv_cells_allocated)
    assert value(text, "gguf_kv_cells_allocated", model_name=EMBEDDED_NAME) == eng.kv_cells_allocated
    assert value(text, "gguf_requests_waiting", model_name=EMBEDDED_NAME) == 0
    assert value(text, "gguf_requests_running", model_name=EMBEDDED_NAME) == 0

    assert fake.client.post("/api/models/unload").status_code == 200
    text = _scrape(fake.client)
    for own, alias, _ in MSP_GAUGES:
        assert series(text, own) == [] and series(text, alias) == [], "no model, no series"
    assert value(text, "gguf_model_loaded") == 0


def test_queue_and_running_gauges_follow_the_runner(fake_factory: Callable[..., FakeService]) -> None:
    """One slot: one generation running, the others queued, as the gauges say while it runs."""
    svc = fake_factory(FakeEngine(token_delay_s=0.02))
    done: list[int] = []

    def ask() -> None:
        with httpx.Client(base_url=svc.url, timeout=60) as c:
            done.append(c.post("/v1/completions", json={"prompt": "a b", "max_tokens": 60}).status_code)

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for t in threads:
        t.start()
    manager = svc.app.state.manager
    deadline = time.monotonic() + 20
    while not (manager.models[EMBEDDED_NAME].runner.waiting == 2 and svc.engine.running.is_set()) and time.monotonic() < deadline:
        time.sleep(0.005)
    text = _scrape(svc.client)
    assert value(text, "gguf_requests_waiting", model_name=EMBEDDED_NAME) == 2
    assert value(text, "vllm:num_requests_waiting", model_name=EMBEDDED_NAME) == 2
    assert value(text, "gguf_requests_running", model_name=EMBEDDED_NAME) == 1
    for t in threads:
        t.join(timeout=30)
    assert done == [200, 200, 200]
    text = _scrape(svc.client)
    assert value(text, "gguf_requests_waiting", model_name=EMBEDDED_NAME) == 0


# -- the acceptance test: the real engine, 4 slots, under load --------------------------------------------

SLOTS = 4
N_UBATCH = 64
MAX_TOKENS = 96
REAL_SETTINGS = dict(parallel=SLOTS, context_length=4096, n_batch=128, n_ubatch=N_UBATCH, queue_size=16,
                     confirm=False)


@dataclass
class _Stream:
    prompt: str
    prompt_tokens: int = 0
    tokens: int = 0
    status: int = 0
    error: str = ""
    done: threading.Event = field(default_factory=threading.Event)


@pytest.fixture(scope="module")
def real_service(tmp_path_factory: pytest.TempPathFactory, embedded_model: str) -> Iterator[tuple[str, Any]]:
    """The real app and engine (llama.cpp, batched with 4 slots) in this process, served by uvicorn over
    loopback, so the test reads the engine's own state beside each scrape."""
    models = tmp_path_factory.mktemp("models")
    port = free_port()
    settings = Settings(host="127.0.0.1", port=port, models_dir=str(models), **REAL_SETTINGS)  # type: ignore[arg-type]
    with in_process_service(settings) as served:
        yield served


def _truth(app: Any) -> tuple[int, int, int, int]:
    """The state the gauges report, read from the runner and the Engine protocol."""
    st = app.state.manager.models[EMBEDDED_NAME]
    eng = st.engine
    return st.runner.waiting, eng.running_sequences, eng.kv_cells_used, eng.kv_cells_allocated


def _stream(url: str, s: _Stream) -> None:
    # One token a step: the prompts repeat ten words, which n-gram drafts copy 48 tokens a step, and the streams
    # would end before six of them are in the engine together.
    body = {"model": EMBEDDED_NAME, "prompt": s.prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "speculative": False}
    try:
        with httpx.Client(base_url=url, timeout=300) as c, c.stream("POST", "/v1/completions", json=body) as r:
            s.status = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if event.get("choices") and event["choices"][0].get("text"):
                    s.tokens += 1
    except Exception as exc:  # reported by the test
        s.error = repr(exc)
    finally:
        s.done.set()


@pytest.mark.slow
def test_gauges_equal_the_engine_state_under_load(real_service: tuple[str, Any]) -> None:
    """6 streamed requests on 4 slots: 4 decode, 2 wait. At several moments the scraped gauges equal the
    runner's queue, the engine's running sequences and its KV cells used / allocated (within one ubatch:
    a prompt enters the cache a ubatch at a time), read just before and just after the scrape."""
    url, app = real_service
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    streams = [_Stream(" ".join(words[(i + j) % len(words)] for j in range(100))) for i in range(SLOTS + 2)]
    with httpx.Client(base_url=url, timeout=120) as c:
        for s in streams:  # each prompt's token count, from the service itself
            r = c.post("/v1/completions", json={"prompt": s.prompt, "max_tokens": 1})
            assert r.status_code == 200, r.text
            s.prompt_tokens = r.json()["usage"]["prompt_tokens"]
        threads = []
        for s in streams:
            threads.append(threading.Thread(target=_stream, args=(url, s), daemon=True))
            threads[-1].start()
            time.sleep(0.05)  # in order: the first four take the slots

        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            waiting, running, _, _ = _truth(app)
            if waiting == 2 and running == SLOTS and sum(s.tokens > 0 for s in streams) >= SLOTS:
                break
            assert not any(s.error for s in streams), [s.error for s in streams]
            time.sleep(0.01)
        else:
            raise AssertionError(f"never 4 running and 2 queued: {_truth(app)}")

        checked = 0
        for _ in range(3):
            before = _truth(app)
            text = _scrape(c)
            after = _truth(app)
            if before[0] != 2 or after[0] != 2:  # a sequence finished in between: the queue moved on
                break
            assert value(text, "gguf_requests_waiting", model_name=EMBEDDED_NAME) == 2
            assert value(text, "vllm:num_requests_waiting", model_name=EMBEDDED_NAME) == 2
            assert value(text, "gguf_requests_running", model_name=EMBEDDED_NAME) == SLOTS == before[1] == after[1]
            assert value(text, "vllm:num_requests_running", model_name=EMBEDDED_NAME) == SLOTS
            allocated = before[3]
            assert allocated == after[3] > 0
            assert value(text, "gguf_kv_cells_allocated", model_name=EMBEDDED_NAME) == allocated
            usage = value(text, "gguf_kv_cache_usage_ratio", model_name=EMBEDDED_NAME)
            assert usage == value(text, "vllm:kv_cache_usage_perc", model_name=EMBEDDED_NAME)
            cells = usage * allocated
            assert min(before[2], after[2]) - N_UBATCH <= cells <= max(before[2], after[2]) + N_UBATCH, (before, after, cells)
            # And from the clients' side: at least the running prompts, at most prompts plus their whole outputs.
            running = [s for s in streams if s.tokens > 0 and not s.done.is_set()]
            assert sum(s.prompt_tokens for s in running) - N_UBATCH <= cells
            assert cells <= sum(s.prompt_tokens + MAX_TOKENS for s in streams[:SLOTS + 2]) + N_UBATCH
            assert 0.05 < usage < 1
            checked += 1
            time.sleep(0.3)
        assert checked >= 1, "no moment with 4 running and 2 queued was scraped"

        for t in threads:
            t.join(timeout=300)
        assert [(s.status, s.tokens, s.error) for s in streams] == [(200, MAX_TOKENS, "")] * len(streams)
        text = _scrape(c)
        assert value(text, "gguf_requests_waiting", model_name=EMBEDDED_NAME) == 0
        assert value(text, "gguf_requests_running", model_name=EMBEDDED_NAME) == 0
        # Finished sequences keep their prompts' cells for reuse (prefix caching): what the idle slots hold.
        eng = app.state.manager.models[EMBEDDED_NAME].engine
        assert value(text, "gguf_kv_cache_usage_ratio", model_name=EMBEDDED_NAME) == pytest.approx(
            eng.kv_cells_used / eng.kv_cells_allocated)
        assert 0 < eng.kv_cells_used <= SLOTS * (max(s.prompt_tokens for s in streams) + MAX_TOKENS)
        eng.forget()
        assert value(_scrape(c), "gguf_kv_cache_usage_ratio", model_name=EMBEDDED_NAME) == 0


def test_metrics_module_has_no_process_global_state(tmp_path: Path) -> None:
    """Two apps in one process keep separate counts (one registry per app, not prometheus-client's global one)."""
    a = create_app(Settings(models_dir=str(tmp_path)), engine=FakeEngine())
    b = create_app(Settings(models_dir=str(tmp_path)), engine=FakeEngine())
    a.state.metrics.request("GET", "/health", 200)
    assert "gguf_requests_total{" in a.state.metrics.render().decode()
    assert "gguf_requests_total{" not in b.state.metrics.render().decode()


def test_a_second_lifespan_replaces_the_gauges_of_the_first() -> None:
    from types import SimpleNamespace

    from service.api.metrics import Metrics

    def manager(waiting: int) -> SimpleNamespace:
        state = SimpleNamespace(name="m", runner=SimpleNamespace(waiting=waiting, running=0), engine=FakeEngine())
        return SimpleNamespace(loaded=lambda: [state], describe=lambda state: None, admission=lambda: ({}, []))

    m = Metrics()
    m.attach(manager(3))  # type: ignore[arg-type]
    m.attach(manager(5))  # type: ignore[arg-type]
    text = m.render().decode()
    assert series(text, "gguf_queue_depth") == [{"model": "m"}] and value(text, "gguf_queue_depth", model="m") == 5
