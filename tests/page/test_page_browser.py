"""The page in a real headless Chromium against the running service on the embedded model.

Each test compares what the page shows with what ``POST /api/dry-run`` answers for the same body.
Screenshots land in the session's pytest tmp folder (tests/page/conftest.py); docs/page-plan.png with GGUF_PAGE_DOCS=1.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import pytest

pytestmark = pytest.mark.slow

MODEL = "gemma-3-270m-q4_k_m"
CARD = {"name": "RTX 4090 24 GB", "free_mib": 20000.0, "total_mib": 24564.0}


def fmt(x: float) -> str:
    return to_fixed(x, 2)


def to_fixed(x: float, digits: int) -> str:
    """JavaScript's ``x.toFixed(digits)``, as the page writes figures: the exact value of the double, a tie going
    to the larger number (44.25 -> "44.3"; Python's format rounds that tie to even, "44.2")."""
    from decimal import ROUND_HALF_UP, Decimal

    return str(Decimal(x).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP))


def wait_for(driver: Any, cond: Callable[[], Any], what: str, timeout_s: float = 30) -> Any:
    from selenium.common.exceptions import StaleElementReferenceException

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            got = cond()
        except StaleElementReferenceException:  # the page redrew under us: look again
            got = None
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}; body: {body_state(driver)}; log: {console(driver)}")


def body_state(driver: Any) -> dict[str, str]:
    return dict(driver.execute_script("return Object.assign({}, document.body.dataset)"))


def renders(driver: Any) -> int:
    return int(body_state(driver).get("renders", "0"))


def wait_render(driver: Any, after: int) -> None:
    """Until the page has drawn a plan newer than ``after`` and is not asking for another."""
    wait_for(driver, lambda: renders(driver) > after and body_state(driver).get("state") == "ready", "a redraw")


def wait_chart(driver: Any, after: int = 0) -> None:
    wait_for(driver, lambda: int(body_state(driver).get("chartRenders", "0")) > after, "the chart")


def console(driver: Any) -> list[dict[str, Any]]:
    return list(driver.get_log("browser"))


def open_page(driver: Any, url: str) -> None:
    driver.get(url + "/")
    wait_render(driver, 0)
    wait_chart(driver)


def screenshot(driver: Any, path: Path) -> None:
    height = int(driver.execute_script("return document.documentElement.scrollHeight"))
    driver.set_window_size(1280, min(max(height + 40, 900), 4000))
    driver.save_screenshot(str(path))
    driver.set_window_size(1280, 900)
    assert path.stat().st_size > 10_000


def cache_rows(driver: Any) -> dict[str, dict[str, str]]:
    return settled(lambda: _cache_rows(driver))


def settled(read: Callable[[], Any]) -> Any:
    """Read the page, again if a redraw replaced the elements mid-read."""
    from selenium.common.exceptions import StaleElementReferenceException

    for _ in range(50):
        try:
            return read()
        except StaleElementReferenceException:
            time.sleep(0.05)
    return read()


def _cache_rows(driver: Any) -> dict[str, dict[str, str]]:
    from selenium.webdriver.common.by import By

    rows = {}
    for tr in driver.find_elements(By.CSS_SELECTOR, "#cache-table tbody tr"):
        cells = {td.get_attribute("data-field"): td.text for td in tr.find_elements(By.CSS_SELECTOR, "td")}
        rows[tr.get_attribute("data-cache-type")] = cells
    return rows


def field(driver: Any, name: str) -> str:
    from selenium.webdriver.common.by import By

    return str(settled(lambda: driver.find_element(By.CSS_SELECTOR, f'#summary dd[data-field="{name}"]').text))


