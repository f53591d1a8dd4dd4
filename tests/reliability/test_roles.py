"""Roles (issue 54): with keys set, only an admin key manages models; an ordinary key infers and reads, and what it
sends never unloads, shortens or reveals what another key relies on. With no key set, the local user does everything.

The fake engine serves here (the gates and the residency are what is tested); tests/reliability/test_tenants.py
does the same against a real runner and llama.cpp.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import pytest

from service.api.security import ADMIN_PATHS, PUBLIC_PATHS, Keys, load_keys
from service.keepalive import granted_keep_alive
from service.settings import Settings

from .conftest import FakeService
from .test_auth import _concrete, all_routes

USER = "user-key-0123456789"
OTHER = "other-user-key-abcdef"
ADMIN = "admin-key-fedcba9876"
ORDINARY_PATHS = frozenset({
    # Inference, and reading what is served
    "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/models", "/v1/models/{name}", "/v1/messages",
    "/v1/messages/count_tokens", "/v1/responses", "/v1/responses/input_tokens", "/v1/responses/{response_id}",
    "/v1/responses/{response_id}/input_items", "/v1/completions/render", "/v1/chat/completions/render",
    "/v1/rerank", "/rerank", "/reranking", "/v1/reranking", "/infill", "/tokenize", "/detokenize", "/apply-template",
    "/api/chat", "/api/generate", "/api/tags", "/api/version", "/api/ps", "/api/show", "/api/embed",
    "/api/embeddings", "/metrics",
    # Planning reads (the page's): what a load would do, which files a repository has; nothing is loaded or fetched
    "/api/dry-run", "/api/models", "/api/hf/files",
    # FastAPI's own: the API's schema and its viewers
    "/docs", "/docs/oauth2-redirect", "/openapi.json", "/redoc",
})
"""Every route an ordinary key may use. A route added later must be put here or in ``ADMIN_PATHS`` (this test fails
until it is): nobody decides a management route's role by forgetting it."""
H_USER = {"Authorization": f"Bearer {USER}"}
H_OTHER = {"Authorization": f"Bearer {OTHER}"}
H_ADMIN = {"Authorization": f"Bearer {ADMIN}"}


def _keyed(fake_factory: Callable[..., FakeService], **kw: Any) -> FakeService:
    return fake_factory(api_keys=f"{USER},{OTHER}", admin_keys=ADMIN, **kw)


def _loaded(svc: FakeService) -> list[str]:
    return [m["name"] for m in svc.client.get("/api/models", headers=H_ADMIN).json()["models"]
            if m["state"] == "loaded"]


def test_every_route_has_a_role(fake_factory: Callable[..., FakeService]) -> None:
    svc = _keyed(fake_factory)
    routes = {path for path, _ in all_routes(svc.app.routes)}
    unplaced = routes - PUBLIC_PATHS - ADMIN_PATHS - ORDINARY_PATHS
    assert not unplaced, f"routes with no role: put each in ADMIN_PATHS or the ordinary list: {sorted(unplaced)}"
    assert ADMIN_PATHS <= routes and ORDINARY_PATHS <= routes, "each listed path is a real route"
    for route_path, methods in all_routes(svc.app.routes):
        path = _concrete(route_path)
        for method in sorted(methods - {"HEAD"}):
            if route_path in ADMIN_PATHS:
                r = svc.client.request(method, path, json={}, headers=H_USER)
                assert r.status_code == 403, (method, path, r.status_code, r.text[:200])
                err = r.json()["error"]
                text = err if isinstance(err, str) else err["message"]
                assert "admin key" in text, r.text
                if not isinstance(err, str):
                    assert (err["type"], err["code"]) == ("permission_error", "permission_denied")
            elif route_path in ORDINARY_PATHS:
                r = svc.client.request(method, path, json={} if method in ("POST", "DELETE") else None,
                                       headers=H_USER)
                assert r.status_code not in (401, 403), (method, path, r.status_code, r.text[:200])


def test_an_ordinary_key_cannot_manage_models_and_the_model_serves_every_key(
        fake_factory: Callable[..., FakeService]) -> None:
    svc = _keyed(fake_factory)
    (name,) = _loaded(svc)
    body = {"prompt": "one two", "max_tokens": 2}
    for method, path, payload in (("POST", "/api/models/unload", {}), ("POST", "/api/models/unload", {"model": name}),
                                  ("POST", "/api/models/load", {"model": name}),
                                  ("POST", "/api/models/pull", {"repo_id": "a/b", "filename": "x.gguf"}),
                                  ("POST", "/api/pull", {"model": "hf.co/a/b"}),
                                  ("DELETE", "/api/delete", {"model": name}), ("GET", "/api/kv-cache", None)):
        r = svc.client.request(method, path, json=payload, headers=H_USER)
        assert r.status_code == 403, (path, r.status_code, r.text)
    assert _loaded(svc) == [name]
    for h in (H_USER, H_OTHER, H_ADMIN):
        assert svc.client.post("/v1/completions", json=body, headers=h).status_code == 200
    # The admin key manages: unloads, and the next request brings the default model back (loaded at start).
    r = svc.client.post("/api/models/unload", json={}, headers=H_ADMIN)
    assert r.status_code == 200 and r.json()["models"] == [name], r.text
    assert _loaded(svc) == []
    assert svc.client.post("/v1/completions", json=body, headers=H_OTHER).status_code == 200
    assert _loaded(svc) == [name]


