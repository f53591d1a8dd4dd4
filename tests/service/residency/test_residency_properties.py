"""Properties of residency under any sequence of loads, unloads, requests and busy models (hypothesis), on declared
cards and the fake engine, driving the manager itself:

- at every load, the new plan fits what the devices have free beside the residents, and afterwards each declared
  card carries the residents' held bytes (each with its runner's CUDA context), never more than its free memory;
- a load that is refused (507, 409) unloads nothing; a load that evicts unloads only idle, unpinned models, and
  no smaller set of them would have made room;
- after every step, what the manager reports per model (``describe``, what GET /api/models answers) is what that
  model's engine reported allocating, and exactly the loaded models hold a loaded engine.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.testing.fake import FakeEngine
from service.errors import ServiceError
from service.residency import Lease, ModelManager
from service.catalog.models import Registry
from service.planning.planner import LoadOptions
from service.settings import Settings
from sizing.plan.device import MIB, Device
from sizing.plan.residency import available, decision_request, held_bytes
from sizing.probe import probe_path

from tests.service.residency.test_residency import _shape
from service.api.errors import code_of, http_of

NAMES = ("a4", "b4", "c8", "d8", "e16", "f24")
LAYERS = {"a4": 4, "b4": 4, "c8": 8, "d8": 8, "e16": 16, "f24": 24}


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sizing.testing.fixtures import write_fixture

    d = tmp_path_factory.mktemp("props")
    for name, n in LAYERS.items():
        p = Path(write_fixture(name, d, shape=_shape(n)))
        p.rename(d / f"{name}.gguf")
    (d / "models.toml").write_text('[models.d8]\npinned = true\n')
    return d


ops = st.lists(st.tuples(st.sampled_from(["load", "load", "load", "unload", "use", "busy", "idle"]),
                         st.sampled_from(NAMES)), min_size=1, max_size=14)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=ops, cards=st.lists(st.integers(1200, 4200), min_size=1, max_size=2),
       host_mib=st.integers(1500, 20000), offload=st.booleans())
def test_residency_invariants_hold_after_every_step(models_dir: Path, steps: list[tuple[str, str]],
                                                    cards: list[int], host_mib: int, offload: bool) -> None:
    gpus = [Device(i, f"card {i}", mib * MIB, 8192 * MIB) for i, mib in enumerate(cards)]
    host = Device(0, "host", host_mib * MIB, 32768 * MIB, "host")
    s = Settings(models_dir=str(models_dir), models_file=str(models_dir / "models.toml"), default_model="",
                 context_length=4096, min_context=2048, calibrate=False, confirm=False, host_bandwidth_gbps=20,
                 load_wait_s=0.05,
                 allow_offload=offload, gpus_json=json.dumps([{"name": g.name, "free_mib": c, "total_mib": 8192}
                                                              for g, c in zip(gpus, cards)]))
    engines: list[FakeEngine] = []

    def factory(_: Settings) -> FakeEngine:
        engines.append(FakeEngine())
        return engines[-1]

    asyncio.run(_run(s, gpus, host, factory, engines, steps, offload))


async def _run(s: Settings, gpus: list[Device], host: Device, factory: Any, engines: list[FakeEngine],
               steps: list[tuple[str, str]], offload: bool) -> None:
    m = ModelManager(s, Registry(s), factory, devices=lambda: (gpus, host), live=False)
    leases: dict[str, list[Lease]] = {}
    try:
        for op, name in steps:
            before = {x.name: x for x in m.loaded()}
            idle_unpinned = {n for n, x in before.items() if not x.busy and not x.pinned}
            if op == "load":
                kept_before = [x.plan.estimate for x in before.values() if x.name != name and x.plan and x.plan.estimate]
                try:
                    state = await m.load(name)
                except ServiceError as exc:
                    assert http_of(exc, "/api/").status in (409, 400) or code_of(exc, "/api/") == "INSUFFICIENT_MEMORY", exc.message
                    assert {x.name for x in m.loaded()} == set(before), "a refused load unloads nothing"
                else:
                    after = {x.name for x in m.loaded()}
                    gone = set(before) - after - {name}
                    assert gone <= idle_unpinned, (gone, idle_unpinned)
                    _check_fits_at_load(state.plan, gpus, host, kept_before, [before[g] for g in gone], name, before)
                    if gone and not offload:
                        _check_no_smaller_set(m, name, gpus, host, before, gone)
            elif op == "unload":
                for lease in leases.pop(name, []):
                    lease.release()
                await m.unload(name)
            elif op == "use" and name in before:
                lease = await m.acquire(name)
                lease.release()
            elif op == "busy" and name in before:
                leases.setdefault(name, []).append(await m.acquire(name))
            elif op == "idle":
                for lease in leases.pop(name, []):
                    lease.release()
            _check_state(m, engines, gpus)
    finally:
        for ls in leases.values():
            for lease in ls:
                lease.release()
        await m.unload(limited=False)
        m.close()


def _check_fits_at_load(plan: Any, gpus: list[Device], host: Device, kept_before: list[Any], gone: list[Any],
                        name: str, before: dict[str, Any]) -> None:
    """The plan's every device need was within what the devices had free beside the residents it kept."""
    kept = [e for e in kept_before if not any(g.plan.estimate is e for g in gone)]
    g_avail, h_avail = available(gpus, host, kept, live=False)
    est = plan.estimate
    assert est is not None
    by_label = {g.label: g for g in g_avail}
    for d in est.gpus:
        assert d.total_bytes <= by_label[d.device].free_bytes, (d.device, d.total_bytes, by_label[d.device].free_bytes)
    # Placed by the offload search (partly or wholly in host memory beside cards), weights may be read from the file.
    spill = plan.verdict == "partial_offload" or (plan.verdict == "cpu" and bool(plan.gpus))
    need_host = est.host.total_bytes - (est.host.weights_bytes if spill else 0)
    assert need_host <= h_avail.free_bytes, (plan.verdict, est.host, h_avail.free_bytes, plan.host.free_bytes)


