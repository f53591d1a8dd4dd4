"""Allocated equals predicted on Vulkan cards, device by device and part by part (issue 56): the embedded gemma-3-270m
and SmolLM2-135M-Instruct placed by the service's plan on Vulkan0 whole, partly (layers on the host), split over
Vulkan0 and Vulkan1 (one lavapipe named twice) and split with layers on the host; f16 and q8_0 caches, flash
attention on and off. llama.cpp's buffers are its load log's (``GET /api/models``' ``memory``), the plan's are its
estimate (``service.testing.vulkan.rows_of``): every row within llama.cpp's 0.01 MiB (a compute figure 0.02 over
where the dry run's log figure was taken at the top of its 0.01 MiB). ggml-vulkan's scratch buffers, which no dry
run shows, are read from ``GGML_VK_MEMORY_LOGGER=1``'s lines after a prompt that fills the context, against the
plan's bound.

The settings of each arrangement are ``service.testing.vulkan.SCENARIOS``' (the closing note's table is
``bench/vulkan_accuracy.py``'s, over every model and pair): a card planned on 10 % of lavapipe's heap less an
allowance that leaves room for some layers but not all. Loads only, but for one prompt: lavapipe is slow."""

from __future__ import annotations

import contextlib
import json
import threading
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from service.testing.vulkan import MODELS, SCENARIOS, rows_of, scenario_env, scratch_of
from sizing.memory import ContextConfig, vulkan_scratch
from sizing.probe import probe_path
from tests.conftest import ServiceProcess, stream_events

pytestmark = pytest.mark.slow

N_CTX = 512


@contextlib.contextmanager
def vulkan_service(tmp_path: Path, settings: dict[str, str], n_ctx: int = N_CTX) -> Iterator[ServiceProcess]:
    """The service over the arrangement's Vulkan devices (its log keeps the runners' memory-logger lines)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    env: dict[str, str | None] = {
        "GGUF_MODELS_DIR": str(tmp_path), "GGUF_CONTEXT_LENGTH": str(n_ctx), "GGUF_MIN_CONTEXT": str(n_ctx),
        "GGUF_PARALLEL": "1", "GGUF_EMBEDDINGS": "off", "GGUF_SPECULATIVE": "off", "GGUF_RUNNER_STALL_S": "0",
        "GGUF_MTP": "off", "GGML_VK_MEMORY_LOGGER": "1", "GGUF_DEFAULT_MODEL": MODELS["smollm2"],
        "GGUF_UNREPORTED_FREE_MARGIN_PCT": None, "GGUF_VULKAN_ALLOWANCE_MIB": None, "GGUF_N_UBATCH": None,
        **settings}
    svc = ServiceProcess(env, tmp_path / "service.log")
    try:
        svc.wait_healthy()
        yield svc
    finally:
        svc.stop()


def load(svc: ServiceProcess, key: str, cache: str, fa: str, body: dict[str, Any]) -> dict[str, Any]:
    """``key``'s model loaded with this cache and flash attention (whatever was loaded before unloaded); its entry."""
    svc.client.post("/api/models/unload", json={"force": True})
    r = svc.client.post("/api/models/load", json={"model": MODELS[key], "cache_type": cache, "flash_attn": fa, **body},
                        timeout=600)
    assert r.status_code == 200, r.text[:2000]
    listed = {m["name"]: m for m in svc.client.get("/api/models").json()["models"]}
    return listed[MODELS[key]]  # type: ignore[no-any-return]


def assert_as_planned(m: dict[str, Any], scratch: dict[str, dict[str, int]] | None = None) -> None:
    rows = rows_of(m, scratch)
    wrong = [r for r in rows if not r.ok]
    assert not wrong, "\n".join(f"{r.device} {r.part}: predicted {r.predicted_mib}, allocated {r.allocated_mib} "
                                f"({r.status})" for r in wrong)
    assert {r.device for r in rows} >= {"CPU", *(d["device"] for d in m["plan"]["estimate"]["devices"])}


