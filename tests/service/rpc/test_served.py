"""One model over two workers and this host, served: the service plans the embedded model over two ggml-rpc workers
on loopback (``GGUF_RPC_WORKERS``), each given a budget that cannot hold the model alone, with the host's memory
capped (``GGUF_HOST_MEMORY_MIB``) below what it needs alone; the plan is llama.cpp's dry run with the workers
registered, the answers are the single host's, what llama.cpp allocates on each device is what the plan predicted,
and a worker killed mid-stream ends that stream with the typed error; once it is back the model is reloaded and
served again. Real processes, killed for real; nothing is left running.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from service.testing.rpc import PROMPT, worker_process
from tests.conftest import EMBEDDED_NAME, ROOT, ServiceProcess, process_alive, stream_events
from tests.service.rpc.test_worker import two_ports

pytestmark = pytest.mark.slow

WORKER_MIB = "760"
"""Each worker's budget: the model's output device alone needs about 755 MiB at 2,048 tokens (its weights and the
logits' compute buffer), all 19 slots about 790: no worker holds the model, two do."""
HOST_MIB = "300"
"""The host's ceiling: the model on the CPU alone needs over 700 MiB (its compute buffer holds the logits); the
token embeddings (170 MiB) and the host's share of the graph fit."""
TOKENS = 24


@contextlib.contextmanager
def _worker(port: int, memory_mib: str = WORKER_MIB) -> Iterator[subprocess.Popen[bytes]]:
    with worker_process(port, "--memory-mib", memory_mib, cwd=str(ROOT)) as proc:
        yield proc


def _model(c: httpx.Client) -> dict[str, Any]:
    return {m["name"]: m for m in c.get("/api/models").json()["models"]}[EMBEDDED_NAME]  # type: ignore[no-any-return]


def _complete(c: httpx.Client) -> httpx.Response:
    return c.post("/v1/completions", json={"model": EMBEDDED_NAME, "prompt": PROMPT, "max_tokens": TOKENS,
                                           "temperature": 0})


@contextlib.contextmanager
def _serving(d: Path, worker_mib: str, env: dict[str, str] | None = None
             ) -> Iterator[tuple[ServiceProcess, list[int], contextlib.ExitStack]]:
    """Two workers of ``worker_mib`` each and a server over them, its host capped at ``HOST_MIB``, the embedded model
    loaded; afterwards the server stopped and its runner gone."""
    ports = list(two_ports())
    with contextlib.ExitStack() as workers:
        for p in ports:
            workers.enter_context(_worker(p, worker_mib))
        svc = ServiceProcess({"GGUF_MODELS_DIR": str(d), "GGUF_CONTEXT_LENGTH": "2048", "GGUF_LOG_LEVEL": "info",
                              "GGUF_RPC_WORKERS": ",".join(f"127.0.0.1:{p}" for p in ports),
                              "GGUF_HOST_MEMORY_MIB": HOST_MIB, **(env or {})}, d / "service.log")
        pid = None
        try:
            svc.wait_healthy()
            svc.wait_ready(300)
            pid = (_model(svc.client).get("runner") or {}).get("pid")
            yield svc, ports, workers
        finally:
            if svc.proc.poll() is None:
                pid = (_model(svc.client).get("runner") or {}).get("pid") or pid
            svc.stop()
            deadline = time.monotonic() + 10
            while pid and process_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not (pid and process_alive(pid)), f"runner {pid} outlived its server"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, embedded_model: str
           ) -> Iterator[tuple[ServiceProcess, list[int], contextlib.ExitStack]]:
    with _serving(tmp_path_factory.mktemp("rpc-served"), WORKER_MIB) as got:
        yield got


def _memory_as_planned(m: dict[str, Any]) -> None:
    """What llama.cpp allocated on each device is the plan's, buffer by buffer (a row of the CPU's extra buffer
    types, predicted as a whole, as a whole)."""
    rows = {d["device"]: d for d in m["plan"]["estimate"]["devices"]}
    tol = 0.011  # llama.cpp logs each buffer rounded to 0.01 MiB
    for got in m["memory"]:
        assert got["predicted_mib"] is not None and abs(got["allocated_mib"] - got["predicted_mib"]) <= 4 * tol, got
        if got["device"] in rows:
            for part in ("weights", "kv", "compute"):
                want = rows[got["device"]][f"{part}_mib"]
                assert abs(got["allocated"][f"{part}_mib"] - want) <= tol, (part, got, rows[got["device"]])


