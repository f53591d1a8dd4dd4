"""A local HTTP server posing as the Hugging Face hub, for pulls tested offline: huggingface_hub's resolve protocol
(HEAD for ETag, X-Repo-Commit and the size, then GET) and the file listing ``hf.co/OWNER/REPO:QUANT`` reads
(``GET /api/models/OWNER/REPO/tree/REVISION``), with the body sent at a bounded rate so that a test (or a browser)
sees a pull's progress move and can cancel it midway. Point HF_ENDPOINT at ``Hub.url``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

PIECE_BYTES = 1 << 20


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: "Hub"

    def log_message(self, *args: object) -> None:
        pass

    def _file(self) -> Path | None:
        m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", self.path.split("?")[0])
        if not m:
            return None
        p = self.hub.root / m.group(1) / m.group(3)
        return p if p.is_file() else None

    def _send(self, status: int, body: bytes = b"", content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _resolve(self, body: bool) -> None:
        self.hub.requests.append(f"{self.command} {self.path}")
        p = self._file()
        if p is None:
            self._send(404)
            return
        size = p.stat().st_size
        self.send_response(200)
        self.send_header("Content-Length", str(size))
        self.send_header("ETag", '"' + hashlib.sha1(str(p).encode()).hexdigest() + '"')
        self.send_header("X-Repo-Commit", "0" * 40)
        self.end_headers()
        if not body:
            return
        rate = self.hub.rate_bytes_per_s
        t0, sent = time.monotonic(), 0
        try:
            with p.open("rb") as f:
                while chunk := f.read(PIECE_BYTES):
                    self.wfile.write(chunk)
                    sent += len(chunk)
                    if rate:  # the next piece when the rate allows it
                        time.sleep(max(0.0, t0 + sent / rate - time.monotonic()))
        except (BrokenPipeError, ConnectionResetError):  # the client cancelled
            self.hub.aborted.append(p.name)

    def do_HEAD(self) -> None:  # noqa: N802
        self._resolve(False)

    def do_GET(self) -> None:  # noqa: N802
        m = re.match(r"^/api/models/([^/]+/[^/]+)/tree/[^/?]+", self.path)
        if m is None:
            self._resolve(True)
            return
        self.hub.requests.append(f"GET {self.path}")
        d = self.hub.root / m.group(1)
        if not d.is_dir():
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound")
            body = b'{"error": "Repository not found"}'
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        listing = [{"type": "file", "path": p.name, "size": p.stat().st_size, "oid": "0" * 40}
                   for p in sorted(d.iterdir())]
        self._send(200, json.dumps(listing).encode())


class Hub:
    """Files under ``root/OWNER/REPO/FILE``, served at ``url``; ``rate_bytes_per_s`` bounds each body (None: as fast
    as it goes). ``requests`` lists what was asked, ``aborted`` the files whose client left mid-body."""

    def __init__(self, root: Path, rate_bytes_per_s: float | None = None) -> None:
        self.root = root
        self.rate_bytes_per_s = rate_bytes_per_s
        self.requests: list[str] = []
        self.aborted: list[str] = []
        handler = type("HubHandler", (_Handler,), {"hub": self})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def add(self, repo_id: str, name: str, source: Path | None = None, size_bytes: int | None = None) -> Path:
        """A file of ``repo_id``: a hard link of ``source``, or a copy extended (sparse) to ``size_bytes``."""
        d = self.root / repo_id
        d.mkdir(parents=True, exist_ok=True)
        path = d / name
        if source is not None and size_bytes is None:
            path.hardlink_to(source)
        else:
            path.write_bytes(source.read_bytes() if source is not None else b"GGUF")
            if size_bytes is not None:
                with path.open("r+b") as f:
                    f.truncate(size_bytes)
        return path

    @contextlib.contextmanager
    def serving(self) -> Iterator["Hub"]:
        thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._httpd.shutdown()
            self._httpd.server_close()
