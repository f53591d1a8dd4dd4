"""The page over plain HTTP (in process, no model, no browser): headers, content types, no inline script."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from typing import Iterator

import pytest
from fastapi.testclient import TestClient

from service.api.app import create_app
from service.api.page import CONTENT_SECURITY_POLICY, STATIC_DIR
from service.settings import Settings

CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
)


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    # No ``with``: the lifespan (which would load a model) does not run; the page needs none.
    yield TestClient(create_app(Settings(default_model="")))


def assert_page_headers(headers: object) -> None:
    h = headers  # httpx.Headers
    assert h["content-security-policy"] == CSP  # type: ignore[index]
    assert h["x-content-type-options"] == "nosniff"  # type: ignore[index]
    assert h["referrer-policy"] == "no-referrer"  # type: ignore[index]


class PageParser(HTMLParser):
    """Collects what a strict CSP would block: inline script, handlers, style attributes and elements."""

    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[dict[str, str | None]] = []
        self.script_text: list[str] = []
        self.in_script = False
        self.handlers: list[tuple[str, str]] = []
        self.style_attrs: list[str] = []
        self.style_elements = 0
        self.stylesheets: list[str] = []
        self.js_urls: list[str] = []
        self.ids: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        for name, value in attrs:
            if name.startswith("on"):
                self.handlers.append((tag, name))
            if name == "style":
                self.style_attrs.append(tag)
            if value and value.strip().lower().startswith("javascript:"):
                self.js_urls.append(f"{tag} {name}")
            if name == "id" and value:
                self.ids.append(value)
        if tag == "script":
            self.scripts.append(a)
            self.in_script = True
        if tag == "style":
            self.style_elements += 1
        if tag == "link" and a.get("rel") == "stylesheet" and a.get("href"):
            self.stylesheets.append(a["href"] or "")

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self.in_script = False

    def handle_data(self, data: str) -> None:
        if self.in_script and data.strip():
            self.script_text.append(data)


def parse_page(html: str) -> PageParser:
    p = PageParser()
    p.feed(html)
    p.close()
    return p


def test_the_policy_is_the_one_the_issue_asks_for() -> None:
    assert CONTENT_SECURITY_POLICY == CSP


def test_get_root_returns_the_page_with_its_security_headers(client: TestClient) -> None:
    r = client.get("/")
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/html; charset=utf-8"
    assert_page_headers(r.headers)
    assert "<title>GGUF fit: the plan, drawn to scale</title>" in r.text
    assert r.text == (STATIC_DIR / "index.html").read_text()


def test_head_root_answers_with_headers_and_no_body(client: TestClient) -> None:
    r = client.head("/")
    assert r.status_code == 200
    assert_page_headers(r.headers)
    assert r.content == b""


SCRIPTS = ("common.js", "page.js", "models.js", "chat.js")


@pytest.mark.parametrize(
    ("path", "media_type"),
    [*((f"/static/{js}", "text/javascript; charset=utf-8") for js in SCRIPTS),
     ("/static/page.css", "text/css; charset=utf-8")],
)
def test_static_assets_are_served_with_their_content_type(client: TestClient, path: str, media_type: str) -> None:
    r = client.get(path)
    assert r.status_code == 200
    assert r.headers["content-type"] == media_type
    assert_page_headers(r.headers)
    assert r.content == (STATIC_DIR / path.rsplit("/", 1)[1]).read_bytes()
    assert len(r.content) < 64 * 1024, "small and fast: no bundled framework"


@pytest.mark.parametrize("path", ["/static/index.html", "/static/../api/page.py", "/static/nope.js", "/static/"])
def test_only_the_named_assets_are_served(client: TestClient, path: str) -> None:
    r = client.get(path)
    assert r.status_code == 404
    assert r.headers["content-type"].startswith("application/json")


def test_the_api_does_not_get_the_page_headers(client: TestClient) -> None:
    r = client.get("/health")
    assert r.status_code == 200
    for name in ("content-security-policy", "x-content-type-options", "referrer-policy"):
        assert name not in r.headers


def test_the_html_has_no_inline_script_handler_or_style(client: TestClient) -> None:
    page = parse_page(client.get("/").text)
    assert page.scripts == [{"src": f"/static/{js}", "defer": None} for js in SCRIPTS]
    assert page.script_text == []
    assert page.handlers == []
    assert page.style_attrs == []
    assert page.style_elements == 0
    assert page.js_urls == []
    assert page.stylesheets == ["/static/page.css"]
    assert len(page.ids) == len(set(page.ids)), "duplicate ids"


def test_every_asset_the_page_names_is_same_origin_and_served(client: TestClient) -> None:
    html = client.get("/").text
    urls = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert urls, "the page names its script and stylesheet"
    for url in urls:
        if url.startswith("#") or url == "data:,":
            continue
        assert url.startswith("/") and not url.startswith("//"), f"{url} is not same-origin"
        assert client.get(url).status_code == 200, url


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_scripts_need_nothing_the_policy_forbids(name: str) -> None:
    """No markup is ever parsed from a string (the chat's Markdown included: elements and text nodes only), no code
    from a string, no other origin."""
    js = (STATIC_DIR / name).read_text()
    for forbidden in ("eval(", "new Function", "innerHTML", "outerHTML", "insertAdjacentHTML", "document.write",
                      "DOMParser", "createContextualFragment", "srcdoc", 'setAttribute("style"', "setTimeout(\"",
                      "http://", "https://"):
        assert forbidden not in js.replace("http://www.w3.org/2000/svg", ""), forbidden
    # Every element the script looks up by id is in the page.
    html_ids = set(parse_page((STATIC_DIR / "index.html").read_text()).ids)
    wanted = set(re.findall(r'\$\("([\w-]+)"\)', js))
    assert wanted <= html_ids, sorted(wanted - html_ids)
    assert wanted or name == "common.js"


def test_the_stylesheet_loads_nothing_from_elsewhere() -> None:
    css = (STATIC_DIR / "page.css").read_text()
    assert "@import" not in css
    for url in re.findall(r"url\(([^)]*)\)", css):
        assert url.startswith("#"), f"stylesheet reaches for {url}"
    assert ":focus-visible" in css, "keyboard focus must be visible"
