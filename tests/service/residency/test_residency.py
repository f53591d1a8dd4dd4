"""Several models on two declared cards, on the fake engine, through the real app and HTTP: packing, eviction
(the smallest idle set, least recently used first, never a busy or pinned model), refusals with figures, load on
demand, keep_alive, aliases, the models file and the set dry-run.

The models are llama-shaped header-only files (``sizing.testing.fixtures``) of 4, 8, 16 and 32 layers; the cards
are declared with 2500 MiB free each, so two or three models share them and a fourth needs room. Each model's
runner process holds its own CUDA context (the 477 MiB allowance) on every card it uses.
"""

from __future__ import annotations

import json
import math
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

from tests.service.conftest import FakeService

MIB = 1 << 20
FREE_MIB = 2500
CARDS = json.dumps([{"name": "card A", "free_mib": FREE_MIB, "total_mib": 8192},
                    {"name": "card B", "free_mib": FREE_MIB, "total_mib": 8192}])
ALLOWANCE_MIB = 477


def _shape(n_layer: int) -> FixtureShape:
    return FixtureShape("llama", 2048, n_layer, 16, 4, 128, 5632, 32000, 4096, tokenizer="llama")


@pytest.fixture(scope="session")
def fixtures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Model name -> path: a4, b4 (4 layers), c8, d8 (8), e16 (16), g48 (48: more than both cards hold)."""
    d = tmp_path_factory.mktemp("residency")
    out = {}
    for name, n in (("a4", 4), ("b4", 4), ("c8", 8), ("d8", 8), ("e16", 16), ("g48", 48)):
        path = write_fixture(name, d, shape=_shape(n))
        out[Path(path).stem] = path
    return out


def N(short: str) -> str:
    """A fixture's model name (its file name without .gguf)."""
    return f"{short}-bf16"


SETTINGS: dict[str, Any] = dict(gpus_json=CARDS, default_model="", context_length=4096, min_context=2048,
                                calibrate=False, host_bandwidth_gbps=20, allow_offload=False)


@pytest.fixture
def multi(fake_factory: Callable[..., FakeService], fixtures: dict[str, str]) -> Callable[..., FakeService]:
    """A service with every fixture in its models directory and one fake engine per loaded model."""

    def start(engine: Callable[[Settings], FakeEngine] = lambda s: FakeEngine(), **overrides: Any) -> FakeService:
        return fake_factory(models=list(fixtures.values()), engine_factory=engine, wait_ready=False,
                            **{**SETTINGS, **overrides})

    return start


def _load(svc: FakeService, short: str, **body: Any) -> httpx.Response:
    return svc.client.post("/api/models/load", json={"model": N(short), **body})


def _models(svc: FakeService) -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in svc.client.get("/api/models").json()["models"]}


def _loaded(svc: FakeService) -> set[str]:
    return {n for n, m in _models(svc).items() if m["state"] == "loaded"}


def _ask(svc: FakeService, short: str, **body: Any) -> httpx.Response:
    return svc.client.post("/v1/completions", json={"model": N(short), "prompt": "a b", "max_tokens": 2, **body})


def _held_per_card(svc: FakeService) -> dict[str, float]:
    """Per card: what the loaded models' plans hold there (each plan's device total, its runner's context included)."""
    out: dict[str, float] = {}
    for m in _models(svc).values():
        if m["state"] != "loaded":
            continue
        for d in m["plan"]["estimate"]["devices"]:
            if d["device"] != "CPU":
                out[d["device"]] = out.get(d["device"], 0.0) + d["total_mib"]
    return out


