"""Models from Hugging Face: downloaded through huggingface_hub into the models directory, with progress,
then served by name; offline, the files already there answer. The hub is a local server speaking its
resolve protocol (HEAD for ETag / X-Repo-Commit / size, then GET)."""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest


class _Hub(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    root: Path
    requests: list[str]

    def log_message(self, *args: object) -> None:
        pass

    def _file(self) -> Path | None:
        m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", self.path.split("?")[0])
        if not m:
            return None
        p = self.root / m.group(1) / m.group(3)
        return p if p.is_file() else None

    def _answer(self, body: bool) -> None:
        self.requests.append(f"{self.command} {self.path}")
        p = self._file()
        if p is None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(p.stat().st_size))
        self.send_header("ETag", '"' + hashlib.sha1(str(p).encode()).hexdigest() + '"')
        self.send_header("X-Repo-Commit", "0" * 40)
        self.end_headers()
        if body:
            with p.open("rb") as f:
                while chunk := f.read(1 << 20):
                    self.wfile.write(chunk)

    def do_HEAD(self) -> None:  # noqa: N802
        self._answer(False)

    def do_GET(self) -> None:  # noqa: N802
        self._answer(True)


@pytest.fixture
def hub(tmp_path: Path, embedded_model: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, list[str]]]:
    root = tmp_path / "hub"
    (root / "acme" / "tiny").mkdir(parents=True)
    os.link(embedded_model, root / "acme" / "tiny" / "gemma-tiny.gguf")
    (root / "acme" / "tiny" / "broken.gguf").write_bytes(b"NOT A GGUF" * 100)
    from sizing.testing.projector_fixtures import TINY, write_projector

    write_projector(root / "acme" / "tiny" / "mmproj-gemma-tiny-f32.gguf", TINY)
    (root / "acme" / "tiny" / "mmproj-broken.gguf").write_bytes(b"NOT A GGUF" * 100)
    handler = type("Hub", (_Hub,), {"root": root, "requests": []})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    monkeypatch.setenv("HF_ENDPOINT", url)
    try:
        yield url, handler.requests
    finally:
        httpd.shutdown()


def _wait(client: Any, name: str, timeout_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for d in client.get("/api/models").json()["downloads"]:
            if d["name"] == name and d["state"] != "downloading":
                return dict(d)
        time.sleep(0.05)
    raise TimeoutError(name)


@pytest.mark.slow
def test_pull_downloads_then_serves_by_name(fake_factory: Any, hub: tuple[str, list[str]],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    svc = fake_factory()
    r = svc.client.post("/api/models/pull", json={"repo_id": "acme/tiny", "filename": "gemma-tiny.gguf"})
    assert r.status_code == 202, r.text
    assert r.json()["state"] == "downloading"
    done = _wait(svc.client, "gemma-tiny")
    assert done["state"] == "done", done
    assert done["bytes_done"] == done["bytes_total"] == 253_113_024
    assert "gemma-tiny" in [m["id"] for m in svc.client.get("/v1/models").json()["data"]]
    r = svc.client.post("/api/models/load", json={"model": "gemma-tiny"})
    assert r.status_code == 200, r.text
    assert r.json()["name"] == "gemma-tiny"
    # Offline: the hub is not asked; the file already here answers.
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    asked = len(hub[1])
    r = svc.client.post("/api/models/pull", json={"repo_id": "acme/tiny", "filename": "gemma-tiny.gguf"})
    assert r.status_code == 202
    again = _wait(svc.client, "gemma-tiny")
    assert again["state"] == "done", again
    assert len(hub[1]) == asked


@pytest.mark.slow
def test_pull_failures_are_reported_not_served(fake_factory: Any, hub: tuple[str, list[str]]) -> None:
    svc = fake_factory()
    svc.client.post("/api/models/pull", json={"repo_id": "acme/tiny", "filename": "missing.gguf"})
    assert _wait(svc.client, "missing")["state"] == "failed"
    svc.client.post("/api/models/pull", json={"repo_id": "acme/tiny", "filename": "broken.gguf"})
    broken = _wait(svc.client, "broken")
    assert broken["state"] == "failed" and "GGUF" in broken["error"]
    assert "broken" not in [m["id"] for m in svc.client.get("/v1/models").json()["data"]]
    for bad in ({"repo_id": "acme/tiny", "filename": "../x.gguf"}, {"repo_id": "../x", "filename": "a.gguf"},
                {"repo_id": "acme/tiny", "filename": "a.bin"}):
        assert svc.client.post("/api/models/pull", json=bad).status_code == 400


@pytest.mark.slow
def test_a_pulled_projector_goes_beside_the_model_not_among_the_models(fake_factory: Any,
                                                                         hub: tuple[str, list[str]]) -> None:
    svc = fake_factory()
    svc.client.post("/api/models/pull", json={"repo_id": "acme/tiny", "filename": "gemma-tiny.gguf"})
    assert _wait(svc.client, "gemma-tiny")["state"] == "done"
    svc.client.post("/api/models/pull", json={"repo_id": "acme/tiny", "filename": "mmproj-gemma-tiny-f32.gguf"})
    assert _wait(svc.client, "mmproj-gemma-tiny-f32")["state"] == "done"
    svc.client.post("/api/models/pull", json={"repo_id": "acme/tiny", "filename": "mmproj-broken.gguf"})
    assert _wait(svc.client, "mmproj-broken")["state"] == "failed"
    assert not [m for m in svc.client.get("/v1/models").json()["data"] if "mmproj" in m["id"]]
    r = svc.client.post("/api/dry-run", json={"model": "gemma-tiny"})
    assert r.status_code == 200, r.text
    assert r.json()["projector"]["path"].endswith("mmproj-gemma-tiny-f32.gguf")  # found beside it (auto)
    r = svc.client.post("/api/dry-run", json={"model": "gemma-tiny", "mmproj": "/etc/passwd"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "mmproj"
    r = svc.client.post("/api/dry-run", json={"model": "gemma-tiny", "mmproj": ""})
    assert r.status_code == 200 and r.json()["projector"] is None
