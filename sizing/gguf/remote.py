"""Probing a GGUF over HTTP(S): range requests for the header, never the weights.

``probe_url`` reads any http(s) URL that honours ``Range``; ``probe_hf``
resolves a Hugging Face ``repo_id`` + ``filename`` with ``hf_hub_url`` (the
``HF_ENDPOINT`` environment variable, read at call time, picks the hub) and
sends the token ``huggingface_hub`` would send (``token`` argument, else
``HF_TOKEN`` or the stored login, via ``huggingface_hub.get_token``).

The header is fetched in growing windows (see ``sizing.gguf.reader._Cursor.grow``):
each window is at least a lower bound of the bytes still needed and at most
1/16 more than what is already held, so the bytes transferred stay within a
few percent of the header's size. httpx errors become ``RemoteError`` here,
at the boundary.
"""

from __future__ import annotations

import os
import re
from typing import Mapping
from urllib.parse import urlsplit, urlunsplit

import httpx

from ..errors import ProbeError, RemoteError, ShardError
from ..spec import ModelSource, ModelSpec
from .probe import _SPLIT_RE, read_header, spec_from_headers
from .reader import GGUFHeader, MIN_WINDOW_BYTES

DEFAULT_TIMEOUT_S = 30.0
_CONTENT_RANGE_RE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


class RangeSource:
    """One remote file, read with ``Range: bytes=a-b`` requests over a shared client.

    The first request (``initial_bytes`` from offset 0) also learns the file's
    size from ``Content-Range``. ``bytes_fetched`` counts the body bytes received.
    """

    def __init__(self, url: str, client: httpx.Client, *, initial_bytes: int = MIN_WINDOW_BYTES) -> None:
        self._url = url
        self._client = client
        self.bytes_fetched = 0
        self.requests = 0
        self._first, self._size = self._request(0, max(1, initial_bytes))

    @property
    def name(self) -> str:
        return self._url

    @property
    def size(self) -> int:
        return self._size

    def fetch(self, offset: int, length: int) -> bytes:
        length = max(0, min(length, self._size - offset))
        if length == 0:
            return b""
        if offset + length <= len(self._first):
            return self._first[offset : offset + length]
        data, _ = self._request(offset, length)
        return data

    def _request(self, offset: int, length: int) -> tuple[bytes, int]:
        """GET ``length`` bytes at ``offset``; returns them and the file's total size."""
        headers = {"Range": f"bytes={offset}-{offset + length - 1}", "Accept-Encoding": "identity"}
        self.requests += 1
        try:
            with self._client.stream("GET", self._url, headers=headers) as resp:
                if resp.status_code == 416:
                    # Range past the end: only an empty file answers this to bytes=0-.
                    return b"", 0
                if resp.status_code == 200:
                    return self._whole_body(resp, offset, length)
                if resp.status_code != 206:
                    raise RemoteError(
                        f"HTTP {resp.status_code} for a range request", status=resp.status_code, source=self._url
                    )
                total = self._total_from(resp.headers.get("content-range", ""), offset)
                data = self._read(resp, min(length, total - offset))
        except httpx.HTTPError as exc:
            raise RemoteError(f"{type(exc).__name__}: {exc}", source=self._url) from exc
        return data, total

    def _whole_body(self, resp: httpx.Response, offset: int, length: int) -> tuple[bytes, int]:
        # The server ignored Range. Accept a body no larger than the window asked for
        # (a small file); refuse a large one rather than download the weights.
        try:
            total = int(resp.headers.get("content-length", ""))
        except ValueError:
            total = -1
        if offset != 0 or total < 0 or total > length:
            raise RemoteError("server ignores Range requests; refusing to download the whole file", source=self._url)
        return self._read(resp, total), total

    def _total_from(self, content_range: str, offset: int) -> int:
        m = _CONTENT_RANGE_RE.match(content_range.strip())
        if not m or m.group(3) == "*" or int(m.group(1)) != offset:
            raise RemoteError(f"unusable Content-Range {content_range!r}", source=self._url)
        return int(m.group(3))

    def _read(self, resp: httpx.Response, n: int) -> bytes:
        chunks: list[bytes] = []
        got = 0
        for chunk in resp.iter_bytes():
            chunks.append(chunk)
            got += len(chunk)
            self.bytes_fetched += len(chunk)
            if got >= n:
                break
        data = b"".join(chunks)[:n]
        if len(data) != n:
            raise RemoteError(f"short body: {len(data)} of {n} bytes", source=self._url)
        return data


