"""Request limits: body size while reading, CORS allow-list, caps on stop/logprobs, escaped request strings in logs."""

from __future__ import annotations

import logging
import socket
import time
from typing import Callable, Iterator

import pytest

from .conftest import FakeService

LIMIT = 4096


def _chunks(n: int, size: int) -> Iterator[bytes]:
    yield b'{"prompt": "'
    for _ in range(n):
        yield b"a" * size
    yield b'", "max_tokens": 1}'


def test_body_over_the_limit_is_413_by_content_length_and_while_streaming(fake_factory: Callable[..., FakeService]) -> None:
    svc = fake_factory(max_body_bytes=LIMIT)
    ok = svc.client.post("/v1/completions", json={"prompt": "a " * 100, "max_tokens": 1})
    assert ok.status_code == 200
    big = svc.client.post("/v1/completions", json={"prompt": "a" * (LIMIT + 1), "max_tokens": 1})
    assert big.status_code == 413
    assert big.json()["error"]["code"] == "payload_too_large"
    # Chunked: no Content-Length; refused once the bytes read pass the limit.
    streamed = svc.client.post("/v1/completions", content=_chunks(20, 1000), headers={"content-type": "application/json"})
    assert streamed.status_code == 413
    assert streamed.json()["error"]["type"] == "invalid_request_error"
    # A chunked body under the limit still works.
    small = svc.client.post("/v1/completions", content=_chunks(2, 1000), headers={"content-type": "application/json"})
    assert small.status_code == 200, small.text
    assert svc.client.post("/api/dry-run", json={"model": "x" * (LIMIT + 10)}).status_code == 413


def test_a_declared_huge_body_is_refused_before_it_is_sent(fake_factory: Callable[..., FakeService]) -> None:
    """Content-Length 10 GB, no body sent: the 413 arrives at once (nothing waits for, or buffers, the body)."""
    svc = fake_factory(max_body_bytes=LIMIT)
    host, port = svc.url.removeprefix("http://").split(":")
    t0 = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 10000000000\r\n\r\n{")
        reply = s.recv(4096)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:100]
    # Had the server waited for the body, recv would have timed out (5 s, raising); generous below that.
    assert time.monotonic() - t0 < 5


def test_cors_is_off_by_default(fake: FakeService) -> None:
    r = fake.client.options("/v1/models", headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "GET"})
    assert "access-control-allow-origin" not in r.headers
    r = fake.client.get("/v1/models", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers


def test_cors_allow_list_without_credentials(fake_factory: Callable[..., FakeService]) -> None:
    svc = fake_factory(cors_origins="https://app.example, http://localhost:3000", api_keys="k-1")
    pre = svc.client.options("/v1/chat/completions", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert pre.status_code == 200, "a preflight carries no key and must not need one"
    assert pre.headers["access-control-allow-origin"] == "https://app.example"
    assert "access-control-allow-credentials" not in pre.headers
    got = svc.client.get("/v1/models", headers={"Origin": "http://localhost:3000", "X-Api-Key": "k-1"})
    assert got.headers["access-control-allow-origin"] == "http://localhost:3000"
    other = svc.client.get("/v1/models", headers={"Origin": "https://evil.example", "X-Api-Key": "k-1"})
    assert "access-control-allow-origin" not in other.headers
    bad = svc.client.options("/v1/models", headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "GET"})
    assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers


def test_cors_star_never_with_credentials(fake_factory: Callable[..., FakeService]) -> None:
    svc = fake_factory(cors_origins="*")
    r = svc.client.get("/v1/models", headers={"Origin": "https://any.example"})
    assert r.headers["access-control-allow-origin"] == "*"
    assert "access-control-allow-credentials" not in r.headers


def test_a_malformed_cors_origin_is_refused() -> None:
    from service.api.app import create_app
    from service.api.security import ConfigurationError
    from service.settings import Settings

    with pytest.raises(ConfigurationError, match="not an origin"):
        create_app(Settings(cors_origins="https://ok.example,javascript:alert(1)", default_model=""))


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"prompt": "x", "max_tokens": 10**9}, "max_tokens"),
])
def test_request_caps(fake: FakeService, body: dict[str, object], param: str) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = fake.client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_request_strings_are_escaped_in_logs(fake_factory: Callable[..., FakeService], caplog: pytest.LogCaptureFixture) -> None:
    """A percent-encoded newline in the path (decoded by the server, logged with the 401) cannot forge a log line."""
    svc = fake_factory(api_keys="k-1")
    caplog.set_level(logging.INFO, logger="service")
    r = svc.client.get("/v1/models%0a2026-01-01 INFO service: FORGED%1b[2J")
    assert r.status_code == 401
    lines = [rec.getMessage() for rec in caplog.records if rec.name.startswith("service")]
    hit = [line for line in lines if "FORGED" in line]
    assert hit, lines
    assert all("\n" not in line and "\x1b" not in line for line in hit)
    assert "/v1/models\\x0a2026-01-01 INFO service: FORGED\\x1b[2J" in hit[0]
