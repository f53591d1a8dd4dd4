"""The tests on a real Vulkan device (``make test-vulkan``): collected only where the installed llama-cpp-python
has ggml's Vulkan backend (``.venv-vulkan``, ``make vulkan``), so ``make test`` on the CPU build neither runs nor
lists them.

Without a GPU they run on Mesa's lavapipe, a software Vulkan device (``mesa-vulkan-drivers``), which ggml-vulkan
uses only when named (it skips CPU-type devices): where ggml lists no Vulkan GPU and ``GGML_VK_VISIBLE_DEVICES`` is
not set, the session sets it to ``0``, and every process the tests start inherits it. The two-device tests name
the device twice (``0,0``)."""

from __future__ import annotations

import os
from typing import Iterator

import pytest

from service.engine.devices import gpu_backends, read_rows
from tests.page.conftest import browser  # noqa: F401  (the page's headless Chromium, for the plan drawn on Vulkan0)

collect_ignore_glob = [] if "vulkan" in gpu_backends() else ["test_*.py"]


@pytest.fixture(scope="session", autouse=True)
def vulkan_device() -> Iterator[str]:
    """The Vulkan device the tests run on (its description); lavapipe's where there is no GPU."""
    chosen = os.environ.get("GGML_VK_VISIBLE_DEVICES")
    if chosen is None and not any(r.get("backend") == "Vulkan" for r in read_rows()):
        os.environ["GGML_VK_VISIBLE_DEVICES"] = "0"
    rows = [r for r in read_rows() if r.get("backend") == "Vulkan"]
    if not rows:
        pytest.fail("ggml lists no Vulkan device, lavapipe's included: is mesa-vulkan-drivers installed "
                    "(tools/vulkan-deps)?")
    yield str(rows[0].get("description", ""))
    if chosen is None:
        os.environ.pop("GGML_VK_VISIBLE_DEVICES", None)
