"""ggml's device list read into ``Device`` values (issue 56): llama.cpp's choice among the devices, their labels as
llama.cpp names their buffers, free memory that cannot be read, NVML's figures for NVIDIA cards, declared cards of
another backend. The rows are what ``python -m service.engine.devices`` prints (as read on lavapipe and on the
shapes of CUDA and mixed builds)."""

from __future__ import annotations

from typing import Any

import pytest

from sizing.errors import DeviceError
from sizing.probe.devices import NvmlCard, ggml_devices, parse_declared, pci_key, unreported_free
from sizing.units import MIB

GIB = 1 << 30


def row(name: str, kind: str = "gpu", free: int = 2 * GIB, total: int = 2 * GIB, backend: str = "",
        device_id: str | None = None, description: str = "", host_buffer: str | None = None) -> dict[str, Any]:
    backend = backend or name.rstrip("0123456789")
    return {"name": name, "description": description or f"{name} card", "type": kind, "backend": backend,
            "free_bytes": free, "total_bytes": total, "device_id": device_id,
            "host_buffer": host_buffer if host_buffer is not None else f"{backend}_Host",
            "alignment": 64, "max_size": 1 << 31}


CPU = row("CPU", "cpu", 20 * GIB, 24 * GIB, "CPU", host_buffer="")
LAVAPIPE = row("Vulkan0", description="llvmpipe (LLVM 15.0.6, 256 bits)")


def test_lavapipe_is_vulkan0_whose_free_memory_is_not_reported() -> None:
    """lavapipe (Mesa 22.3, no VK_EXT_memory_budget): ggml gives its 2 GiB heap as free for ever. The plan takes the
    total less the margin, and says so."""
    devices, skipped = ggml_devices([CPU, LAVAPIPE])
    assert len(devices) == 1
    d = devices[0]
    assert (d.label, d.index, d.name) == ("Vulkan0", 0, "llvmpipe (LLVM 15.0.6, 256 bits)")
    assert d.backend.prefix == "Vulkan" and d.backend.host_buffer == "Vulkan_Host"
    assert d.free_memory == "unreported" and not d.backend.reports_free
    assert d.total_bytes == 2 * GIB
    assert d.free_margin_bytes == 2 * GIB // 10 + 1 == 214_748_365  # 10 %, rounded up
    assert d.free_bytes == 2 * GIB - d.free_margin_bytes
    assert (d.alignment_bytes, d.max_buffer_bytes) == (64, 1 << 31)
    assert skipped == ["CPU: a cpu device of CPU backend holds no layers"]


def test_margin_follows_the_setting() -> None:
    devices, _ = ggml_devices([LAVAPIPE], margin_pct=0)
    assert devices[0].free_bytes == 2 * GIB and devices[0].free_memory == "unreported"
    assert unreported_free(1000, 25) == (750, 250)
    assert unreported_free(1000, 100) == (0, 1000)


def test_two_lavapipe_devices_are_vulkan0_and_vulkan1() -> None:
    """GGML_VK_VISIBLE_DEVICES=0,0: one lavapipe twice, without a PCI id, so llama.cpp keeps both."""
    devices, _ = ggml_devices([CPU, LAVAPIPE, row("Vulkan1", description="llvmpipe")])
    assert [(d.index, d.label) for d in devices] == [(0, "Vulkan0"), (1, "Vulkan1")]


def test_a_card_that_reports_its_budget_is_live() -> None:
    """Vulkan with VK_EXT_memory_budget (radv, anv): free below total is a measurement."""
    devices, _ = ggml_devices([row("Vulkan0", free=7 * GIB, total=8 * GIB, device_id="0000:03:00.0")])
    d = devices[0]
    assert d.free_memory == "reported" and d.free_bytes == 7 * GIB and d.free_margin_bytes == 0
    assert d.device_id == "0000:03:00.0"


