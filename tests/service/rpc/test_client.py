"""The server's side of the workers, without worker processes: the order llama.cpp gives their devices, what a
worker's device costs beside a card, the socket table a worker counts its clients from, the settings' list of
workers (and the server's refusal to start on a bad one)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from service.engine.params import device_params
from service.rpc.client import parse_workers
from service.rpc.worker import rpc_clients
from sizing.memory import Placement
from sizing.plan import Device, PlanRequest, available
from sizing.plan.sizer import Sizer
from sizing.testing.fixtures import TINY_LLAMA, write_fixture
from sizing.probe import probe_path
from tests.conftest import ROOT

MIB = 1 << 20


def rpc(i: int, ep: str, free_mib: int = 1000) -> Device:
    return Device(index=i, name=f"RPC0[{ep}]", kind="rpc", endpoint=ep, free_bytes=free_mib * MIB,
                  total_bytes=4000 * MIB, remote_kind="cpu")


def test_workers_devices_come_before_the_local_cards_in_llama_cpps_order() -> None:
    gpus = [rpc(0, "10.0.0.2:50052"), rpc(1, "10.0.0.3:50052"), Device(index=0, name="RTX 4090", free_bytes=MIB,
                                                                         total_bytes=MIB)]
    assert [g.label for g in gpus] == ["RPC0[10.0.0.2:50052]", "RPC0[10.0.0.3:50052]", "CUDA0"]
    # Layers on the second worker and the card: tensor_split indexes llama.cpp's list (workers first).
    mp = device_params(Placement(gpus=(1, 2), n_gpu_layers=10, tensor_split=(3.0, 7.0)), gpus)
    assert mp.tensor_split == (0.0, 3.0, 7.0) and mp.main_gpu == 1
    assert mp.rpc_workers == ("10.0.0.2:50052", "10.0.0.3:50052")  # every worker listed is registered, in order
    # A worker left out of the list shifts the card's index: it is not registered either.
    mp = device_params(Placement(gpus=(0, 1), n_gpu_layers=10, tensor_split=(1.0, 1.0)), [gpus[1], gpus[2]])
    assert mp.tensor_split == (1.0, 1.0) and mp.rpc_workers == ("10.0.0.3:50052",)
    # A plan with nothing off the host connects to no worker.
    assert device_params(Placement(), gpus).rpc_workers == ()


def test_a_workers_device_keeps_no_runner_context_and_no_cuda_pool(tmp_path: Path) -> None:
    spec = probe_path(str(write_fixture("tiny", tmp_path, shape=TINY_LLAMA)))
    host = Device(index=0, name="host memory", free_bytes=8000 * MIB, total_bytes=8000 * MIB, kind="host")
    card = Device(index=0, name="card", free_bytes=8000 * MIB, total_bytes=8000 * MIB)
    one = Placement(gpus=(0,), n_gpu_layers=spec.n_layer_all + 1, tensor_split=(1.0,))
    req = PlanRequest(n_ctx=512)
    on_card = Sizer(spec, [card], host, req, "f16").estimate(one, 512).gpus[0]
    on_worker = Sizer(spec, [rpc(0, "127.0.0.1:50052")], host, req, "f16").estimate(one, 512).gpus[0]
    assert on_card.allowance_bytes == req.allowance_bytes > 0 and on_worker.allowance_bytes == 0
    assert on_worker.pool_bytes == 0
    assert on_worker.weights_bytes == on_card.weights_bytes and on_worker.kv_bytes == on_card.kv_bytes


def test_a_worker_with_a_resident_offers_nothing_and_its_status_is_live(tmp_path: Path) -> None:
    spec = probe_path(str(write_fixture("tiny", tmp_path, shape=TINY_LLAMA)))
    host = Device(index=0, name="host memory", free_bytes=8000 * MIB, total_bytes=8000 * MIB, kind="host")
    w, other = rpc(0, "127.0.0.1:50052", free_mib=500), rpc(1, "127.0.0.1:50062", free_mib=700)
    one = Placement(gpus=(0,), n_gpu_layers=spec.n_layer_all + 1, tensor_split=(1.0,))
    resident = Sizer(spec, [w, other], host, PlanRequest(n_ctx=512), "f16").estimate(one, 512)
    # Declared cards get the residents subtracted; a worker's /status is live (it counts them already), and a
    # worker that holds a resident offers nothing to another model (it serves one client).
    gpus, _ = available([w, other], host, [resident], live=False)
    assert [g.free_bytes for g in gpus] == [0, 700 * MIB]
    gpus, _ = available([w, other], host, [], [resident], live=False)
    assert [g.free_bytes for g in gpus] == [500 * MIB + sum(d.total_bytes for d in resident.gpus[:1]), 700 * MIB]


def test_a_worker_counts_its_clients_from_the_socket_table(tmp_path: Path) -> None:
    table = tmp_path / "tcp"
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    rows = [  # 50052 = 0xC384: one established client, one listener, one client of another port
        "   0: 0100007F:C384 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1\n",
        "   1: 0100007F:C384 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 2\n",
        "   2: 0100007F:D431 0100007F:C384 01 00000000:00000000 00:00000000 00000000     0        0 3\n",
    ]
    table.write_text(header + "".join(rows))
    assert rpc_clients(50052, (str(table),)) == 1
    assert rpc_clients(50053, (str(table),)) == 0
    assert rpc_clients(50052, (str(tmp_path / "missing"),)) == 0


def test_a_plan_names_a_worker_and_a_card_apart(tmp_path: Path) -> None:
    """A worker's device and a local card both number from 0 (``Device.index``): the plan's ``gpus`` are positions
    in its ``devices``, so a plan on the card is not read as a plan on the worker (the page picks devices by it)."""
    from sizing.plan.make import make_plan
    from sizing.plan.report import plan_json

    spec = probe_path(str(write_fixture("tiny", tmp_path, shape=TINY_LLAMA)))
    host = Device(index=0, name="host memory", free_bytes=8000 * MIB, total_bytes=8000 * MIB, kind="host")
    gpus = [rpc(0, "10.0.0.2:50052"), Device(index=0, name="RTX 4090", free_bytes=8000 * MIB, total_bytes=8000 * MIB)]
    out = plan_json(make_plan(spec, gpus, host, PlanRequest(n_ctx=512, gpu=1)))
    chosen = out["chosen"]
    assert isinstance(chosen, dict) and chosen["gpus"] == [1], chosen
    devices = out["devices"]
    assert isinstance(devices, list) and devices[1]["label"] == "CUDA0" and devices[0]["index"] == devices[1]["index"]


def test_the_settings_list_of_workers() -> None:
    assert parse_workers(" 10.0.0.2:50052, [::1]:50060,10.0.0.2:50052 ,") == ["10.0.0.2:50052", "[::1]:50060"]
    assert parse_workers(None) == []
    with pytest.raises(ValueError, match="GGUF_RPC_WORKERS: '10.0.0.2': expected HOST:PORT"):
        parse_workers("10.0.0.2")
    with pytest.raises(ValueError, match="needs GGUF_RUNNER_PROCESS=true"):
        parse_workers("10.0.0.2:50052", runner_process=False)
    assert parse_workers("", runner_process=False) == []


@pytest.mark.parametrize("env, says", [
    ({"GGUF_RPC_WORKERS": "10.0.0.2:50052,bogus"}, "invalid settings: GGUF_RPC_WORKERS: 'bogus': expected HOST:PORT"),
    ({"GGUF_RPC_WORKERS": "10.0.0.2:50052", "GGUF_RUNNER_PROCESS": "false"}, "needs GGUF_RUNNER_PROCESS=true"),
])
def test_the_server_refuses_to_start_with_bad_workers_settings(env: dict[str, str], says: str) -> None:
    """Refused before anything loads or binds: exit 2 and one line naming the variable (not a startup traceback)."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("GGUF_")}
    full.update({"GGUF_DEFAULT_MODEL": "", "GGUF_PORT": "0", **env})
    p = subprocess.run([sys.executable, "-m", "service"], cwd=ROOT, env=full, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_a_token_pays_each_workers_link_in_the_predicted_speed(tmp_path: Path) -> None:
    from dataclasses import replace

    from sizing.plan.offload import speed
    from sizing.plan.speed import RPC_TOKEN_OVERHEAD_S, Tiers

    spec = probe_path(str(write_fixture("tiny", tmp_path, shape=TINY_LLAMA)))
    host = Device(index=0, name="host memory", free_bytes=8000 * MIB, total_bytes=8000 * MIB, kind="host")
    near = rpc(0, "127.0.0.1:50052")
    far = replace(near, link_latency_s=0.005)
    one = Placement(gpus=(0,), n_gpu_layers=spec.n_layer_all + 1, tensor_split=(1.0,))
    req = PlanRequest(n_ctx=512)

    def seconds(dev: Device) -> float:
        sz = Sizer(spec, [dev], host, req, "f16")
        return 1 / speed(sz, one, sz.estimate(one, 512), 512, Tiers.for_request(req))[0]

    card = Device(index=0, name="card", free_bytes=8000 * MIB, total_bytes=8000 * MIB,
                  bandwidth_bytes_per_s=near.bandwidth_bytes_per_s)
    assert abs(seconds(near) - seconds(card) - RPC_TOKEN_OVERHEAD_S) < 1e-9  # the protocol's cost, no round trip
    assert abs(seconds(far) - seconds(near) - 0.005) < 1e-9  # one round trip a token (RPC_ROUND_TRIPS_PER_TOKEN)
    # A measured link's rate: the token's hidden state in and, from the worker holding the output, the logits out.
    slow = replace(far, link_bandwidth_bytes_per_s=100e6)
    moved = 4 * spec.n_embd + 4 * spec.n_vocab
    assert abs(seconds(slow) - seconds(far) - moved / 100e6) < 1e-9


def test_a_cpu_workers_share_of_a_token_is_computed_at_a_cpus_speed(tmp_path: Path) -> None:
    """A worker's CPU (its /status gives its threads) decodes its share as the host does, the slower of reading and
    computing, and evaluates a prompt at a CPU's matrix speed per thread, not a card's (the plan said 68,000 prompt
    tokens/s for CPU workers before); without threads reported only its bandwidth counts, as before."""
    from dataclasses import replace

    from sizing.plan.offload import speed
    from sizing.plan.speed import CPU_FLOPS_PER_CORE, Tiers

    spec = probe_path(str(write_fixture("tiny", tmp_path, shape=TINY_LLAMA)))
    host = Device(index=0, name="host memory", free_bytes=8000 * MIB, total_bytes=8000 * MIB, kind="host")
    one = Placement(gpus=(0,), n_gpu_layers=spec.n_layer_all + 1, tensor_split=(1.0,))
    req = PlanRequest(n_ctx=512)
    fast = replace(rpc(0, "127.0.0.1:50052"), bandwidth_bytes_per_s=1e13)  # reading never the bound

    def on(dev: Device) -> tuple[float, float]:
        sz = Sizer(spec, [dev], host, req, "f16")
        decode, prompt, _ = speed(sz, one, sz.estimate(one, 512), 512, Tiers.for_request(req))
        return decode, prompt

    unknown, two, four = on(fast), on(replace(fast, cpu_threads=2)), on(replace(fast, cpu_threads=4))
    card = on(Device(index=0, name="card", free_bytes=8000 * MIB, total_bytes=8000 * MIB, bandwidth_bytes_per_s=1e13))
    assert two[0] < four[0] < unknown[0]  # compute-bound, faster with more threads; unknown threads: bandwidth only
    measured = on(replace(fast, cpu_threads=2, cpu_flops_per_core=2 * CPU_FLOPS_PER_CORE))  # its /status's figure
    assert measured[0] == pytest.approx(four[0])  # twice the speed per thread: as twice the threads
    assert abs(four[1] / two[1] - 2.0) < 1e-9  # the whole prompt on the worker's CPU: linear in its threads
    assert card[1] > 100 * four[1] and unknown[1] == card[1]


def test_a_workers_speeds_are_taken_only_as_positive_finite_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a worker's /status reports of its speeds sizes the plan's predicted speed: a negative, infinite, NaN or
    non-numeric figure is taken as not reported (the speed model's own figure), never as a share that costs
    nothing."""
    from service.rpc import client
    from service.rpc.worker import PROTOCOL

    rows = [{"index": i, "kind": "cpu", "free_bytes": 1 << 30, "total_bytes": 1 << 30, "threads": 2,
             "bandwidth_bytes_per_s": v, "decode_flops_per_core": v}
            for i, v in enumerate([3e10, -1.0, 0, float("inf"), float("nan"), "3e10", True, None])]
    monkeypatch.setattr(client, "read_status", lambda ep, timeout_s: {"protocol": PROTOCOL, "devices": rows})
    devices, absent = client.worker_devices(["127.0.0.1:50052"], measure_links=False)
    assert not absent
    assert [(d.bandwidth_bytes_per_s, d.cpu_flops_per_core) for d in devices] == [(3e10, 3e10)] + [(None, None)] * 7
