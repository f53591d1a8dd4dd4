"""Fixtures for the GGUF probe tests: small GGUFs written by ``gguf.GGUFWriter``,
hostile headers built byte by byte, and a local HTTP server with Range support."""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator, Sequence

import gguf
import numpy as np
import pytest

from sizing.testing.fixtures import add_key

# ---------------------------------------------------------------- GGUFWriter models


def write_model(
    path: Path,
    *,
    arch: str = "llama",
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int | Sequence[int] = 2,
    n_vocab: int = 32,
    extra: dict[str, object] | None = None,
    split_max_tensors: int = 0,
) -> list[Path]:
    """A tiny model with real tensor data; returns the files written (shards if split)."""
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    w.add_context_length(256)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_head_count(n_head)
    w.add_head_count_kv(list(n_head_kv) if not isinstance(n_head_kv, int) else n_head_kv)  # type: ignore[arg-type]
    w.add_feed_forward_length(2 * n_embd)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"tok{i}".encode() for i in range(n_vocab)])
    w.add_token_scores([0.0] * n_vocab)
    for key, value in (extra or {}).items():
        add_key(w, key, value)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((n_vocab, n_embd)).astype(np.float16))
    for il in range(n_layer):
        w.add_tensor(f"blk.{il}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(f"blk.{il}.attn_q.weight", rng.standard_normal((n_embd, n_embd)).astype(np.float16))
        w.add_tensor(f"blk.{il}.ffn_up.weight", rng.standard_normal((2 * n_embd, n_embd)).astype(np.float16))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.add_tensor("output.weight", rng.standard_normal((n_vocab, n_embd)).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if split_max_tensors:
        return sorted(path.parent.glob(f"{path.stem}-*-of-*.gguf"))
    return [path]


@pytest.fixture
def small_model(tmp_path: Path) -> Path:
    return write_model(tmp_path / "small.gguf")[0]


@pytest.fixture(scope="session")
def big_vocab_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model whose header (a 60,000-token vocabulary, about 1 MB) dwarfs the first window."""
    path = tmp_path_factory.mktemp("big") / "bigvocab.gguf"
    return write_model(path, n_vocab=60_000, n_embd=64)[0]


# ---------------------------------------------------------------- byte-level headers


# ---------------------------------------------------------------- HTTP range server


@dataclass
class RangeServer:
    base_url: str
    root: Path
    bytes_sent: int = 0
    requests: list[str] = field(default_factory=list)
    authorizations: list[str] = field(default_factory=list)
    ignore_range: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def url(self, name: str) -> str:
        return f"{self.base_url}/{name}"

    def reset(self) -> None:
        with self.lock:
            self.bytes_sent = 0
            self.requests.clear()


_RANGE_RE = re.compile(r"^bytes=(\d+)-(\d*)$")


def _handler(state: RangeServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # quiet
            pass

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            name = self.path.split("?", 1)[0].lstrip("/")
            path = state.root / name
            rng = self.headers.get("Range", "")
            with state.lock:
                state.requests.append(f"{name} {rng}")
                state.authorizations.append(self.headers.get("Authorization", ""))
            if ".." in name.split("/") or not path.is_file():
                self._send(404, b"not found")
                return
            size = path.stat().st_size
            m = _RANGE_RE.match(rng)
            if state.ignore_range or not m:
                # Tell the client the size, then stream only what it reads before closing.
                self.send_response(200)
                self.send_header("Content-Length", str(size))
                self.end_headers()
                with open(path, "rb") as f:
                    self._copy(f, size)
                return
            start = int(m.group(1))
            end = min(int(m.group(2)) if m.group(2) else size - 1, size - 1)
            if start >= size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
            self.send_header("Content-Length", str(end - start + 1))
            self.end_headers()
            with open(path, "rb") as f:
                f.seek(start)
                self._copy(f, end - start + 1)

        def _copy(self, f: object, n: int) -> None:
            left = n
            try:
                while left:
                    chunk = f.read(min(left, 1 << 16))  # type: ignore[attr-defined]
                    if not chunk:
                        break
                    self.wfile.write(chunk)
                    with state.lock:
                        state.bytes_sent += len(chunk)
                    left -= len(chunk)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True

        def _send(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client closing early (the no-Range test) is expected


@pytest.fixture
def range_server(tmp_path: Path) -> Iterator[RangeServer]:
    root = tmp_path / "served"
    root.mkdir()
    state = RangeServer(base_url="", root=root)
    httpd = _QuietServer(("127.0.0.1", 0), _handler(state))
    httpd.daemon_threads = True
    state.base_url = f"http://127.0.0.1:{httpd.server_address[1]}"
    t = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        yield state
    finally:
        httpd.shutdown()
        httpd.server_close()
        t.join(timeout=5)


def link_into(server: RangeServer, *paths: Path, under: str = "") -> None:
    """Serve files by hard link (or copy) from the server's root (or a folder ``under`` it)."""
    folder = server.root / under
    folder.mkdir(parents=True, exist_ok=True)
    for p in paths:
        dst = folder / p.name
        try:
            os.link(p, dst)
        except OSError:
            dst.write_bytes(p.read_bytes())
