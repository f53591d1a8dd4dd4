"""GPU terms per backend (issue 56): a backend is a row of ``sizing.memory.gpu.BACKENDS``. CUDA's row gives what it
gave before (the request's allowance, the pool bound, the whole graph on a card); Vulkan's keeps a weight whose op
ggml-vulkan refuses in host memory, pads the card's weights to ggml's alignment, bounds ggml-vulkan's scratch
buffers and takes its own allowance. The figures are lavapipe's, measured (``make test-vulkan``,
``bench/vulkan_accuracy.py``)."""

from __future__ import annotations

from typing import Callable

import pytest

from sizing.memory import Card, ContextConfig, Placement, estimate, gpu, vulkan_scratch
from sizing.memory.compute import compute_bytes, layers_compute_bytes
from sizing.model.spec import ModelSpec
from sizing.plan.device import Backend, Device
from sizing.plan.make import PlanRequest, make_plan
from sizing.probe import probe_path
from sizing.units import MIB, mib

GIB = 1 << 30
LAVAPIPE = Card("Vulkan", None, 16, 128 * MIB)
"""Mesa 22.3's lavapipe as ggml reports it: 16-byte alignment, ops on tensors up to 128 MiB (maxStorageBufferRange)."""
RADV = Card("Vulkan", None, 64, 4 * GIB - 1)
HOST = Device(0, "host memory", 48 * GIB, 64 * GIB, "host")


@pytest.fixture(scope="module")
def gemma(embedded_path: str) -> ModelSpec:
    return probe_path(embedded_path)


@pytest.fixture(scope="module")
def smollm2() -> ModelSpec:
    from service.catalog.embedded import instruct_model_path

    return probe_path(instruct_model_path())


def whole(spec: ModelSpec, n: int = 1) -> Placement:
    if n == 1:
        return Placement(gpus=(0,), n_gpu_layers=spec.n_layer_all + 1, tensor_split=(1.0,))
    return Placement(gpus=tuple(range(n)), n_gpu_layers=spec.n_layer_all + 1, tensor_split=(1.0,) * n)


def test_the_tied_head_past_the_range_stays_on_the_host(gemma: ModelSpec) -> None:
    """gemma-3-270m's q8_0 embedding (170 MiB) is also its head: lavapipe refuses MUL_MAT on it (and on its 512-row
    result, 512 MiB), so the card holds 65.16 MiB, the host the 170.00 MiB it maps anyway (lavapipe's load logs
    both); a card with a 4 GiB range takes the head, as a CUDA card does."""
    cfg = ContextConfig(2048, "f16", "f16", "on")
    lava = estimate(gemma, cfg, whole(gemma), gpu_labels=["Vulkan0"], cards=[LAVAPIPE])
    assert (mib(lava.host.weights_bytes), mib(lava.gpus[0].weights_bytes)) == (170.0, 65.16)
    cuda = estimate(gemma, cfg, whole(gemma), gpu_labels=["CUDA0"])
    radv = estimate(gemma, cfg, whole(gemma), gpu_labels=["Vulkan0"], cards=[RADV])
    assert mib(radv.gpus[0].weights_bytes) == mib(cuda.gpus[0].weights_bytes) == 235.16
    assert radv.host.weights_bytes == cuda.host.weights_bytes == gemma.token_embd_bytes
    # The logits are then the host's: simulated, the card gets its layers' phases, the host the whole graph.
    assert lava.gpus[0].compute_bytes < compute_bytes(gemma, cfg, True) <= lava.host.compute_bytes
    assert lava.gpus[0].compute_bytes == layers_compute_bytes(gemma, cfg, True)


def test_the_rule_is_the_test_op_of_each_weight(gemma: ModelSpec) -> None:
    head = next(t for t in gemma.tensors if t.name == "token_embd.weight")
    assert gpu.vulkan_test_op_bytes(head, op="MUL_MAT") == 4 * gemma.n_vocab * 512  # the result: 512 MiB
    assert gpu.vulkan_refuses(head, 128 * MIB, op="MUL_MAT") and not gpu.vulkan_refuses(head, 0, op="MUL_MAT")
    assert gpu.vulkan_refuses(head, 128 * MIB, op="GET_ROWS")  # the 170 MiB weight itself
    assert not gpu.vulkan_refuses(head, 256 * MIB, op="GET_ROWS")
    block = [t for t in gemma.tensors if t.layer == 0]
    assert not any(gpu.vulkan_refuses(t, 128 * MIB) for t in block)


def test_scratch_bound_mirrors_each_buffer(gemma: ModelSpec) -> None:
    """Flash attention over a q8_0 cache: the F16 copies of K and V of every cell (lavapipe allocated 256 KiB at 256
    cells, 2 x 256 x (256 + 256)); without flash attention: a copy of the larger view and the kq rows in F16."""
    fa = vulkan_scratch(gemma, ContextConfig(256, "q8_0", "q8_0", "on"), True)
    assert fa.x_bytes == 2 * 256 * (256 + 256) == 262144
    assert fa.partials_bytes == 1024 and fa.split_k_bytes > 0
    f16 = vulkan_scratch(gemma, ContextConfig(256, "f16", "f16", "on"), True)
    assert f16.x_bytes == 0  # nothing to dequantize
    off = vulkan_scratch(gemma, ContextConfig(2048, "f16", "f16", "off"), False)
    assert off.x_bytes == 2 * 2048 * 256
    assert off.y_bytes == max(2 * 2048 * 512 * 4, 2 * 512 * 2048)  # kq rows of 4 heads in F16; the widest input
    assert gpu.terms("Vulkan").pool(gemma, ContextConfig(256, "q8_0", "q8_0", "on"), True, None) == fa.total_bytes


