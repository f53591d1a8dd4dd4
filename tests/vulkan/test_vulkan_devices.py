"""llama.cpp's Vulkan backend for real (issue 56), on Mesa's lavapipe where there is no GPU: the cards as ggml
lists them, and the embedded gemma placed whole on Vulkan0 by the service's plan, loaded and answering.

lavapipe is slow (its first graphs compile their pipelines: 12 tokens took 93 s on 2 cores), so generations are a
few tokens. Its 2 GiB heap is reported free for ever (Mesa 22.3 has no VK_EXT_memory_budget there): the plan says
so."""

from __future__ import annotations

from typing import Any

import pytest

from service.engine.devices import LocalDevices, read_rows
from sizing.probe import unreported_free
from sizing.units import MIB
from tests.page.test_page_browser import wait_render

pytestmark = pytest.mark.slow

LAVAPIPE_HEAP_BYTES = 2048 * MIB
"""Mesa 22.3.6's lavapipe: one 2 GiB device-local heap (``vulkaninfo``)."""
LAVAPIPE_STORAGE_RANGE_BYTES = 128 * MIB
"""Its ``maxStorageBufferRange`` (2^27): the largest tensor ggml-vulkan runs an op on there."""


def test_ggml_lists_vulkan0_with_its_memory_and_whether_free_is_reported(vulkan_device: str) -> None:
    rows = read_rows()
    vk = [r for r in rows if r["backend"] == "Vulkan"]
    assert vk and vk[0]["name"] == "Vulkan0"
    assert vk[0]["description"] == vulkan_device
    assert vk[0]["host_buffer"] == "Vulkan_Host"
    assert vk[0]["alignment"] > 0 and vk[0]["max_size"] > 0 and vk[0]["max_tensor"] > 0
    cards = LocalDevices().cards()
    assert cards[0].label == "Vulkan0" and cards[0].index == 0
    card = cards[0]
    assert card.total_bytes == vk[0]["total_bytes"] > 0
    if vk[0]["free_bytes"] == vk[0]["total_bytes"]:
        assert card.free_memory == "unreported"
        assert (card.free_bytes, card.free_margin_bytes) == unreported_free(card.total_bytes)
    else:
        assert card.free_memory in ("reported", "shared") and card.free_bytes == vk[0]["free_bytes"]
    assert card.max_tensor_bytes == vk[0]["max_tensor"] and card.alignment_bytes == vk[0]["alignment"]
    if "llvmpipe" in vulkan_device:  # Mesa 22.3's lavapipe: one 2 GiB heap, no memory budget
        assert [c.label for c in cards] == ["Vulkan0"]
        assert vk[0]["free_bytes"] == vk[0]["total_bytes"] == LAVAPIPE_HEAP_BYTES
        assert card.free_memory == "unreported"
        # ggml-vulkan's ops take tensors up to lavapipe's maxStorageBufferRange (no 64-bit indexing there)
        assert vk[0]["max_tensor"] == LAVAPIPE_STORAGE_RANGE_BYTES and vk[0]["alignment"] == 16


def test_a_device_named_twice_is_vulkan0_and_vulkan1(monkeypatch: pytest.MonkeyPatch) -> None:
    """``GGML_VK_VISIBLE_DEVICES=0,0``: one device twice, two ggml devices (without a PCI id on lavapipe, so
    llama.cpp keeps both): a real two-device split to plan for."""
    monkeypatch.setenv("GGML_VK_VISIBLE_DEVICES", "0,0")
    cards = LocalDevices().cards()
    assert [c.label for c in cards][:2] == ["Vulkan0", "Vulkan1"]
    if not cards[0].device_id:
        assert [(c.index, c.label) for c in cards] == [(0, "Vulkan0"), (1, "Vulkan1")]
        assert cards[0].total_bytes == cards[1].total_bytes


def test_the_embedded_gemma_loads_whole_on_vulkan0_and_answers(service_factory: object, browser: Any) -> None:
    """The service plans gemma-3-270m on Vulkan0 (every layer: 18 blocks and the output), says where the card's
    free memory was not read (in the plan, the dry run's answer and under the card's bar on the page), loads it
    there (llama.cpp's allocations on Vulkan0) and answers a few tokens."""
    from selenium.webdriver.common.by import By

    svc = service_factory(GGUF_CONTEXT_LENGTH="2048", GGUF_MIN_CONTEXT="2048",  # type: ignore[operator]
                          GGUF_PARALLEL="1", GGUF_RUNNER_STALL_S="0", GGUF_EMBEDDINGS="off")
    with svc.running() as s:
        listed = s.client.get("/api/models").json()["models"]
        model = next(m for m in listed if m.get("state") == "loaded")
        plan = model["plan"]
        assert plan["verdict"] == "one_card", plan.get("reasons")
        assert plan["chosen"]["n_gpu_layers"] == 19 and plan["chosen"]["gpus"] == [0]
        assert plan["calibration"]["backend"] == "Vulkan"  # llama.cpp's dry run with the Vulkan backend measured it
        dev = plan["devices"][0]
        assert (dev["label"], dev["backend"]) == ("Vulkan0", "Vulkan")
        if dev["free_memory"] == "unreported":
            assert "does not report its free memory" in dev["free_note"]
            assert any("does not report its free memory" in w for w in plan["warnings"])
        memory = {m["device"]: m for m in model["memory"]}
        assert memory["Vulkan0"]["allocated"]["weights_mib"] > 60
        assert memory["Vulkan0"]["allocated"]["kv_mib"] > 0
        dry = s.client.post("/api/dry-run", json={"model": model["name"]}).json()
        assert dry["devices"][0]["label"] == "Vulkan0"
        assert dry["devices"][0]["free_memory"] == dev["free_memory"]
        browser.get(s.url + "/")
        wait_render(browser, 0)
        bar = browser.find_element(By.CSS_SELECTOR, '#bars figure.bar[data-device="Vulkan0"]')
        notes = bar.find_elements(By.CSS_SELECTOR, 'p[data-field="free_note"]')
        if dev["free_memory"] == "unreported":
            assert [n.text for n in notes] == [dev["free_note"]]
            margin = bar.find_element(By.CSS_SELECTOR, 'rect[data-kind="used"]')
            assert float(margin.get_attribute("data-mib") or 0) == pytest.approx(dev["free_margin_mib"], abs=0.01)
            assert "kept back (free memory not reported)" in (bar.find_element(By.TAG_NAME, "svg")
                                                              .get_attribute("aria-label") or "")
        else:
            assert notes == []
        r = s.client.post("/v1/completions", json={"model": model["name"], "prompt": "The capital of France is",
                                                   "max_tokens": 3, "temperature": 0}, timeout=600)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"].strip()
