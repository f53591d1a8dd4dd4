"""Image URLs and the threads that fetch them (issue 54), over real HTTP on the fake engine with a real image host on
127.0.0.1 that records each request and holds it until the test lets it answer.

What can break: an image fetched for a model that takes none (the refusal must come first, with no request to the
host, whichever API the image came in); slow image hosts holding the threads that decode inline images, so that a
chat with a 1x1 image waits behind them; fetches beyond ``GGUF_IMAGE_FETCHES`` or
``GGUF_IMAGE_FETCHES_PER_CLIENT`` waiting instead of a prompt 429 with Retry-After; a slot not given back when its
fetch ends."""

from __future__ import annotations

import base64
import concurrent.futures
import http.server
import io
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

import httpx
import pytest
from PIL import Image

from service.engine.base import EngineLimits
from service.testing.fake import FakeEngine
from tests.conftest import EMBEDDED_NAME
from tests.service.conftest import FakeService

HOLD_S = 60.0
"""How long the host holds a request at most: the test lets them answer long before."""
PROMPT_S = 10.0
"""What "at once" means for an answer here: far below the held fetches' HOLD_S and the fetch limit, far above
what the answer takes on a loaded 2-core machine."""


def _png(w: int = 1, h: int = 1) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (20, 200, 90)).save(buf, "PNG")
    return buf.getvalue()


class _Held(http.server.BaseHTTPRequestHandler):
    """Records the request, then holds it until ``release`` is set (at most ``HOLD_S``); then a 1x1 PNG."""

    host: "_Host"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.host.arrived()
        self.host.release.wait(HOLD_S)
        body = _png()
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@dataclass
class _Host:
    url: str
    release: threading.Event
    hits: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def arrived(self) -> None:
        with self.lock:
            self.hits += 1

    def wait_hits(self, n: int) -> None:
        deadline = time.monotonic() + PROMPT_S
        while self.hits < n and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.hits == n, f"{self.hits} requests reached the image host, not {n}"


@pytest.fixture
def image_host() -> Iterator[_Host]:
    host = _Host("", threading.Event())
    handler = type("Handler", (_Held,), {"host": host})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    host.url = f"http://127.0.0.1:{server.server_address[1]}/cat.png"
    try:
        yield host
    finally:
        host.release.set()
        server.shutdown()
        server.server_close()


class SeeingFake(FakeEngine):
    """The fake engine as a model loaded with a vision projector (``EngineLimits.images``); its prompt is the
    messages' text, images included as they print."""

    @property
    def limits(self) -> EngineLimits:
        return replace(super().limits, images=True) if self.n_ctx else super().limits


