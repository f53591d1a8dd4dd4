"""Two real models resident at once on llama.cpp (this CPU): the embedded gemma-3-270m and a tiny llama-shaped
model written by the test (``TINY_LLAMA``: its weights are the file's hole, zeros, and it runs like any model).
Both answer interleaved requests over HTTP (the official ``openai`` client), each response naming its model, and
``GET /api/models`` reports for each what llama.cpp's allocation log lines say it allocated.

The app runs in this process, served by uvicorn over loopback, so the test reads each engine's own load log.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from service.engine.loglines import parse_allocations
from service.settings import Settings
from sizing.plan.device import MIB
from sizing.testing.fixtures import TINY_LLAMA, write_fixture
from tests.conftest import EMBEDDED_NAME, free_port, in_process_service

pytestmark = pytest.mark.slow

TINY = "tiny-llama-bf16"


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: pytest.TempPathFactory, embedded_model: str) -> Iterator[tuple[str, Any]]:
    models = tmp_path_factory.mktemp("two-models")
    path = Path(write_fixture("tiny-llama", models, shape=TINY_LLAMA))
    assert path.name == f"{TINY}.gguf"
    assert os.stat(path).st_blocks * 512 < path.stat().st_size, "the weights are a hole: zeros, never written"
    port = free_port()
    settings = Settings(host="127.0.0.1", port=port, models_dir=str(models), context_length=2048, parallel=1,
                        confirm=False, queue_size=16)
    with in_process_service(settings) as served:
        yield served


def test_two_real_models_answer_interleaved_requests_each_with_its_name(two_models: tuple[str, Any]) -> None:
    import openai

    url, app = two_models
    with httpx.Client(base_url=url, timeout=120) as c:
        r = c.post("/api/models/load", json={"model": TINY})
        assert r.status_code == 200, r.text
        models = {m["name"]: m for m in c.get("/api/models").json()["models"]}
    assert models[EMBEDDED_NAME]["state"] == "loaded" and models[TINY]["state"] == "loaded"
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def ask(i: int) -> tuple[str, str, int]:
        name = (EMBEDDED_NAME, TINY)[i % 2]
        # Sampled, not greedy: the zero model's logits are all equal, and its first token (<unk>) prints nothing.
        if i % 3 == 2:
            stream = client.completions.create(model=name, prompt=f"Count: {i},", max_tokens=4, seed=i, stream=True,
                                               stream_options={"include_usage": True})
            chunks = list(stream)
            usage = chunks[-1].usage
            assert {ch.model for ch in chunks} == {name}
            return name, chunks[0].model, usage.completion_tokens if usage else 0
        out = client.completions.create(model=name, prompt=f"Count: {i},", max_tokens=4, seed=i)
        return name, out.model, out.usage.completion_tokens if out.usage else 0

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(ask, range(8)))
    for asked, answered, tokens in results:
        assert answered == asked
        assert tokens >= 1
    chat = client.chat.completions.create(model=TINY, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.model == TINY and chat.choices[0].message.role == "assistant"


def test_api_models_reports_what_llama_cpp_allocated_for_each(two_models: tuple[str, Any]) -> None:
    url, app = two_models
    with httpx.Client(base_url=url, timeout=120) as c:
        if app.state.manager.resident(TINY) is None:  # run alone: the first test loaded it
            assert c.post("/api/models/load", json={"model": TINY}).status_code == 200
        models = {m["name"]: m for m in c.get("/api/models").json()["models"] if m["state"] == "loaded"}
    manager = app.state.manager
    assert set(models) == {EMBEDDED_NAME, TINY}
    for name, m in models.items():
        report = manager.models[name].report
        allocations, _ = parse_allocations(list(report.log_lines))  # llama.cpp's own lines, parsed again here
        assert allocations, f"{name}: no allocation lines in its load log"
        # Beside them, the rows the output buffer grew by for drafts (llama.cpp logs that only in debug builds).
        grown = report.draft_output_bytes
        want = {a.device: round((a.total_bytes + (grown if a.device == "CPU" else 0)) / MIB, 2) for a in allocations}
        assert {x["device"]: x["allocated_mib"] for x in m["memory"]} == want
        cpu = [x for x in m["memory"] if x["device"] == "CPU"][0]
        assert cpu["allocated"].get("draft_output_mib", 0) == round(grown / MIB, 2)
        plan = manager.models[name].plan
        assert m["plan"]["chosen"]["draft_rows"] > 0 and grown == plan.estimate.host.draft_bytes  # as predicted
        assert m["devices"] == ["CPU"]
