"""Certificates for ``python -m service tunnel`` in tests and benches, made as docs/deployment.md tells an operator
to make them: ``openssl`` (a CA of its own, each worker's certificate for the names it is dialled by, the server's
client certificate), EC P-256 keys."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence


@dataclass(frozen=True)
class Pair:
    cert: str
    key: str


@dataclass(frozen=True)
class Certs:
    ca: str
    worker: Pair
    """For ``tunnel serve``: signed for every name given (``subjectAltName``), for server authentication."""
    client: Pair
    """For ``tunnel connect``: for client authentication."""


def unavailable() -> str | None:
    return None if shutil.which("openssl") else "openssl is not installed"


def _run(*args: str) -> None:
    r = subprocess.run(["openssl", *args], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)}: {r.stderr.strip()}")


def _signed(d: Path, name: str, ca: Path, ca_key: Path, extensions: str) -> Pair:
    key, csr, crt, ext = d / f"{name}.key", d / f"{name}.csr", d / f"{name}.crt", d / f"{name}.ext"
    _run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", str(key), "-out",
         str(csr), "-subj", f"/CN={name}")
    ext.write_text(extensions + "\n")
    _run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial", "-out", str(crt),
         "-days", "30", "-extfile", str(ext))
    return Pair(str(crt), str(key))


def make_certs(d: Path, worker_names: Sequence[str], *, ca_name: str = "gguf-workers-ca") -> Certs:
    """A CA in ``d``, a worker certificate for ``worker_names`` (IP addresses or DNS names) and a client one."""
    d.mkdir(parents=True, exist_ok=True)
    ca, ca_key = d / f"{ca_name}.crt", d / f"{ca_name}.key"
    _run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", str(ca_key),
         "-out", str(ca), "-days", "30", "-subj", f"/CN={ca_name}")
    sans = ",".join(f"IP:{n}" if n.replace(".", "").isdigit() or ":" in n else f"DNS:{n}" for n in worker_names)
    worker = _signed(d, f"{ca_name}-worker", ca, ca_key, f"subjectAltName={sans}\nextendedKeyUsage=serverAuth")
    client = _signed(d, f"{ca_name}-server", ca, ca_key, "extendedKeyUsage=clientAuth")
    return Certs(str(ca), worker, client)


@contextlib.contextmanager
def tunnel_process(side: str, listen: str, to: str, pair: Pair, ca: str, *args: str, cwd: str | None = None,
                   prefix: Sequence[str] = ()) -> Iterator[subprocess.Popen[bytes]]:
    """``python -m service tunnel SIDE`` (``prefix`` before it, such as ``ip netns exec NS``), yielded once both its
    ports accept; killed and reaped on the way out."""
    host, port = listen.rsplit(":", 1)
    proc = subprocess.Popen([*prefix, sys.executable, "-m", "service", "tunnel", side, "--listen", listen, "--to", to,
                             "--cert", pair.cert, "--key", pair.key, "--ca", ca, *args], cwd=cwd,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        for p in (int(port), int(port) + 1):
            while True:
                try:
                    socket.create_connection((host, p), timeout=1).close()
                    break
                except OSError:
                    if proc.poll() is not None:
                        raise SystemExit(f"the tunnel exited with {proc.returncode}: "
                                         f"{proc.stderr.read().decode() if proc.stderr else ''}")
                    if time.monotonic() > deadline:
                        raise SystemExit(f"the tunnel on {listen} did not accept within 30 s")
                    time.sleep(0.05)
        yield proc
    finally:
        proc.kill()
        proc.wait()