def _stream_in_thread(url: str, short: str, started: threading.Event, out: dict[str, Any]) -> threading.Thread:
    def run() -> None:
        stream_events(url + "/v1/completions", {"model": N(short), "prompt": "x", "max_tokens": 400, "stream": True},
                      started, out)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_three_models_pack_over_two_cards_within_their_free_memory(multi: Callable[..., FakeService]) -> None:
    svc = multi()
    for short in ("a4", "b4", "c8"):
        r = _load(svc, short)
        assert r.status_code == 200, r.text
    models = _models(svc)
    assert _loaded(svc) == {N("a4"), N("b4"), N("c8")}
    # a4 took the card with the most free memory (the first of two equal ones), b4 the other, c8 is split.
    assert models[N("a4")]["devices"] == ["CPU", "CUDA0"] and models[N("b4")]["devices"] == ["CPU", "CUDA1"]
    assert models[N("c8")]["plan"]["verdict"] == "split"
    held = _held_per_card(svc)
    for card in ("CUDA0", "CUDA1"):
        assert held[card] <= FREE_MIB, (card, held)
    # Each model's plan was made on what the ones before it left: c8's cards had a4's and b4's bytes taken off.
    c8_free = {d["label"]: d["free_mib"] for d in models[N("c8")]["plan"]["devices"]}
    a4 = {d["device"]: d for d in models[N("a4")]["plan"]["estimate"]["devices"]}
    assert c8_free["CUDA0"] == pytest.approx(FREE_MIB - a4["CUDA0"]["total_mib"],
                                             abs=0.02)
    # /api/models' device view: every card with each model's share.
    devices = {d["device"]: d for d in svc.client.get("/api/models").json()["devices"]}
    assert {s["model"] for s in devices["CUDA0"]["models"]} == {N("a4"), N("c8")}
    assert sum(s["held_mib"] for s in devices["CUDA1"]["models"]) == pytest.approx(held["CUDA1"], abs=0.05)
    # Each answers its own requests, with its own name.
    for short in ("a4", "b4", "c8"):
        r = _ask(svc, short)
        assert r.status_code == 200 and r.json()["model"] == N(short)
    assert svc.engines is not None and len(svc.engines) == 3 and all(e.loads == 1 for e in svc.engines)


def test_eviction_unloads_the_least_recently_used_idle_model_only(multi: Callable[..., FakeService]) -> None:
    svc = multi()
    for short in ("a4", "b4", "c8"):
        assert _load(svc, short).status_code == 200
    assert _ask(svc, "a4").status_code == 200  # a4 used last: b4 is now the least recently used
    dry = svc.client.post("/api/dry-run", json={"model": N("d8")}).json()
    assert dry["verdict"] != "refused" and dry["residency"]["evict"] == [N("b4")]
    assert _loaded(svc) == {N("a4"), N("b4"), N("c8")}, "a dry run unloads nothing"
    r = _load(svc, "d8")
    assert r.status_code == 200, r.text
    assert _loaded(svc) == {N("a4"), N("c8"), N("d8")}
    assert _models(svc)[N("b4")]["unloaded"] == f"evicted for {N('d8')}"
    for card, mib in _held_per_card(svc).items():
        assert mib <= FREE_MIB, card


def test_prompt_caches_are_emptied_before_a_model_is_evicted_and_resized_after(
        multi: Callable[..., FakeService]) -> None:
    """Residents' prompt caches beyond the slots give their host memory first: emptied before the plan that evicts
    b4 is made again, then each given its share of what is left (the cards are declared, so the eviction still
    happens: the caches were host memory)."""
    engines: list[FakeEngine] = []

    def make(_: Settings) -> FakeEngine:
        e = FakeEngine()
        e.prompt_cache_bytes = 64 * MIB
        engines.append(e)
        return e

    svc = multi(engine=make)
    for short in ("a4", "b4", "c8"):
        assert _load(svc, short).status_code == 200
    assert all(e.prompt_cache_budgets == [] for e in engines), "no load needed room yet"
    assert _ask(svc, "a4").status_code == 200
    assert _load(svc, "d8").status_code == 200
    assert _loaded(svc) == {N("a4"), N("c8"), N("d8")}
    by_path = {Path(e.path or "").stem: e for e in engines if e.path}
    for short in ("a4", "c8"):
        budgets = by_path[N(short)].prompt_cache_budgets
        assert budgets[0] == 0 and len(budgets) == 2 and 0 < budgets[1] <= 8192 * MIB, (short, budgets)
    assert by_path[N("d8")].prompt_cache_budgets[-1] == by_path[N("a4")].prompt_cache_budgets[-1]


def test_the_fewest_models_go_even_when_smaller_ones_are_older(multi: Callable[..., FakeService]) -> None:
    """One card: a4 and b4 (older, smaller) and d8 (newest). c8 needs d8's memory, or a4's and b4's together:
    one model is fewer than two, so d8 goes although a4 is the least recently used."""
    CARD_MIB = 3800  # the three with their runners' contexts, and too little beside them for c8
    card = json.dumps([{"name": "card A", "free_mib": CARD_MIB, "total_mib": 8192}])
    svc = multi(gpus_json=card)
    for short in ("a4", "b4", "d8"):
        assert _load(svc, short).status_code == 200, short
    models = _models(svc)
    held = {n: m["memory"][1]["held_mib"] for n, m in models.items() if m["state"] == "loaded"}
    free_beside = CARD_MIB - sum(held.values())
    need = next(d["total_mib"] for d in svc.client.post("/api/dry-run", json={
        "model": N("c8"), "gpus": [{"name": "empty", "free_mib": CARD_MIB, "total_mib": 8192}]}).json()["estimate"]["devices"]
        if d["device"] == "CUDA0")
    # The scenario: neither small model alone makes room, d8 alone does, and so do both small ones.
    assert free_beside + held[N("a4")] < need and free_beside + held[N("b4")] < need
    assert free_beside + held[N("d8")] >= need and free_beside + held[N("a4")] + held[N("b4")] >= need
    dry = svc.client.post("/api/dry-run", json={"model": N("c8")}).json()
    assert dry["residency"]["evict"] == [N("d8")]
    assert _load(svc, "c8").status_code == 200
    assert _loaded(svc) == {N("a4"), N("b4"), N("c8")}


