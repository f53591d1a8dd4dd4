"""Plans on cards of other backends than CUDA (issue 56): labels as llama.cpp names the buffers, and a card whose
free memory cannot be read (Vulkan without VK_EXT_memory_budget) planned on its total less a margin, the residents
subtracted, and said so in the plan and its JSON."""

from __future__ import annotations

from typing import Callable

from sizing.memory.context import ContextConfig
from sizing.memory.estimate import DeviceMemory, MemoryEstimate
from sizing.memory.kv import KvCells
from sizing.model.spec import ModelSpec
from sizing.plan import plan_json, plan_table
from sizing.plan.device import Backend, Device
from sizing.plan.make import PlanRequest, make_plan
from sizing.plan.residency import available
from sizing.units import MIB

GIB = 1 << 30
HOST = Device(0, "host memory", 48 * GIB, 64 * GIB, "host")
LAVAPIPE = Device(0, "llvmpipe (LLVM 15.0.6, 256 bits)", 2 * GIB - 205 * MIB, 2 * GIB,
                  backend=Backend("Vulkan", reports_free=False, host_buffer="Vulkan_Host"), free_margin_bytes=205 * MIB)
RADV = Device(0, "AMD Radeon RX 7900 XTX (RADV NAVI31)", 20 * GIB, 24 * GIB,
              backend=Backend("Vulkan", host_buffer="Vulkan_Host"))

Spec = Callable[..., ModelSpec]


def test_a_plan_on_a_vulkan_card_names_it_vulkan0(model_spec: Spec) -> None:
    plan = make_plan(model_spec("Llama-3.1-8B", "q4_k_m"), [RADV], HOST, PlanRequest(n_ctx=4096, cache_type="f16"))
    assert plan.verdict == "one_card"
    assert plan.estimate is not None and [g.device for g in plan.estimate.gpus] == ["Vulkan0"]
    assert "one card holds the model: Vulkan0 AMD Radeon RX 7900 XTX (RADV NAVI31)" in plan.reasons
    assert not any("free memory" in w for w in plan.warnings)
    d = plan_json(plan)["devices"][0]  # type: ignore[index]
    assert d["label"] == "Vulkan0" and d["backend"] == "Vulkan" and d["free_memory"] == "reported"
    assert "free_note" not in d


def test_a_card_that_cannot_report_free_memory_is_said_so(model_spec: Spec) -> None:
    plan = make_plan(model_spec("Llama-3.1-8B", "q4_k_m"), [LAVAPIPE], HOST,
                     PlanRequest(n_ctx=512, cache_type="f16", allowance_bytes=0))
    note = next(w for w in plan.warnings if "does not report its free memory" in w)
    assert note.startswith("Vulkan0 (llvmpipe (LLVM 15.0.6, 256 bits)) does not report its free memory")
    assert "2048 MiB" in note and "205 MiB margin" in note and "GGUF_UNREPORTED_FREE_MARGIN_PCT" in note
    j = plan_json(plan)
    d = j["devices"][0]  # type: ignore[index]
    assert (d["free_memory"], d["free_mib"], d["free_margin_mib"], d["free_note"]) == (
        "unreported", 1843.0, 205.0, note)
    rows = j["estimate"]["devices"]  # type: ignore[index]
    assert {r["device"]: r["free_memory"] for r in rows}["Vulkan0"] == "unreported"
    assert "Vulkan0 llvmpipe (LLVM 15.0.6, 256 bits) 1843.0/2048.0 MiB free (not reported: the total less a margin)" \
        in plan_table(plan)


def test_no_note_where_the_card_is_not_used(model_spec: Spec) -> None:
    plan = make_plan(model_spec("Llama-3.1-8B", "q4_k_m"), [RADV, LAVAPIPE], HOST,
                     PlanRequest(n_ctx=4096, cache_type="f16"))
    assert plan.placement.gpus == (0,)
    assert not any("free memory" in w for w in plan.warnings)


def held(**cards: int) -> MemoryEstimate:
    return MemoryEstimate(ContextConfig(n_ctx=4096), True, KvCells(4096, 0), DeviceMemory("CPU"),
                          tuple(DeviceMemory(label, weights_bytes=n) for label, n in cards.items()))


def test_residents_are_subtracted_on_a_card_that_cannot_report_free_memory_even_live() -> None:
    """A live card's free figure already excludes the residents (NVML, a memory budget); the total a card without
    one reports does not, so what this server's models hold there is subtracted as on a declared card."""
    reported = Device(1, "radv", 20 * GIB, 24 * GIB, backend=Backend("Vulkan"))
    lavapipe = Device(0, LAVAPIPE.name, LAVAPIPE.free_bytes, LAVAPIPE.total_bytes, backend=LAVAPIPE.backend)
    gpus, _ = available([lavapipe, reported], HOST, [held(Vulkan0=500 * MIB, Vulkan1=3 * GIB)], live=True)
    assert gpus[0].free_bytes == LAVAPIPE.free_bytes - 500 * MIB
    assert gpus[1].free_bytes == 20 * GIB
    # A resident to evict gives its bytes back only where the figure had them out.
    gpus, _ = available([lavapipe, reported], HOST, [], [held(Vulkan0=500 * MIB, Vulkan1=3 * GIB)], live=True)
    assert gpus[0].free_bytes == LAVAPIPE.free_bytes
    assert gpus[1].free_bytes == 23 * GIB