def layers(m: dict[str, Any]) -> dict[str, int]:
    return {d["device"]: len(d["layers"]) for d in m["plan"]["estimate"]["devices"] if d["layers"]}


def settings_of(name: str, key: str, cache: str, fa: str) -> dict[str, str]:
    return scenario_env(SCENARIOS[name], key, cache, fa)


def lavapipe_only(device: str) -> None:
    """The arrangements with layers on the host are sized for lavapipe's 2 GiB heap (``SCENARIOS``)."""
    if "llvmpipe" not in device:
        pytest.skip(f"sized for lavapipe's 2 GiB heap, not {device}: its allowances would not leave the host layers")


def test_whole_on_vulkan0_every_cache_and_attention(tmp_path: Path) -> None:
    """Every layer on Vulkan0: gemma's tied q8_0 head (170 MiB, over lavapipe's 128 MiB maxStorageBufferRange) stays
    in CPU_Mapped and its logits in the Vulkan_Host compute buffer; SmolLM2's head (49,152 rows) goes to the card."""
    with vulkan_service(tmp_path, settings_of("one", "gemma", "f16", "on")) as svc:
        for key, cache, fa in (("gemma", "f16", "on"), ("gemma", "f16", "off"), ("gemma", "q8_0", "on"),
                               ("smollm2", "q8_0", "on")):
            m = load(svc, key, cache, fa, SCENARIOS["one"]["body"])
            assert m["plan"]["verdict"] == "one_card", (key, cache, fa, m["plan"]["reasons"])
            assert m["plan"]["calibration"]["backend"] == "Vulkan"
            assert_as_planned(m)
            est = {d["device"]: d for d in m["plan"]["estimate"]["devices"]}
            if key == "gemma":  # the head refused: the card holds the blocks and the output norm only
                assert est["CPU"]["weights_mib"] == 170.0 and est["Vulkan0"]["weights_mib"] == 65.16
            else:
                assert est["Vulkan0"]["weights_mib"] > est["CPU"]["weights_mib"] > 28


def test_layers_on_vulkan0_and_the_host(tmp_path: Path, vulkan_device: str) -> None:
    """Partial offload: some blocks on Vulkan0, the first ones on the host. SmolLM2's blocks lie in the file in name
    order (blk.2 after blk.19), so the host's mapped buffer spans the card's blocks 28 and 29 too: predicted."""
    lavapipe_only(vulkan_device)
    for key, cache, fa in (("gemma", "q8_0", "on"), ("smollm2", "f16", "off")):
        with vulkan_service(tmp_path / key, settings_of("one-partial", key, cache, fa)) as svc:
            m = load(svc, key, cache, fa, SCENARIOS["one-partial"]["body"])
            assert m["plan"]["verdict"] == "partial_offload", m["plan"]["reasons"]
            assert layers(m).get("CPU") and layers(m).get("Vulkan0"), layers(m)
            assert_as_planned(m)


def test_split_over_vulkan0_and_vulkan1(tmp_path: Path) -> None:
    with vulkan_service(tmp_path, settings_of("two", "gemma", "f16", "off")) as svc:
        for key, cache, fa in (("gemma", "f16", "off"), ("smollm2", "q8_0", "on")):
            m = load(svc, key, cache, fa, SCENARIOS["two"]["body"])
            assert m["plan"]["verdict"] == "split", m["plan"]["reasons"]
            assert set(layers(m)) == {"Vulkan0", "Vulkan1"}, layers(m)
            assert_as_planned(m)