def test_busy_and_pinned_models_are_never_evicted(multi: Callable[..., FakeService], tmp_path: Path,
                                                  fixtures: dict[str, str]) -> None:
    models_file = tmp_path / "models.toml"
    models_file.write_text(f'[models."{N("a4")}"]\npinned = true\n')
    svc = multi(engine=lambda s: FakeEngine(token_delay_s=0.02), models_file=str(models_file))
    deadline = time.monotonic() + 10
    while N("a4") not in _loaded(svc) and time.monotonic() < deadline:  # a pinned model loads at start
        time.sleep(0.05)
    assert _models(svc)[N("a4")]["pinned"] is True
    for short in ("b4", "c8"):
        assert _load(svc, short).status_code == 200
    started, out = threading.Event(), {}
    t = _stream_in_thread(svc.url, "b4", started, out)  # b4 generates while d8 is loaded
    assert started.wait(10)
    # a4 (pinned) and b4 (busy) are older than c8; only c8 may go.
    r = _load(svc, "d8")
    assert r.status_code == 200, r.text
    assert _loaded(svc) == {N("a4"), N("b4"), N("d8")}
    assert t.is_alive(), "the busy model's stream was not disturbed"
    t.join(30)
    assert out["status"] == 200 and out["events"][-1] == "[DONE]" and "error" not in out["events"][-2]


def test_memory_held_only_by_busy_models_is_409_and_force_evicts_them(multi: Callable[..., FakeService]) -> None:
    svc = multi(engine=lambda s: FakeEngine(token_delay_s=0.02))
    for short in ("a4", "b4", "c8"):
        assert _load(svc, short).status_code == 200
    streams = []
    for short in ("a4", "b4", "c8"):
        started, out = threading.Event(), {}
        streams.append((_stream_in_thread(svc.url, short, started, out), out))
        assert started.wait(10)
    r = _load(svc, "d8")
    assert r.status_code == 409, r.text
    err = r.json()["error"]
    assert err["code"] == "model_busy" and r.headers["retry-after"] == "5"
    assert set(err["residents"]["busy"]) == {N("a4"), N("b4"), N("c8")}
    assert _loaded(svc) == {N("a4"), N("b4"), N("c8")}, "nothing unloaded"
    r = _load(svc, "d8", force=True)
    assert r.status_code == 200, r.text
    gone = {N("a4"), N("b4"), N("c8")} - _loaded(svc)
    assert gone and N("d8") in _loaded(svc)
    for t, out in streams:
        t.join(30)
    ended = [out for (_, out), short in zip(streams, ("a4", "b4", "c8")) if N(short) in gone]
    for out in ended:  # the forced eviction ended their streams with the error event
        assert out["events"][-1] == "[DONE]" and json.loads(out["events"][-2])["error"]["code"] == "model_not_ready"


def test_a_model_that_cannot_fit_is_507_with_every_cards_figures_and_nothing_is_unloaded(
        multi: Callable[..., FakeService]) -> None:
    svc = multi()
    for short in ("a4", "b4"):
        assert _load(svc, short).status_code == 200
    r = _load(svc, "g48")
    assert r.status_code == 507, r.text
    err = r.json()["error"]
    assert err["code"] == "INSUFFICIENT_MEMORY"
    for card in ("CUDA0 (card A)", "CUDA1 (card B)"):
        assert card in err["message"], err["message"]
    assert "missing" in err["message"]
    assert f"held by {N('a4')}" in err["message"] and f"held by {N('b4')}" in err["message"]
    assert err["residents"]["beside"] and set(err["residents"]["held_mib"]["CUDA0"]) == {N("a4")}
    assert _loaded(svc) == {N("a4"), N("b4")}
    assert svc.engines is not None and all(e.unloads == 0 for e in svc.engines), "nothing was unloaded"
    assert _models(svc)[N("g48")]["state"] == "unloaded"