def test_the_same_card_through_two_backends_is_used_once_and_keeps_its_backend_number() -> None:
    """A CUDA + Vulkan build on an NVIDIA and an AMD card: ggml lists CUDA0, then Vulkan0 (the NVIDIA card again,
    same PCI id: llama.cpp skips it) and Vulkan1 (the AMD card). llama.cpp's devices are CUDA0 and Vulkan1, at
    positions 0 and 1: the label keeps ggml's name, the index llama.cpp's position (tensor_split's)."""
    rows = [CPU, row("CUDA0", free=20 * GIB, total=24 * GIB, device_id="0000:01:00.0"),
            row("Vulkan0", free=20 * GIB, total=24 * GIB, device_id="0000:01:00.0"),
            row("Vulkan1", free=15 * GIB, total=16 * GIB, device_id="0000:02:00.0")]
    devices, skipped = ggml_devices(rows)
    assert [(d.index, d.label) for d in devices] == [(0, "CUDA0"), (1, "Vulkan1")]
    assert "Vulkan0: the same device (0000:01:00.0) as CUDA0" in skipped


def test_cpu_accelerators_and_rpc_devices_hold_no_layers() -> None:
    rows = [CPU, row("BLAS", "accel", 0, 0, "BLAS"), row("RPC0[127.0.0.1:50052]", backend="RPC"), LAVAPIPE]
    devices, skipped = ggml_devices(rows)
    assert [d.label for d in devices] == ["Vulkan0"]
    assert len(skipped) == 3


def test_an_integrated_gpu_only_where_there_is_no_discrete_one_and_its_memory_is_the_hosts() -> None:
    igpu = row("Vulkan1", "igpu", free=10 * GIB, total=16 * GIB, description="Intel(R) UHD Graphics")
    alone, _ = ggml_devices([CPU, igpu])
    assert [d.label for d in alone] == ["Vulkan1"]
    assert alone[0].index == 0 and alone[0].gpu_type == "igpu" and alone[0].free_memory == "shared"
    beside, skipped = ggml_devices([CPU, row("Vulkan0", free=7 * GIB, total=8 * GIB), igpu])
    assert [d.label for d in beside] == ["Vulkan0"]
    assert any("integrated GPU, left out" in s for s in skipped)


def test_nvidia_cards_take_nvmls_name_and_figures_matched_by_pci_bus_id() -> None:
    """ggml-cuda's ``0000:c1:00.0`` is NVML's ``00000000:C1:00.0``; the cards are matched by it, not by position
    (CUDA_VISIBLE_DEVICES can hide the first)."""
    rows = [CPU, row("CUDA0", free=70 * GIB, total=80 * GIB, device_id="0000:c1:00.0")]
    nvml = [NvmlCard(0, "NVIDIA A100", 40 * GIB, 80 * GIB, "00000000:41:00.0"),
            NvmlCard(1, "NVIDIA H100 80GB HBM3", 60 * GIB, 80 * GIB, "00000000:C1:00.0", "GPU-1234", 30)]
    devices, _ = ggml_devices(rows, nvml)
    d = devices[0]
    assert (d.label, d.name, d.free_bytes, d.total_bytes) == ("CUDA0", "NVIDIA H100 80GB HBM3", 60 * GIB, 80 * GIB)
    assert d.free_memory == "reported"
    assert pci_key("0000:c1:00.0") == pci_key("00000000:C1:00.0") == (0, 0xC1, 0, 0)
    assert pci_key("not a bus id") is None


def test_rocm_and_sycl_and_metal_names_are_kept() -> None:
    for name in ("ROCm0", "SYCL0", "MTL0", "MUSA0"):
        devices, _ = ggml_devices([row(name, free=GIB, total=2 * GIB)])
        assert devices[0].label == name
        assert devices[0].backend.prefix == name[:-1]


def test_a_declared_card_is_cuda_unless_it_names_its_backend() -> None:
    cards = parse_declared([{"name": "RTX 3090", "free_mib": 20_000, "total_mib": 24_000},
                            {"name": "RX 7900 XTX", "free_mib": 20_000, "total_mib": 24_000, "backend": "Vulkan"}])
    assert [c.label for c in cards] == ["CUDA0", "Vulkan1"]
    assert cards[0].backend.host_buffer == "CUDA_Host" and cards[1].backend.host_buffer == "Vulkan_Host"
    assert all(c.free_memory == "reported" for c in cards)
    assert cards[1].free_bytes == 20_000 * MIB
    with pytest.raises(DeviceError, match="backend"):
        parse_declared([{"name": "x", "free_mib": 1, "backend": "Vulkan 0"}])
