"""``python -m service tunnel``: a worker's two ports (ggml-rpc's and ``/status`` on the next) over mutual TLS, for
workers across a network that others reach.

ggml-rpc has no authentication and no encryption: whoever reaches its port runs graphs on the worker's devices and
reads their memory, and the tensors (the prompt's activations, the logits) cross in clear. A tunnel pair carries
both ports over TLS 1.3, each end proving itself with a certificate of a CA of the deployment's own:

    worker host:  python -m service worker --listen 127.0.0.1:50052          (loopback: no --allow-public)
                  python -m service tunnel serve --listen 0.0.0.0:50052 --to 127.0.0.1:50052 \\
                      --cert worker.crt --key worker.key --ca ca.crt
    server host:  python -m service tunnel connect --listen 127.0.0.1:50052 --to WORKER:50052 \\
                      --cert server.crt --key server.key --ca ca.crt
                  GGUF_RPC_WORKERS=127.0.0.1:50052 python -m service

``serve`` accepts only clients whose certificate the CA signed, ``connect`` only a worker whose certificate the CA
signed for the name it dials (``--server-name``, default the ``--to`` host). Each side's TLS connection gets
``service.engine.rpc.hold_link``, so a peer host that vanishes is dropped within ``--link-timeout-s``; a dropped or
refused connection closes its plaintext side at once (ggml-rpc's client then aborts its runner, whose death path
answers; the worker frees the client's buffers). Each direction is copied in chunks of up to 1 MiB as it arrives,
on one asyncio loop (TCP_NODELAY on every socket, as ggml-rpc sets on its own).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import ssl
import sys
from typing import Any

from ..engine.rpc import LINK_TIMEOUT_S, hold_link, parse_endpoint
from ..hosts import is_loopback

log = logging.getLogger("service.rpc.tunnel")

CHUNK_BYTES = 1 << 20
"""The most one read takes from a side before writing it to the other."""
CONNECT_TIMEOUT_S = 10.0
"""How long a connection to the other end, its TLS handshake included, may take."""


def server_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    """``serve``'s TLS: its certificate, and clients' required, signed by ``ca``; TLS 1.3 only."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(cert, key)
    ctx.load_verify_locations(ca)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    """``connect``'s TLS: its certificate, and the worker's checked against ``ca`` and the name dialled."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(cert, key)
    ctx.load_verify_locations(ca)
    return ctx


def _hold(writer: asyncio.StreamWriter, timeout_s: float) -> None:
    sock: Any = writer.get_extra_info("socket")
    if sock is not None and timeout_s > 0:
        with contextlib.suppress(OSError):
            hold_link(sock, timeout_s)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK_BYTES):
            writer.write(data)
            await writer.drain()
    except (OSError, ssl.SSLError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()  # the other side ends: ggml-rpc uses no half-close


class Tunnel:
    """One direction of the pair: accept on ``listen`` (TLS with ``accept_tls``), connect to ``to`` (TLS with
    ``dial_tls``), copy both ways; for the ggml-rpc port and the ``/status`` port after it."""

    def __init__(self, listen: str, to: str, *, accept_tls: ssl.SSLContext | None = None,
                 dial_tls: ssl.SSLContext | None = None, server_name: str | None = None,
                 link_timeout_s: float = LINK_TIMEOUT_S) -> None:
        self.listen, self.to = parse_endpoint(listen), parse_endpoint(to)
        self.accept_tls, self.dial_tls = accept_tls, dial_tls
        self.server_name = server_name or self.to[0]
        self.link_timeout_s = link_timeout_s

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, port: int) -> None:
        peer = writer.get_extra_info("peername")
        if self.accept_tls is not None:
            _hold(writer, self.link_timeout_s)
        try:
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(
                self.to[0], port, ssl=self.dial_tls, server_hostname=self.server_name if self.dial_tls else None,
                ssl_handshake_timeout=CONNECT_TIMEOUT_S if self.dial_tls else None), CONNECT_TIMEOUT_S)
        except (OSError, ssl.SSLError, asyncio.TimeoutError) as exc:
            log.warning("tunnel from %s: cannot reach %s:%d: %s", peer, self.to[0], port, exc)
            writer.close()
            return
        if self.dial_tls is not None:
            _hold(up_writer, self.link_timeout_s)
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    async def serve(self) -> None:
        host, port = self.listen
        servers = []
        for offset in (0, 1):  # ggml-rpc's port, then /status's
            def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, to_port: int = self.to[1] + offset
                        ) -> Any:
                return self._connection(r, w, to_port)

            servers.append(await asyncio.start_server(handler, host, port + offset, ssl=self.accept_tls,
                                                      ssl_handshake_timeout=CONNECT_TIMEOUT_S if self.accept_tls
                                                      else None, limit=CHUNK_BYTES))
        log.info("tunnel: %s:%d and %d %s to %s:%d and %d %s", host, port, port + 1,
                 "(TLS)" if self.accept_tls else "(plain)", self.to[0], self.to[1], self.to[1] + 1,
                 "(TLS)" if self.dial_tls else "(plain)")
        await asyncio.gather(*(s.serve_forever() for s in servers))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m service tunnel", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("side", choices=("serve", "connect"), help="serve: on the worker's host, TLS in, the loopback "
                    "worker out; connect: on the server's host, plain on loopback in, TLS to the worker's tunnel out")
    ap.add_argument("--listen", required=True, help="HOST:PORT to accept on (and PORT + 1 for /status); connect "
                    "listens on loopback only")
    ap.add_argument("--to", required=True, help="HOST:PORT to connect to (and PORT + 1): the worker's --listen "
                    "(serve), the serving tunnel (connect)")
    ap.add_argument("--cert", required=True, help="this end's certificate (PEM), signed by --ca")
    ap.add_argument("--key", required=True, help="its private key (PEM)")
    ap.add_argument("--ca", required=True, help="the CA certificate (PEM) the other end's certificate must be "
                    "signed by: a CA of the deployment's own, for these certificates only")
    ap.add_argument("--server-name", default=None, help="connect: the name the worker's certificate must carry "
                    "(default: the --to host)")
    ap.add_argument("--link-timeout-s", type=float, default=LINK_TIMEOUT_S, help="drop a TLS connection whose peer "
                    f"host stops acknowledging anything for this long (default {LINK_TIMEOUT_S:g}; 0: never)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        host, _ = parse_endpoint(args.listen)
        parse_endpoint(args.to)
    except ValueError as exc:
        sys.stderr.write(f"gguf-tunnel: {exc}\n")
        return 2
    if args.side == "connect" and not is_loopback(host):
        sys.stderr.write(f"gguf-tunnel: connect listens in clear: on loopback only, not {host}\n")
        return 2
    try:
        if args.side == "serve":
            tunnel = Tunnel(args.listen, args.to, accept_tls=server_context(args.cert, args.key, args.ca),
                            link_timeout_s=args.link_timeout_s)
        else:
            tunnel = Tunnel(args.listen, args.to, dial_tls=client_context(args.cert, args.key, args.ca),
                            server_name=args.server_name, link_timeout_s=args.link_timeout_s)
    except (OSError, ssl.SSLError) as exc:
        sys.stderr.write(f"gguf-tunnel: {exc}\n")
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        asyncio.run(tunnel.serve())
    except (KeyboardInterrupt, SystemExit):
        pass
    except OSError as exc:
        sys.stderr.write(f"gguf-tunnel: {exc}\n")
        return 2
    return 0


__all__ = ["Tunnel", "client_context", "main", "server_context"]
