"""Whether an address stays on this machine: the one rule the API's bind check, the worker's and the KV events' use."""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback address (IPv6 in brackets or not); a host name other than localhost may resolve
    anywhere, so it is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


__all__ = ["is_loopback"]