def test_load_on_demand_under_twenty_concurrent_requests_loads_once(multi: Callable[..., FakeService]) -> None:
    svc = multi(engine=lambda s: FakeEngine(load_delay_s=0.5), load_on_demand=True, queue_size=32)
    assert svc.client.get("/ready").json()["load_on_demand"] is True, "ready: a request loads what it names"
    results: list[httpx.Response] = []
    lock = threading.Lock()

    def ask() -> None:
        with httpx.Client(base_url=svc.url, timeout=30) as c:
            r = c.post("/v1/completions", json={"model": N("c8"), "prompt": "a b", "max_tokens": 2})
        with lock:
            results.append(r)

    threads = [threading.Thread(target=ask) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [r.status_code for r in results] == [200] * 20, [r.text for r in results if r.status_code != 200][:2]
    assert {r.json()["model"] for r in results} == {N("c8")}
    assert svc.engines is not None and len(svc.engines) == 1 and svc.engines[0].loads == 1
    assert svc.app.state.manager.loads == 1


def test_a_request_during_an_explicit_load_waits_for_it_instead_of_loading_again(
        multi: Callable[..., FakeService]) -> None:
    svc = multi(engine=lambda s: FakeEngine(load_delay_s=0.8), load_on_demand=True)
    out: dict[str, httpx.Response] = {}
    t = threading.Thread(target=lambda: out.setdefault("load", _load(svc, "a4")))
    t.start()
    deadline = time.monotonic() + 5
    while _models(svc).get(N("a4"), {}).get("state") != "loading" and time.monotonic() < deadline:
        time.sleep(0.01)
    r = _ask(svc, "a4")
    t.join(10)
    assert r.status_code == 200 and out["load"].status_code == 200
    assert svc.engines is not None and len(svc.engines) == 1, "the request joined the running load"


def test_load_on_demand_waits_its_limit_then_503_and_the_load_goes_on(multi: Callable[..., FakeService]) -> None:
    svc = multi(engine=lambda s: FakeEngine(load_delay_s=1.5), load_on_demand=True, load_on_demand_wait_s=0.3)
    r = _ask(svc, "a4")
    assert r.status_code == 503 and r.json()["error"]["state"] == "loading" and r.headers["retry-after"] == "5"
    deadline = time.monotonic() + 10
    while N("a4") not in _loaded(svc) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _ask(svc, "a4").status_code == 200


def test_load_on_demand_evicts_an_idle_model_and_a_request_without_model_needs_one_when_several_serve(
        multi: Callable[..., FakeService]) -> None:
    svc = multi(load_on_demand=True)
    for short in ("a4", "b4", "c8", "d8"):
        r = _ask(svc, short)
        assert r.status_code == 200 and r.json()["model"] == N(short)
    assert _loaded(svc) == {N("b4"), N("c8"), N("d8")}, "a4, least recently used, made room"
    r = svc.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_keep_alive_zero_unloads_after_the_request_and_a_duration_after_that_long(
        multi: Callable[..., FakeService]) -> None:
    svc = multi(load_on_demand=True)
    r = _ask(svc, "a4", keep_alive=0)
    assert r.status_code == 200
    deadline = time.monotonic() + 5
    while N("a4") in _loaded(svc) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert N("a4") not in _loaded(svc)
    assert _models(svc)[N("a4")]["unloaded"].startswith("keep_alive")
    assert _ask(svc, "b4", keep_alive="1s").status_code == 200
    deadline = time.monotonic() + 5
    while _models(svc)[N("b4")].get("expires_in_s") is None and time.monotonic() < deadline:
        time.sleep(0.01)  # the runner releases the request just after its answer went out
    assert _models(svc)[N("b4")]["expires_in_s"] <= 1.0
    assert N("b4") in _loaded(svc)
    deadline = time.monotonic() + 10
    while N("b4") in _loaded(svc) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert N("b4") not in _loaded(svc)
    assert _ask(svc, "c8").status_code == 200  # no keep_alive: GGUF_KEEP_ALIVE, -1 by default
    time.sleep(0.3)
    m = _models(svc)[N("c8")]
    assert m["state"] == "loaded" and m["keep_alive_s"] == -1 and m["expires_in_s"] is None


def test_keep_alive_setting_and_models_file_per_model(multi: Callable[..., FakeService], tmp_path: Path) -> None:
    models_file = tmp_path / "models.yaml"
    models_file.write_text(f'models:\n  "{N("b4")}":\n    keep_alive: -1\n')
    svc = multi(keep_alive="200ms", models_file=str(models_file))
    assert _load(svc, "a4").status_code == 200 and _load(svc, "b4").status_code == 200
    deadline = time.monotonic() + 5
    while N("a4") in _loaded(svc) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _loaded(svc) == {N("b4")}, "a4 went after GGUF_KEEP_ALIVE; b4's own keep_alive is -1"


@pytest.mark.parametrize("bad", ["forever", "5 minutes", True, [1], "1e30", ""])
def test_a_malformed_keep_alive_is_400(multi: Callable[..., FakeService], bad: Any) -> None:
    svc = multi(load_on_demand=True)
    r = _ask(svc, "a4", keep_alive=bad)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("keep_alive")
    assert _load(svc, "a4", keep_alive=bad).status_code == 400
    assert _loaded(svc) == set(), "nothing was loaded for a refused request"


def test_aliases_route_to_their_model_from_the_setting_and_the_models_file(
        multi: Callable[..., FakeService], tmp_path: Path) -> None:
    models_file = tmp_path / "models.toml"
    models_file.write_text(f'[models."{N("b4")}"]\naliases = ["gpt-4o-mini", "org/chat:latest"]\nslots = 2\n')
    svc = multi(models_file=str(models_file), model_aliases=f"small={N('a4')}", load_on_demand=True)
    for alias, short in (("small", "a4"), ("gpt-4o-mini", "b4"), ("org/chat:latest", "b4")):
        r = svc.client.post("/v1/completions", json={"model": alias, "prompt": "x", "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == N(short), "the response names the model, not the alias"
    cards = {m["id"]: m for m in svc.client.get("/v1/models").json()["data"]}
    assert cards[N("b4")]["aliases"] == ["gpt-4o-mini", "org/chat:latest"] and cards[N("a4")]["aliases"] == ["small"]
    assert svc.client.get("/v1/models/small").json()["id"] == N("a4")
    assert _models(svc)[N("b4")]["plan"]["chosen"]["n_seq_max"] == 2, "slots from the models file"
    assert svc.client.post("/v1/completions", json={"model": "SMALL", "prompt": "x"}).status_code == 404
    r = svc.client.post("/api/models/unload", json={"model": "small"})
    assert r.status_code == 200 and r.json()["models"] == [N("a4")]


def test_the_models_file_sets_a_models_context_ceiling_and_cache_type(
        multi: Callable[..., FakeService], tmp_path: Path, fixtures: dict[str, str]) -> None:
    models_file = tmp_path / "models.toml"
    models_file.write_text(f'[models.chat]\nfile = "{fixtures[N("a4")]}"\ncontext_length = 2048\ncache_type = "F16"\n')
    svc = multi(models_file=str(models_file))
    r = svc.client.post("/api/models/load", json={"model": "chat"})
    assert r.status_code == 200, r.text
    chosen = r.json()["plan"]["chosen"]
    assert chosen["n_ctx"] == 2048 and chosen["cache_type"] == "f16"
    assert r.json()["origin"] == "models_file"


def test_cache_type_auto_is_the_default_and_the_plan_says_what_it_chose(
        multi: Callable[..., FakeService], tmp_path: Path, fixtures: dict[str, str]) -> None:
    """``auto`` (the settings' default, and accepted in any case in the models file and a body) loads a concrete
    type and says why; a named type, from the body or the models file, wins over it."""
    assert Settings.model_fields["cache_type"].default == "auto"
    models_file = tmp_path / "models.toml"
    models_file.write_text(f'[models.chat]\nfile = "{fixtures[N("a4")]}"\ncache_type = "AUTO"\n'
                           f'[models.fixed]\nfile = "{fixtures[N("b4")]}"\ncache_type = "q4_0"\n')
    svc = multi(models_file=str(models_file))
    plan = svc.client.post("/api/dry-run", json={"model": "chat"}).json()
    f16 = next(c for c in plan["cache_types"] if c["cache_type"] == "f16")
    assert f16["n_ctx"] == plan["ctx_cap"] == 4096, "premise: f16 reaches the ceiling (GGUF_CONTEXT_LENGTH)"
    assert plan["chosen"]["cache_type"] == "f16" and plan["estimate"]["type_v"] == "f16"
    assert plan["chosen"]["cache_type_reason"] == "cache type auto: f16 reaches the ceiling 4096"
    assert plan["chosen"]["cache_type_reason"] in plan["reasons"]
    off = svc.client.post("/api/dry-run", json={"model": "chat", "flash_attn": "off", "n_ctx": 4096}).json()
    assert off["chosen"]["cache_type"] == "f16" and off["chosen"]["flash_attn"] == "off"
    named = svc.client.post("/api/dry-run", json={"model": "chat", "cache_type": "Q8_0"}).json()
    assert named["chosen"]["cache_type"] == "q8_0"
    assert named["chosen"]["cache_type_reason"] == "cache type q8_0: as asked (not auto)"
    r = svc.client.post("/api/models/load", json={"model": "fixed"})
    assert r.status_code == 200, r.text
    assert _models(svc)["fixed"]["plan"]["chosen"]["cache_type"] == "q4_0", "the models file over auto"
    r = svc.client.post("/api/models/load", json={"model": "chat", "cache_type": "automatic"})
    assert r.status_code in (400, 422) and "auto" in r.text and "cache_type" in r.text, r.text


def test_a_load_option_is_the_bodys_else_the_models_files_else_the_settings_by_one_name(
        multi: Callable[..., FakeService], tmp_path: Path, fixtures: dict[str, str]) -> None:
    """``service.options``: one name per knob (older ones accepted), one merge. kv_unified was added as a load
    option by one field there and one line of the plan request (issue 23's measure of the merge)."""
    models_file = tmp_path / "models.toml"
    models_file.write_text(f'[models.chat]\nfile = "{fixtures[N("a4")]}"\nkv_unified = false\nparallel = 2\n'
                           f'[models.old]\nfile = "{fixtures[N("b4")]}"\nslots = 3\n')
    svc = multi(models_file=str(models_file), kv_unified=True, parallel=4)
    r = svc.client.post("/api/models/load", json={"model": "chat"})
    assert r.status_code == 200, r.text
    chosen = r.json()["plan"]["chosen"]
    assert chosen["kv_unified"] is False and chosen["n_seq_max"] == 2, "the models file over the settings"
    r = svc.client.post("/api/models/load", json={"model": "chat", "kv_unified": True, "n_seq_max": 3})
    assert r.status_code == 200, r.text
    chosen = r.json()["plan"]["chosen"]
    assert chosen["kv_unified"] is True and chosen["n_seq_max"] == 3, "the body over the models file (an alias)"
    r = svc.client.post("/api/models/load", json={"model": "old", "flash_attention": "on"})
    assert r.status_code == 200, r.text
    chosen = r.json()["plan"]["chosen"]
    assert chosen["n_seq_max"] == 3 and chosen["flash_attn"] == "on" and chosen["kv_unified"] is True, chosen
    bad = svc.client.post("/api/models/load", json={"model": "chat", "kv_unified": "perhaps"})
    assert bad.status_code in (400, 422) and "kv_unified" in bad.text, bad.text


@pytest.mark.parametrize("text, says", [
    ('[models.x]\nfile = "nope.gguf"\n', "models.x.file"),
    ('[models.x]\ncache_type = "q9_9"\n', "unknown KV cache type"),
    ('[models.x]\nkeep_alive = "soon"\n', "models.x.keep_alive"),
    ('[models.x]\nslots = 0\n', "models.x.slots"),
    ('[models.x]\ncolour = "red"\n', "colour"),
    ('[models]\nx = 3\n', "models.x"),
    ('[models.x\n', "not valid TOML"),
    ('[models."../etc"]\n', "model name"),
    ('[models."gemma-3-270m-q4_k_m"]\naliases = ["a"]\n[models.y]\nfile = "y.gguf"\naliases = ["a"]\n',
     "names two models"),
    ('[models.y]\nfile = "not-gguf.gguf"\n', "is not a GGUF file"),
    ('[models."gemma-3-270m-q4_k_m"]\naliases = ["gemma-3-270m-q4_k_m"]\n', "name of a model itself"),
])
def test_the_models_file_is_validated_at_start_with_a_clear_error(tmp_path: Path, text: str, says: str) -> None:
    from service.api.app import create_app
    from service.api.security import ConfigurationError

    path = tmp_path / "models.toml"
    path.write_text(text)
    (tmp_path / "y.gguf").write_bytes(b"GGUF" + bytes(60))
    (tmp_path / "not-gguf.gguf").write_bytes(b"NOPE" + bytes(60))
    with pytest.raises(ConfigurationError) as info:
        create_app(Settings(models_dir=str(tmp_path), models_file=str(path), default_model=""))
    assert str(path) in str(info.value) and says in str(info.value), str(info.value)


def test_an_alias_to_a_model_that_does_not_exist_stops_the_service_with_exit_2(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.conftest import ROOT

    env = {"GGUF_MODEL_ALIASES": "chat=no-such-model", "GGUF_MODELS_DIR": str(tmp_path), "PATH": "/usr/bin:/bin",
           "GGUF_DEFAULT_MODEL": ""}
    r = subprocess.run([sys.executable, "-m", "service"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "alias 'chat' names 'no-such-model', which is not a model here" in r.stderr


def test_a_set_dry_run_answers_whether_models_fit_together_and_how_per_card(
        multi: Callable[..., FakeService]) -> None:
    svc = multi()
    body = {"models": [{"model": N("a4")}, {"model": N("b4")}, {"model": N("c8")}]}
    r = svc.client.post("/api/dry-run", json=body)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["fits"] is True and got["how"] in ("largest_contexts", "smallest_contexts")
    assert [m["model"] for m in got["models"]] == [N("a4"), N("b4"), N("c8")]
    for dev in got["devices"]:
        if dev["device"] == "CPU":
            continue
        used = sum(m["total_mib"] for m in dev["models"])
        assert dev["left_mib"] == pytest.approx(dev["free_mib"] - used, abs=0.05)
        assert dev["left_mib"] >= 0
        for m in dev["models"]:
            parts = (m["weights_mib"] + m["kv_mib"] + m["state_mib"] + m["compute_mib"] + m["output_mib"]
                     + m["gpu_pool_mib"] + m["allowance_mib"])
            assert parts == pytest.approx(m["total_mib"], abs=0.05)
    assert _loaded(svc) == set(), "a dry run loads nothing"
    # With a fourth model the set does not fit at all, and the answer names it.
    r = svc.client.post("/api/dry-run", json={"models": body["models"] + [{"model": N("g48")}]})
    assert r.status_code == 200 and r.json()["fits"] is False and N("g48") in r.json()["refused"]
    # On hypothetical cards, and beside what is loaded.
    cards = [{"name": "big", "free_mib": 24000, "total_mib": 24576}]
    r = svc.client.post("/api/dry-run", json={"models": body["models"] + [{"model": N("g48")}], "gpus": cards})
    assert r.json()["fits"] is True
    assert _load(svc, "e16").status_code == 200
    beside = svc.client.post("/api/dry-run", json={**body, "beside_residents": True}).json()
    alone = svc.client.post("/api/dry-run", json=body).json()
    assert alone["fits"] is True
    assert beside["fits"] is False or beside["devices"][1]["free_mib"] < alone["devices"][1]["free_mib"]


@pytest.mark.parametrize("body", [
    {"models": []},
    {"models": [{"model": "x"}] * 17},
    {"models": [{"model": "a4-bf16"}, {"model": "a4-bf16"}]},
    {"models": [{"model": "../x"}]},
    {"models": [{"model": "a4-bf16"}], "model": "a4-bf16"},
    {"models": [{"nope": 1}]},
    {"models": "a4-bf16"},
])
def test_malformed_set_dry_runs_are_4xx(multi: Callable[..., FakeService], body: dict[str, Any]) -> None:
    svc = multi()
    r = svc.client.post("/api/dry-run", json=body)
    assert 400 <= r.status_code < 500, r.text
    assert isinstance(r.json()["error"]["code"], str)


def test_unload_takes_a_model_name_and_without_one_unloads_every_model(multi: Callable[..., FakeService]) -> None:
    svc = multi()
    for short in ("a4", "b4"):
        assert _load(svc, short).status_code == 200
    r = svc.client.post("/api/models/unload", json={"model": N("a4")})
    assert r.status_code == 200 and r.json()["models"] == [N("a4")]
    assert _loaded(svc) == {N("b4")}
    assert svc.client.post("/api/models/unload", json={"model": "../x"}).status_code == 404
    r = svc.client.post("/api/models/unload")
    assert r.status_code == 200 and r.json()["models"] == [N("b4")] and _loaded(svc) == set()
    assert svc.client.get("/ready").status_code == 503


def test_api_models_equals_what_each_engine_reported_allocating(multi: Callable[..., FakeService]) -> None:
    svc = multi()
    for short in ("a4", "b4", "c8", "d8", "e16"):  # each a load, some of them evictions
        _load(svc, short)
    assert svc.engines is not None
    live = {e.path: e for e in svc.engines if e.report is not None}
    models = _models(svc)
    loaded = {n: m for n, m in models.items() if m["state"] == "loaded"}
    assert len(loaded) == len(live) >= 2
    for name, m in loaded.items():
        eng = next(e for e in live.values() if e.path is not None and Path(e.path).stem == name)
        assert eng.report is not None
        want = {a.device: round(a.total_bytes / MIB, 2) for a in eng.report.allocations}
        assert {x["device"]: x["allocated_mib"] for x in m["memory"]} == want
        assert m["n_ctx"] == eng.report.n_ctx


def test_metrics_carry_each_models_label(multi: Callable[..., FakeService]) -> None:
    from tests.prom import series, value

    svc = multi()
    for short in ("a4", "c8"):
        assert _load(svc, short).status_code == 200
        assert _ask(svc, short).status_code == 200
    text = svc.client.get("/metrics").text
    assert {s["model"] for s in series(text, "gguf_kv_cells_used")} == {N("a4"), N("c8")}
    assert {s["model_name"] for s in series(text, "gguf_requests_waiting")} == {N("a4"), N("c8")}
    assert value(text, "gguf_model_loaded") == 2
    assert value(text, "gguf_completion_tokens_total", model=N("c8")) == 2
    assert value(text, "gguf_device_bytes", model=N("c8"), device="CUDA1", kind="allocated") > 0


def test_keep_alive_values_follow_ollamas_semantics() -> None:
    from service.errors import BadRequest
    from service.keepalive import parse_keep_alive

    assert parse_keep_alive("5m") == 300 and parse_keep_alive("1h30m") == 5400 and parse_keep_alive("300ms") == 0.3
    assert parse_keep_alive(0) == 0 and parse_keep_alive("0") == 0 and parse_keep_alive(12.5) == 12.5
    assert parse_keep_alive(-1) == math.inf and parse_keep_alive("-1") == math.inf and parse_keep_alive("-5m") == math.inf
    assert parse_keep_alive("5") == 5
    for bad in ("", "5 m", "m", "1d", "nan", float("nan"), True, None, "1" * 65):
        with pytest.raises(BadRequest):
            parse_keep_alive(bad)


def test_a_draft_model_from_the_models_file_is_planned_on_the_card_of_the_output_layer(
        multi: Callable[..., FakeService], tmp_path: Path, fixtures: dict[str, str]) -> None:
    """``draft_model`` in a model's table (a model of the registry by name): the plan puts it whole on the card that
    holds the model's output layer, its bytes in that card's total; a body's ``""`` plans without it, and a draft
    that would cost the model context is left out with the figures (``draft_squeeze`` keeps it)."""
    models_file = tmp_path / "models.toml"
    models_file.write_text(f'[models.chat]\nfile = "{fixtures[N("c8")]}"\ndraft_model = "{N("a4")}"\n')
    svc = multi(models_file=str(models_file))
    plan = svc.client.post("/api/dry-run", json={"model": "chat", "n_ctx": 2048}).json()
    assert plan["verdict"] == "one_card" and plan["draft"]["name"] == N("a4"), plan.get("draft_refusal")
    card = next(d for d in plan["estimate"]["devices"] if d["device"] != "CPU")
    assert plan["draft"]["device"] == card["device"] and card["draft_model_mib"] > plan["draft"]["weights_mib"] / 2
    alone = svc.client.post("/api/dry-run", json={"model": "chat", "n_ctx": 2048, "draft_model": ""}).json()
    assert alone["draft"] is None
    card_alone = next(d for d in alone["estimate"]["devices"] if d["device"] == card["device"])
    assert card["total_mib"] == pytest.approx(card_alone["total_mib"] + card["draft_model_mib"], abs=0.02)
    # On a card whose memory holds the draft beside the model at the ceiling's half but not at the ceiling, the
    # draft would take context from the model: the plan leaves it out and says so, unless squeezed.
    full = svc.client.post("/api/dry-run", json={"model": "chat"}).json()
    at_full = next(d for d in full["estimate"]["devices"] if d["device"] != "CPU")
    assert full["draft"] is not None and full["chosen"]["n_ctx"] == 4096
    tight = [{"name": "tight", "free_mib": (card["total_mib"] + at_full["total_mib"]) / 2, "total_mib": 8192}]
    f16 = {"model": "chat", "gpus": tight, "cache_type": "f16"}
    left_out = svc.client.post("/api/dry-run", json=f16).json()
    assert left_out["draft"] is None and left_out["chosen"]["n_ctx"] == 4096
    refusal = left_out["draft_refusal"]
    assert refusal.startswith("DRAFT_DOES_NOT_FIT") and N("a4") in refusal and "without it 4096 tokens" in refusal
    squeezed = svc.client.post("/api/dry-run", json={**f16, "draft_squeeze": True}).json()
    assert squeezed["draft"] is not None and 2048 <= squeezed["chosen"]["n_ctx"] < 4096
    assert f"with it the plan is {squeezed['chosen']['n_ctx']} tokens of f16 cache" in refusal
    # With auto the draft would cost the cache's precision instead (a quantized type reaches the ceiling beside it).
    auto = svc.client.post("/api/dry-run", json={"model": "chat", "gpus": tight}).json()
    assert auto["draft"] is None and auto["chosen"]["cache_type"] == "f16"
    assert "without it 4096 tokens of f16 cache" in auto["draft_refusal"]
    bad = svc.client.post("/api/dry-run", json={"model": "chat", "draft_model": "../etc/passwd"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "draft_model", bad.text
