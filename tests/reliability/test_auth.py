"""API keys: every route but the public list answers 401 without a key; keys from env and file; bind refusal."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

from service.api.errors import OLLAMA_PATHS
from service.api.security import PUBLIC_PATHS, is_loopback, key_matches, presented_key
from tests.conftest import ROOT

from .conftest import FakeService

KEYS = "first-key-0123456789,second-key-abcdef"


def _concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "x", path)


def all_routes(routes: list[Any], prefix: str = "") -> Iterator[tuple[str, set[str]]]:
    """(path, methods) of every HTTP route, through included routers (FastAPI nests them)."""
    for route in routes:
        if hasattr(route, "original_router"):
            yield from all_routes(route.original_router.routes, prefix + route.include_context.prefix)
        elif isinstance(getattr(route, "methods", None), (set, frozenset)):
            yield prefix + route.path, set(route.methods)
        else:
            raise AssertionError(f"a route this test does not know how to reach: {route!r}")


def test_every_route_outside_the_public_list_needs_a_key(fake_factory: Callable[..., FakeService]) -> None:
    svc = fake_factory(api_keys=KEYS)
    checked = 0
    public_seen = set()
    for route_path, methods in all_routes(svc.app.routes):
        path = _concrete(route_path)
        for method in sorted(methods):
            r = svc.client.request(method, path, json={} if method == "POST" else None)
            if route_path in PUBLIC_PATHS:
                public_seen.add(route_path)
                assert r.status_code != 401, (method, path)
                continue
            assert r.status_code == 401, (method, path, r.status_code, r.text[:200])
            assert r.headers["www-authenticate"] == "Bearer"
            if method == "HEAD":
                continue
            body = r.json()
            err = body["error"]
            if path.startswith("/v1/messages"):  # Anthropic's shape on its routes
                assert body["type"] == "error" and err["type"] == "authentication_error", body
            elif path in OLLAMA_PATHS:  # Ollama's shape on its routes: the message alone
                assert isinstance(err, str) and err, body
            else:
                assert (err["code"], err["type"]) == ("invalid_api_key", "authentication_error")
            checked += 1
    assert checked >= 12, "the walk reached the API routes"
    assert public_seen == PUBLIC_PATHS, "each public path is a real route"
    # Paths no route serves are not told apart from protected ones.
    assert svc.client.get("/no/such/route").status_code == 401
    assert svc.client.get("/docs").status_code == 401


def test_keys_by_bearer_or_x_api_key_any_of_several(fake_factory: Callable[..., FakeService]) -> None:
    svc = fake_factory(api_keys=KEYS)
    body = {"prompt": "one two", "max_tokens": 2, "seed": 1}
    for headers in ({"Authorization": "Bearer first-key-0123456789"}, {"authorization": "bearer second-key-abcdef"},
                    {"X-Api-Key": "second-key-abcdef"}):
        assert svc.client.post("/v1/completions", json=body, headers=headers).status_code == 200, headers
    for headers in ({"Authorization": "Bearer first-key-012345678"}, {"Authorization": "Basic first-key-0123456789"},
                    {"Authorization": "Bearer"}, {"X-Api-Key": "first-key-0123456789x"}, {}):
        r = svc.client.post("/v1/completions", json=body, headers=headers)
        assert r.status_code == 401, headers
    assert svc.client.get("/health").status_code == 200
    assert svc.client.get("/ready").status_code == 200
    assert svc.client.get("/").status_code == 200
    assert svc.client.get("/static/page.js").status_code == 200


def test_key_file_adds_keys_and_keys_never_reach_the_log(
    fake_factory: Callable[..., FakeService], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# comment\n\nfile-key-secret-1\n  file-key-secret-2  \n")
    caplog.set_level(logging.DEBUG, logger="service")
    caplog.set_level(logging.DEBUG, logger="uvicorn")
    svc = fake_factory(api_key_file=str(key_file), api_keys="env-key-secret")
    for key in ("file-key-secret-1", "file-key-secret-2", "env-key-secret"):
        assert svc.client.get("/v1/models", headers={"X-Api-Key": key}).status_code == 200, key
    r = svc.client.get("/v1/models", headers={"X-Api-Key": "wrong-key-secret", "User-Agent": "evil\x9b2J\xe9t\xe9".encode("latin-1")})
    assert r.status_code == 401
    text = "\n".join(rec.getMessage() for rec in caplog.records if rec.name.startswith(("service", "uvicorn")))
    assert "401 GET /v1/models" in text
    assert "evil\\x9b2J\xe9t\xe9" in text and "\x9b" not in text, "the user-agent's C1 control (CSI) is escaped"
    for secret in ("secret-1", "secret-2", "env-key-secret", "wrong-key-secret"):
        assert secret not in text


def test_no_keys_on_loopback_means_open(fake: FakeService) -> None:
    assert fake.client.get("/v1/models").status_code == 200


def _run_service(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("GGUF_")}
    full.update({"GGUF_DEFAULT_MODEL": "", "GGUF_PORT": "0", **env})
    return subprocess.run([sys.executable, "-m", "service"], cwd=ROOT, env=full, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.10", "example.com"])
def test_refuses_to_bind_beyond_loopback_without_keys(host: str) -> None:
    p = _run_service({"GGUF_HOST": host})
    assert p.returncode == 2
    assert f"refusing to bind {host}" in p.stderr and "GGUF_API_KEYS" in p.stderr


def test_refuses_an_unreadable_or_empty_key_file(tmp_path: Path) -> None:
    p = _run_service({"GGUF_HOST": "127.0.0.1", "GGUF_API_KEY_FILE": str(tmp_path / "missing")})
    assert p.returncode == 2 and "cannot be read" in p.stderr
    empty = tmp_path / "empty"
    empty.write_text("# no key here\n\n")
    p = _run_service({"GGUF_HOST": "0.0.0.0", "GGUF_API_KEY_FILE": str(empty)})
    assert p.returncode == 2 and "holds no key" in p.stderr


def test_binds_beyond_loopback_with_a_key(tmp_path: Path) -> None:
    """With a key the non-loopback bind goes ahead: the process serves /health (then we stop it)."""
    from tests.conftest import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGUF_")}
    env.update({"GGUF_DEFAULT_MODEL": "", "GGUF_HOST": "0.0.0.0", "GGUF_PORT": str(port), "GGUF_API_KEYS": "k-123"})
    proc = subprocess.Popen([sys.executable, "-m", "service"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import time

        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, "the service exited"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).status_code == 401
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"X-Api-Key": "k-123"}, timeout=5).status_code == 200
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def test_loopback_and_key_helpers() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "example.com", ""))
    keys = (b"aaaa", b"bbbb")
    assert key_matches(b"bbbb", keys) and not key_matches(b"bbb", keys) and not key_matches(b"", keys)
    assert presented_key([(b"Authorization", b"Bearer  tok ")]) == b"tok"
    assert presented_key([(b"authorization", b"Token tok")]) is None
    assert presented_key([(b"x-api-key", b"k")]) == b"k"


def test_esc_escapes_controls_and_truncates() -> None:
    from service.api.validation import esc

    assert esc("a\nb\r\x1b[2J\u2028") == "a\\x0ab\\x0d\\x1b[2J\\u2028"
    assert esc("x" * 500).endswith("...(truncated)") and len(esc("x" * 500)) == 200 + len("...(truncated)")
    assert esc("plain-model_name.1") == "plain-model_name.1"