def test_cuda_row_gives_what_cuda_plans_had(gemma: ModelSpec) -> None:
    cfg = ContextConfig(4096, "q8_0", "q8_0", "on")
    for n in (1, 2):
        labels = [f"CUDA{i}" for i in range(n)]
        before = estimate(gemma, cfg, whole(gemma, n), gpu_labels=labels, allowance_bytes=477 * MIB)
        rows = estimate(gemma, cfg, whole(gemma, n), gpu_labels=labels, allowance_bytes=477 * MIB,
                        cards=[Card()] * n, host_features=frozenset({"AVX2", "REPACK"}))
        assert rows == before
        assert all(g.pool_bytes == gpu.cuda_pool_bound_bytes(gemma, cfg, True) for g in rows.gpus)
        assert all(g.allowance_bytes == 477 * MIB for g in rows.gpus)
    assert gpu.terms("ROCm").pool is gpu.terms("CUDA").pool and gpu.terms("SYCL") is gpu.CUDA_TERMS


def test_a_vulkan_card_takes_its_own_allowance_and_scratch(gemma: ModelSpec) -> None:
    card = Device(0, "llvmpipe", 1843 * MIB, 2048 * MIB, backend=Backend("Vulkan", reports_free=False,
                                                                          host_buffer="Vulkan_Host"),
                  alignment_bytes=16, max_tensor_bytes=128 * MIB)
    req = PlanRequest(n_ctx=512, cache_type="q8_0", flash_attn="on", allowance_bytes=477 * MIB)
    plan = make_plan(gemma, [card], HOST, req)
    assert plan.estimate is not None
    (g,) = plan.estimate.gpus
    assert g.allowance_bytes == gpu.VULKAN_ALLOWANCE_BYTES
    assert g.pool_bytes == vulkan_scratch(gemma, plan.estimate.cfg, True, g.layers).total_bytes
    assert mib(g.weights_bytes) == 65.16
    # The host stages the card's weights through a buffer as large as the largest (where the card's memory is not
    # host-visible; lavapipe's is, and stages none): a bound in the host's pool.
    assert plan.estimate.host.pool_bytes == max(t.n_bytes for t in gemma.tensors if t.layer is not None)
    cuda = make_plan(gemma, [Device(0, "RTX", 8 * GIB, 8 * GIB)], HOST, req)
    assert cuda.estimate is not None and cuda.estimate.host.pool_bytes == 0
    plan = make_plan(gemma, [card], HOST, PlanRequest(n_ctx=512, cache_type="q8_0", flash_attn="on",
                                                      backend_allowance_bytes=(("Vulkan", 100 * MIB),)))
    assert plan.estimate is not None and plan.estimate.gpus[0].allowance_bytes == 100 * MIB


def test_the_host_maps_a_span_of_the_file(smollm2: ModelSpec) -> None:
    """SmolLM2's blocks are in the file in name order (blk.2 after blk.19): 28 blocks on the host and 2 on a Vulkan
    card, the host's mapping spans the card's two (lavapipe's load logs CPU_Mapped 92.10 MiB, the sum is 87.87)."""
    pl = Placement(gpus=(0,), n_gpu_layers=3, tensor_split=(1.0,))
    cfg = ContextConfig(512, "f16", "f16", "off")
    vk = estimate(smollm2, cfg, pl, gpu_labels=["Vulkan0"], cards=[LAVAPIPE])
    assert (mib(vk.host.weights_bytes), mib(vk.gpus[0].weights_bytes)) == (92.1, 32.92)
    cuda = estimate(smollm2, cfg, pl, gpu_labels=["CUDA0"])
    assert mib(cuda.host.weights_bytes) == 87.87  # CUDA's plans keep the sum (the figures its tests hold)


def test_a_scan_ggml_vulkan_has_no_shader_for_stays_on_the_host(fixture_spec: Callable[..., ModelSpec]) -> None:
    """ggml-vulkan scans Mamba-2's state only (d_state 128 or 256): Mamba-1's ``ssm_a`` (d_state x d_inner) stays on
    the host beside a Vulkan card, one a block (llama.cpp's dry run beside lavapipe moved 50: those 48, the
    embedding and the tied head); Mamba-2's goes to the card."""
    mamba1, mamba2 = fixture_spec("Mamba-1.4B"), fixture_spec("Mamba2-2.7B")
    a1 = [t for t in mamba1.tensors if t.name.endswith(".ssm_a")]
    a2 = [t for t in mamba2.tensors if t.name.endswith(".ssm_a")]
    assert len(a1) == mamba1.n_layer and a2
    assert all(gpu.vulkan_refuses(t, 128 * MIB, ssm=mamba1.ssm) for t in a1)
    assert not any(gpu.vulkan_refuses(t, 128 * MIB, ssm=mamba2.ssm) for t in a2)
    assert not any(gpu.vulkan_refuses(t, 0, ssm=mamba1.ssm) for t in a1)  # no card's figures: nothing refused
    cfg = ContextConfig(4096, "f16", "f16", "on")
    lava = estimate(mamba1, cfg, whole(mamba1), gpu_labels=["Vulkan0"], cards=[LAVAPIPE])
    cuda = estimate(mamba1, cfg, whole(mamba1), gpu_labels=["CUDA0"])
    moved = sum(t.n_bytes for t in a1)
    assert lava.host.weights_bytes - cuda.host.weights_bytes >= moved