def shard_urls(url: str) -> list[str]:
    """Every shard's URL of a split GGUF named by any one shard's URL, or ``[url]``."""
    parts = urlsplit(url)
    head, _, base = parts.path.rpartition("/")
    m = _SPLIT_RE.match(base)
    if not m:
        return [url]
    count = int(m.group("count"))
    if count < 1 or not 1 <= int(m.group("no")) <= count:
        raise ShardError(f"shard number {m.group('no')} of {count} is out of range", source=url)
    out = []
    for i in range(1, count + 1):
        path = f"{head}/{m.group('prefix')}-{i:05d}-of-{count:05d}.gguf"
        out.append(urlunsplit((parts.scheme, parts.netloc, path, parts.query, parts.fragment)))
    return out


def probe_url(
    url: str,
    *,
    headers: Mapping[str, str] | None = None,
    client: httpx.Client | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> ModelSpec:
    """Probe a GGUF at an http(s) URL (any shard of a split model names the whole model)."""
    scheme = urlsplit(url).scheme.lower()
    if scheme not in ("http", "https"):
        raise ProbeError(f"not an http(s) URL (scheme {scheme!r})", source=url)
    urls = shard_urls(url)
    own = client is None
    c = client or httpx.Client(follow_redirects=True, timeout=timeout_s, headers=dict(headers or {}))
    try:
        hdrs = [_read_remote(u, c) for u in urls]
    finally:
        if own:
            c.close()
    return spec_from_headers(hdrs, ModelSource(url=urls[0], shards=tuple(urls) if len(urls) > 1 else ()))


def _read_remote(url: str, client: httpx.Client) -> GGUFHeader:
    src = RangeSource(url, client)
    header = read_header(src)
    header.bytes_read = src.bytes_fetched
    return header


def hf_url(repo_id: str, filename: str, revision: str | None = None) -> str:
    """The resolve URL of a file on the Hugging Face hub, honouring ``HF_ENDPOINT`` now."""
    from huggingface_hub import hf_hub_url

    endpoint = os.environ.get("HF_ENDPOINT") or None
    return str(hf_hub_url(repo_id, filename, revision=revision, endpoint=endpoint))


def probe_hf(
    repo_id: str,
    filename: str,
    revision: str | None = None,
    token: str | None = None,
    *,
    client: httpx.Client | None = None,
) -> ModelSpec:
    """Probe ``filename`` of the Hugging Face repo ``repo_id`` without downloading its weights.

    ``token`` defaults to huggingface_hub's own (``HF_TOKEN``, else the stored login).
    The headers are built here rather than with ``build_hf_headers``, which may
    itself call the hub (``/api/agent-harnesses``, huggingface_hub 2.x).
    """
    from huggingface_hub import get_token

    url = hf_url(repo_id, filename, revision)
    tok = token if token is not None else get_token()
    headers = {"User-Agent": "gguf-fit-server-probe"}
    if tok:
        headers["Authorization"] = f"Bearer {tok}"
    if client is not None:
        client.headers.update(headers)
    return probe_url(url, headers=headers, client=client)


def probe_location(location: str) -> ModelSpec:
    """Probe a local path, an http(s) URL or ``hf://repo_owner/repo_name/path/in/repo.gguf[@revision]``."""
    from .probe import probe_path

    if location.startswith("hf://"):
        rest = location[len("hf://") :]
        revision = None
        if "@" in rest:
            rest, _, revision = rest.rpartition("@")
        parts = rest.split("/")
        if len(parts) < 3 or not all(parts):
            raise ProbeError("expected hf://owner/repo/filename.gguf[@revision]", source=location)
        return probe_hf("/".join(parts[:2]), "/".join(parts[2:]), revision=revision)
    if re.match(r"^https?://", location, re.IGNORECASE):
        return probe_url(location)
    return probe_path(location)
