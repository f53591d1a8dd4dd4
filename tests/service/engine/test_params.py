"""The one plan -> llama.cpp translation (service.engine.params): what the engine and the dry run both receive."""

from __future__ import annotations

import json

from sizing.memory.context import ContextConfig
from sizing.probe.devices import Device
from sizing.memory.placement import Placement

from service.engine.params import (
    LLAMA_FLASH_ATTN_TYPE_AUTO, LLAMA_FLASH_ATTN_TYPE_DISABLED, LLAMA_FLASH_ATTN_TYPE_ENABLED,
    ContextParams, ModelParams, context_params, device_params, model_params, physical_cores,
)


def test_tensor_split_names_every_device_with_zero_for_unused_cards() -> None:
    # Cards 1 and 3 of four, 10 and 20 slots: llama.cpp must see four proportions, zeros on 0 and 2.
    pl = Placement(gpus=(0, 1), n_gpu_layers=30, tensor_split=(10.0, 20.0))
    mp = model_params(pl, device_indexes=[1, 3], n_devices=4)
    assert mp.tensor_split == (0.0, 10.0, 0.0, 20.0)
    assert mp.main_gpu == 1
    assert mp.n_gpu_layers == 30


def test_one_card_plan_puts_everything_on_that_card() -> None:
    mp = model_params(Placement(gpus=(0,), n_gpu_layers=19, tensor_split=(1.0,)), device_indexes=[2], n_devices=3)
    assert mp.tensor_split == (0.0, 0.0, 1.0) and mp.main_gpu == 2


def test_cpu_only_plan_gives_no_split_and_no_gpu_layers() -> None:
    mp = model_params(Placement())
    assert mp == ModelParams()
    assert mp.n_gpu_layers == 0 and mp.tensor_split == ()


def test_expert_blocks_on_host_become_a_buffer_override() -> None:
    mp = model_params(Placement(gpus=(0,), n_gpu_layers=49, tensor_split=(1.0,), n_cpu_moe=3))
    assert mp.cpu_overrides == (r"^blk\.(0|1|2)\.ffn_(up|down|gate)_exps",)


def test_context_params_clamp_batches_as_llama_does() -> None:
    cp = context_params(ContextConfig(n_ctx=300, type_k="q8_0", type_v="q4_0", flash_attn="on", n_batch=512,
                                      n_ubatch=512, n_seq_max=4))
    assert (cp.n_batch, cp.n_ubatch, cp.n_seq_max) == (300, 300, 4)
    assert (cp.type_k, cp.type_v) == (8, 2)
    assert cp.flash_attn_type == LLAMA_FLASH_ATTN_TYPE_ENABLED
    assert context_params(ContextConfig(n_ctx=4096, flash_attn="off")).flash_attn_type == LLAMA_FLASH_ATTN_TYPE_DISABLED
    assert context_params(ContextConfig(n_ctx=4096, flash_attn="auto")).flash_attn_type == LLAMA_FLASH_ATTN_TYPE_AUTO
    # At least one token per sequence in a batch, even with a tiny context.
    assert context_params(ContextConfig(n_ctx=2, n_seq_max=8)).n_batch == 8


def test_params_cross_the_process_boundary_unchanged() -> None:
    mp = model_params(Placement(gpus=(0, 1), n_gpu_layers=20, tensor_split=(1.0, 3.0), n_cpu_moe=1), [0, 1])
    cp = context_params(ContextConfig(n_ctx=8192, type_k="q8_0", type_v="q8_0", flash_attn="on", swa_full=True))
    assert ModelParams.from_json(json.loads(json.dumps(mp.to_json()))) == mp
    assert ContextParams.from_json(json.loads(json.dumps(cp.to_json()))) == cp


def test_physical_cores_is_at_least_one_and_at_most_logical() -> None:
    import os

    assert 1 <= physical_cores() <= (os.cpu_count() or 1)


def test_plan_params_use_the_plans_device_indexes(embedded_model: str) -> None:
    from sizing.probe import probe_path
    from sizing.plan.make import PlanRequest, make_plan
    from service.engine.params import plan_params

    gib = 1 << 30
    spec = probe_path(embedded_model)
    cards = [Device(0, "A", 1 * gib, 24 * gib), Device(1, "B", 20 * gib, 24 * gib), Device(2, "C", 20 * gib, 24 * gib)]
    plan = make_plan(spec, cards, Device(0, "host", 20 * gib, 24 * gib, "host"), PlanRequest(gpu=2, n_ctx=4096))
    mp, cp = plan_params(plan)
    assert mp.tensor_split == (0.0, 0.0, 1.0) and mp.main_gpu == 2 and mp.n_gpu_layers == spec.n_layer_all + 1
    assert cp.n_ctx == plan.cfg.n_ctx and cp.flash_attn_type in (LLAMA_FLASH_ATTN_TYPE_ENABLED, LLAMA_FLASH_ATTN_TYPE_DISABLED)


def test_a_context_below_the_slot_count_is_raised_to_it() -> None:
    """llama.cpp aborts (output_reserve's assert) when n_batch, clamped to n_ctx, is below n_seq_max."""
    cp = context_params(ContextConfig(n_ctx=1, n_seq_max=4, kv_unified=True))
    assert cp.n_ctx >= cp.n_seq_max == 4 and cp.n_batch >= 4
    assert context_params(ContextConfig(n_ctx=4096, n_seq_max=4)).n_ctx == 4096


def test_a_cpu_plan_beside_a_vulkan_card_loads_without_it() -> None:
    """A CPU-only plan where a Vulkan card is: loaded with the CPU alone (``ModelParams.host_only``: llama.cpp would
    otherwise run large batches' ops on the card, op_offload, in a compute buffer the plan did not count there);
    beside a CUDA card, as before."""
    from sizing.plan.device import Backend

    gib = 1 << 30
    vk = Device(0, "llvmpipe", gib, 2 * gib, backend=Backend("Vulkan", host_buffer="Vulkan_Host"))
    cuda = Device(0, "RTX", gib, 2 * gib)
    assert device_params(Placement(), [vk]).host_only
    assert not device_params(Placement(), [cuda]).host_only
    assert not device_params(Placement(gpus=(0,), n_gpu_layers=5, tensor_split=(1.0,)), [vk]).host_only
    mp = device_params(Placement(), [vk])
    assert ModelParams.from_json(mp.to_json()) == mp
