"""The page beyond the plan, in Debian's headless Chromium against real services: the Models view (what is loaded,
with llama.cpp's allocations beside the plan's, slots, keep-alive, prompt cache; load and unload, refused in words
for a key that is not an admin's), a pull from a local hub (tests/hub.py) whose progress moves and which is
cancelled, and the Chat view (tokens streamed and stopped, the figures of an answer, Markdown drawn safely: a
script-bearing answer stays text). Screenshots in the session's tmp folder; docs/page-*.png with GGUF_PAGE_DOCS=1.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.conftest import EMBEDDED_NAME, INSTRUCT_NAME, ServiceProcess
from tests.hub import Hub
from tests.page.test_page_browser import body_state, screenshot, wait_for

pytestmark = pytest.mark.slow

USER = "page-user-key-0123"
ADMIN = "page-admin-key-4567"
MIB = 1 << 20


def fmt(x: float) -> str:
    from tests.page.test_page_browser import fmt as plan_fmt

    return plan_fmt(x)


def fmt_bytes(n: int) -> str:
    """As the page writes a size (common.js ``fmtBytes``)."""
    from tests.page.test_page_browser import to_fixed

    return to_fixed(n / (1 << 30), 2) + " GiB" if n >= 1 << 30 else to_fixed(n / (1 << 20), 1) + " MiB"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    """acme/tiny: a small GGUF named with its quantization; acme/big: 2 GiB (sparse) sent at 16 MiB/s."""
    from sizing.testing.fixtures import TINY_LLAMA, write_fixture

    tiny = Path(write_fixture("tiny-llama", tmp_path_factory.mktemp("tiny"), shape=TINY_LLAMA))
    h = Hub(tmp_path_factory.mktemp("hub"), rate_bytes_per_s=16 * MIB)
    h.add("acme/tiny", "tiny-Q4_K_M.gguf", tiny)
    h.add("acme/big", "big-Q8_0.gguf", tiny, size_bytes=2 << 30)
    with h.serving():
        yield h


@pytest.fixture(scope="module")
def keyed(service_factory: Any, hub: Hub, tmp_path_factory: pytest.TempPathFactory) -> ServiceProcess:
    """The service with an ordinary key and an admin key, its hub the local one; gemma loaded at start."""
    models = tmp_path_factory.mktemp("keyed-models")
    svc: ServiceProcess = service_factory(GGUF_API_KEYS=USER, GGUF_ADMIN_KEYS=ADMIN, HF_ENDPOINT=hub.url,
                                          GGUF_MODELS_DIR=str(models), GGUF_CONTEXT_LENGTH="4096")
    svc.wait_ready()
    svc.models_dir = models  # type: ignore[attr-defined]
    return svc


def as_admin(svc: ServiceProcess) -> httpx.Client:
    return httpx.Client(base_url=svc.url, timeout=60, headers={"Authorization": f"Bearer {ADMIN}"})


def open_view(driver: Any, url: str, view: str, key: str | None = None) -> None:
    """The page at ``#view`` with ``key`` as the tab's API key (what typing it under "API key" keeps)."""
    driver.get(url + "/#" + view)
    driver.execute_script("window.sessionStorage.setItem('gguf-api-key', arguments[0] || '')", key)
    driver.refresh()
    wait_for(driver, lambda: body_state(driver).get("view") == view, f"the {view} view")
    if view == "models":
        wait_for(driver, lambda: int(body_state(driver).get("modelsRenders", "0")) > 0, "the models listing")


def rows(driver: Any) -> dict[str, dict[str, str]]:
    from selenium.webdriver.common.by import By

    out = {}
    for tr in driver.find_elements(By.CSS_SELECTOR, "#loaded-table tbody tr"):
        out[tr.get_attribute("data-model")] = {
            "state": tr.get_attribute("data-state"),
            **{td.get_attribute("data-field"): td.text for td in tr.find_elements(By.CSS_SELECTOR, "td[data-field]")}}
    return out


