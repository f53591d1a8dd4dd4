"""The plan as the service applies it: refusal statuses, the dry-run confirmation, the engine's
placement arguments, expert overrides, swaps, and batched decoding behind the HTTP API."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from sizing.plan.device import MIB, Device
from sizing.probe import probe_path
from sizing.plan.make import PlanRequest, make_plan
from sizing.plan.residency import available
from service.engine.llama import LlamaEngine
from service.text.served import ServedModel
from service.engine.params import plan_params
from tests.conftest import EMBEDDED_NAME
from tests.prom import value

GIB_ = 1 << 30


def test_tensor_split_covers_every_device_with_zeros_for_unused(embedded_model: str) -> None:
    spec = probe_path(embedded_model)
    cards = [Device(0, "A", 1 * GIB_, 24 * GIB_), Device(1, "B", 20 * GIB_, 24 * GIB_), Device(2, "C", 20 * GIB_, 24 * GIB_)]
    plan = make_plan(spec, cards, Device(0, "host", 20 * GIB_, 24 * GIB_, "host"), PlanRequest(gpu=2))
    mp, _ = plan_params(plan)
    assert mp.n_gpu_layers == spec.n_layer_all + 1
    assert mp.tensor_split == (0.0, 0.0, 1.0)
    assert mp.main_gpu == 2
    cpu = make_plan(spec, [], Device(0, "host", 20 * GIB_, 24 * GIB_, "host"), PlanRequest())
    mp, _ = plan_params(cpu)
    assert (mp.n_gpu_layers, mp.tensor_split, mp.main_gpu) == (0, (), 0)


@pytest.mark.slow
def test_expert_override_reaches_llama_cpp(embedded_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tensor_buft_overrides the plan asks for are what llama.cpp's loader applies (its log says so)."""
    from dataclasses import replace

    import service.engine.llama.loading as llama_mod

    spec = probe_path(embedded_model)
    plan = make_plan(spec, [], Device(0, "host", 20 * GIB_, 24 * GIB_, "host"), PlanRequest(n_ctx=1024))
    assert plan_params(plan)[0].cpu_overrides == ()  # a dense model keeps no experts anywhere

    def with_overrides(plan: Any, **kw: Any) -> Any:
        mp, cp = plan_params(plan, **kw)
        return replace(mp, cpu_overrides=(r"^blk\.(0|1)\.ffn_up",)), cp

    monkeypatch.setattr(llama_mod, "plan_params", with_overrides)
    engine = ServedModel.of(LlamaEngine())
    try:
        report = engine.load(embedded_model, plan)
    finally:
        engine.unload()
    overridden = sorted(ln.split()[1] for ln in report.log_lines if "buffer type overridden to CPU" in ln)
    assert overridden == ["blk.0.ffn_up.weight", "blk.1.ffn_up.weight"]


def test_swap_credits_the_loaded_models_memory(embedded_model: str) -> None:
    spec = probe_path(embedded_model)
    card = Device(0, "RTX 3060", 2000 * MIB, 12 * 1024 * MIB)
    host = Device(0, "host", 8 * GIB_, 16 * GIB_, "host")
    plan = make_plan(spec, [card], host, PlanRequest(n_ctx=4096))
    assert plan.estimate is not None and plan.verdict == "one_card"
    # Live free memory now excludes what the loaded model holds, its runner's CUDA context (the allowance) too...
    live = [Device(0, "RTX 3060", card.free_bytes - plan.estimate.gpus[0].total_bytes, card.total_bytes)]
    credited, _ = available(live, host, (), [plan.estimate], live=True)
    # ...and the plan for the next load gets it all back once it is unloaded: its process and context end with it.
    assert credited[0].free_bytes == card.free_bytes
    assert available(live, host, (), (), live=True)[0][0].free_bytes == live[0].free_bytes


def _gpus(*cards: tuple[str, int]) -> str:
    return json.dumps([{"name": n, "free_mib": f, "total_mib": 24576} for n, f in cards])


@pytest.mark.slow
def test_refusals_get_their_own_status(fake_factory: Any) -> None:
    svc = fake_factory(gpus_json=_gpus(("RTX 3090", 24000), ("RTX 3090", 300)), allow_offload=False)
    # "all" would leave the 300 MB card without a layer: 409, the current model keeps serving.
    r = svc.client.post("/api/models/load", json={"model": EMBEDDED_NAME, "gpu": "all"})
    assert r.status_code == 409, r.text
    err = r.json()["error"]
    assert err["code"] == "SPLIT_NOT_HONOURED"
    assert "0 layers" in err["message"]
    assert svc.client.get("/ready").status_code == 200
    # A card that does not exist is the client's mistake: 400.
    r = svc.client.post("/api/models/load", json={"model": EMBEDDED_NAME, "gpu": 5})
    assert r.status_code == 400
    # Quantized cache with flash attention off: 400 naming the setting.
    r = svc.client.post("/api/models/load", json={"model": EMBEDDED_NAME, "cache_type": "q4_0", "flash_attn": "off"})
    assert r.status_code == 400
    assert "flash" in r.json()["error"]["message"].lower()
    # A context the cards cannot hold without offload: 507 with every card's figures.
    r = svc.client.post("/api/models/load", json={"model": EMBEDDED_NAME, "n_ctx": 32768, "cache_type": "f16", "gpu": 1})
    assert r.status_code == 507
    assert r.json()["error"]["code"] == "INSUFFICIENT_MEMORY"
    assert "CUDA1" in r.json()["error"]["message"]
    assert svc.client.get("/ready").status_code == 200


