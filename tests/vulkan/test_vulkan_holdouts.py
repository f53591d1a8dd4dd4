"""The holdout shapes (``sizing.testing``'s header-only GGUFs of real models' shapes) planned on a Vulkan card by
llama.cpp's dry run with the Vulkan backend: 0 false fits (issue 56).

Each shape is planned as the service plans it (``Planner``: ggml's device list, the Vulkan calibration, every cache
type's row); each row that fits is then measured once more, by the dry run with exactly that row's placement and
context, and llama.cpp's figures must not exceed the plan's, device by device: the KV cache, every compute buffer
(the card's; the host's and ``Vulkan_Host``'s together). The weights a no_alloc load does not size: what is checked
of them is the rule that keeps a weight off the card, the count of weights llama.cpp moved off their preferred
buffer (its load log's ``(and N others)``) against the count ``sizing.memory.gpu.vulkan_refuses`` gives.

A few shapes by default (a dense model, a sliding-window one, a MoE, a hybrid recurrent one); every holdout with
``GGUF_VULKAN_HOLDOUTS=all`` (about 2 minutes a shape on lavapipe)."""

from __future__ import annotations

import os
import re
from typing import Iterator

import pytest

from service.engine.calibrate import Calibrator
from service.engine.devices import LocalDevices
from service.engine.params import device_params
from service.planning.planner import LoadOptions, Planner
from service.settings import Settings
from sizing.memory import gpu
from sizing.model.spec import ModelSpec
from sizing.plan import Device
from sizing.plan.request import context_config
from sizing.probe import host_memory, probe_path
from sizing.testing.fixtures import ALL_FIXTURES, write_fixture

pytestmark = pytest.mark.slow

MIB = 1 << 20
DEFAULT = ("Llama-3.1-8B", "gemma-3-27b", "Qwen3-30B-A3B", "Falcon-H1-0.5B")
SHAPES = ALL_FIXTURES if os.environ.get("GGUF_VULKAN_HOLDOUTS") == "all" else DEFAULT
MOVED = re.compile(r"tensor '[^']+' \(\w+\) \(and (\d+) others\) cannot be used with preferred buffer type")


@pytest.fixture(scope="module")
def calibrator() -> Iterator[Calibrator]:
    cal = Calibrator(timeout_s=600)
    yield cal
    cal.close()


def expected_moved(spec: ModelSpec, card: Device) -> int:
    """Weights llama.cpp's load (without mmap, as a dry run loads) moves off their list's first buffer type beside a
    Vulkan card: every use whose test op the card refuses, wherever its block is (a host block's list begins with
    the card's pinned host buffer, ``Vulkan_Host``, asked with the same device)."""
    limit = card.max_tensor_bytes
    n = 0
    for t in spec.tensors:
        if t.layer is not None and t.layer >= spec.n_layer:
            continue  # a NextN block: not loaded
        op = "GET_ROWS" if t.name.startswith("token_embd.") else None
        n += gpu.vulkan_refuses(t, limit, spec.n_expert_used, op, spec.ssm)
    if spec.output_tied:
        embd = next(t for t in spec.tensors if t.name == "token_embd.weight")
        n += gpu.vulkan_refuses(embd, limit, spec.n_expert_used, "MUL_MAT")
    return n


@pytest.mark.parametrize("name", SHAPES)
def test_no_false_fit_on_a_vulkan_card(name: str, tmp_path_factory: pytest.TempPathFactory,
                                       calibrator: Calibrator) -> None:
    path = str(write_fixture(name, tmp_path_factory.mktemp("holdout")))
    spec = probe_path(path)
    cards = LocalDevices().cards()
    assert cards and cards[0].label == "Vulkan0"
    host = host_memory()
    planner = Planner(Settings(min_context=1024, parallel=1), lambda: (list(cards), host), calibrator)
    plan = planner.plan(spec, LoadOptions(), path=path)
    assert plan.calibration is not None and plan.calibration.backend == "Vulkan"
    rows = 0
    for opt in plan.options:
        if opt.verdict == "refused" or opt.estimate is None:
            continue
        rows += 1
        est = opt.estimate
        cfg = context_config(plan.request, opt.cache_type, opt.n_ctx)
        mp = device_params(opt.placement, cards)
        (r,) = calibrator.measure(path, mp, [cfg])
        assert r.ok, (name, opt.cache_type, r.failure)
        where = f"{name} {opt.cache_type} n_ctx {opt.n_ctx} {opt.placement}"
        assert r.kv_mib <= round(est.kv_bytes / MIB, 2) + 0.02, where
        predicted = {d.device: d.compute_bytes for d in est.devices}
        on_host = sum(v for k, v in r.compute_mib.items() if k == "CPU" or k.endswith("_Host"))
        assert on_host <= predicted["CPU"] / MIB + 0.011, (where, r.compute_mib, predicted)
        for dev, got in r.compute_mib.items():
            if dev.startswith("Vulkan") and not dev.endswith("_Host"):
                assert got <= predicted.get(dev, 0) / MIB + 0.011, (where, dev, got, predicted)
        if opt.placement.gpus and not opt.placement.n_cpu_moe:
            lines = calibrator.load_lines(path, mp)
            moved = sum(int(m.group(1)) + 1 for ln in lines if (m := MOVED.search(ln)))
            assert moved == expected_moved(spec, cards[opt.placement.gpus[0]]), (where, lines)
    assert rows, f"{name}: no row fits a {cards[0].total_bytes / MIB:.0f} MiB card and this host"
