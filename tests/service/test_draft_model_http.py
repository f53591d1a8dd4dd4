"""A draft model named by the settings (``GGUF_DRAFT_MODEL``), through the real service over HTTP: the plan and
``GET /api/models`` carry its lines and what llama.cpp allocated for it, the official ``openai`` client's answer
reports the kept drafts and is the answer without them, a name that is not a model is a 400 naming the field, and a
model whose vocabulary the draft does not share is refused at load with the difference (the server serves on)."""

from __future__ import annotations

from typing import Any, Iterator

import httpx
import pytest

from service.settings import Settings
from sizing.testing.fixtures import TINY_LLAMA, write_fixture
from tests.conftest import EMBEDDED_NAME, free_port, in_process_service
from tests.service.engine.test_speculation import COPY

pytestmark = pytest.mark.slow

TINY = "tiny-llama-bf16"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    models = tmp_path_factory.mktemp("draft-models")
    write_fixture("tiny-llama", models, shape=TINY_LLAMA)
    settings = Settings(host="127.0.0.1", port=free_port(), models_dir=str(models), context_length=2048, parallel=2,
                        confirm=False, cache_type="q8_0", cpu_repack="off", draft_model=EMBEDDED_NAME)
    with in_process_service(settings) as s:
        yield s


def test_the_plan_and_api_models_show_the_draft_beside_the_model(served: tuple[str, Any]) -> None:
    url, _ = served
    with httpx.Client(base_url=url, timeout=120) as c:
        m = {x["name"]: x for x in c.get("/api/models").json()["models"]}[EMBEDDED_NAME]
    plan = m["plan"]
    assert plan["draft"]["name"] == EMBEDDED_NAME and plan["draft"]["device"] == "CPU"
    assert plan["draft"]["n_ctx"] == plan["chosen"]["n_ctx"] and plan["draft_refusal"] is None
    host = [d for d in plan["estimate"]["devices"] if d["device"] == "CPU"][0]
    assert host["draft_model_mib"] == plan["draft"]["total_mib"] > plan["draft"]["weights_mib"] > 0
    rows = m["draft"]["memory"]
    assert rows and all(r["predicted_mib"] is not None for r in rows)
    for r in rows:
        assert abs(r["allocated_mib"] - r["predicted_mib"]) <= 0.02, r


def test_answers_report_the_kept_drafts_and_are_the_answers_without(served: tuple[str, Any]) -> None:
    import openai

    url, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    on = client.completions.create(model=EMBEDDED_NAME, prompt=COPY, max_tokens=48, temperature=0)
    off = client.completions.create(model=EMBEDDED_NAME, prompt=COPY, max_tokens=48, temperature=0,
                                    extra_body={"speculative": False})
    assert on.choices[0].text == off.choices[0].text
    details = on.usage.completion_tokens_details  # type: ignore[union-attr]
    assert details is not None and (details.accepted_prediction_tokens or 0) > 16
    assert off.usage.completion_tokens_details.accepted_prediction_tokens == 0  # type: ignore[union-attr]


def test_a_draft_that_is_not_a_model_here_is_a_400_naming_the_field(served: tuple[str, Any]) -> None:
    url, _ = served
    with httpx.Client(base_url=url, timeout=120) as c:
        r = c.post("/api/dry-run", json={"model": EMBEDDED_NAME, "draft_model": "no-such-model"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "draft_model", r.text
        none = c.post("/api/dry-run", json={"model": EMBEDDED_NAME, "draft_model": ""})
        assert none.status_code == 200 and none.json()["draft"] is None


def test_a_model_of_another_vocabulary_is_refused_at_load_and_the_server_serves_on(served: tuple[str, Any]) -> None:
    url, _ = served
    with httpx.Client(base_url=url, timeout=120) as c:
        r = c.post("/api/models/load", json={"model": TINY})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "does not share the model's vocabulary" in err["message"] and "262144 tokens" in err["message"]
        ok = c.post("/v1/completions", json={"model": EMBEDDED_NAME, "prompt": "Hello", "max_tokens": 3})
        assert ok.status_code == 200
        # Without the draft it loads.
        assert c.post("/api/models/load", json={"model": TINY, "draft_model": ""}).status_code == 200


def test_a_confirmed_load_dry_runs_the_draft_too(served: tuple[str, Any]) -> None:
    url, _ = served
    with httpx.Client(base_url=url, timeout=300) as c:
        r = c.post("/api/models/load", json={"model": EMBEDDED_NAME, "confirm": True})
        assert r.status_code == 200, r.text
        conf = r.json()["confirmation"]
    assert conf["status"] == "confirmed", conf
    draft = conf["draft"]
    assert draft["status"] == "confirmed"
    assert abs(draft["kv_mib"]["predicted"] - draft["kv_mib"]["llama_cpp"]) <= 0.02
    cpu = draft["compute_mib"]["CPU"]
    assert abs(cpu["predicted"] - cpu["llama_cpp"]) <= 0.02


def test_a_draft_its_dry_run_finds_bigger_than_planned_is_left_out(embedded_model: str) -> None:
    """The plan's figure for the draft's KV cut by a MiB: llama.cpp's dry run needs more, so the load's plan is the
    one without the draft, saying why."""
    from dataclasses import replace

    from service.planning.planner import Planner
    from sizing.memory import DraftModel
    from sizing.plan import PlanRequest, make_plan
    from sizing.probe import host_memory, probe_path

    spec = probe_path(embedded_model)
    req = PlanRequest(n_ctx=2048, n_seq_max=2, kv_unified=True, cache_type="q8_0", cpu_repack=False,
                      draft=DraftModel(spec, path=embedded_model, name="self"))
    plan = make_plan(spec, [], host_memory(), req)
    est = plan.estimate
    assert est is not None and est.draft is not None
    small = replace(est.draft.estimate, host=replace(est.draft.estimate.host, kv_bytes=est.draft.estimate.host.kv_bytes - (1 << 20)))
    plan = replace(plan, estimate=replace(est, draft=replace(est.draft, estimate=small)))
    planner = Planner(Settings(confirm=True, cpu_repack="off"), lambda: ([], host_memory()))
    conf = planner.confirm(plan, embedded_model, "gemma")
    assert conf.status == "replanned" and conf.plan.draft is None
    assert conf.plan.draft_refusal is not None and "needs more than predicted on CPU" in conf.plan.draft_refusal
    assert conf.to_json()["draft"]["status"] == "refused"