@pytest.mark.parametrize("api", ["completions", "chat", "ollama"])
@pytest.mark.parametrize("value", [0, "0", "0s", "1ns"])
def test_an_ordinary_keys_keep_alive_zero_does_not_unload(fake_factory: Callable[..., FakeService], api: str,
                                                          value: Any) -> None:
    svc = _keyed(fake_factory)
    (name,) = _loaded(svc)
    path, body = {
        "completions": ("/v1/completions", {"prompt": "one two", "max_tokens": 2}),
        "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        "ollama": ("/api/generate", {"model": name, "prompt": "one two", "stream": False,
                                     "options": {"num_predict": 2}}),
    }[api]
    r = svc.client.post(path, json={**body, "keep_alive": value}, headers=H_USER)
    assert r.status_code == 200, r.text
    time.sleep(0.5)
    assert _loaded(svc) == [name], "an ordinary key's keep_alive 0 unloaded the model"
    assert svc.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=H_OTHER).status_code == 200


def test_an_ollama_unload_request_is_an_admins(fake_factory: Callable[..., FakeService]) -> None:
    svc = _keyed(fake_factory)
    (name,) = _loaded(svc)
    r = svc.client.post("/api/generate", json={"model": name, "keep_alive": 0}, headers=H_USER)
    assert r.status_code == 403 and "admin key" in r.json()["error"], r.text
    assert _loaded(svc) == [name]
    r = svc.client.post("/api/generate", json={"model": name, "keep_alive": 0}, headers=H_ADMIN)
    assert r.status_code == 200 and r.json()["done_reason"] == "unload", r.text
    assert _loaded(svc) == []


def test_ollama_semantics_for_everyone_when_the_operator_says_so(fake_factory: Callable[..., FakeService]) -> None:
    svc = _keyed(fake_factory, keep_alive_policy="ollama")
    (name,) = _loaded(svc)
    r = svc.client.post("/v1/completions", json={"prompt": "one", "max_tokens": 1, "keep_alive": 0}, headers=H_USER)
    assert r.status_code == 200
    deadline = time.monotonic() + 5
    while _loaded(svc) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _loaded(svc) == [], "keep_alive 0 unloads under the ollama policy"
    # A model loaded at start is never left unavailable: the next request of any key loads it again.
    r = svc.client.post("/v1/completions", json={"prompt": "one", "max_tokens": 1}, headers=H_OTHER)
    assert r.status_code == 200, r.text
    assert _loaded(svc) == [name]


def test_a_request_without_keep_alive_puts_the_configured_one_back(fake_factory: Callable[..., FakeService]) -> None:
    svc = _keyed(fake_factory, keep_alive="60s")  # long enough that a loaded machine's pauses do not let it expire
    (name,) = _loaded(svc)
    body = {"prompt": "one", "max_tokens": 1}
    assert svc.client.post("/v1/completions", json={**body, "keep_alive": "1h"}, headers=H_USER).status_code == 200
    model = next(m for m in svc.client.get("/api/models", headers=H_ADMIN).json()["models"] if m["name"] == name)
    assert model["expires_in_s"] > 3000, "an ordinary key may lengthen the stay"
    assert svc.client.post("/v1/completions", json=body, headers=H_OTHER).status_code == 200
    model = next(m for m in svc.client.get("/api/models", headers=H_ADMIN).json()["models"] if m["name"] == name)
    assert model["expires_in_s"] is not None and model["expires_in_s"] <= 60.0, model


def test_no_host_path_reaches_an_ordinary_key(fake_factory: Callable[..., FakeService], tmp_path: Path) -> None:
    cache = tmp_path / "prompt-cache-folder"
    svc = _keyed(fake_factory, prompt_cache_dir=str(cache))
    (name,) = _loaded(svc)
    as_user = svc.client.get("/api/models", headers=H_USER).text
    as_admin = svc.client.get("/api/models", headers=H_ADMIN).text
    assert str(cache) in as_admin, "admins see the prompt cache's folder (docs/api.md)"
    assert str(tmp_path) not in as_user and "/root/" not in as_user and "/tmp/" not in as_user, as_user[:2000]
    dry = svc.client.post("/api/dry-run", json={"model": name}, headers=H_USER)
    assert dry.status_code == 200 and "/tmp/" not in dry.text and "/root/" not in dry.text, dry.text[:2000]
    # A failed load's message names the file, not where it lies: here a corrupt GGUF in the models directory.
    models_dir = Path(svc.app.state.settings.models_dir)
    (models_dir / "broken.gguf").write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    r = svc.client.post("/api/models/load", json={"model": "broken"}, headers=H_ADMIN)
    assert r.status_code >= 400 and "broken.gguf" in r.text, r.text
    assert str(models_dir) not in r.text and "/tmp/" not in r.text, r.text


def test_keys_and_roles_from_the_file(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# keys\nplain-key\nuser-key user\nboss-key admin\n")
    keys = load_keys(Settings(api_key_file=str(key_file), admin_keys="env-admin", api_keys="env-user"))
    assert set(keys.all) == {b"plain-key", b"user-key", b"boss-key", b"env-admin", b"env-user"}
    assert set(keys.admin) == {b"boss-key", b"env-admin"}
    key_file.write_text("boss-key root\n")
    from service.api.security import ConfigurationError

    with pytest.raises(ConfigurationError, match="line 1") as info:
        load_keys(Settings(api_key_file=str(key_file)))
    assert "boss-key" not in str(info.value), "a key never reaches a message"
    assert not Keys()


def test_granted_keep_alive() -> None:
    assert granted_keep_alive(None, 300, may_shorten=False) is None
    assert granted_keep_alive(0, 300, may_shorten=False) is None
    assert granted_keep_alive(299, 300, may_shorten=False) is None
    assert granted_keep_alive(3600, 300, may_shorten=False) == 3600
    assert granted_keep_alive(float("inf"), 300, may_shorten=False) == float("inf")
    assert granted_keep_alive(0, 300, may_shorten=True) == 0
