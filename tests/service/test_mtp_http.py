"""A model whose GGUF carries an MTP head, through the real service over HTTP (its runner process, the official
``openai`` client): the plan and ``GET /api/models`` carry the head's lines beside what llama.cpp allocated for
them, and the answer reports the head's kept guesses and is the answer without them (``GGUF_MTP=auto``)."""

from __future__ import annotations

from typing import Any, Iterator

import httpx
import pytest

from service.settings import Settings
from sizing.testing.fixtures import write_mtp_fixture
from tests.conftest import free_port, in_process_service

pytestmark = pytest.mark.slow

NAME = "tiny-glm4moe-mtp-bf16"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Any]]:
    models = tmp_path_factory.mktemp("mtp-models")
    write_mtp_fixture(models)
    settings = Settings(host="127.0.0.1", port=free_port(), models_dir=str(models), context_length=512, parallel=2,
                        confirm=False, cpu_repack="off", default_model=NAME)
    with in_process_service(settings) as s:
        yield s


def test_answers_report_the_heads_kept_guesses_and_are_the_answers_without(served: tuple[str, Any]) -> None:
    import openai

    url, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    body = {"ignore_eos": True}
    on = client.completions.create(model=NAME, prompt="The sea is", max_tokens=40, temperature=0, extra_body=body)
    off = client.completions.create(model=NAME, prompt="The sea is", max_tokens=40, temperature=0,
                                    extra_body={**body, "speculative": False})
    assert on.choices[0].text == off.choices[0].text and on.usage.completion_tokens == 40
    details = on.usage.completion_tokens_details  # type: ignore[union-attr]
    assert details is not None and (details.accepted_prediction_tokens or 0) > 16


def test_the_plan_and_api_models_show_the_head_beside_the_model(served: tuple[str, Any]) -> None:
    url, _ = served
    with httpx.Client(base_url=url, timeout=120) as c:
        assert c.post("/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 1}).status_code == 200
        m = {x["name"]: x for x in c.get("/api/models").json()["models"]}[NAME]
    plan = m["plan"]
    assert plan["mtp"] is not None and plan["mtp_refusal"] is None, plan["mtp_refusal"]
    assert plan["mtp"]["weights_mib"]["CPU"] > 0 and plan["mtp"]["compute_mib"] > 0
    host = [d for d in plan["estimate"]["devices"] if d["device"] == "CPU"][0]
    assert host["mtp_mib"] > 0
    rows = m["mtp"]["memory"]
    assert rows and all(r["predicted_mib"] is not None for r in rows)
    for r in rows + m["memory"]:
        assert round(abs(r["allocated_mib"] - r["predicted_mib"]), 6) <= 0.02, r  # both in hundredths of a MiB
