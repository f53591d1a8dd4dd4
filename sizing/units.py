"""Units and names: bytes as the plan counts them, MiB as llama.cpp's logs and every answer show them, and the
label a card goes by."""

from __future__ import annotations

MIB = 1 << 20


def mib(n: int | float) -> float:
    """Bytes in MiB, rounded to the 0.01 MiB llama.cpp's log lines print: the one formatter of every figure shown."""
    return round(n / MIB, 2)


def gpu_label(index: int) -> str:
    """The name of card ``index`` in the plan, the answers and llama.cpp's logs (its CUDA backend's device name):
    the one place it is spelled."""
    return f"CUDA{index}"


__all__ = ["MIB", "gpu_label", "mib"]
