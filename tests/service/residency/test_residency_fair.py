"""Residency that serves everyone (issue 29): a request for a model that is not loaded waits for the swap instead of
a 409, the busy model yields (finishes what it admitted while new requests for it queue behind the swap), the
wait is bounded (503 with Retry-After) and visible in the metrics, two models under alternating load are both
served, refusals stay short, and a reload keeps /ready and new requests pointed at the model.

On the fake engine over real HTTP, on declared cards (``tests/service/residency/test_residency.py``'s setup): two 4-layer
llama-shaped models, at most one loaded (``GGUF_MAX_LOADED_MODELS=1``), each load taking ``load_delay_s``. One
check runs the real server with two copies of the embedded model.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest

from service.testing.fake import FakeEngine
from service.settings import Settings
from sizing.testing.fixtures import FixtureShape, write_fixture

from tests.conftest import stream_events
from tests.prom import samples

from tests.service.conftest import FakeService
from tests.figures import figure

CARDS = json.dumps([{"name": "card A", "free_mib": 2500, "total_mib": 8192},
                    {"name": "card B", "free_mib": 2500, "total_mib": 8192}])
SETTINGS: dict[str, Any] = dict(gpus_json=CARDS, default_model="", context_length=4096, min_context=2048,
                                calibrate=False, host_bandwidth_gbps=20, allow_offload=False)
A, B = "fa4-bf16", "fb4-bf16"


@pytest.fixture(scope="session")
def pair(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    d = tmp_path_factory.mktemp("fair")
    shape = FixtureShape("llama", 2048, 4, 16, 4, 128, 5632, 32000, 4096, tokenizer="llama")
    return [write_fixture(name, d, shape=shape) for name in ("fa4", "fb4")]


@pytest.fixture
def one_slot(fake_factory: Callable[..., FakeService], pair: list[str]) -> Callable[..., FakeService]:
    """Both models in the models directory, at most one loaded, loaded on demand, one fake engine per load."""

    def start(load_delay_s: float = 0.3, token_delay_s: float = 0.0, **overrides: Any) -> FakeService:
        def engine(_: Settings) -> FakeEngine:
            return FakeEngine(load_delay_s=load_delay_s, token_delay_s=token_delay_s)

        return fake_factory(models=pair, engine_factory=engine, wait_ready=False,
                            **{**SETTINGS, "max_loaded_models": 1, "load_on_demand": True, **overrides})

    return start


def _ask(c: httpx.Client, model: str, **body: Any) -> httpx.Response:
    return c.post("/v1/completions", json={"model": model, "prompt": "a b", "max_tokens": 2, **body})


def _state(svc: FakeService, name: str) -> str:
    models = {m["name"]: m for m in svc.client.get("/api/models").json()["models"]}
    return str(models.get(name, {}).get("state"))


def _gauges(svc: FakeService) -> dict[tuple[str, str], float]:
    got = samples(svc.client.get("/metrics").text)
    return {(n, dict(labels).get("model", "")): v for (n, labels), v in got.items()
            if n in ("gguf_requests_waiting_for_load", "gguf_model_yielding", "gguf_load_wait_seconds")}


def _until(pred: Callable[[], bool], timeout_s: float = 10, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["r"] = fn()
        except Exception as exc:  # reported to the test thread
            out["error"] = repr(exc)
        out["t"] = time.monotonic()

    t = threading.Thread(target=run)
    t.start()
    return t, out


def alternate(url: str, models: list[str], threads: int, seconds: float, timeout_s: float = 180,
              rounds: int | None = None) -> list[tuple[str, int, float]]:
    """``threads`` clients, each asking the models in turn (client i starts with model i mod 2) for ``seconds``
    (or ``rounds`` requests each): (model, status, seconds) per request."""
    out: list[tuple[str, int, float]] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def client(i: int) -> None:
        with httpx.Client(base_url=url, timeout=timeout_s) as c:
            k = i
            while time.monotonic() < stop and (rounds is None or k - i < rounds):
                model = models[k % len(models)]
                t0 = time.monotonic()
                r = _ask(c, model)
                with lock:
                    out.append((model, r.status_code, time.monotonic() - t0))
                k += 1

    ts = [threading.Thread(target=client, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(seconds + timeout_s)
    return out


def _fmt(fig: dict[str, dict[str, Any]]) -> str:
    return "; ".join(f"{m}: {f['served']}/{f['asked']} served" + (
        f", median {f['median_s']:.2f} s, max {f['max_s']:.2f} s" if f["served"] else f", statuses {f['statuses']}")
        for m, f in fig.items())


def figures(records: list[tuple[str, int, float]], models: list[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for m in models:
        mine = [r for r in records if r[0] == m]
        ok = [s for _, status, s in mine if status == 200]
        out[m] = {"asked": len(mine), "served": len(ok),
                  "statuses": sorted({status for _, status, _ in mine}),
                  "median_s": statistics.median(ok) if ok else None, "max_s": max(ok) if ok else None}
    return out


@pytest.mark.timeout(120)
def test_two_models_alternating_on_one_slot_are_both_served(one_slot: Callable[..., FakeService]) -> None:
    """The issue's measurement, shorter and on the fake engine: 8 clients alternating between two models that
    cannot be loaded together, for 20 s, each load 0.3 s. Before: every request for the second model got 409 at
    once (0 of 495 served in 60 s). Now every request is served, each model gets about half, and the swaps come
    in batches (every swap serves what waited for it) instead of one per request."""
    svc = one_slot(load_delay_s=0.3, load_on_demand_wait_s=30)
    records = alternate(svc.url, [A, B], threads=8, seconds=20)
    fig = figures(records, [A, B])
    manager = svc.app.state.manager
    figure(f"8 clients alternating {A}/{B}, 1 slot, load 0.3 s, 20 s: "
           + _fmt(fig) + f"; {manager.swaps} swaps, {manager.loads} loads")
    for m in (A, B):
        assert fig[m]["statuses"] == [200], fig
    served = fig[A]["served"] + fig[B]["served"]
    for m in (A, B):
        assert fig[m]["served"] >= 0.4 * served, fig  # each about half: alternating clients ask both equally
    assert manager.swaps >= 10, "the models were swapped back and forth"
    assert served >= 4 * manager.swaps, "each swap serves a batch (what waited for it), not one request"
    assert max(fig[m]["max_s"] for m in (A, B)) < 10, fig  # a swap and a batch (0.4 s unloaded), within the limit
    # A swap starts when the model it waits for goes idle (not at the scheduler's periodic look, every 2 s).
    assert statistics.median(s for _, status, s in records if status == 200) < 1.5, fig


@pytest.mark.timeout(60)
def test_a_request_for_another_model_waits_for_the_busy_one_and_new_ones_queue_behind_the_swap(
        one_slot: Callable[..., FakeService]) -> None:
    svc = one_slot(load_delay_s=0.05, token_delay_s=0.02, parallel=2)
    assert _ask(svc.client, A).status_code == 200  # A loaded on demand; its slice (its 0.05 s load) passes at once
    started, streamed = threading.Event(), dict[str, Any]()
    stream = threading.Thread(target=stream_events, args=(
        svc.url + "/v1/completions", {"model": A, "prompt": "x", "max_tokens": 300, "stream": True}, started, streamed))
    # 300 tokens of 0.02 s: the stream outlasts what follows on a loaded machine.
    stream.start()
    assert started.wait(10)
    t_b, b = _in_thread(lambda: _ask(httpx.Client(base_url=svc.url, timeout=60), B))
    _until(lambda: _gauges(svc).get(("gguf_requests_waiting_for_load", B)) == 1, what="B waiting")
    # A yields once B's swap has tried and found it busy (B counts as waiting a moment before that: a request for
    # A sent in between is admitted, which is right, and then no wait for A could be seen).
    _until(lambda: _gauges(svc).get(("gguf_model_yielding", A)) == 1, what="A yielding")
    # A yields: what it admitted (the stream) runs on, but a new request for it waits behind the swap, although
    # A has a free slot (parallel 2).
    t_a, a = _in_thread(lambda: _ask(httpx.Client(base_url=svc.url, timeout=60), A))
    _until(lambda: _gauges(svc).get(("gguf_requests_waiting_for_load", A)) == 1, what="A waiting")
    g = _gauges(svc)
    assert g[("gguf_model_yielding", A)] == 1 and g[("gguf_load_wait_seconds", B)] > 0, g
    desc = {m["name"]: m for m in svc.client.get("/api/models").json()["models"]}
    assert desc[A]["yields_to"] == [B] and desc[A]["waiting"] == 1, desc[A]
    assert stream.is_alive() and "r" not in b and "r" not in a
    for t in (stream, t_b, t_a):
        t.join(30)
    assert streamed["status"] == 200 and streamed["events"][-1] == "[DONE]" and "error" not in streamed["events"][-2]
    assert b["r"].status_code == 200 and b["r"].json()["model"] == B, b
    assert a["r"].status_code == 200 and a["r"].json()["model"] == A, a
    assert a["t"] > b["t"], "the request for A that came after B's waited for B's turn"
    manager = svc.app.state.manager
    assert manager.swaps == 2 and manager.loads == 3  # A, then B (A evicted), then A again (B evicted)
    g = _gauges(svc)
    assert ("gguf_requests_waiting_for_load", A) not in g and ("gguf_model_yielding", A) not in g, g


@pytest.mark.timeout(60)
def test_the_wait_is_bounded_503_retry_after_and_the_busy_model_admits_again(
        one_slot: Callable[..., FakeService]) -> None:
    svc = one_slot(load_delay_s=0.05, token_delay_s=0.02, parallel=2, load_on_demand_wait_s=0.6)
    # Loaded by the management API, not on demand: a first load on a busy machine (its planning, the imports it
    # makes) can take longer than the 0.6 s this test gives a wait, which is what it measures below.
    assert svc.client.post("/api/models/load", json={"model": A}).status_code == 200
    started, streamed = threading.Event(), dict[str, Any]()
    stream = threading.Thread(target=stream_events, args=(
        svc.url + "/v1/completions", {"model": A, "prompt": "x", "max_tokens": 250, "stream": True}, started, streamed))
    stream.start()
    assert started.wait(10)
    t0 = time.monotonic()
    r = _ask(svc.client, B)
    waited = time.monotonic() - t0
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert r.headers["retry-after"] == "5" and err["state"] == "waiting" and err["code"] == "model_not_ready"
    assert err["blocked_on"] == [A] and err["position"] == 1 and A in err["message"], err
    assert 0.5 < waited < 3, waited
    # Nobody waits for the swap any more: A admits again, at once (its second slot), while the stream runs.
    t0 = time.monotonic()
    r = _ask(svc.client, A)
    assert r.status_code == 200 and stream.is_alive() and time.monotonic() - t0 < 1.5
    assert _state(svc, B) == "unloaded" and svc.app.state.manager.swaps == 0
    stream.join(30)
    assert streamed["events"][-1] == "[DONE]" and "error" not in streamed["events"][-2]


@pytest.mark.timeout(60)
def test_a_model_just_swapped_in_admits_for_as_long_as_its_load_took(one_slot: Callable[..., FakeService]) -> None:
    """Its slice: a swap is paid for by at least as much serving, so two busy models alternate instead of
    thrashing. Within it a new request for it is admitted although a request for the other model waits."""
    svc = one_slot(load_delay_s=1.5, token_delay_s=0.02, parallel=2)
    started, streamed = threading.Event(), dict[str, Any]()
    stream = threading.Thread(target=stream_events, args=(
        svc.url + "/v1/completions", {"model": A, "prompt": "x", "max_tokens": 150, "stream": True}, started, streamed))
    stream.start()
    assert started.wait(10)  # A loaded a moment ago: its slice, as long as its load took (1.5 s and planning)
    st = svc.app.state.manager.models[A]
    loaded_at, slice_s = st.loaded_at, st.load_s
    assert 1.5 <= slice_s < 3, slice_s
    t_b, b = _in_thread(lambda: _ask(httpx.Client(base_url=svc.url, timeout=60), B))
    _until(lambda: _gauges(svc).get(("gguf_requests_waiting_for_load", B)) == 1, what="B waiting")
    r = _ask(svc.client, A)
    assert r.status_code == 200 and stream.is_alive(), "admitted within A's slice"
    assert time.monotonic() - loaded_at < slice_s
    _until(lambda: time.monotonic() - loaded_at > slice_s + 0.1, what="the slice to pass")
    t_a, a = _in_thread(lambda: _ask(httpx.Client(base_url=svc.url, timeout=60), A))
    _until(lambda: _gauges(svc).get(("gguf_requests_waiting_for_load", A)) == 1, what="A waiting after its slice")
    for t in (stream, t_b, t_a):
        t.join(30)
    assert b["r"].status_code == 200 and a["r"].status_code == 200 and a["t"] > b["t"]


def test_the_wait_queue_is_bounded_by_the_queue_size(one_slot: Callable[..., FakeService]) -> None:
    # The waits are long: what this measures is the bound, and under a loaded host the stream and B's load can
    # outlast a short one (CI once answered a waiter 503 "still loading after 3 s").
    svc = one_slot(load_delay_s=0.05, token_delay_s=0.02, queue_size=2, load_on_demand_wait_s=30)
    assert _ask(svc.client, A).status_code == 200
    started, streamed = threading.Event(), dict[str, Any]()
    stream = threading.Thread(target=stream_events, args=(
        svc.url + "/v1/completions", {"model": A, "prompt": "x", "max_tokens": 100, "stream": True}, started, streamed))
    stream.start()
    assert started.wait(10)
    waiting = [_in_thread(lambda: _ask(httpx.Client(base_url=svc.url, timeout=60), B)) for _ in range(2)]
    _until(lambda: _gauges(svc).get(("gguf_requests_waiting_for_load", B)) == 2, what="two waiting")
    r = _ask(svc.client, B)
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full" and "retry-after" in r.headers
    for t, out in waiting:
        t.join(30)
        assert out["r"].status_code == 200, out
    stream.join(30)


def test_refusals_stay_short_with_the_plan_behind_a_link(one_slot: Callable[..., FakeService],
                                                        fake_factory: Callable[..., FakeService],
                                                        big_fixture: str) -> None:
    """A 409/507 carries the plan in summary (per-device figures) and where the whole one is, not the plan."""
    gpus = json.dumps([{"name": "RTX 3060", "free_mib": 2000, "total_mib": 12288}])
    svc = fake_factory(models=[big_fixture], gpus_json=gpus, allow_offload=False)
    r = svc.client.post("/api/models/load", json={"model": "gemma-3-27b-bf16"})
    assert r.status_code == 507, r.text
    err = r.json()["error"]
    assert len(r.content) < 2000, len(r.content)
    assert err["plan_url"] == "/api/dry-run" and "estimate" not in err["plan"]
    cuda = next(d for d in err["plan"]["devices"] if d["device"] == "CUDA0")
    assert cuda["name"] == "RTX 3060" and cuda["missing_mib"] > 0 and 0 < cuda["free_mib"] < 2000  # beside the default
    assert abs(cuda["needs_mib"] - cuda["free_mib"] - cuda["missing_mib"]) <= 1
    assert "CUDA0 (RTX 3060): needs" in err["message"] and "missing" in err["message"]
    # The whole plan is the dry run's answer for the same body.
    dry = svc.client.post(err["plan_url"], json={"model": "gemma-3-27b-bf16"}).json()
    assert dry["verdict"] == err["plan"]["verdict"] and dry["estimate"]["devices"]
    # 409: an explicit load that needs a busy model's memory (no waiting there: the operator asked for it now).
    two = one_slot(load_delay_s=0.05, token_delay_s=0.02)
    assert _ask(two.client, A).status_code == 200
    started, streamed = threading.Event(), dict[str, Any]()
    stream = threading.Thread(target=stream_events, args=(
        two.url + "/v1/completions", {"model": A, "prompt": "x", "max_tokens": 60, "stream": True}, started, streamed))
    stream.start()
    assert started.wait(10)
    r = two.client.post("/api/models/load", json={"model": B})
    assert r.status_code == 409, r.text
    assert len(r.content) < 2000 and r.json()["error"]["residents"]["busy"] == [A]
    assert r.json()["error"]["plan_url"] == "/api/dry-run"
    stream.join(30)


@pytest.mark.timeout(60)
def test_ready_and_new_requests_follow_a_reload_while_the_old_model_finishes(
        fake_factory: Callable[..., FakeService], pair: list[str]) -> None:
    """A reload waits for the running generations: meanwhile /ready names the model (not "no model") and a new
    request waits for the reload and is answered by the new model, with or without a model name."""
    svc = fake_factory(models=pair, engine_factory=lambda s: FakeEngine(token_delay_s=0.02), wait_ready=False,
                       **{**SETTINGS, "load_wait_s": 20})
    assert svc.client.post("/api/models/load", json={"model": A, "n_ctx": 2048}).status_code == 200
    started, streamed = threading.Event(), dict[str, Any]()
    stream = threading.Thread(target=stream_events, args=(
        svc.url + "/v1/completions", {"prompt": "x", "max_tokens": 80, "stream": True}, started, streamed))
    stream.start()
    assert started.wait(10)
    t_load, load = _in_thread(lambda: httpx.Client(base_url=svc.url, timeout=60).post(
        "/api/models/load", json={"model": A, "n_ctx": 4096}))
    _until(lambda: _state(svc, A) == "unloading", what="the reload waiting")
    r = svc.client.get("/ready")
    assert r.status_code == 200, r.text
    assert r.json()["model"] == A and r.json()["reloading"] == [A], r.json()
    named = _in_thread(lambda: _ask(httpx.Client(base_url=svc.url, timeout=60), A))
    unnamed = _in_thread(lambda: httpx.Client(base_url=svc.url, timeout=60).post(
        "/v1/completions", json={"prompt": "a b", "max_tokens": 2}))
    _until(lambda: _gauges(svc).get(("gguf_requests_waiting_for_load", A)) == 2, what="two waiting for the reload")
    assert stream.is_alive()
    for t, _ in (named, unnamed):
        t.join(30)
    t_load.join(30)
    stream.join(30)
    assert load["r"].status_code == 200 and load["r"].json()["n_ctx"] == 4096
    assert streamed["events"][-1] == "[DONE]" and "error" not in streamed["events"][-2], "the old model finished"
    for _, out in (named, unnamed):
        assert out["r"].status_code == 200 and out["r"].json()["model"] == A, out
        assert out["t"] >= load["t"] - 0.5, "answered once the reload was done"
    assert svc.engines is not None and len(svc.engines) == 2 and svc.engines[1].loads == 1
    assert svc.engines[0].unloads == 1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_real_server_serves_two_copies_of_the_embedded_model_alternating_on_one_slot(
        service_factory: Any, embedded_model: str, tmp_path: Path) -> None:
    """The real path (llama.cpp, a runner process per model, llama.cpp's confirmation of each load): 4 clients
    asking the two in turn, 4 requests each. Before, every request for the model not loaded got 409 at once."""
    models = tmp_path / "models"
    models.mkdir()
    for name in ("one", "two"):
        os.link(embedded_model, models / f"{name}.gguf")
    svc = service_factory(GGUF_MODELS_DIR=str(models), GGUF_DEFAULT_MODEL="", GGUF_MAX_LOADED_MODELS="1",
                          GGUF_LOAD_ON_DEMAND="true", GGUF_CONTEXT_LENGTH="2048")
    t0 = time.monotonic()
    records = alternate(svc.url, ["one", "two"], threads=4, seconds=240, rounds=4)
    took = time.monotonic() - t0
    fig = figures(records, ["one", "two"])
    swaps = svc.log_path.read_text(errors="replace").count("(least recently used, idle) to load")
    figure("real server, 4 clients x 4 requests alternating two copies of the embedded model, 1 slot: "
           + _fmt(fig) + f"; {swaps} swaps in {took:.1f} s")
    for m in ("one", "two"):
        assert fig[m]["statuses"] == [200] and fig[m]["served"] == 8, fig
    assert 2 <= swaps <= 8, "a swap serves every client that waited for it, not one request each"
