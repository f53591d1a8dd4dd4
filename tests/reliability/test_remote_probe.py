"""Remote probes (dry-run by URL): refused targets, one deadline and byte budget, shards checked before fetching,
no redirects to other hosts, errors that quote nothing a server sent. Local servers on 127.0.0.1 only."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from sizing.errors import ProbeError, RemoteError, ShardError
from sizing.probe.remote import ProbeLimits, probe_url
from tests.sizing.probe.conftest import RangeServer, link_into, range_server  # noqa: F401  (a fixture, used here)

from .conftest import FakeService

LOCAL = ProbeLimits(allow_hosts=("127.0.0.1",), public_only=True)


class _Server:
    """A tiny HTTP server whose answers a test scripts: ``routes[path] = fn(handler)``."""

    def __init__(self) -> None:
        self.routes: dict[str, Callable[[BaseHTTPRequestHandler], None]] = {}
        self.hits: list[str] = []
        routes, hits = self.routes, self.hits

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                hits.append(self.path)
                fn = routes.get(self.path.split("?")[0])
                if fn is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                try:
                    fn(self)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server() -> Iterator[_Server]:
    s = _Server()
    yield s
    s.close()


def _body(status: int, data: bytes, headers: dict[str, str] | None = None) -> Callable[[BaseHTTPRequestHandler], None]:
    def send(h: BaseHTTPRequestHandler) -> None:
        h.send_response(status)
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)
    return send


def test_loopback_private_and_link_local_are_refused_unless_allowed(range_server: RangeServer,  # noqa: F811
                                                                     embedded_model: str) -> None:
    link_into(range_server, Path(embedded_model))
    url = range_server.url(Path(embedded_model).name)
    strict = ProbeLimits(public_only=True)
    for target in (url, "http://10.0.0.1/m.gguf", "http://192.168.1.1/m.gguf", "http://169.254.169.254/m.gguf",
                   "http://[::1]:9/m.gguf", "http://[::ffff:127.0.0.1]:9/m.gguf", "http://0.0.0.0:9/m.gguf",
                   "http://localhost:9/m.gguf", "http://100.64.0.1/m.gguf"):
        with pytest.raises(ProbeError, match="not a public address") as ei:
            probe_url(target, limits=strict)
        assert not isinstance(ei.value, RemoteError), target  # the client's mistake: 400 in the service
    assert range_server.requests == [], "nothing was sent anywhere"
    assert probe_url(url, limits=LOCAL).n_vocab == 262_144  # named in the allow-list: probed
    assert probe_url(url, limits=ProbeLimits(public_only=True, allow_hosts=("127.0.0.0/8",))).n_layer > 0


def test_redirects_stay_on_their_host(server: _Server, range_server: RangeServer, embedded_model: str) -> None:  # noqa: F811
    link_into(range_server, Path(embedded_model))
    name = Path(embedded_model).name
    server.routes["/elsewhere.gguf"] = _body(302, b"", {"Location": range_server.url(name)})
    with pytest.raises(ProbeError, match="another host"):
        probe_url(server.url + "/elsewhere.gguf", limits=ProbeLimits(public_only=True,
                                                                      allow_hosts=("127.0.0.1",)))
    assert range_server.requests == [], "the other host was never contacted"
    # On the same host (scheme, name and port), a redirect is followed.
    other = _Server()
    try:
        other.routes["/moved.gguf"] = _body(301, b"", {"Location": "/" + name})
        other.routes["/" + name] = lambda h: _proxy_range(h, Path(embedded_model))
        assert probe_url(other.url + "/moved.gguf", limits=LOCAL).n_vocab == 262_144
    finally:
        other.close()


def _proxy_range(h: BaseHTTPRequestHandler, path: Path) -> None:
    import re

    m = re.match(r"bytes=(\d+)-(\d+)", h.headers.get("Range", ""))
    assert m
    size = path.stat().st_size
    a, b = int(m.group(1)), min(int(m.group(2)), size - 1)
    with open(path, "rb") as f:
        f.seek(a)
        data = f.read(b - a + 1)
    _body(206, data, {"Content-Range": f"bytes {a}-{b}/{size}"})(h)


def test_one_deadline_for_the_whole_probe(server: _Server) -> None:
    def trickle(h: BaseHTTPRequestHandler) -> None:
        h.send_response(206)
        h.send_header("Content-Range", "bytes 0-65535/1000000")
        h.send_header("Content-Length", "65536")
        h.end_headers()
        h.wfile.write(b"GGUF")
        for _ in range(200):  # a byte every 50 ms: each read is quick, the whole never ends
            h.wfile.write(b"\0")
            h.wfile.flush()
            time.sleep(0.05)

    server.routes["/slow.gguf"] = trickle
    t0 = time.monotonic()
    with pytest.raises(RemoteError, match="longer than its 1 s limit"):
        probe_url(server.url + "/slow.gguf", limits=ProbeLimits(deadline_s=1.0, public_only=True,
                                                                allow_hosts=("127.0.0.1",)))
    assert time.monotonic() - t0 < 3


def test_one_byte_budget(range_server: RangeServer, embedded_model: str) -> None:  # noqa: F811
    link_into(range_server, Path(embedded_model))
    with pytest.raises(ProbeError, match="byte budget"):
        probe_url(range_server.url(Path(embedded_model).name),
                  limits=ProbeLimits(max_bytes=1 << 20, public_only=True, allow_hosts=("127.0.0.1",)))
    assert range_server.bytes_sent <= 1 << 20  # no request asks beyond what the budget has left


def test_a_shard_name_is_checked_against_the_first_header_before_any_other_shard(range_server: RangeServer,  # noqa: F811
                                                                                 embedded_model: str,
                                                                                 tmp_path: Path) -> None:
    fake = tmp_path / "m-00001-of-00020.gguf"
    fake.write_bytes(Path(embedded_model).read_bytes()[: 8 << 20])  # a whole header, not a split model
    link_into(range_server, fake)
    with pytest.raises(ShardError, match="announces 20 shards"):
        probe_url(range_server.url("m-00007-of-00020.gguf"), limits=LOCAL)
    names = {r.split(" ")[0] for r in range_server.requests}
    assert names == {"m-00001-of-00020.gguf"}, names
    assert range_server.bytes_sent < 8 << 20


def test_errors_never_quote_what_the_server_sent(server: _Server) -> None:
    secret = b"root:x:0:0:SECRET-TOKEN-123\n" * 100
    server.routes["/etc.gguf"] = _body(206, secret[:65536], {"Content-Range": f"bytes 0-{len(secret) - 1}/{len(secret)}"})
    server.routes["/range.gguf"] = _body(206, secret, {"Content-Range": "SECRET-TOKEN-123"})
    server.routes["/status.gguf"] = _body(500, secret)
    for path in ("/etc.gguf", "/range.gguf", "/status.gguf"):
        with pytest.raises(ProbeError) as ei:
            probe_url(server.url + path, limits=LOCAL)
        assert "SECRET" not in str(ei.value) and "root:" not in str(ei.value), str(ei.value)


def test_connection_errors_say_what_failed_and_nothing_more() -> None:
    import socket

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    with pytest.raises(RemoteError) as ei:
        probe_url(f"http://127.0.0.1:{port}/m.gguf", limits=ProbeLimits(deadline_s=1.0, public_only=True,
                                                                         allow_hosts=("127.0.0.1",)))
    assert ei.value.reason == "could not connect to 127.0.0.1"  # no errno, no exception text


@pytest.mark.timeout(120)
def test_service_refuses_internal_urls_and_slow_probes_do_not_hold_up_the_rest(
        fake_factory: Callable[..., FakeService], server: _Server) -> None:
    from tests.conftest import EMBEDDED_NAME

    svc = fake_factory()
    r = svc.client.post("/api/dry-run", json={"url": server.url + "/m.gguf"})
    assert r.status_code == 400 and "not a public address" in r.json()["error"]["message"], r.text
    assert server.hits == []

    def stall(h: BaseHTTPRequestHandler) -> None:
        time.sleep(3)
        _body(404, b"")(h)

    server.routes["/stall.gguf"] = stall
    slow = fake_factory(remote_allow_hosts="127.0.0.1", remote_probes=2, remote_timeout_s=2.0)
    results: list[Any] = []
    threads = [threading.Thread(target=lambda: results.append(slow.client.post(
        "/api/dry-run", json={"url": server.url + "/stall.gguf"}))) for _ in range(6)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    r = slow.client.post("/api/dry-run", json={"model": EMBEDDED_NAME})  # a local plan: not behind the probes
    assert r.status_code == 200 and time.monotonic() - t0 < 2.5
    for t in threads:
        t.join(30)
    statuses = sorted(x.status_code for x in results)
    assert statuses.count(429) == 4, statuses  # two probe slots; the rest told to retry
    assert all(s in (429, 502) for s in statuses), statuses
