"""A pull's progress streamed (server-sent events: bytes, rate, time left, state), its cancel (the transfer stops, the
partial file goes), ``hf.co/OWNER/REPO:QUANT`` names, and GGUF_DEFAULT_MODEL as a Hugging Face reference: pulled at
the first start and served, offline served from what an earlier pull left, or the embedded model with an error that
says so. The hub is a local server (tests/hub.py) that sends its files at a bounded rate."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

from service.catalog.downloads import Downloads, parse_hf_reference
from service.catalog.models import Registry
from service.errors import BadRequest, NotReady
from service.settings import INSTRUCT_MODEL_NAME, Settings
from sizing.testing.fixtures import TINY_LLAMA, write_fixture
from tests.hub import Hub

MIB = 1 << 20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(write_fixture("tiny-llama", tmp_path_factory.mktemp("tiny"), shape=TINY_LLAMA))


@pytest.fixture
def hub(tmp_path: Path, tiny: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Hub]:
    """acme/tiny: a model named with its quantization and its vision projector; acme/big: 2 GiB (sparse) sent at
    16 MiB/s, long enough to watch and cancel."""
    from sizing.testing.projector_fixtures import TINY, write_projector

    h = Hub(tmp_path / "hub")
    h.add("acme/tiny", "tiny-Q4_K_M.gguf", tiny)
    write_projector(h.root / "acme" / "tiny" / "mmproj-tiny-f16.gguf", TINY)
    h.add("acme/big", "big-Q8_0.gguf", tiny, size_bytes=2 << 30)
    monkeypatch.setenv("HF_ENDPOINT", h.url)
    with h.serving():
        yield h


def sse(client: httpx.Client, body: dict[str, Any], out: list[dict[str, Any]], first: threading.Event,
        moved: threading.Event | None = None) -> None:
    """POST a streamed pull, each event's JSON into ``out``; ``first`` at the first, ``moved`` once bytes arrived."""
    with client.stream("POST", "/api/models/pull", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))
                first.set()
                if moved is not None and out[-1]["bytes_done"] > 0:
                    moved.set()
    first.set()


def test_a_reference_by_quant_streams_the_model_then_its_projector(fake_factory: Callable[..., Any], hub: Hub) -> None:
    svc = fake_factory()
    events: list[dict[str, Any]] = []
    sse(svc.client, {"model": "hf.co/acme/tiny:q4_k_m"}, events, threading.Event())
    files = [e["filename"] for e in events]
    assert files[0] == "tiny-Q4_K_M.gguf" and files[-1] == "mmproj-tiny-f16.gguf", files
    assert files == sorted(files, key=lambda f: f.startswith("mmproj")), "the model first, then the projector"
    ends = [e for e in events if e["state"] != "downloading"]
    assert [(e["filename"], e["state"], e["file_index"], e["files"]) for e in ends] == [
        ("tiny-Q4_K_M.gguf", "done", 0, 2), ("mmproj-tiny-f16.gguf", "done", 1, 2)]
    assert ends[0]["bytes_done"] == ends[0]["bytes_total"] == Path(hub.root / "acme/tiny/tiny-Q4_K_M.gguf").stat().st_size
    assert "tiny-Q4_K_M" in [m["id"] for m in svc.client.get("/v1/models").json()["data"]]
    assert any("/tree/" in r for r in hub.requests), "the quantization was found by listing the repo"