def test_split_over_two_cards_with_layers_on_the_host(tmp_path: Path, vulkan_device: str) -> None:
    lavapipe_only(vulkan_device)
    with vulkan_service(tmp_path, settings_of("two-partial", "gemma", "f16", "on")) as svc:
        for cache, fa in (("f16", "on"), ("q8_0", "on")):
            m = load(svc, "gemma", cache, fa, SCENARIOS["two-partial"]["body"])
            assert m["plan"]["verdict"] == "partial_offload", m["plan"]["reasons"]
            assert set(layers(m)) == {"CPU", "Vulkan0", "Vulkan1"}, layers(m)
            assert_as_planned(m)


def test_a_plan_with_no_layer_on_the_card_keeps_off_it(tmp_path: Path, vulkan_device: str) -> None:
    """A CPU-only plan beside a Vulkan card loads with the CPU alone: llama.cpp would otherwise run large batches'
    ops on Vulkan0 (op_offload) in a compute buffer the plan did not count there (126 MiB for SmolLM2)."""
    lavapipe_only(vulkan_device)
    settings = {**SCENARIOS["one-partial"]["env"], "GGUF_VULKAN_ALLOWANCE_MIB": "200"}  # no room for a layer
    with vulkan_service(tmp_path, settings) as svc:
        m = load(svc, "smollm2", "f16", "on", {})
        assert m["plan"]["verdict"] == "cpu", m["plan"]["reasons"]
        assert [a["device"] for a in m["memory"] if a["device"].startswith("Vulkan")] == []
        assert_as_planned(m)


def prompt_of(c: httpx.Client, model: str, n_tokens: int) -> str:
    """A text of ``model`` just under ``n_tokens`` tokens."""
    unit = " the sea"
    per = len(c.post("/tokenize", json={"model": model, "content": unit * 100}).json()["tokens"]) / 100
    text = unit * int(n_tokens / per)
    while len(c.post("/tokenize", json={"model": model, "content": text}).json()["tokens"]) > n_tokens:
        text = text[: -len(unit)]
    return text


def test_scratch_within_its_bound_and_answers_streamed(tmp_path: Path, embedded_model: str) -> None:
    """A prompt that fills the context (256 cells): ggml-vulkan's scratch buffers grow with the cells in use, F16
    copies of the q8_0 K and V for flash attention over 64+ rows among them (exactly 2 x 256 cells x (256 + 256) x 2
    bytes); each within the plan's bound (``gpu_pool_mib``). Then the answer streamed, token by token."""
    n_ctx = 256
    with vulkan_service(tmp_path, settings_of("one", "gemma", "q8_0", "on"), n_ctx=n_ctx) as svc:
        m = load(svc, "gemma", "q8_0", "on", SCENARIOS["one"]["body"])
        start = svc.log_path.stat().st_size
        prompt = prompt_of(svc.client, MODELS["gemma"], n_ctx - 8)
        r = svc.client.post("/v1/completions", json={"model": MODELS["gemma"], "prompt": prompt, "max_tokens": 2,
                                                     "temperature": 0}, timeout=900)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] >= 64
        with open(svc.log_path, "rb") as f:
            f.seek(start)
            scratch = scratch_of(f.read().decode("utf-8", "replace").splitlines())
        spec = probe_path(embedded_model)
        bound = vulkan_scratch(spec, ContextConfig(n_ctx, "q8_0", "q8_0", "on", n_ubatch=512, n_batch=512), True)
        assert scratch["Vulkan0"]["x"] == 2 * n_ctx * (256 + 256) * 1 <= bound.x_bytes  # F16 K and V, 256 cells
        assert_as_planned(m, scratch)

        first = threading.Event()
        got: dict[str, Any] = {}
        stream_events(svc.url + "/v1/completions", {"model": MODELS["gemma"], "prompt": "The capital of France is",
                                                    "max_tokens": 3, "temperature": 0, "stream": True}, first, got,
                      timeout=900)
        assert got.get("status") == 200 and got["events"][-1] == "[DONE]", got
        text = "".join(json.loads(e)["choices"][0]["text"] for e in got["events"][:-1] if json.loads(e).get("choices"))
        assert text.strip()