@pytest.mark.slow
def test_load_is_confirmed_by_llamas_dry_run(service_factory: Any) -> None:
    svc = service_factory(GGUF_DEFAULT_MODEL="", GGUF_CONFIRM_LOADS="true")
    r = svc.client.post("/api/models/load", json={"model": EMBEDDED_NAME, "n_ctx": 8192, "cache_type": "q8_0"})
    assert r.status_code == 200, r.text
    conf = r.json()["confirmation"]
    assert conf["status"] == "confirmed"
    # KV is exact: the prediction and llama.cpp's dry run agree to the log's resolution.
    assert conf["kv_mib"]["predicted"] == pytest.approx(conf["kv_mib"]["llama_cpp"], abs=0.02)
    cpu = conf["compute_mib"]["CPU"]
    assert cpu["llama_cpp"] > 0
    assert abs(cpu["predicted"] - cpu["llama_cpp"]) <= 0.05 * cpu["llama_cpp"]
    # What the real load allocated agrees too.
    mem = {m["device"]: m for m in r.json()["memory"]}
    assert mem["CPU"]["allocated"]["kv_mib"] == pytest.approx(conf["kv_mib"]["llama_cpp"], abs=0.02)
    # The confirmation is optional per request.
    r = svc.client.post("/api/models/load", json={"model": EMBEDDED_NAME, "confirm": False, "n_ctx": 2048})
    assert r.status_code == 200 and "confirmation" not in r.json()


@pytest.mark.slow
def test_parallel_slots_decode_concurrent_requests(service_factory: Any) -> None:
    svc = service_factory(GGUF_PARALLEL="2", GGUF_KV_UNIFIED="false", GGUF_CONTEXT_LENGTH="4096",
                          GGUF_CONFIRM_LOADS="false")
    svc.wait_ready()
    ready = svc.client.get("/ready").json()
    assert ready["n_ctx"] == 2048  # not unified: each of the 2 slots gets half of the 4096-token context
    models = svc.client.get("/api/models").json()["models"]
    plan = next(m for m in models if m["name"] == EMBEDDED_NAME)["plan"]
    assert plan["chosen"]["n_seq_max"] == 2
    prompts = ["The sky is", "Paris is the capital of", "One, two, three,", "Water boils at"]
    alone = {}
    for p in prompts:
        r = svc.client.post("/v1/completions", json={"prompt": p, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200
        alone[p] = r.json()["usage"]["completion_tokens"]

    def ask(p: str) -> tuple[str, int]:
        r = svc.client.post("/v1/completions", json={"prompt": p, "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        return p, r.json()["usage"]["completion_tokens"]

    with ThreadPoolExecutor(4) as ex:
        together = dict(ex.map(ask, prompts))
    assert together.keys() == alone.keys()
    assert all(n > 0 for n in together.values())


@pytest.mark.slow
def test_measured_speeds_stand_beside_the_predicted_ones(served: Any) -> None:
    for _ in range(2):
        r = served.client.post("/v1/completions", json={"prompt": "Count: one, two,", "max_tokens": 16,
                                                        "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200
    models = served.client.get("/api/models").json()["models"]
    speed = next(m for m in models if m["name"] == EMBEDDED_NAME)["speed"]
    assert speed["predicted"]["decode_tokens_per_s"] > 0
    assert speed["predicted"]["prompt_tokens_per_s"] > 0
    assert speed["measured"]["decode_tokens_per_s"] > 0
    assert speed["measured"]["prompt_tokens_per_s"] > 0
    text = served.client.get("/metrics").text
    assert value(text, "gguf_tokens_per_second", model=EMBEDDED_NAME, phase="decode", kind="measured") > 0
    assert value(text, "gguf_tokens_per_second", model=EMBEDDED_NAME, phase="decode", kind="predicted") > 0


from tests.sizing.probe.conftest import RangeServer, link_into, range_server  # noqa: E402,F401  (a fixture, imported to use here)


@pytest.mark.slow
def test_dry_run_of_a_remote_file_reads_its_header_only(fake_factory: Any, range_server: RangeServer,  # noqa: F811
                                                       embedded_model: str) -> None:
    from pathlib import Path

    # Loopback is refused unless named (tests/reliability/test_remote_probe.py); this server is named.
    served = fake_factory(remote_allow_hosts="127.0.0.1")
    link_into(range_server, Path(embedded_model))
    range_server.reset()
    url = range_server.url(Path(embedded_model).name)
    r = served.client.post("/api/dry-run", json={"url": url, "gpus": [{"name": "RTX 3060", "free_mib": 11000, "total_mib": 12288}]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"]["n_ctx_train"] == 32768 and body["model"]["n_layer"] == 18
    assert body["verdict"] == "one_card"
    local = served.client.post("/api/dry-run", json={"model": EMBEDDED_NAME, "gpus": [{"name": "RTX 3060", "free_mib": 11000, "total_mib": 12288}]}).json()
    assert [o["n_ctx"] for o in body["cache_types"]] == [o["n_ctx"] for o in local["cache_types"]]
    # Only the header travelled, not the 241 MiB of weights.
    assert range_server.bytes_sent < 1.1 * 6_525_120
    # One source at a time.
    r = served.client.post("/api/dry-run", json={"model": EMBEDDED_NAME, "url": url})
    assert r.status_code == 400
    r = served.client.post("/api/dry-run", json={"url": "file:///etc/passwd"})
    assert r.status_code == 400
