"""NextN/MTP blocks (GLM-4.5, DeepSeek-V3, Qwen3.5, MiMo, Step-3.5 ... carry one or more after their main blocks,
``nextn_predict_layers``): llama.cpp creates their tensors with ``TENSOR_SKIP`` unless the model is loaded with
``load_mtp``, and a skipped tensor gets no buffer. The engine does not load them, so the plan must not count them:
counting them was 1.6 GiB of VRAM left unused on GLM-4.5-Air at Q4_K_M. What can break: the block's bytes back
in a device's weights, the block's slot moving the output layer, the loaded bytes differing from llama.cpp's."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from service.engine.base import Cancel, GenerationParams
from service.engine.llama import LlamaEngine
from service.text.served import ServedModel
from sizing.memory.placement import Placement
from sizing.plan.device import MIB, Device
from sizing.plan.make import PlanRequest, make_plan
from sizing.plan.report import spec_json
from sizing.plan.sizer import Sizer
from sizing.probe import probe_path
from sizing.probe.devices import host_memory
from sizing.testing.fixtures import TINY_GLM4MOE, write_fixture

GIB = 1 << 30


def test_a_real_load_allocates_what_the_plan_counts_without_the_nextn_block(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    path = write_fixture("tiny-glm4moe", tmp_path, quant="q8_0", shape=TINY_GLM4MOE)
    spec = probe_path(path)
    assert (spec.n_layer, spec.n_layer_all) == (2, 3)
    assert spec.nextn_weights_bytes == spec.layers[2].weights_bytes > 0.2 * MIB
    plan = make_plan(spec, [], host_memory(), PlanRequest(n_ctx=1024, n_seq_max=1, min_ctx=256, cpu_repack=False))
    est = plan.estimate
    assert est is not None
    assert est.host.weights_bytes == spec.loaded_weights_bytes == spec.weights_bytes - spec.nextn_weights_bytes
    eng = ServedModel.of(LlamaEngine())
    with caplog.at_level(logging.INFO, logger="service.engine.llama"):
        report = eng.load(path, plan)
    assert "the file's 1 NextN/MTP block(s) are not loaded" in caplog.text
    try:
        (cpu,) = [a for a in report.allocations if a.device == "CPU"]
        # llama.cpp's ``CPU model buffer size`` line (0.01 MiB resolution) is the plan's weights, not the file's
        assert abs(cpu.weights_bytes - est.host.weights_bytes) <= 0.01 * MIB, (cpu.weights_bytes / MIB,
                                                                                est.host.weights_bytes / MIB)
        assert abs(cpu.kv_bytes - est.host.kv_bytes) <= 0.01 * MIB
        # the model without its MTP block still runs (zeros: the tokens mean nothing)
        chunks = list(eng.generate(eng.tokenize("The sea"), GenerationParams(max_tokens=4, temperature=0.0), Cancel()))
        assert chunks[-1].completion_tokens == 4
    finally:
        eng.unload()


@pytest.mark.parametrize("quant", ["q4_k_m", "bf16"])
def test_on_a_card_the_nextn_block_costs_nothing_and_keeps_its_slot(tmp_path: Path, quant: str) -> None:
    path = write_fixture("GLM-4.5-Air", tmp_path, quant=quant)  # type: ignore[arg-type]
    spec = probe_path(path)
    assert (spec.n_layer, spec.n_layer_all) == (46, 47)
    assert spec.nextn_weights_bytes > (1.5 if quant == "q4_k_m" else 4.0) * GIB  # 128 experts of 1408 x 4096, x 3
    probed = spec_json(spec)  # what ``python -m sizing probe`` prints
    assert (probed["nextn_layers"], probed["nextn_weights_bytes"], probed["nextn_loaded"]) == (
        1, spec.nextn_weights_bytes, False)
    card = Device(0, "RTX PRO 6000", 600 * GIB, 600 * GIB)
    host = Device(0, "host memory", 64 * GIB, 64 * GIB, "host")
    req = PlanRequest(n_ctx=8192, n_seq_max=1, min_ctx=256)
    sz = Sizer(spec, [card], host, req, "f16")
    full = Placement(gpus=(0,), n_gpu_layers=spec.n_layer_all + 1, tensor_split=(1.0,))
    est = sz.estimate(full, 8192)
    (gpu,) = est.gpus
    # every loaded byte is somewhere, the MTP block's nowhere: the token embedding stays on the host
    assert est.host.weights_bytes == spec.token_embd_bytes
    assert gpu.weights_bytes + est.host.weights_bytes == spec.loaded_weights_bytes
    assert 46 in gpu.layers  # the block's slot is still the card's, as llama.cpp assigns it
    # two slots fewer on the card: blocks 0 and 1 go to the host with their bytes; the NextN slot stays
    part = sz.estimate(Placement(gpus=(0,), n_gpu_layers=spec.n_layer_all - 1, tensor_split=(1.0,)), 8192)
    assert part.host.layers == (0, 1) and 46 in part.gpus[0].layers
    moved = spec.layers[0].weights_bytes + spec.layers[1].weights_bytes
    assert part.gpus[0].weights_bytes == gpu.weights_bytes - moved
    assert part.host.weights_bytes == spec.token_embd_bytes + moved


def test_experts_kept_in_host_memory_never_count_the_nextn_blocks(tmp_path: Path) -> None:
    """``n_cpu_moe`` over every block (``--cpu-moe``): the main blocks' experts move to the host, the NextN block's
    are nowhere; neither device may count them, added or taken away."""
    path = write_fixture("GLM-4.5-Air", tmp_path, quant="q4_k_m")
    spec = probe_path(path)
    card = Device(0, "RTX PRO 6000", 600 * GIB, 600 * GIB)
    host = Device(0, "host memory", 256 * GIB, 256 * GIB, "host")
    sz = Sizer(spec, [card], host, PlanRequest(n_ctx=8192, n_seq_max=1, min_ctx=256), "f16")
    full = Placement(gpus=(0,), n_gpu_layers=spec.n_layer_all + 1, tensor_split=(1.0,))
    base = sz.estimate(full, 8192)
    experts = sum(spec.layers[il].expert_bytes for il in range(spec.n_layer))
    assert spec.layers[spec.n_layer].expert_bytes > GIB  # the NextN block's own experts, not loaded
    for n_cpu_moe in (spec.n_layer, spec.n_layer_all):
        est = sz.estimate(Placement(gpus=(0,), n_gpu_layers=spec.n_layer_all + 1, tensor_split=(1.0,),
                                    n_cpu_moe=n_cpu_moe), 8192)
        assert est.host.weights_bytes == spec.token_embd_bytes + experts, n_cpu_moe
        assert est.gpus[0].weights_bytes == base.gpus[0].weights_bytes - experts, n_cpu_moe
        assert est.gpus[0].weights_bytes + est.host.weights_bytes == spec.loaded_weights_bytes
