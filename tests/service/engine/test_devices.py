"""ggml's device list read in a child process (``service.engine.devices``, issue 56): which builds start the
child, when the list is read again, and the child itself on this build."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from service.engine import devices as D
from sizing.errors import DeviceError
from sizing.probe import NvmlCard
from sizing.probe import devices as probe_devices

GIB = 1 << 30


def test_gpu_backends_are_the_ggml_libraries_beside_the_cpu_ones(tmp_path: Path) -> None:
    for name in ("libggml.so", "libggml-base.so.0", "libggml-cpu.so", "libggml-cpu-haswell.so", "libggml-rpc.so",
                 "libggml-blas.so", "libllama.so"):
        (tmp_path / name).touch()
    assert D.gpu_backends(tmp_path) == ()
    (tmp_path / "libggml-vulkan.so.0.25.3").touch()
    (tmp_path / "libggml-hip.so").touch()
    assert D.gpu_backends(tmp_path) == ("hip", "vulkan")


def rows(free: int, total: int = 2 * GIB) -> list[dict[str, Any]]:
    return [{"name": "CPU", "type": "cpu", "backend": "CPU", "free_bytes": GIB, "total_bytes": GIB},
            {"name": "Vulkan0", "description": "card", "type": "gpu", "backend": "Vulkan", "free_bytes": free,
             "total_bytes": total}]


@pytest.mark.parametrize(("free", "reads"), [(2 * GIB, 1), (GIB, 3)])
def test_the_list_is_read_again_only_where_its_free_figures_are_ggmls_own(
        monkeypatch: pytest.MonkeyPatch, free: int, reads: int) -> None:
    """A card that gives its total as free has nothing new to say: read once. One with a memory budget is read for
    each plan (here with ``reread_s`` 0)."""
    calls: list[int] = []

    def read(timeout_s: float = D.READ_TIMEOUT_S) -> list[dict[str, Any]]:
        calls.append(1)
        return rows(free)

    monkeypatch.setattr(D, "gpu_backends", lambda libdir=None: ("vulkan",))
    monkeypatch.setattr(D, "read_rows", read)
    local = D.LocalDevices(reread_s=0.0)
    for _ in range(3):
        cards = local.cards()
    assert [c.label for c in cards] == ["Vulkan0"]
    assert cards[0].free_memory == ("unreported" if free == 2 * GIB else "reported")
    assert len(calls) == reads
    assert local.skipped == ("CPU: a cpu device of CPU backend holds no layers",)


def test_no_child_on_a_cpu_build_and_declared_cards_as_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU build's cards are NVML's, as before ggml's list was read; declared cards are as given, whatever the
    build."""
    def fail(timeout_s: float = 0) -> list[dict[str, Any]]:
        raise AssertionError("no child here")

    monkeypatch.setattr(D, "read_rows", fail)
    monkeypatch.setattr(D, "gpu_backends", lambda libdir=None: ())
    monkeypatch.setattr(probe_devices, "nvml_cards",
                        lambda: [NvmlCard(0, "NVIDIA L4", 20 * GIB, 22 * GIB, "00000000:01:00.0")])
    assert [(c.label, c.name) for c in D.LocalDevices().cards()] == [("CUDA0", "NVIDIA L4")]
    monkeypatch.setattr(D, "gpu_backends", lambda libdir=None: ("vulkan",))
    declared = D.LocalDevices(declared_json='[{"name": "x", "free_mib": 100, "backend": "Vulkan"}]')
    assert [c.label for c in declared.cards()] == ["Vulkan0"]


def test_a_list_that_cannot_be_read_falls_back_to_nvml_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def broken(timeout_s: float = 0) -> list[dict[str, Any]]:
        calls.append(1)
        raise DeviceError("ggml's device list could not be read (exit 134): ggml_vulkan: abort")

    monkeypatch.setattr(D, "gpu_backends", lambda libdir=None: ("vulkan",))
    monkeypatch.setattr(D, "read_rows", broken)
    monkeypatch.setattr(D, "inventory", lambda **kw: [])
    local = D.LocalDevices()
    assert local.cards() == [] and local.cards() == []
    assert len(calls) == 1 and local.error is not None and "exit 134" in local.error


def test_the_child_lists_this_builds_devices() -> None:
    """The child on the build the tests run (the CPU one: the CPU device only; a Vulkan build adds its cards)."""
    listed = D.read_rows()
    cpu = next(r for r in listed if r["type"] == "cpu")
    assert cpu["name"] == "CPU" and cpu["backend"] == "CPU" and cpu["total_bytes"] > 0
    assert {"description", "free_bytes", "device_id", "host_buffer", "alignment", "max_size", "caps"} <= set(cpu)
    assert cpu["alignment"] > 0 and cpu["max_size"] > 0
