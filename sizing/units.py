"""Units and names: bytes as the plan counts them, MiB as llama.cpp's logs and every answer show them, and the
label a card goes by."""

from __future__ import annotations

MIB = 1 << 20


def mib(n: int | float) -> float:
    """Bytes in MiB, rounded to the 0.01 MiB llama.cpp's log lines print: the one formatter of every figure shown."""
    return round(n / MIB, 2)


def gpu_label(index: int, prefix: str = "CUDA") -> str:
    """The name of card ``index`` of a backend in the plan, the answers and llama.cpp's logs, as ggml names the
    backend's devices and llama.cpp their buffers (``CUDA0``, ``ROCm0``, ``Vulkan0``, ``SYCL0``, ``MTL0``;
    ``ggml_backend_dev_name``): the one place it is spelled. CUDA's where a card's backend is not known (NVML, a
    declared inventory)."""
    return f"{prefix}{index}"


__all__ = ["MIB", "gpu_label", "mib"]