@pytest.fixture(scope="module")
def single_host_text(served: tuple[ServiceProcess, list[int], contextlib.ExitStack], embedded_model: str) -> str:
    """The embedded model's greedy text on this host alone (llama.cpp in a process of its own, no worker), with the
    context and the attention the served plan chose: flash attention changes the last bits of the logits, and this
    model's greedy text turns on them (an AVX2 host: 16 tokens in, flash attention on or off picks another word)."""
    chosen = _model(served[0].client)["plan"]["chosen"]
    assert chosen["flash_attn"] in ("on", "off"), chosen
    flash = ["--flash-attn"] if chosen["flash_attn"] == "on" else []
    out = subprocess.run([sys.executable, "-m", "service.testing.rpc", "--tokens", str(TOKENS), "--n-ctx",
                          str(chosen["n_ctx"]), *flash, embedded_model],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return str(json.loads(out.stdout.strip().splitlines()[-1])["text"])


def test_planned_over_two_workers_and_the_host_answers_as_one_host(
        served: tuple[ServiceProcess, list[int], contextlib.ExitStack], single_host_text: str) -> None:
    svc, ports, _ = served
    m = _model(svc.client)
    assert m["state"] == "loaded", m
    plan = m["plan"]
    labels = [f"RPC0[127.0.0.1:{p}]" for p in ports]
    assert [d["label"] for d in plan["devices"]] == labels
    assert [d["host"] for d in plan["devices"]] == [f"127.0.0.1:{p}" for p in ports]
    assert plan["verdict"] == "split" and plan["calibration"]["backend"].startswith("RPC(")
    rows = {d["device"]: d for d in plan["estimate"]["devices"]}
    assert set(rows) == {"CPU", *labels}
    assert all(rows[label]["layers"] for label in labels), rows  # both workers hold layers
    for label in labels:  # no worker alone holds the whole model: the budget is below its total
        assert rows[label]["total_mib"] < float(WORKER_MIB)
    assert sum(rows[label]["total_mib"] for label in labels) > float(WORKER_MIB)

    memory = {r["device"]: r for r in m["memory"]}
    assert set(memory) == {"CPU", *labels}, memory
    _memory_as_planned(m)  # the output device's compute too: llama.cpp's dry run over-counts it, the plan does not
    assert {r["device"] for r in m["memory"]} >= set(rows), m["memory"]

    r = _complete(svc.client)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == single_host_text
    for p in ports:  # the workers hold what llama.cpp placed there, and each serves this server's runner
        st = httpx.get(f"http://127.0.0.1:{p + 1}/status", timeout=5).json()
        assert st["clients"] == 1 and st["devices"][0]["held_bytes"] >= rows[f"RPC0[127.0.0.1:{p}]"]["weights_mib"] * 2**20


def test_a_worker_killed_mid_stream_ends_it_with_the_typed_error_and_the_model_comes_back(
        served: tuple[ServiceProcess, list[int], contextlib.ExitStack], single_host_text: str) -> None:
    svc, ports, workers = served
    before = _model(svc.client)["runner"]
    first = threading.Event()
    got: dict[str, Any] = {}
    body = {"model": EMBEDDED_NAME, "prompt": "Write about the sea.", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    t = threading.Thread(target=stream_events, args=(svc.url + "/v1/completions", body, first, got),
                         kwargs={"timeout": 180})
    t.start()
    assert first.wait(120)
    victim = ports[1]
    pids = [int(x) for x in subprocess.run(["pgrep", "-f", "--", f"--listen 127.0.0.1:{victim}"], capture_output=True,
                                           text=True).stdout.split()]
    assert pids
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    t.join(120)
    assert got["status"] == 200 and got["events"][-1] == "[DONE]", got
    err = json.loads(got["events"][-2])["error"]
    assert err["code"] == "runner_died", err

    # While the worker is away the model is not served: a request waits for the restart, then says so.
    deadline = time.monotonic() + 60
    while _model(svc.client).get("runner", {}).get("state") != "restarting" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _model(svc.client)["runner"]["state"] == "restarting"

    workers.enter_context(_worker(victim))  # back on the same port: the runner restarts over it
    deadline = time.monotonic() + 120
    while _model(svc.client).get("runner", {}).get("state") != "loaded" and time.monotonic() < deadline:
        time.sleep(0.2)
    after = _model(svc.client)["runner"]
    assert after["state"] == "loaded" and after["pid"] != before["pid"], after
    assert not process_alive(before["pid"])
    r = _complete(svc.client)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == single_host_text


def test_planned_over_two_workers_with_layers_on_the_host(tmp_path: Path) -> None:
    """Smaller workers and batches: the host keeps layers too (partial offload), and on a CPU whose repacked layouts
    are on (no AMX) llama.cpp copies the host's matrices into CPU_REPACK, since a worker's device has no pinned host
    buffer to take them: predicted too, every device as allocated."""
    with _serving(tmp_path, "450", {"GGUF_N_UBATCH": "256"}) as (svc, ports, _):
        m = _model(svc.client)
        plan = m["plan"]
        assert plan["verdict"] == "partial_offload", plan["verdict"]
        rows = {d["device"]: d for d in plan["estimate"]["devices"]}
        assert rows["CPU"]["layers"] and all(rows[f"RPC0[127.0.0.1:{p}]"]["layers"] for p in ports), rows
        _memory_as_planned(m)
        # Repacking is on unless llama.cpp's AMX kernel would take it (service.engine.cpu); then the host's first
        # layer (Q4_K matrices, AVX2 layouts) is copied.
        repacked = "CPU_REPACK" in {r["device"] for r in m["memory"]}
        assert repacked == plan["chosen"]["cpu_repack"], (m["memory"], plan["chosen"])
        r = _complete(svc.client)  # not compared with the single host's text: its first layer runs repacked kernels
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == TOKENS, r.text


def test_unreachable_workers_are_named_in_the_refusal(tmp_path: Path) -> None:
    """A plan that needs workers that are not there is a typed refusal naming each one and why."""
    dead, _ = two_ports()
    svc = ServiceProcess({"GGUF_MODELS_DIR": str(tmp_path), "GGUF_CONTEXT_LENGTH": "2048", "GGUF_DEFAULT_MODEL": "",
                          "GGUF_RPC_WORKERS": f"127.0.0.1:{dead}", "GGUF_HOST_MEMORY_MIB": HOST_MIB},
                         tmp_path / "service.log")
    try:
        svc.wait_healthy()
        r = svc.client.post("/api/models/load", json={"model": EMBEDDED_NAME})
        assert r.status_code == 507, r.text
        err = r.json()["error"]
        assert err["code"] == "INSUFFICIENT_MEMORY", err
        assert f"127.0.0.1:{dead}" in err["message"] and "no answer" in err["message"], err
    finally:
        svc.stop()