def available(driver: Any) -> list[str]:
    from selenium.webdriver.common.by import By

    return [li.get_attribute("data-model") for li in driver.find_elements(By.CSS_SELECTOR, "#available li")]


def settled(read: Any) -> Any:
    from selenium.common.exceptions import StaleElementReferenceException

    for _ in range(50):
        try:
            return read()
        except StaleElementReferenceException:  # the listing was redrawn under us
            time.sleep(0.05)
    return read()


def test_the_models_view_shows_what_is_loaded_and_loads_and_unloads_with_an_admin_key(
        browser: Any, keyed: ServiceProcess, shots: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    open_view(browser, keyed.url, "models", USER)
    wait_for(browser, lambda: EMBEDDED_NAME in settled(lambda: rows(browser)), "the loaded model's row")
    with as_admin(keyed) as admin:
        listed = {m["name"]: m for m in admin.get("/api/models").json()["models"]}
    gemma = listed[EMBEDDED_NAME]
    row = settled(lambda: rows(browser))[EMBEDDED_NAME]
    assert row["state"] == "loaded"
    # llama.cpp's allocations beside the plan's prediction, per device, as GET /api/models has them.
    assert row["memory"].splitlines() == [
        f"{d['device']}: {fmt(d['allocated_mib'])} MiB allocated, {fmt(d['predicted_mib'])} predicted"
        for d in gemma["memory"]]
    assert row["slots"] == f"0 of {gemma['plan']['chosen']['n_seq_max']} busy"
    assert row["keep_alive"] == "never unloaded"
    holds = gemma["prompt_cache"]["holds"]
    assert row["prompt_cache"] == (f"{fmt_bytes(holds['bytes'])} of {fmt_bytes(holds['budget_bytes'])}, "
                                   f"{holds['entries']} prompts, {holds['hits']} hits"), row
    assert INSTRUCT_NAME in available(browser)

    # An ordinary key: the load is refused, and the page says why.
    # The listing is redrawn every 2 s: a button found just before a redraw is gone by the click.
    settled(lambda: browser.find_element(By.CSS_SELECTOR, f'button[aria-label="Load {INSTRUCT_NAME}"]').click())
    error = browser.find_element(By.ID, "models-error")
    wait_for(browser, lambda: error.is_displayed() and "admin key" in error.text, "the refusal")
    assert error.get_attribute("role") == "alert"
    assert f"Loading {INSTRUCT_NAME} failed: This needs an admin key (GGUF_ADMIN_KEYS)" in error.text
    with as_admin(keyed) as admin:
        assert {m["name"]: m["state"] for m in admin.get("/api/models").json()["models"]}[INSTRUCT_NAME] == "unloaded"

    # An admin key: from the keyboard, Tab from the view's link to the model's Load button, then Enter.
    open_view(browser, keyed.url, "models", ADMIN)
    wait_for(browser, lambda: INSTRUCT_NAME in available(browser), "the available models")
    browser.execute_script("document.getElementById('view-models').focus()")
    target = f"Load {INSTRUCT_NAME}"
    for _ in range(40):
        active = browser.switch_to.active_element
        if active.get_attribute("aria-label") == target:
            break
        active.send_keys(Keys.TAB)
    assert browser.switch_to.active_element.get_attribute("aria-label") == target
    # The listing is redrawn every 2 s: the focus stays on the model's button through two redraws.
    drawn = int(body_state(browser)["modelsRenders"])
    wait_for(browser, lambda: int(body_state(browser)["modelsRenders"]) >= drawn + 2, "two refreshes")
    assert browser.switch_to.active_element.get_attribute("aria-label") == target
    browser.switch_to.active_element.send_keys(Keys.ENTER)
    wait_for(browser, lambda: settled(lambda: rows(browser)).get(INSTRUCT_NAME, {}).get("state") == "loaded",
             "the loaded instruct model", timeout_s=120)
    assert "Loaded " + INSTRUCT_NAME in browser.find_element(By.ID, "models-status").text
    with as_admin(keyed) as admin:
        smol = {m["name"]: m for m in admin.get("/api/models").json()["models"]}[INSTRUCT_NAME]
    assert smol["state"] == "loaded"
    shown = settled(lambda: rows(browser))[INSTRUCT_NAME]["memory"]
    assert shown.startswith(f"{smol['memory'][0]['device']}: {fmt(smol['memory'][0]['allocated_mib'])} MiB allocated")
    assert INSTRUCT_NAME not in available(browser)
    screenshot(browser, shots / "20-models-loaded.png")

    settled(lambda: browser.find_element(By.CSS_SELECTOR, f'button[aria-label="Unload {INSTRUCT_NAME}"]').click())
    wait_for(browser, lambda: INSTRUCT_NAME in available(browser), "the model back among the available ones")
    assert INSTRUCT_NAME not in settled(lambda: rows(browser))
    with as_admin(keyed) as admin:
        assert {m["name"]: m["state"] for m in admin.get("/api/models").json()["models"]}[INSTRUCT_NAME] == "unloaded"


def test_a_pull_shows_its_progress_moving_and_is_cancelled_then_another_is_pulled(
        browser: Any, keyed: ServiceProcess, hub: Hub, shots: Path, docs_shot: Any) -> None:
    from selenium.webdriver.common.by import By

    open_view(browser, keyed.url, "models", ADMIN)
    box = browser.find_element(By.ID, "pull-ref")
    box.clear()
    box.send_keys("hf.co/acme/big/big-Q8_0.gguf")
    browser.find_element(By.ID, "pull-start").click()
    progress = browser.find_element(By.ID, "pull-progress")

    def done_bytes() -> int:
        return int(progress.get_attribute("data-bytes-done") or 0)

    wait_for(browser, lambda: done_bytes() > 0, "the first bytes")
    first = done_bytes()
    wait_for(browser, lambda: done_bytes() > first, "the progress moving")
    bar = float(browser.find_element(By.ID, "pull-bar").get_attribute("value"))
    assert 0 < bar < 0.5
    figures = browser.find_element(By.ID, "pull-figures").text
    assert " of 2.00 GiB (" in figures and "MiB/s" in figures and " left" in figures, figures
    assert browser.find_element(By.ID, "pull-file").text == "acme/big/big-Q8_0.gguf"
    screenshot(browser, shots / "21-pull-running.png")
    docs_shot(browser, "page-models.png")

    browser.find_element(By.ID, "pull-cancel").click()
    wait_for(browser, lambda: progress.get_attribute("data-state") == "cancelled", "the cancel")
    assert "the partial file was removed" in browser.find_element(By.ID, "pull-figures").text
    models: Path = keyed.models_dir  # type: ignore[attr-defined]
    wait_for(browser, lambda: not [p for p in models.rglob("*") if "big-Q8_0" in p.name], "no partial file")
    wait_for(browser, lambda: "big-Q8_0.gguf" in hub.aborted, "the transfer stopped midway (the hub's client left)")
    screenshot(browser, shots / "22-pull-cancelled.png")

    # A small file by its quantization: done, and then among the available models.
    box.clear()
    box.send_keys("hf.co/acme/tiny:Q4_K_M")
    browser.find_element(By.ID, "pull-start").click()
    wait_for(browser, lambda: progress.get_attribute("data-state") == "done", "the second pull")
    wait_for(browser, lambda: "tiny-Q4_K_M" in available(browser), "the pulled model among the available ones")

    # An ordinary key may not pull: the page says why.
    open_view(browser, keyed.url, "models", USER)
    box = browser.find_element(By.ID, "pull-ref")
    box.send_keys("hf.co/acme/tiny:Q4_K_M")
    browser.find_element(By.ID, "pull-start").click()
    error = browser.find_element(By.ID, "models-error")
    wait_for(browser, lambda: "admin key" in error.text, "the refusal")
    assert error.text.startswith("The pull failed: This needs an admin key")


@pytest.fixture(scope="module")
def chatty(service_factory: Any) -> ServiceProcess:
    """The instruct model as the default, gemma loaded beside it (a base model: it writes on and on)."""
    svc: ServiceProcess = service_factory(GGUF_DEFAULT_MODEL=INSTRUCT_NAME, GGUF_CONTEXT_LENGTH="4096")
    svc.wait_ready()
    assert svc.client.post("/api/models/load", json={"model": EMBEDDED_NAME}).status_code == 200
    return svc


def chat_state(driver: Any) -> str:
    return body_state(driver).get("chat", "")


def ask(driver: Any, text: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    box = driver.find_element(By.ID, "chat-input")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)  # Enter sends


def set_field(driver: Any, element_id: str, value: str) -> None:
    from selenium.webdriver.common.by import By

    box = driver.find_element(By.ID, element_id)
    box.clear()
    box.send_keys(value)


def answers(driver: Any) -> list[Any]:
    from selenium.webdriver.common.by import By

    return list(driver.find_elements(By.CSS_SELECTOR, '#chat-log li[data-role="assistant"]'))


def open_chat(driver: Any, svc: ServiceProcess, model: str) -> None:
    from selenium.webdriver.support.ui import Select
    from selenium.webdriver.common.by import By

    open_view(driver, svc.url, "chat")
    wait_for(driver, lambda: model in [o.get_attribute("value") for o in
                                       driver.find_elements(By.CSS_SELECTOR, "#chat-model option")], "the models")
    Select(driver.find_element(By.ID, "chat-model")).select_by_value(model)


def test_a_chat_streams_an_answer_with_its_figures_and_the_next_turn_is_cached(
        browser: Any, chatty: ServiceProcess, shots: Path, docs_shot: Any) -> None:
    from selenium.webdriver.common.by import By

    open_chat(browser, chatty, INSTRUCT_NAME)
    first_option = browser.find_element(By.CSS_SELECTOR, "#chat-model option").get_attribute("value")
    assert first_option == INSTRUCT_NAME, "the default model first"
    set_field(browser, "chat-system", "You are a helpful assistant.")
    set_field(browser, "chat-temperature", "0")
    set_field(browser, "chat-max-tokens", "48")
    ask(browser, "What is the capital of France? Answer in one sentence.")
    wait_for(browser, lambda: chat_state(browser) == "done", "the answer", timeout_s=120)
    [answer] = answers(browser)
    assert "Paris" in answer.text
    stats = browser.find_element(By.ID, "chat-stats").text
    assert "tokens/s" in stats and "first token after" in stats and ", 0 cached" in stats, stats
    n = int(stats.split(" tokens")[0])
    assert n >= 2

    ask(browser, "And the capital of Italy?")
    wait_for(browser, lambda: chat_state(browser) == "done" and len(answers(browser)) == 2, "the second answer",
             timeout_s=120)
    stats = browser.find_element(By.ID, "chat-stats").text
    cached = int(stats.rsplit(", ", 1)[1].split(" cached")[0])
    prompt = int(stats.split("prompt ")[1].split(" tokens")[0])
    assert 0 < cached < prompt, stats  # the first turn's prompt came from the slot's KV
    screenshot(browser, shots / "23-chat.png")
    docs_shot(browser, "page-chat.png")


def test_a_streaming_answer_grows_and_stops_when_asked(browser: Any, chatty: ServiceProcess, shots: Path) -> None:
    from selenium.webdriver.common.by import By

    open_chat(browser, chatty, EMBEDDED_NAME)
    set_field(browser, "chat-max-tokens", "2000")
    ask(browser, "Write a long story about a lighthouse keeper.")
    wait_for(browser, lambda: chat_state(browser) == "streaming", "the stream")
    seen: set[int] = set()

    def chunks() -> int:
        got = answers(browser)
        return int(got[-1].get_attribute("data-chunks") or 0) if got else 0

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len({c for c in seen if c}) < 4:
        seen.add(chunks())
        time.sleep(0.05)
    assert len({c for c in seen if c}) >= 4, f"the answer grows as tokens arrive: {sorted(seen)}"
    assert chat_state(browser) == "streaming"
    assert browser.find_element(By.ID, "chat-stop").is_enabled()
    browser.find_element(By.ID, "chat-stop").click()
    wait_for(browser, lambda: chat_state(browser) == "stopped", "the stop")
    at_stop = chunks()
    time.sleep(1.0)
    assert chunks() == at_stop, "nothing arrives after the stop"
    answer = answers(browser)[-1]
    assert answer.get_attribute("data-state") == "stopped" and "(stopped)" in answer.text
    assert "tokens/s" in browser.find_element(By.ID, "chat-stats").text
    # The server ended the generation when the page left it: the model's slot is free again.
    wait_for(browser, lambda: {m["name"]: m for m in chatty.client.get("/api/models").json()["models"]}[
        EMBEDDED_NAME]["in_flight"] == 0, "the generation's end on the server", timeout_s=15)
    screenshot(browser, shots / "24-chat-stopped.png")


HOSTILE = [
    "Here is <script>window.__pwned = 1</script> and ",
    "<img src=x onerror=\"window.__pwned = 2\"> then [a link](javascript:window.__pwned=3) and ",
    "[a fine one](https://example.com/x?a=1) with **bold** and `<b>code</b>`.\n\n```html\n<script>",
    "window.__pwned = 4</script>\n```\n\n<iframe src=\"/\"></iframe>",
]


def test_a_script_bearing_answer_is_drawn_as_text_and_never_runs(browser: Any, chatty: ServiceProcess) -> None:
    """The answer a model could write, streamed in pieces that cut its tags: the page's fetch is answered with it
    (the server's own answers are drawn the same way). Nothing of it becomes an element it names, nothing runs."""
    from selenium.webdriver.common.by import By

    open_chat(browser, chatty, INSTRUCT_NAME)
    browser.execute_script("""
        const pieces = arguments[0];
        const real = window.fetch;
        window.fetch = function (url, init) {
          if (String(url) !== '/v1/chat/completions') return real.apply(this, arguments);
          const enc = new TextEncoder();
          const body = new ReadableStream({ start(c) {
            for (const p of pieces) {
              c.enqueue(enc.encode('data: ' + JSON.stringify({choices: [{index: 0, delta: {content: p}}]}) + '\\n\\n'));
            }
            c.enqueue(enc.encode('data: [DONE]\\n\\n'));
            c.close();
          }});
          return Promise.resolve(new Response(body, {status: 200, headers: {'content-type': 'text/event-stream'}}));
        };""", HOSTILE)
    ask(browser, "Show me some HTML.")
    wait_for(browser, lambda: chat_state(browser) == "done", "the answer")
    [answer] = answers(browser)
    body = answer.find_element(By.CSS_SELECTOR, ".body")
    for tag in ("script", "img", "iframe"):
        assert body.find_elements(By.TAG_NAME, tag) == [], tag
    assert [a.get_attribute("href") for a in body.find_elements(By.TAG_NAME, "a")] == ["https://example.com/x?a=1"]
    assert body.find_element(By.TAG_NAME, "a").get_attribute("rel") == "noopener noreferrer nofollow"
    text = body.text
    assert "<script>window.__pwned = 1</script>" in text and '<img src=x onerror="window.__pwned = 2">' in text
    assert "[a link](javascript:window.__pwned=3)" in text and '<iframe src="/"></iframe>' in text
    assert body.find_element(By.TAG_NAME, "strong").text == "bold"
    assert [c.text for c in body.find_elements(By.CSS_SELECTOR, ":not(pre) > code")] == ["<b>code</b>"]
    assert body.find_element(By.CSS_SELECTOR, "pre > code").text == "<script>window.__pwned = 4</script>"
    assert browser.execute_script("return window.__pwned === undefined")
    # The renderer alone, on the same text whole: elements of its own making only.
    made = browser.execute_script("""
        const frag = window.GGUF_MARKDOWN(arguments[0]);
        const box = document.createElement('div');
        box.appendChild(frag);
        return Array.from(box.querySelectorAll('*')).map((n) => n.tagName.toLowerCase());""", "".join(HOSTILE))
    assert set(made) <= {"p", "br", "a", "strong", "code", "pre"}, made
