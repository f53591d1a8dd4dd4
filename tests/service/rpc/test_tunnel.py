"""ggml-rpc has no authentication and no encryption; ``python -m service tunnel`` carries a worker's two ports over
mutual TLS. A model over a worker through a tunnel pair answers as over the worker itself; no one gets in without a
certificate of the deployment's CA (a plain client, a client of another CA), and the server's side will not talk to
a worker that cannot show one (a host in the middle). Real workers, tunnels and ggml-rpc clients on loopback;
certificates made with openssl as docs/deployment.md shows."""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from service.testing import tls
from service.testing.ports import worker_ports
from service.testing.rpc import worker_process
from tests.conftest import ROOT
from tests.service.rpc.test_worker_guard import HELLO

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[tls.Certs, tls.Certs]:
    """The deployment's certificates, and another CA's (an outsider's)."""
    why = tls.unavailable()
    if why is not None:
        pytest.skip(why)
    d = tmp_path_factory.mktemp("tls")
    return tls.make_certs(d / "ours", ["127.0.0.1"]), tls.make_certs(d / "theirs", ["127.0.0.1"], ca_name="other-ca")


@contextlib.contextmanager
def tunnelled(worker_certs: tls.Certs, client_certs: tls.Certs) -> Iterator[tuple[int, int, int]]:
    """A worker on loopback, ``tunnel serve`` in front of it (``worker_certs``) and ``tunnel connect`` to that
    (``client_certs``): the worker's port, the serving tunnel's, the connecting tunnel's."""
    worker, serve, connect = worker_ports(3)
    with worker_process(worker, cwd=str(ROOT)), \
            tls.tunnel_process("serve", f"127.0.0.1:{serve}", f"127.0.0.1:{worker}", worker_certs.worker,
                               worker_certs.ca, cwd=str(ROOT)), \
            tls.tunnel_process("connect", f"127.0.0.1:{connect}", f"127.0.0.1:{serve}", client_certs.client,
                               client_certs.ca, cwd=str(ROOT)):
        yield worker, serve, connect


def _run(model: str, endpoint: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-m", "service.testing.rpc", "--tokens", "8", model, endpoint], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_a_model_through_the_tunnel_answers_as_over_the_worker_itself(certs: tuple[tls.Certs, tls.Certs],
                                                                       embedded_model: str) -> None:
    ours, _ = certs
    with tunnelled(ours, ours) as (worker, _, connect):
        status = httpx.get(f"http://127.0.0.1:{connect + 1}/status", timeout=5).json()  # /status through it too
        assert status["endpoint"] == f"127.0.0.1:{worker}"
        direct = _run(embedded_model, f"127.0.0.1:{worker}")
        through = _run(embedded_model, f"127.0.0.1:{connect}")
    assert through["text"] == direct["text"] and through["tokens"] == 8 and through["devices"], (through, direct)


REFUSED = ("closed", "SSLError", "SSLEOFError", "ConnectionResetError", "BrokenPipeError")


def _refused(port: int, context: ssl.SSLContext | None) -> str:
    """What a client gets from the serving tunnel: it sends ggml-rpc's HELLO (in clear, or over TLS with
    ``context``) and reads; how it was turned away (the worker answering fails the test)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        try:
            sock = context.wrap_socket(raw, server_hostname="127.0.0.1") if context is not None else raw
            sock.sendall(HELLO)
            data = sock.recv(64)
        except (ssl.SSLError, ConnectionError) as exc:
            return type(exc).__name__
        assert data == b"", f"the worker answered: {data!r}"
        return "closed"


def test_no_one_gets_in_without_a_certificate_of_the_deployments_ca(certs: tuple[tls.Certs, tls.Certs]) -> None:
    ours, theirs = certs
    with tunnelled(ours, ours) as (worker, serve, _):
        assert _refused(serve, None) in REFUSED  # in clear: no TLS, nothing crosses
        outsider = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        outsider.load_cert_chain(theirs.client.cert, theirs.client.key)
        outsider.load_verify_locations(ours.ca)  # it even trusts our worker: its own certificate is not ours
        assert _refused(serve, outsider) in REFUSED
        anonymous = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        anonymous.load_verify_locations(ours.ca)
        assert _refused(serve, anonymous) in REFUSED
        with pytest.raises(httpx.HTTPError):  # /status's port is behind it too
            httpx.get(f"https://127.0.0.1:{serve + 1}/status", verify=False, timeout=5)
        conn = httpx.get(f"http://127.0.0.1:{worker + 1}/status", timeout=5).json()["connection"]
        assert conn["cut_connections"] == 0 and conn["served"] is None  # ggml-rpc never saw one of them


def test_the_server_side_talks_to_no_worker_without_a_certificate_of_its_ca(certs: tuple[tls.Certs, tls.Certs],
                                                                             tmp_path: Path) -> None:
    """A host in the middle with a certificate of another CA: the connecting tunnel closes at once, nothing of the
    client's crosses."""
    ours, theirs = certs
    with tunnelled(theirs, ours) as (_, _, connect):
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{connect + 1}/status", timeout=5)
        with socket.create_connection(("127.0.0.1", connect), timeout=10) as sock:
            sock.sendall(HELLO)
            assert sock.recv(64) == b""


def test_the_connecting_side_listens_on_loopback_only(certs: tuple[tls.Certs, tls.Certs]) -> None:
    ours, _ = certs
    r = subprocess.run([sys.executable, "-m", "service", "tunnel", "connect", "--listen", "0.0.0.0:50052", "--to",
                        "192.0.2.7:50052", "--cert", ours.client.cert, "--key", ours.client.key, "--ca", ours.ca],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "loopback only" in r.stderr, r.stderr
