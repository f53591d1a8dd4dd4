"""A real headless Chromium (Debian's), driven by chromedriver through Selenium; screenshots under the session's
pytest tmp folder (``page-shots*``: its path is printed), and the pictures docs/ shows (docs/page-*.png) written again
where GGUF_PAGE_DOCS=1 says so.

Nothing is downloaded: the browser and its driver come from Debian (``tests/page/install_browser.sh``).
Without them the browser tests fail with that instruction, they are not skipped.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
INSTALL = "bash tests/page/install_browser.sh"

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1280,900",
    "--force-device-scale-factor=1",
)


def _find(env: str, *names: str) -> str | None:
    given = os.environ.get(env)
    if given:
        return given if Path(given).exists() else None
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    return None


@pytest.fixture(scope="session")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One headless Chromium for the session, with a fresh profile."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError as exc:
        pytest.fail(f"the page tests need Selenium in the venv ({exc}); run: {INSTALL}", pytrace=False)
    chromium = _find("CHROMIUM", "chromium", "chromium-browser")
    driver_path = _find("CHROMEDRIVER", "chromedriver")
    if chromium is None or driver_path is None:
        missing = " and ".join(n for n, p in (("chromium", chromium), ("chromedriver", driver_path)) if p is None)
        pytest.fail(f"the page tests need Debian's {missing} (no browser is downloaded); run: {INSTALL}",
                    pytrace=False)
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # An explicit driver path: Selenium Manager (which would download one) is not consulted.
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=driver_path))
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="session")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the tests' screenshots go: a folder of the session's pytest tmp folder."""
    folder = tmp_path_factory.mktemp("page-shots")
    print(f"page screenshots: {folder}")
    return folder


@pytest.fixture(scope="session")
def docs_shot() -> Any:
    """``docs_shot(driver, "page-models.png")``: the page from its top, 1280 px wide and as tall as its content up to
    ``max_height`` px, as the picture docs/ shows; written only with GGUF_PAGE_DOCS=1 (a test run leaves the tracked
    pictures alone). Returns the path or None."""

    def take(driver: Any, name: str, max_height: int = 1200, top_id: str | None = None) -> Path | None:
        """``top_id``: the picture starts at that element (the page scrolled to it) instead of the page's top."""
        if os.environ.get("GGUF_PAGE_DOCS") != "1":
            return None
        path = DOCS / name
        driver.set_window_size(1280, 900)
        chrome = 900 - int(driver.execute_script("return window.innerHeight"))  # the window's own bars
        top = int(driver.execute_script(
            "const e = arguments[0] && document.getElementById(arguments[0]);"
            "return e ? Math.max(0, e.getBoundingClientRect().top + window.scrollY - 12) : 0", top_id))
        height = int(driver.execute_script("return document.documentElement.scrollHeight")) - top
        driver.set_window_size(1280, min(height, max_height) + chrome)
        driver.execute_script("window.scrollTo(0, arguments[0])", top)
        driver.save_screenshot(str(path))
        driver.set_window_size(1280, 900)
        assert path.stat().st_size > 10_000
        return path

    return take
