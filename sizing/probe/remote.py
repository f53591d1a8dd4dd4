"""Probing a GGUF over HTTP(S): range requests for the header, never the weights.

``probe_url`` reads any http(s) URL that honours ``Range``; ``probe_hf``
resolves a Hugging Face ``repo_id`` + ``filename`` with ``hf_hub_url`` (the
``HF_ENDPOINT`` environment variable, read at call time, picks the hub) and
sends the token ``huggingface_hub`` would send (``token`` argument, else
``HF_TOKEN`` or the stored login, via ``huggingface_hub.get_token``).

The header is fetched in growing windows (see ``sizing.probe.reader._Cursor.grow``):
each window is at least a lower bound of the bytes still needed and at most
1/16 more than what is already held, so the bytes transferred stay within a
few percent of the header's size. httpx errors become ``RemoteError`` here,
at the boundary.

Every probe runs under ``ProbeLimits``: one total deadline and one byte budget
for all its requests and shards; redirects only within the URL's own host
(unless the limits allow others, as a Hugging Face hub's CDN needs); and,
with ``public_only`` (what the service sets for URLs its clients send), no
connection to a loopback, private, link-local or otherwise non-public address
unless ``allow_hosts`` names it. The address is checked where the socket is
opened, on every address the name resolves to, so neither a redirect nor a
DNS answer can lead the probe inside. A split model's other shards are fetched
only after the first shard's header confirms the split its name announces.
Errors say what failed and never quote what a server sent.

Every entry point (``probe_url``, ``probe_hf``, ``probe_location``) checks its URL with ``check_url`` before
any request: scheme, host name (DNS labels; IDNA for international names and ``xn--`` labels), IPv4 and
bracketed IPv6 literals, port. A malformed URL is the caller's ``InvalidURLError`` (400 in the service), never
an IDNA or resolver error from deep inside httpx (a 500) nor an ``httpx.InvalidURL`` taken for the upstream's
failure (a 502).
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping
from urllib.parse import urljoin, urlsplit, urlunsplit

import httpcore
import httpx
import idna

from ..errors import InvalidURLError, NotGGUFError, ProbeError, RemoteError, ShardError
from ..model.spec import ModelSource, ModelSpec
from .gguf import SPLIT_RE, read_header, spec_from_headers
from .reader import GGUFHeader, MIN_WINDOW_BYTES

DEFAULT_TIMEOUT_S = 30.0
_CONTENT_RANGE_RE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")
MAX_REDIRECTS = 5
MAX_HOST_CHARS = 253
"""The longest DNS name (RFC 1035), without its trailing dot."""
_LABEL = re.compile(r"^[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?$")
"""One DNS label, lower case: 1 to 63 letters, digits, hyphens (not first or last) and underscores (which some
real names carry; the resolver takes them)."""


def check_url(url: str) -> None:
    """``InvalidURLError`` unless ``url`` is an http(s) URL a request can be made to, checked before any is made:
    no whitespace or control characters; scheme http or https; a host that is a DNS name (each label a DNS
    label, ``xn--`` labels valid punycode, a non-ASCII name valid IDNA as httpx encodes it), an IPv4 address or a
    bracketed IPv6 address; a port from 1 to 65535; and whatever else httpx refuses to parse."""
    if any(ord(ch) < 0x21 or ord(ch) == 0x7F for ch in url):
        raise InvalidURLError("the URL holds whitespace or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError: not a number, or beyond 65535
    except ValueError as exc:
        raise InvalidURLError(f"not a valid URL: {exc}") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise InvalidURLError(f"not an http(s) URL (scheme {parts.scheme[:20]!r})")
    host = parts.netloc.rpartition("@")[2]
    if host.startswith("["):
        # urlsplit lets an IPvFuture literal ("[v1.x]") through; nothing can connect to one
        literal = host[1:].partition("]")[0]
        try:
            ipaddress.IPv6Address(literal)
        except ValueError:
            raise InvalidURLError(f"[{literal[:60]}] is not an IPv6 address") from None
    else:
        _check_host_name(parts.hostname or "")
    if port == 0:
        raise InvalidURLError("port 0 is not a port a server listens on")
    try:
        httpx.URL(url)  # the parser the request will use: nothing it refuses may reach a request
    except httpx.InvalidURL as exc:
        raise InvalidURLError(f"not a valid URL: {exc}") from None


def _check_host_name(host: str) -> None:
    """``InvalidURLError`` unless ``host`` (lower case, no brackets) is a DNS name or an IPv4 address."""
    if not host:
        raise InvalidURLError("the URL has no host")
    shown = host[:80]
    if not host.isascii():
        try:
            host = idna.encode(host).decode("ascii")  # IDNA 2008 without UTS 46 mapping: what httpx sends
        except (idna.IDNAError, UnicodeError) as exc:
            raise InvalidURLError(f"the host name {shown!r} is not a valid international name ({exc})") from None
    name = host[:-1] if host.endswith(".") else host  # one trailing dot: a fully qualified name
    if len(name) > MAX_HOST_CHARS:
        raise InvalidURLError(f"the host name is longer than {MAX_HOST_CHARS} characters")
    labels = name.split(".")
    for label in labels:
        if not _LABEL.match(label):
            raise InvalidURLError(f"the host name {shown!r} has an empty or invalid label (1 to 63 letters, digits, "
                                  "hyphens and underscores, no hyphen first or last)")
        if label.startswith("xn--"):
            try:
                idna.decode(label)
            except (idna.IDNAError, UnicodeError) as exc:
                raise InvalidURLError(f"the host name {shown!r} has an invalid punycode label ({exc})") from None
    if labels[-1].isdigit():  # a number last: URL parsers read the host as an IPv4 address
        try:
            ipaddress.IPv4Address(name)
        except ValueError:
            raise InvalidURLError(f"{shown!r} is not an IPv4 address") from None


@dataclass(frozen=True)
class ProbeLimits:
    """What one remote probe may do. The defaults suit a caller probing its own URL (the CLI); the service
    passes ``public_only=True`` for URLs its clients send (``GGUF_REMOTE_*`` settings)."""

    deadline_s: float = DEFAULT_TIMEOUT_S
    """Total time for all requests of the probe (every shard)."""
    max_bytes: int = 64 * 1024 * 1024
    """Most body bytes the probe may read, all requests together."""
    public_only: bool = False
    """Refuse addresses that are not global unicast (loopback, private, link-local, CGNAT, multicast...)."""
    allow_hosts: tuple[str, ...] = ()
    """Host names (exact, any case), addresses or networks (CIDR) allowed although not public."""
    cross_host_redirects: bool = False
    """Follow a redirect to another host (a hub's CDN); the address rule still applies to it."""

    def host_allowed(self, host: str) -> bool:
        return host.lower().strip("[]") in {h.lower().strip("[]") for h in self.allow_hosts}

    def address_allowed(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address.split("%", 1)[0])
        except ValueError:
            return False
        ip = embedded_ipv4(ip)
        if not self.public_only or (ip.is_global and not ip.is_multicast):
            return True
        for entry in self.allow_hosts:
            try:
                if ip in ipaddress.ip_network(entry.strip("[]"), strict=False):
                    return True
            except ValueError:
                continue
        return False


_NAT64 = (ipaddress.IPv6Network("64:ff9b::/96"), ipaddress.IPv6Network("64:ff9b:1::/48"))
"""NAT64 prefixes (RFC 6052's well-known one, RFC 8215's local-use one): the last 32 bits are an IPv4 address."""


def embedded_ipv4(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The IPv4 address an IPv6 transition address reaches (IPv4-mapped ``::ffff:a.b.c.d``, NAT64
    ``64:ff9b::a.b.c.d``, 6to4 ``2002:AABB:CCDD::``, Teredo's client), judged as the address it is; others as
    they are. A NAT64 gateway or a 6to4 relay would carry a request for ``64:ff9b::7f00:1`` to 127.0.0.1."""
    if ip.version != 6:
        return ip
    assert isinstance(ip, ipaddress.IPv6Address)
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if any(ip in net for net in _NAT64):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    return ip


def parse_allow_hosts(text: str | None) -> tuple[str, ...]:
    """``GGUF_REMOTE_ALLOW_HOSTS``: comma-separated host names, addresses and networks."""
    return tuple(h.strip() for h in (text or "").split(",") if h.strip())


class _Budget:
    """The deadline and byte budget one probe shares between its requests and shards."""

    def __init__(self, limits: ProbeLimits) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.deadline_s
        self.bytes_left = limits.max_bytes

    def remaining_s(self, source: str) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RemoteError(f"the probe took longer than its {self.limits.deadline_s:g} s limit", source=source)
        return left

    def spend(self, n: int, source: str) -> None:
        self.bytes_left -= n
        if self.bytes_left < 0:
            raise ProbeError(f"the header is larger than the probe's {self.limits.max_bytes} byte budget", source=source)


class _GuardedBackend(httpcore.SyncBackend):
    """httpcore's socket backend, connecting only to addresses ``limits`` allows (checked after resolution)."""

    def __init__(self, limits: ProbeLimits) -> None:
        super().__init__()
        self.limits = limits

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> Any:
        if self.limits.public_only and not self.limits.host_allowed(host):
            try:
                infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except (OSError, UnicodeError) as exc:  # UnicodeError: a name the idna codec refuses (check_url's net)
                raise httpcore.ConnectError(f"cannot resolve {host}") from exc
            addresses = [str(info[4][0]) for info in infos]
            allowed = [a for a in addresses if self.limits.address_allowed(a)]
            if not allowed:
                raise Refused(host)
            host = allowed[0]
        return super().connect_tcp(host, port, timeout=timeout, local_address=local_address,
                                   socket_options=socket_options)


class Refused(Exception):
    """A probe's target resolves only to addresses its limits refuse."""

    def __init__(self, host: str) -> None:
        super().__init__(host)
        self.host = host


def probe_client(limits: ProbeLimits, headers: Mapping[str, str] | None = None) -> httpx.Client:
    """An httpx client for probes under ``limits``: guarded connections, no automatic redirects, no proxies
    from the environment (a proxy would connect for us, past the address check)."""
    transport = httpx.HTTPTransport()
    transport._pool._network_backend = _GuardedBackend(limits)
    return httpx.Client(transport=transport, follow_redirects=False, trust_env=False,
                        timeout=min(limits.deadline_s, DEFAULT_TIMEOUT_S), headers=dict(headers or {}))


class RangeSource:
    """One remote file, read with ``Range: bytes=a-b`` requests over a shared client.

    The first request (``initial_bytes`` from offset 0) also learns the file's
    size from ``Content-Range``. ``bytes_fetched`` counts the body bytes received.
    """

    def __init__(self, url: str, client: httpx.Client, *, initial_bytes: int = MIN_WINDOW_BYTES,
                 budget: _Budget | None = None) -> None:
        self._url = url
        self._client = client
        self._budget = budget or _Budget(ProbeLimits())
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

    def _send(self, headers: dict[str, str]) -> Any:
        """The response to a GET of the file, following redirects as the limits allow (the final URL is kept)."""
        limits = self._budget.limits
        for _ in range(MAX_REDIRECTS + 1):
            timeout = min(self._budget.remaining_s(self._url), DEFAULT_TIMEOUT_S)
            request = self._client.build_request("GET", self._url, headers=headers, timeout=timeout)
            resp = self._client.send(request, stream=True)
            if resp.status_code not in (301, 302, 303, 307, 308) or "location" not in resp.headers:
                return resp
            resp.close()
            # A malformed Location is the server's, not the caller's: the upstream failed (what it sent is not quoted).
            malformed = RemoteError("redirected to a malformed URL; not followed", source=self._url)
            try:
                target = urljoin(self._url, resp.headers["location"])
                scheme = urlsplit(target).scheme.lower()
            except ValueError:
                raise malformed from None
            if scheme not in ("http", "https"):
                raise ProbeError("redirected to a URL that is not http(s); not followed", source=self._url)
            try:
                check_url(target)
            except InvalidURLError:
                raise malformed from None
            old, new = urlsplit(self._url), urlsplit(target)
            if not limits.cross_host_redirects and (new.hostname, new.port) != (old.hostname, old.port):
                raise ProbeError(f"redirected to another host ({new.hostname}); not followed", source=self._url)
            self._url = target
        raise ProbeError(f"more than {MAX_REDIRECTS} redirects", source=self._url)

    def _request(self, offset: int, length: int) -> tuple[bytes, int]:
        """GET ``length`` bytes at ``offset``; returns them and the file's total size."""
        if length > self._budget.bytes_left:
            # Refused before asking: what a server sends beyond the budget would still arrive in our buffers.
            self._budget.spend(length, self._url)
        headers = {"Range": f"bytes={offset}-{offset + length - 1}", "Accept-Encoding": "identity"}
        self.requests += 1
        try:
            resp = self._send(headers)
            try:
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
            finally:
                resp.close()
        except Refused as exc:
            # The client's mistake, not the upstream's: a ProbeError (400), not a RemoteError (502).
            raise ProbeError(f"{exc.host} is not a public address; refused (GGUF_REMOTE_ALLOW_HOSTS can allow it)",
                             source=self._url) from None
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            # One message for refused, unreachable and silent: a probe must not map which ports are open.
            raise RemoteError(f"could not connect to {urlsplit(self._url).hostname}", source=self._url) from exc
        except httpx.TimeoutException as exc:
            raise RemoteError("the server did not answer in time", source=self._url) from exc
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise RemoteError(f"the request failed ({type(exc).__name__})", source=self._url) from exc
        except UnicodeError as exc:
            # Our URL passed check_url: an IDNA error here is httpx reading a server's Location (to build the
            # redirect it reports even when it does not follow it), so the upstream's fault.
            raise RemoteError("redirected to a malformed URL; not followed", source=self._url) from exc
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
            raise RemoteError("the answer to a range request has no usable Content-Range", source=self._url)
        return int(m.group(3))

    def _read(self, resp: httpx.Response, n: int) -> bytes:
        chunks: list[bytes] = []
        got = 0
        for chunk in resp.iter_bytes():
            chunks.append(chunk)
            got += len(chunk)
            self.bytes_fetched += len(chunk)
            self._budget.spend(len(chunk), self._url)
            self._budget.remaining_s(self._url)  # a server trickling bytes cannot outlast the deadline
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
    m = SPLIT_RE.match(base)
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
    timeout_s: float | None = None,
    limits: ProbeLimits | None = None,
) -> ModelSpec:
    """Probe a GGUF at an http(s) URL (any shard of a split model names the whole model), within ``limits``.

    ``timeout_s`` (older callers) sets the limits' deadline. A ``client`` of the caller's is used as given
    (its redirects and connections are its own); without one, ``probe_client(limits)`` guards them.
    """
    limits = limits or ProbeLimits()
    if timeout_s is not None:
        limits = ProbeLimits(timeout_s, limits.max_bytes, limits.public_only, limits.allow_hosts,
                             limits.cross_host_redirects)
    check_url(url)
    urls = shard_urls(url)
    budget = _Budget(limits)
    own = client is None
    c = client or probe_client(limits, headers)
    try:
        first = _read_remote(urls[0], c, budget)
        if len(urls) > 1:
            _check_split(first, len(urls), urls[0])
        hdrs = [first] + [_read_remote(u, c, budget) for u in urls[1:]]
    finally:
        if own:
            c.close()
    return spec_from_headers(hdrs, ModelSource(url=urls[0], shards=tuple(urls) if len(urls) > 1 else ()))


def _check_split(first: GGUFHeader, count: int, source: str) -> None:
    """Before any other shard is fetched: the first shard's header must announce the split its name does."""
    md = first.metadata
    declared, no = md.get("split.count"), md.get("split.no")
    if declared != count or no != 0:
        raise ShardError(
            f"the name announces {count} shards but the first shard's header has split.count {declared!r}, "
            f"split.no {no!r}; no other shard was fetched", source=source,
        )


def _read_remote(url: str, client: httpx.Client, budget: _Budget | None = None) -> GGUFHeader:
    src = RangeSource(url, client, budget=budget)
    try:
        header = read_header(src)
    except NotGGUFError:
        # The reader's message quotes the first bytes; what a remote server sent is never echoed.
        raise NotGGUFError("not a GGUF file (it does not start with the GGUF magic)", offset=0, source=url) from None
    header.bytes_read = src.bytes_fetched
    return header


def hf_url(repo_id: str, filename: str, revision: str | None = None) -> str:
    """The resolve URL of a file on the Hugging Face hub, honouring ``HF_ENDPOINT`` now."""
    from huggingface_hub import hf_hub_url

    endpoint = os.environ.get("HF_ENDPOINT") or None
    try:
        return str(hf_hub_url(repo_id, filename, revision=revision, endpoint=endpoint))
    except ValueError as exc:  # huggingface_hub's HFValidationError: a repo id the hub cannot have ("a--b/c")
        raise InvalidURLError(f"not a Hugging Face repo id: {exc}") from None


def probe_hf(
    repo_id: str,
    filename: str,
    revision: str | None = None,
    token: str | None = None,
    *,
    client: httpx.Client | None = None,
    limits: ProbeLimits | None = None,
) -> ModelSpec:
    """Probe ``filename`` of the Hugging Face repo ``repo_id`` without downloading its weights.

    ``token`` defaults to huggingface_hub's own (``HF_TOKEN``, else the stored login).
    The headers are built here rather than with ``build_hf_headers``, which may
    itself call the hub (``/api/agent-harnesses``, huggingface_hub 2.x).
    """
    from huggingface_hub import get_token

    url = hf_url(repo_id, filename, revision)
    check_url(url)  # before the hub's host is read from it (HF_ENDPOINT is the operator's, but may be mistyped)
    tok = token if token is not None else get_token()
    headers = {"User-Agent": "gguf-fit-server-probe"}
    if tok:
        headers["Authorization"] = f"Bearer {tok}"
    if client is not None:
        client.headers.update(headers)
    # The hub is the operator's (HF_ENDPOINT): its host is trusted, and it redirects downloads to a CDN.
    base = limits or ProbeLimits()
    hub = urlsplit(url).hostname or ""
    limits = ProbeLimits(base.deadline_s, base.max_bytes, base.public_only, (*base.allow_hosts, hub), True)
    return probe_url(url, headers=headers, client=client, limits=limits)


def probe_location(location: str, limits: ProbeLimits | None = None) -> ModelSpec:
    """Probe a local path, an http(s) URL or ``hf://repo_owner/repo_name/path/in/repo.gguf[@revision]``."""
    from .gguf import probe_path

    if location.startswith("hf://"):
        rest = location[len("hf://") :]
        revision = None
        if "@" in rest:
            rest, _, revision = rest.rpartition("@")
        parts = rest.split("/")
        if len(parts) < 3 or not all(parts) or revision == "":
            raise InvalidURLError("expected hf://owner/repo/filename.gguf[@revision]", source=location[:300])
        return probe_hf("/".join(parts[:2]), "/".join(parts[2:]), revision=revision, limits=limits)
    if re.match(r"^https?://", location, re.IGNORECASE):
        return probe_url(location, limits=limits)
    return probe_path(location)