def _check_no_smaller_set(m: ModelManager, name: str, gpus: list[Device], host: Device, before: dict[str, Any],
                          gone: set[str]) -> None:
    """Brute force: no set of fewer idle, unpinned residents would have let the model fit."""
    entry = m.registry.resolve(name)
    spec = probe_path(entry.path)
    req = decision_request(spec, m.planner.request(m.placing.options_for(entry, LoadOptions())))
    others = {n: x for n, x in before.items() if n != name}
    candidates = [n for n, x in others.items() if not x.busy and not x.pinned]
    for k in range(len(gone)):
        for subset in itertools.combinations(candidates, k):
            kept = [x.plan.estimate for n, x in others.items() if n not in subset]
            g, h = available(gpus, host, kept, live=False)
            assert not m.planner.plan_on(spec, g, h, req).fits, f"{subset} would have made room for {name}"


def _check_state(m: ModelManager, engines: list[FakeEngine], gpus: list[Device]) -> None:
    loaded = m.loaded()
    assert sum(1 for e in engines if e.report is not None) == len(loaded), "exactly the loaded models hold an engine"
    for x in loaded:
        eng = x.engine.engine  # the runner's engine under the API process's text (service.text.served)
        assert isinstance(eng, FakeEngine) and eng.report is not None
        described = m.describe(x)
        assert described is not None
        assert {a["device"]: a["allocated_mib"] for a in described["memory"]} == {
            a.device: round(a.total_bytes / MIB, 2) for a in eng.report.allocations}
    for g in gpus:
        # Each model's runner process holds its own CUDA context there: in its held bytes (sizing.plan.residency).
        held = [held_bytes(x.plan.estimate).get(g.label, 0) for x in loaded if x.plan and x.plan.estimate]
        assert sum(held) <= g.free_bytes, (g.label, sum(held), g.free_bytes)