def _image(url: str) -> list[dict[str, Any]]:
    return [{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": url}}]


def _chat(base: str, content: Any, key: str | None = None, timeout: float = PROMPT_S) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", timeout=timeout,
                      headers={"Authorization": f"Bearer {key}"} if key else {},
                      json={"model": EMBEDDED_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": content}]})


def test_an_image_url_to_a_model_without_a_projector_is_refused_before_it_is_fetched(
        fake_factory: Callable[..., FakeService], image_host: _Host) -> None:
    svc = fake_factory(image_url_hosts="127.0.0.1")
    assert not svc.engine.limits.images
    image_host.release.set()  # the host answers at once: a fetch would be seen, not waited for
    r = _chat(svc.url, _image(image_host.url))
    assert r.status_code == 400, r.text
    assert "takes no images" in r.json()["error"]["message"] and r.json()["error"]["param"] == "messages[0].content[1]"
    # Each API's images, converted to image parts by its adapter, meet the same check first.
    anthropic = {"model": EMBEDDED_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": image_host.url}}, {"type": "text", "text": "x"}]}]}
    for path, body in [
        ("/v1/messages", anthropic),
        ("/v1/messages/count_tokens", {k: v for k, v in anthropic.items() if k != "max_tokens"}),
        ("/v1/responses", {"model": EMBEDDED_NAME, "max_output_tokens": 2, "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "x"}, {"type": "input_image", "image_url": image_host.url}]}]}),
        ("/v1/chat/completions/render", {"model": EMBEDDED_NAME, "messages": [
            {"role": "user", "content": _image(image_host.url)}]}),
    ]:
        r = svc.client.post(path, json=body)
        assert r.status_code == 400 and "takes no images" in r.text, (path, r.text)
    assert image_host.hits == 0  # no request reached the image host
    assert _chat(svc.url, "Hi").status_code == 200


def test_every_image_of_a_request_is_checked_before_the_first_is_fetched(
        fake_factory: Callable[..., FakeService], image_host: _Host) -> None:
    svc = fake_factory(engine=SeeingFake(), image_url_hosts="127.0.0.1", images_per_request=2)
    image_host.release.set()
    listed, unlisted = image_host.url, image_host.url.replace("127.0.0.1", "127.0.0.2")
    three = [*_image(listed), *_image(listed)[1:], *_image(listed)[1:]]
    r = _chat(svc.url, three)
    assert r.status_code == 400 and "more than 2 images" in r.text and "content[3]" in r.json()["error"]["param"]
    r = _chat(svc.url, [*_image(listed), *_image(unlisted)[1:]])
    assert r.status_code == 400 and "GGUF_IMAGE_URL_HOSTS" in r.text and "content[2]" in r.json()["error"]["param"]
    assert image_host.hits == 0
    r = _chat(svc.url, [*_image(listed), *_image(listed)[1:]])  # the same host, once both are allowed: fetched
    assert r.status_code == 200 and image_host.hits == 2, r.text


def _default_threads() -> int:
    """How many threads asyncio's default executor has (``concurrent.futures.ThreadPoolExecutor``'s default)."""
    cpus = os.process_cpu_count() if hasattr(os, "process_cpu_count") else os.cpu_count()  # 3.13 counts affinity
    return min(32, (cpus or 1) + 4)


def test_slow_image_hosts_neither_delay_inline_images_nor_wait_beyond_their_limits(
        fake_factory: Callable[..., FakeService], image_host: _Host) -> None:
    # As many fetches at once as asyncio's default executor has threads: fetched there, they would hold them all.
    n = _default_threads()
    keys = [f"key-{i}" for i in range(n + 8)]
    svc = fake_factory(engine=SeeingFake(), image_url_hosts="127.0.0.1", image_fetches=n, image_fetches_per_client=2,
                       remote_timeout_s=HOLD_S, api_keys=",".join(keys))
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2 * n + 16)
    held: list[concurrent.futures.Future[httpx.Response]] = []

    def send(key: str) -> concurrent.futures.Future[httpx.Response]:
        return pool.submit(_chat, svc.url, _image(image_host.url), key, HOLD_S + 30)

    def refused(r: httpx.Response, setting: str) -> None:
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "queue_full" and setting in r.json()["error"]["message"], r.text
        assert int(r.headers["retry-after"]) >= 1

    try:
        # One client: its first two are fetched (and held), its third refused at once.
        first = [send(keys[0]) for _ in range(3)]
        done, waiting = concurrent.futures.wait(first, timeout=PROMPT_S, return_when=concurrent.futures.FIRST_COMPLETED)
        assert len(done) == 1, "a fetch beyond the client's limit waited"
        refused(done.pop().result(), "GGUF_IMAGE_FETCHES_PER_CLIENT")
        held += waiting
        image_host.wait_hits(2)
        # Other clients take the server's other slots; every fetch after them is refused at once, whoever asks.
        others = iter(keys[1:])
        while len(held) < n:
            key = next(others)
            held += [send(key) for _ in range(min(2, n - len(held)))]
        image_host.wait_hits(n)
        flood = [send(key) for key in [next(others) for _ in range(4)] for _ in range(3)]
        for f in concurrent.futures.as_completed(flood, timeout=PROMPT_S):
            refused(f.result(), "(GGUF_IMAGE_FETCHES)")
        assert image_host.hits == n and not any(f.done() for f in held)
        # Meanwhile an inline image is decoded and answered at once, as is a chat without one.
        inline = _chat(svc.url, _image("data:image/png;base64," + base64.b64encode(_png()).decode()), keys[0])
        assert inline.status_code == 200 and inline.json()["usage"]["prompt_tokens"] > 0, inline.text
        assert _chat(svc.url, "Hi", keys[0]).status_code == 200
        # The held fetches answer: each request is answered with its image, and the slots are free again.
        image_host.release.set()
        for f in held:
            assert f.result(timeout=PROMPT_S).status_code == 200
        again = [send(keys[0]), send(keys[0])]
        assert [f.result(timeout=PROMPT_S).status_code for f in again] == [200, 200]
    finally:
        image_host.release.set()
        pool.shutdown(wait=True, cancel_futures=True)