def dry_run(served: Any, **body: Any) -> dict[str, Any]:
    r = served.client.post("/api/dry-run", json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def select(driver: Any, element_id: str, value: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    Select(driver.find_element(By.ID, element_id)).select_by_value(value)


def test_the_page_loads_and_shows_the_cache_table_of_the_dry_run(browser: Any, served: Any, shots: Path) -> None:
    console(browser)  # drop what an earlier page logged
    open_page(browser, served.url)
    plan = dry_run(served)
    rows = cache_rows(browser)
    assert list(rows) == [c["cache_type"] for c in plan["cache_types"]]
    assert len(rows) == 3
    for c in plan["cache_types"]:
        row = rows[c["cache_type"]]
        assert row["n_ctx"] == str(c["n_ctx"])
        assert row["kv_mib"] == fmt(c["kv_mib"])
        assert row["total_mib"] == fmt(c["total_mib"])
        # each row reads true: its placement, its predicted speed, the largest context, where figures came from
        assert row["largest_n_ctx"] == str(c["largest_n_ctx"])
        assert row["placement"] == c["placement"]["description"]
        assert row["decode_tokens_per_s"] == to_fixed(c["decode_tokens_per_s"], 1)
        assert row["sources"] == c["sources"]["compute"]
    # The verdict in words, and the estimate of the chosen cache type.
    from selenium.webdriver.common.by import By

    verdict = browser.find_element(By.ID, "verdict")
    assert verdict.get_attribute("data-verdict") == plan["verdict"]
    assert "CPU" in verdict.text
    assert field(browser, "kv_mib") == fmt(plan["estimate"]["kv_mib"]) + " MiB"
    assert field(browser, "total_mib") == fmt(plan["estimate"]["total_mib"]) + " MiB"
    assert browser.find_element(By.ID, "cache-type").get_attribute("value") == plan["chosen"]["cache_type"]
    # No card here: the model is in host memory, drawn as the host bar.
    bars = browser.find_elements(By.CSS_SELECTOR, "#bars figure.bar")
    assert [b.get_attribute("data-device") for b in bars] == ["CPU"]
    assert fmt(plan["estimate"]["total_mib"]) in bars[0].find_element(By.TAG_NAME, "svg").get_attribute("aria-label")
    # The page ran under its CSP without a complaint (a violation is logged as an error).
    errors = [e for e in console(browser) if e.get("level") == "SEVERE"]
    assert errors == []
    screenshot(browser, shots / "01-loaded.png")


def test_a_change_of_cache_type_redraws_with_its_numbers(browser: Any, served: Any, shots: Path) -> None:
    open_page(browser, served.url)
    from selenium.webdriver.common.by import By

    # The default (auto) loads f16 where f16 reaches the ceiling, as on this host: change to another type.
    first = browser.find_element(By.ID, "cache-type").get_attribute("value")
    other = "q8_0" if first == "f16" else "f16"
    before = field(browser, "kv_mib")
    n = renders(browser)
    select(browser, "cache-type", other)
    wait_render(browser, n)
    plan = dry_run(served, cache_type=other)
    assert plan["chosen"]["cache_type"] == other
    after = field(browser, "kv_mib")
    assert after == fmt(plan["estimate"]["kv_mib"]) + " MiB"
    assert after != before
    assert field(browser, "cache_type") == f"{other} / {other}"
    cpu = browser.find_element(By.CSS_SELECTOR, '#bars-table tr[data-device="CPU"]')
    cells = {td.get_attribute("data-field"): td.get_attribute("textContent") for td in cpu.find_elements(By.TAG_NAME, "td")}
    est_cpu = next(d for d in plan["estimate"]["devices"] if d["device"] == "CPU")
    assert cells["kv_mib"] == fmt(est_cpu["kv_mib"])
    assert cells["total_mib"] == fmt(est_cpu["total_mib"])
    chosen = browser.find_elements(By.CSS_SELECTOR, "#cache-table tr.chosen")
    assert [r.get_attribute("data-cache-type") for r in chosen] == [other]
    screenshot(browser, shots / "02-cache-type.png")


def test_a_fixed_context_redraws_the_estimate_at_that_context(browser: Any, served: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    open_page(browser, served.url)
    n = renders(browser)
    browser.find_element(By.ID, "ctx-largest").click()
    wait_render(browser, n)
    n = renders(browser)
    box = browser.find_element(By.ID, "ctx-number")
    box.clear()
    box.send_keys("8192", Keys.TAB)  # leaving the box fires its change event
    wait_for(browser, lambda: field(browser, "n_ctx") == "8192 tokens", "n_ctx 8192")
    plan = dry_run(served, n_ctx=8192, cache_type=browser.find_element(By.ID, "cache-type").get_attribute("value"))
    assert field(browser, "total_mib") == fmt(plan["estimate"]["total_mib"]) + " MiB"
    # The table still shows each cache type's largest context, not the fixed one.
    largest = dry_run(served)
    assert {k: v["n_ctx"] for k, v in cache_rows(browser).items()} == {
        c["cache_type"]: str(c["n_ctx"]) for c in largest["cache_types"]}
    assert renders(browser) > n


def test_a_hypothetical_card_appears_as_a_new_bar_drawn_to_scale(browser: Any, served: Any, shots: Path) -> None:
    from selenium.webdriver.common.by import By

    open_page(browser, served.url)
    live = dry_run(served)["devices"]
    bars_before = len(browser.find_elements(By.CSS_SELECTOR, "#bars figure.bar"))
    for element_id, value in (("card-name", CARD["name"]), ("card-free", "20000"), ("card-total", "24564")):
        box = browser.find_element(By.ID, element_id)
        box.clear()
        box.send_keys(value)
    n = renders(browser)
    chart_n = int(body_state(browser).get("chartRenders", "0"))
    browser.find_element(By.ID, "card-add").click()
    wait_render(browser, n)
    wait_chart(browser, chart_n)
    gpus = [{"name": d["name"], "free_mib": d["free_mib"], "total_mib": d["total_mib"]} for d in live] + [CARD]
    plan = dry_run(served, gpus=gpus, cache_type=browser.find_element(By.ID, "cache-type").get_attribute("value"))
    card = plan["devices"][-1]
    bar = browser.find_element(By.CSS_SELECTOR, f'#bars figure.bar[data-name="{CARD["name"]}"]')
    assert bar.get_attribute("data-device") == card["label"]
    cards = browser.find_elements(By.CSS_SELECTOR, "#bars figure.bar")
    assert len(cards) == len(plan["devices"]) + (1 if any(
        d["device"] == "CPU" and d["layers"] for d in plan["estimate"]["devices"]) else 0)
    assert len(cards) >= bars_before  # the host bar may give way to the card
    assert browser.find_element(By.ID, "verdict").get_attribute("data-verdict") == plan["verdict"]
    est = next(d for d in plan["estimate"]["devices"] if d["device"] == card["label"])
    label = bar.find_element(By.TAG_NAME, "svg").get_attribute("aria-label")
    assert fmt(est["kv_mib"]) in label and fmt(est["weights_mib"]) in label
    # To scale: the cards share one scale, this one's memory is the widest extent here.
    weights = bar.find_element(By.CSS_SELECTOR, 'rect[data-kind="weights"]')
    edge = float(bar.find_element(By.CSS_SELECTOR, "line.edge").get_attribute("x1"))
    width = float(weights.get_attribute("width"))
    assert width / edge * card["total_mib"] == pytest.approx(est["weights_mib"], abs=1.0)
    assert float(bar.find_element(By.CSS_SELECTOR, 'rect[data-kind="used"]').get_attribute("data-mib")) == \
        pytest.approx(CARD["total_mib"] - CARD["free_mib"], abs=0.01)
    # The chart now compares with the card's free memory.
    labels = [t.text for t in browser.find_elements(By.CSS_SELECTOR, "#chart .free-label")]
    assert any(card["label"] in t and "20000.00" in t for t in labels), labels
    screenshot(browser, shots / "03-hypothetical-card.png")
    # Removing it takes the bar away again.
    n = renders(browser)
    browser.find_element(By.CSS_SELECTOR, "#cards button").click()
    wait_render(browser, n)
    assert browser.find_elements(By.CSS_SELECTOR, f'#bars figure.bar[data-name="{CARD["name"]}"]') == []


def test_a_card_too_small_shows_the_refusal_in_words(browser: Any, served: Any, shots: Path) -> None:
    from selenium.webdriver.common.by import By

    open_page(browser, served.url)
    for element_id, value in (("card-name", "Tiny 2 GB"), ("card-free", "300"), ("card-total", "2048")):
        box = browser.find_element(By.ID, element_id)
        box.clear()
        box.send_keys(value)
    browser.find_element(By.ID, "keep-live").click()  # only the hypothetical card
    wait_chart(browser, 1)  # the redraw that unticking asked for
    n, chart_n = renders(browser), int(body_state(browser)["chartRenders"])
    browser.find_element(By.ID, "card-add").click()
    wait_render(browser, n)
    wait_chart(browser, chart_n)
    plan = dry_run(served, gpus=[{"name": "Tiny 2 GB", "free_mib": 300, "total_mib": 2048}],
                   cache_type=browser.find_element(By.ID, "cache-type").get_attribute("value"))
    verdict = browser.find_element(By.ID, "verdict")
    assert verdict.get_attribute("data-verdict") == plan["verdict"]
    if plan["verdict"] == "refused":
        assert "Does not fit" in verdict.text
        over = browser.find_elements(By.CSS_SELECTOR, '#bars rect[data-kind="over"]')
        assert over, "the part over the card's memory is drawn"
    reasons = [li.text for li in browser.find_elements(By.CSS_SELECTOR, "#reasons li")]
    assert reasons == plan["reasons"]
    for c in plan["cache_types"]:
        assert cache_rows(browser)[c["cache_type"]]["n_ctx"] == str(c["n_ctx"])
    # The chart measures where the plan puts the memory, against that place's free memory.
    on_cards = any(d["device"] != "CPU" for d in plan["estimate"]["devices"])
    title = browser.find_elements(By.CSS_SELECTOR, "#chart .axis-title")[1].text
    assert title == ("MiB on the cards" if on_cards else "MiB in host memory")
    screenshot(browser, shots / "04-too-small.png")


def test_the_chart_samples_the_dry_run_per_cache_type(browser: Any, served: Any) -> None:
    from selenium.webdriver.common.by import By

    open_page(browser, served.url)
    plan = dry_run(served)
    types = [c["cache_type"] for c in plan["cache_types"]]
    groups = browser.find_elements(By.CSS_SELECTOR, "#chart g[data-cache-type]")
    assert [g.get_attribute("data-cache-type") for g in groups] == types
    for g in groups:
        assert len(g.find_elements(By.CSS_SELECTOR, "circle.cross")) == 1, "the largest context is marked"
    head = [th.get_attribute("textContent") for th in browser.find_elements(By.CSS_SELECTOR, "#chart-table thead th")]
    assert head == ["n_ctx"] + [t + " MiB" for t in types]
    rows = browser.find_elements(By.CSS_SELECTOR, "#chart-table tbody tr")
    assert len(rows) == 9
    n_train = plan["model"]["n_ctx_train"]
    assert rows[-1].find_element(By.TAG_NAME, "th").get_attribute("textContent") == str(n_train)
    # One sampled point, against the dry-run at that context: memory in host memory (no cards here).
    point = rows[4]
    n_ctx = int(point.find_element(By.TAG_NAME, "th").get_attribute("textContent"))
    cells = [td.get_attribute("textContent") for td in point.find_elements(By.TAG_NAME, "td")]
    for t, shown in zip(types, cells):
        at = dry_run(served, n_ctx=n_ctx, cache_type=t)
        devs = [d for d in at["estimate"]["devices"] if d["device"] != "CPU"] or at["estimate"]["devices"]
        assert shown == fmt(round(sum(d["total_mib"] for d in devs), 2))


def test_keyboard_reaches_the_controls_with_a_visible_focus(browser: Any, served: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    open_page(browser, served.url)
    body = browser.find_element(By.TAG_NAME, "body")
    body.send_keys(Keys.TAB)
    seen = []
    for _ in range(12):
        active = browser.switch_to.active_element
        seen.append(active.get_attribute("id") or active.tag_name)
        if active.get_attribute("id") == "cache-type":
            break
        active.send_keys(Keys.TAB)
    assert seen[-1] == "cache-type", seen
    outline = browser.execute_script(
        "const s = getComputedStyle(document.activeElement); return [s.outlineStyle, s.outlineWidth];")
    assert outline[0] != "none" and float(outline[1].rstrip("px")) >= 2, outline
    # Arrow keys on the focused select pick another cache type, and the page redraws.
    n = renders(browser)
    before = browser.switch_to.active_element.get_attribute("value")
    browser.switch_to.active_element.send_keys(Keys.ARROW_UP if before != "f16" else Keys.ARROW_DOWN)
    wait_render(browser, n)
    assert browser.find_element(By.ID, "cache-type").get_attribute("value") != before


def test_where_a_line_crosses_the_free_memory_is_the_largest_context(browser: Any, served: Any, shots: Path,
                                                                    docs_shot: Any) -> None:
    """A small card: each cache type's largest context differs, and the chart marks it on the card's free line."""
    from selenium.webdriver.common.by import By

    open_page(browser, served.url)
    small = {"name": "Laptop 2 GB", "free_mib": 1260.0, "total_mib": 2048.0}
    for element_id, value in (("card-name", small["name"]), ("card-free", "1260"), ("card-total", "2048")):
        box = browser.find_element(By.ID, element_id)
        box.clear()
        box.send_keys(value)
    browser.find_element(By.ID, "keep-live").click()
    wait_chart(browser, 1)
    n, chart_n = renders(browser), int(body_state(browser)["chartRenders"])
    browser.find_element(By.ID, "card-add").click()
    wait_render(browser, n)
    wait_chart(browser, chart_n)
    plan = dry_run(served, gpus=[small], cache_type=browser.find_element(By.ID, "cache-type").get_attribute("value"))
    rows = cache_rows(browser)
    assert {k: v["n_ctx"] for k, v in rows.items()} == {c["cache_type"]: str(c["n_ctx"]) for c in plan["cache_types"]}
    n_train = plan["model"]["n_ctx_train"]
    limited = [c for c in plan["cache_types"] if 0 < c["n_ctx"] < n_train]
    if not limited:
        pytest.fail(f"the sizing changed: no cache type is limited by a {small['free_mib']} MiB card; pick another")
    free_line = [ln for ln in browser.find_elements(By.CSS_SELECTOR, "#chart line.free-line")]
    assert len(free_line) == 1
    y_free = float(free_line[0].get_attribute("y1"))
    for c in limited:
        mark = browser.find_element(By.CSS_SELECTOR, f'#chart g[data-cache-type="{c["cache_type"]}"] circle.cross')
        # The sampled line, read where the plan's largest context is, sits on the free line (within 3 px of 420).
        assert float(mark.get_attribute("cy")) == pytest.approx(y_free, abs=3.0), c
    screenshot(browser, shots / "05-crossing.png")
    docs_shot(browser, "page-plan.png", max_height=1500, top_id="verdict-h")  # README's picture


def test_with_api_keys_the_page_asks_for_one_and_then_plans(browser: Any, service_factory: Any) -> None:
    from selenium.webdriver.common.by import By

    svc = service_factory(GGUF_API_KEYS="page-test-key", GGUF_DEFAULT_MODEL="")
    browser.get(svc.url + "/")
    wait_for(browser, lambda: "API key" in browser.find_element(By.ID, "error").text, "the key request")
    assert not cache_rows(browser)
    key = browser.find_element(By.ID, "api-key")
    key.send_keys("page-test-key")
    browser.execute_script("arguments[0].dispatchEvent(new Event('change'))", key)
    wait_for(browser, lambda: len(cache_rows(browser)) == 3, "the cache-type table after the key")
    assert browser.find_element(By.ID, "error").get_attribute("hidden") is not None
    browser.execute_script("window.sessionStorage.removeItem('gguf-api-key')")


def test_the_bars_draw_each_loaded_models_share_and_the_offload_candidates(
        browser: Any, service_factory: Any, tmp_path: Path, shots: Path) -> None:
    """Two models loaded on a declared card (the embedded one and a tiny llama; llama.cpp runs them on this CPU):
    the plan of a third, too big for the card, is drawn beside them (each share named) with its candidates."""
    from selenium.webdriver.common.by import By

    from sizing.testing.fixtures import TINY_LLAMA, write_fixture

    models = tmp_path / "models"
    tiny = Path(write_fixture("tiny-llama", models, shape=TINY_LLAMA)).stem
    big = Path(write_fixture("gemma-3-27b", models)).stem
    card = '[{"name": "RTX 4090", "free_mib": 20000, "total_mib": 24564}]'
    svc = service_factory(GGUF_MODELS_DIR=str(models), GGUF_GPUS_JSON=card, GGUF_CONFIRM_LOADS="false",
                          GGUF_CONTEXT_LENGTH="4096")
    svc.wait_ready()
    assert svc.client.post("/api/models/load", json={"model": tiny}).status_code == 200
    open_page(browser, svc.url)
    n = renders(browser)
    select(browser, "model", big)
    wait_render(browser, n)
    plan = svc.client.post("/api/dry-run", json={"model": big, "cache_type": browser.find_element(
        By.ID, "cache-type").get_attribute("value")}).json()
    assert plan["verdict"] == "partial_offload" and plan["candidates"]
    held = plan["residency"]["held_mib"]["CUDA0"]
    assert set(held) == {MODEL, tiny}

    def shares() -> dict[str, str]:
        rects = browser.find_elements(By.CSS_SELECTOR, '#bars figure.bar[data-device="CUDA0"] rect[data-kind="resident"]')
        return {r.get_attribute("data-model"): r.get_attribute("data-mib") for r in rects}

    assert settled(shares) == {name: fmt(mib) for name, mib in held.items()}
    label = settled(lambda: browser.find_element(By.CSS_SELECTOR, '#bars figure.bar[data-device="CUDA0"] svg')
                    .get_attribute("aria-label"))
    assert f"loaded model {tiny} {fmt(held[tiny])} MiB" in label
    residency = browser.find_element(By.ID, "residency").text
    assert MODEL in residency and tiny in residency
    rows = settled(lambda: [
        {td.get_attribute("data-field"): td.text for td in tr.find_elements(By.TAG_NAME, "td")}
        for tr in browser.find_elements(By.CSS_SELECTOR, "#candidates-table tbody tr")])
    assert len(rows) == len(plan["candidates"])
    for row, c in zip(rows, plan["candidates"]):
        assert row["n_gpu_layers"] == str(c["n_gpu_layers"]) and row["n_ctx"] == str(c["n_ctx"])
        assert row["gpu_weights_mib"] == fmt(c["gpu_weights_mib"])
        # The page's dry run and this one ran moments apart: weights past the host's live MemAvailable are read
        # at disk speed in the speed model (sizing/plan/offload.py), so the figure moves with what the rest of the
        # machine holds (0.08 against 0.09 tokens/s seen once); the rows' other fields do not.
        assert float(row["decode_tokens_per_s"]) == pytest.approx(c["decode_tokens_per_s"], rel=0.25, abs=0.015)
    assert browser.find_element(By.ID, "candidates-section").is_displayed()
    screenshot(browser, shots / "09-residents-and-candidates.png")


def test_a_draft_model_is_drawn_on_its_device_and_named_in_the_summary(browser: Any, service_factory: Any) -> None:
    """GGUF_DRAFT_MODEL (the embedded model as its own draft): its bytes are a segment of the host's bar, and the
    summary names it with its size; where it is left out, the summary says why."""
    from selenium.webdriver.common.by import By

    svc = service_factory(GGUF_DRAFT_MODEL=MODEL, GGUF_CONFIRM_LOADS="false", GGUF_CONTEXT_LENGTH="4096")
    svc.wait_ready()
    open_page(browser, svc.url)
    plan = svc.client.post("/api/dry-run", json={"model": MODEL, "cache_type": browser.find_element(
        By.ID, "cache-type").get_attribute("value")}).json()
    draft = plan["draft"]
    assert draft["name"] == MODEL and draft["device"] == "CPU"
    assert field(browser, "draft") == f"{MODEL} on CPU, {fmt(draft['total_mib'])} MiB"
    host = [d for d in plan["estimate"]["devices"] if d["device"] == "CPU"][0]
    seg = settled(lambda: browser.find_element(
        By.CSS_SELECTOR, '#bars figure.bar[data-device="CPU"] rect[data-kind="draft"]').get_attribute("data-mib"))
    assert seg == fmt(host["draft_model_mib"])


def test_a_vision_projector_is_drawn_on_its_device_and_named_in_the_summary(browser: Any, service_factory: Any,
                                                                             tmp_path: Any) -> None:
    """GGUF_MMPROJ (a tiny projector of the embedded model's width): its bytes are a segment of the host's bar and
    the summary names its type, device, size and tokens an image."""
    from selenium.webdriver.common.by import By

    from sizing.testing.projector_fixtures import TINY, write_projector

    path = write_projector(tmp_path / "mmproj-tiny.gguf", TINY)
    svc = service_factory(GGUF_MMPROJ=str(path), GGUF_CONFIRM_LOADS="false", GGUF_CONTEXT_LENGTH="4096")
    svc.wait_ready()
    open_page(browser, svc.url)
    plan = svc.client.post("/api/dry-run", json={"model": MODEL, "cache_type": browser.find_element(
        By.ID, "cache-type").get_attribute("value")}).json()
    pj = plan["projector"]
    assert pj["projector_type"] == "gemma3" and pj["device"] == "CPU"
    assert field(browser, "projector") == f"gemma3 on CPU, {fmt(pj['total_mib'])} MiB, 16 tokens an image"
    host = [d for d in plan["estimate"]["devices"] if d["device"] == "CPU"][0]
    seg = settled(lambda: browser.find_element(
        By.CSS_SELECTOR, '#bars figure.bar[data-device="CPU"] rect[data-kind="projector"]').get_attribute("data-mib"))
    assert seg == fmt(host["projector_mib"])
