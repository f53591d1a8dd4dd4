"""Loopback ports for the servers tests and benches start, taken from below the kernel's ephemeral range.

Binding port 0 hands out a port of that range, the range every outgoing connection draws its source port from: a
port chosen that way can be taken by some client's connection before the server that was meant to bind it does. A
worker binds two (ggml-rpc's and ``/status`` on the next one), and Linux gives ``bind(0)`` odd ports and
``connect()`` even ones, so the second port of such a pair is exactly the kind every connection takes (the suite
lost a worker's ``/status`` to that: ``Address already in use``). No connection's source port lies below the range.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_LOWEST = 10_000
"""Below this, ports are the ones well-known services claim."""


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default, and IANA's dynamic range starts above it


def _binds(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(span: int = 1) -> int:
    """A port ``p`` where ``p`` .. ``p + span - 1`` all bind on 127.0.0.1 now, below the ephemeral range; random, so
    processes choosing at once rarely meet (and a collision shows as the server failing to start, not as a wrong
    answer)."""
    top = _ephemeral_start() - span
    if top <= _LOWEST:
        raise RuntimeError(f"no room below the ephemeral range (it starts at {top + span})")
    pick = random.SystemRandom()
    for _ in range(1_000):
        p = pick.randrange(_LOWEST, top)
        if all(_binds(p + i) for i in range(span)):
            return p
    raise RuntimeError(f"no {span} free consecutive ports found between {_LOWEST} and {top}")


def worker_ports(n: int) -> list[int]:
    """``n`` ports for RPC workers, each with its ``/status`` port (the next one) free, none overlapping."""
    out: list[int] = []
    while len(out) < n:
        p = free_port(span=2)
        if all(abs(p - q) > 1 for q in out):
            out.append(p)
    return out
