"""Models by name only: every way a client could point outside the models directory gets the same 404."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pytest

from service.errors import ModelNotFound
from service.catalog.models import Registry
from service.settings import Settings

from .conftest import FakeService
from service.api.errors import code_of, http_of

BAD_NAMES = [
    "../escape", "..", "/etc/passwd", "%2e%2e%2fescape", "%2e%2e", "..%2fescape", "a/b", "a\\b", "x\x00y", "good\x00",
    "", ".hidden", "escape", "fifo", "notgguf", "dir", "nonreg", "dangling", "loop", "inside-bin", "no-such-model",
    "good.gguf", "GOOD", "good ", " good", "good\n", "~root",
]


@pytest.fixture
def models_dir(tmp_path: Path, embedded_model: str) -> Path:
    """A models directory holding one good model and every kind of trap."""
    d = tmp_path / "models"
    d.mkdir()
    os.link(embedded_model, d / "good.gguf")
    outside = tmp_path / "outside"
    outside.mkdir()
    os.link(embedded_model, outside / "secret.gguf")  # a real GGUF, but outside the directory
    (d / "escape.gguf").symlink_to(outside / "secret.gguf")
    os.mkfifo(d / "fifo.gguf")
    (d / "notgguf.gguf").write_bytes(b"NOPE" + b"\0" * 60)
    (d / "dir.gguf").mkdir()
    (d / "nonreg.gguf").symlink_to("/dev/zero")
    (d / "dangling.gguf").symlink_to(d / "gone.gguf")
    (d / "loop.gguf").symlink_to(d / "loop.gguf")
    (d / "inside.bin").write_bytes(b"GGUF" + b"\0" * 60)
    (d / "inside-bin.gguf").symlink_to(d / "inside.bin")
    (d / "sub").mkdir()
    os.link(embedded_model, d / "sub" / "nested.gguf")
    (d / "via-sub.gguf").symlink_to(d / "sub" / "nested.gguf")  # a link that stays inside: allowed
    return d


@pytest.mark.timeout(30)
def test_registry_resolves_names_only(models_dir: Path) -> None:
    reg = Registry(Settings(models_dir=str(models_dir)))
    assert reg.resolve("good").path == str(models_dir / "good.gguf")
    assert reg.resolve("via-sub").path == str(models_dir / "sub" / "nested.gguf")
    for name in BAD_NAMES:
        with pytest.raises(ModelNotFound) as info:
            reg.resolve(name)
        assert http_of(info.value, "/v1/models").status == 404
        assert code_of(info.value, "/v1/models") == "model_not_found"
        assert info.value.message == f"The model '{name}' does not exist", "every refusal reads the same"
    listed = {e.name for e in reg.list() if e.origin == "models_dir"}
    assert listed == {"good", "via-sub"}, "the traps are not listed"


@pytest.mark.timeout(60)
def test_bad_names_are_404_over_http(fake_factory: Callable[..., FakeService], models_dir: Path) -> None:
    svc = fake_factory()
    # Point the running registry at the trap directory (its settings are frozen; the registry reads the dir per call).
    svc.app.state.manager.registry._dir = models_dir
    assert svc.client.post("/api/dry-run", json={"model": "good"}).status_code == 200
    for name in BAD_NAMES:
        for path, body in (("/v1/completions", {"model": name, "prompt": "x"}),
                           ("/v1/chat/completions", {"model": name, "messages": [{"role": "user", "content": "x"}]}),
                           ("/api/dry-run", {"model": name}),
                           ("/api/models/load", {"model": name})):
            r = svc.client.post(path, json=body)
            if name == "" and path == "/api/dry-run":  # an empty model means "none given" there: 400, never a file
                assert r.status_code == 400, r.text
                continue
            assert r.status_code == 404, (path, name, r.status_code, r.text[:200])
            assert r.json()["error"]["code"] == "model_not_found"
    for raw in ("..%2f..%2fetc%2fpasswd", "%2e%2e", "fifo", "escape", "good%00"):
        assert svc.client.get(f"/v1/models/{raw}").status_code == 404, raw
    # The service still answers after all of it (the FIFO blocked nothing).
    assert svc.client.get("/ready").status_code == 200