def test_a_pull_streams_progress_that_moves_then_is_cancelled_and_leaves_nothing(
        fake_factory: Callable[..., Any], hub: Hub) -> None:
    hub.rate_bytes_per_s = 16 * MIB
    svc = fake_factory()
    events: list[dict[str, Any]] = []
    first, moved = threading.Event(), threading.Event()
    t = threading.Thread(target=sse, args=(svc.client, {"repo_id": "acme/big", "filename": "big-Q8_0.gguf"}, events,
                                           first, moved), daemon=True)
    t.start()
    assert moved.wait(30), events
    deadline = time.monotonic() + 30  # huggingface_hub reports every 10 MiB: wait for a second report
    while time.monotonic() < deadline and len({e["bytes_done"] for e in events if e["bytes_done"]}) < 2:
        time.sleep(0.1)
    running = [e for e in events if e["bytes_done"]]
    assert len({e["bytes_done"] for e in running}) >= 2, "the progress moves"
    last = running[-1]
    assert last["state"] == "downloading" and last["bytes_total"] == 2 << 30
    assert 0 < last["progress"] < 0.5
    assert last["rate_bytes_per_s"] is not None and 2 * MIB < last["rate_bytes_per_s"] < 64 * MIB, last
    assert last["eta_s"] == pytest.approx((last["bytes_total"] - last["bytes_done"]) / last["rate_bytes_per_s"], rel=0.2)
    # The same download in the listing every client reads.
    listed = [d for d in svc.client.get("/api/models").json()["downloads"] if d["filename"] == "big-Q8_0.gguf"]
    assert listed and listed[0]["state"] == "downloading" and listed[0]["id"] == last["id"]

    r = svc.client.post("/api/models/pull/cancel", json={"repo_id": "acme/big", "filename": "big-Q8_0.gguf"})
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "cancelled"
    t.join(30)
    assert not t.is_alive(), "the stream ends with the cancel"
    assert events[-1]["state"] == "cancelled" and events[-1]["eta_s"] is None
    models_dir = Path(svc.app.state.settings.models_dir)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (list(models_dir.rglob("*.incomplete")) or "big-Q8_0.gguf" not in hub.aborted):
        time.sleep(0.1)
    assert "big-Q8_0.gguf" in hub.aborted, "the transfer stopped midway, it did not run to its end"
    assert [p.name for p in models_dir.rglob("*") if p.is_file() and "big-Q8_0" in p.name] == [], "no partial file"
    assert "big-Q8_0" not in [m["id"] for m in svc.client.get("/v1/models").json()["data"]]
    r = svc.client.post("/api/models/pull/cancel", json={"repo_id": "acme/big", "filename": "big-Q8_0.gguf"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize("body", [
    {"model": "hf.co/acme/tiny:Q4_K_M", "repo_id": "acme/tiny", "filename": "tiny-Q4_K_M.gguf"},
    {"repo_id": "acme/tiny"},
    {"model": "acme/tiny:Q4_K_M"},
    {"model": "hf.co/acme/tiny"},
    {"model": "hf.co/acme/tiny/../x.gguf"},
    {"model": "hf.co/acme/tiny:Q4 K"},
])
def test_a_pull_is_named_once_and_well(fake: Any, body: dict[str, Any]) -> None:
    r = fake.client.post("/api/models/pull", json=body)
    assert r.status_code == 400, r.text


def test_references_parse_as_ollama_and_llama_server_write_them() -> None:
    ref = parse_hf_reference("hf.co/bartowski/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M")
    assert (ref.repo_id, ref.filename, ref.quant, ref.revision) == (
        "bartowski/Qwen2.5-0.5B-Instruct-GGUF", None, "Q4_K_M", None)
    ref = parse_hf_reference("https://huggingface.co/acme/tiny/tiny-Q4_K_M.gguf@v1.0")
    assert (ref.repo_id, ref.filename, ref.quant, ref.revision) == ("acme/tiny", "tiny-Q4_K_M.gguf", None, "v1.0")
    with pytest.raises(BadRequest) as e:
        parse_hf_reference("hf.co/acme/tiny", param="GGUF_DEFAULT_MODEL")
    assert e.value.param == "GGUF_DEFAULT_MODEL"


# -- GGUF_DEFAULT_MODEL=hf.co/...


class _NoPlanner:
    def devices(self, *a: Any) -> Any:
        raise AssertionError("not planned here")

    request = plan_on = devices


def _downloads(models_dir: Path, reference: str) -> Downloads:
    settings = Settings(models_dir=str(models_dir), default_model=reference)
    return Downloads(settings, Registry(settings), _NoPlanner())


def test_a_default_reference_is_pulled_once_then_served_offline_from_the_models_dir(
        tmp_path: Path, hub: Hub, monkeypatch: pytest.MonkeyPatch) -> None:
    ref = "hf.co/acme/tiny:Q4_K_M"
    downloads = _downloads(tmp_path / "models", ref)
    with pytest.raises(NotReady) as e:  # a request for it before the pull ended: being pulled, retry
        downloads.registry.resolve(ref)
    assert "being pulled" in e.value.message and e.value.retry_after_s == 5
    assert asyncio.run(downloads.fetch_reference(ref, poll_s=0.05)) == "tiny-Q4_K_M"
    assert downloads.registry.canonical(ref) == "tiny-Q4_K_M"
    assert downloads.registry.aliases_of("tiny-Q4_K_M") == [ref]
    assert (tmp_path / "models" / "mmproj-tiny-f16.gguf").is_file(), "its projector came with it"
    asked = len(hub.requests)
    # The next start, with no hub: the file the reference named then is served, nothing is asked.
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    again = _downloads(tmp_path / "models", ref)
    assert asyncio.run(again.fetch_reference(ref, poll_s=0.05)) == "tiny-Q4_K_M"
    assert again.registry.resolve(ref).name == "tiny-Q4_K_M"
    assert len(hub.requests) == asked


def test_a_default_reference_offline_serves_the_embedded_model_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # HF_HUB_OFFLINE=1: no hub is asked
    ref = "hf.co/acme/tiny:Q4_K_M"
    downloads = _downloads(tmp_path / "models", ref)
    with caplog.at_level(logging.ERROR, logger="service.catalog.downloads"):
        assert asyncio.run(downloads.fetch_reference(ref, poll_s=0.05)) == INSTRUCT_MODEL_NAME
    assert downloads.registry.canonical(ref) == INSTRUCT_MODEL_NAME
    [line] = [r.getMessage() for r in caplog.records]
    assert f"GGUF_DEFAULT_MODEL={ref} cannot be served" in line
    assert f"Serving the embedded {INSTRUCT_MODEL_NAME} instead" in line and "hub did not answer" in line


def test_the_service_pulls_its_default_reference_at_start_and_lists_it_first(
        fake_factory: Callable[..., Any], hub: Hub, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="service.catalog.downloads"):
        svc = fake_factory(default_model="hf.co/acme/tiny/tiny-Q4_K_M.gguf")
    assert any("pulling acme/tiny/tiny-Q4_K_M.gguf" in r.getMessage() for r in caplog.records)
    data = svc.client.get("/v1/models").json()["data"]
    assert data[0]["id"] == "tiny-Q4_K_M" and data[0]["loaded"], data
    assert data[0]["aliases"] == ["hf.co/acme/tiny/tiny-Q4_K_M.gguf"]
    r = svc.client.post("/v1/completions", json={"prompt": "a b", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "tiny-Q4_K_M", r.text


def test_while_the_default_reference_is_pulled_a_request_is_told_so(fake_factory: Callable[..., Any], hub: Hub) -> None:
    hub.rate_bytes_per_s = 16 * MIB  # 2 GiB: still pulling while the test asks
    svc = fake_factory(default_model="hf.co/acme/big/big-Q8_0.gguf", wait_ready=False)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not svc.client.get("/api/models").json()["downloads"]:
        time.sleep(0.05)
    r = svc.client.post("/v1/completions", json={"prompt": "a b", "max_tokens": 2})
    assert r.status_code == 503, r.text
    assert "is being pulled from Hugging Face" in r.json()["error"]["message"] and r.headers["retry-after"] == "5"
    assert svc.client.get("/ready").status_code == 503
    [dl] = svc.client.get("/api/models").json()["downloads"]
    assert dl["state"] == "downloading" and dl["name"] == "big-Q8_0"
