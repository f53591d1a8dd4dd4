"""Units: bytes as the plan counts them, MiB as llama.cpp's logs and every answer show them."""

from __future__ import annotations

MIB = 1 << 20


def mib(n: int | float) -> float:
    """Bytes in MiB, rounded to the 0.01 MiB llama.cpp's log lines print: the one formatter of every figure shown."""
    return round(n / MIB, 2)


__all__ = ["MIB", "mib"]
