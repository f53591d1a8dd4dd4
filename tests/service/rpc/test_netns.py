"""One model over two hosts on a real network: each ggml-rpc worker in a network namespace of its own with its own
address (``service.testing.netns``), the server in the root namespace. Host A's link is a veth pair; host B's a
delayed link (a relay adding a 10 ms round trip, so that a dry run's short connections to it last long enough to
be cut in the middle). The embedded gemma is split over both workers (the models file's tensor_split), the instruct
model runs on the host beside it.

What a network does that a loopback hides, each with what the in-flight request gets, how long it took, what the
next request gets, and that the model is served again with the single host's text once the fault is gone:

- a link pulled mid-stream (``ip link set DEV down`` in the namespace: no FIN, no RST, packets dropped);
- a worker SIGSTOPped mid-stream (its kernel still acknowledges everything; nothing answers);
- a worker's host gone during a load, and during the dry run.

Real processes in real namespaces; nothing is left running and the namespaces are deleted at the end. Skipped
(with the reason) where namespaces cannot be made: they need root.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import pytest

from service.runner.process import RPC_SUSPECT_S, WATCH_S
from service.rpc.client import STATUS_PROBE_S
from service.testing import netns
from service.testing.ports import worker_ports
from service.testing.rpc import PROMPT, worker_process
from tests.conftest import EMBEDDED_NAME, INSTRUCT_NAME, ROOT, ServiceProcess, process_alive, stream_events

pytestmark = pytest.mark.slow

TOKENS = 24
DELAY_S = 0.010
"""Host B's link: the round trip its relay adds."""
STALL_BOUND_S = RPC_SUSPECT_S + STATUS_PROBE_S + WATCH_S
"""How long a stream over a worker that stopped answering takes to end (docs/deployment.md): the watchdog sees the
work stuck for RPC_SUSPECT_S, asks the workers' /status (STATUS_PROBE_S to answer) at its next look (WATCH_S)."""
SLACK_S = 6.0
"""This machine's two cores are shared by the whole suite: the figures above plus what a loaded machine adds."""
LOST_LOAD_BOUND_S = 10.0 + STATUS_PROBE_S
"""A load over a worker whose host vanished: the runner's link timeout (LINK_TIMEOUT_S), then the worker asked."""


@dataclass
class Cluster:
    svc: ServiceProcess
    hosts: list[netns.Host]
    ports: list[int]
    workers: list[subprocess.Popen[bytes]]
    single_host_text: str

    def endpoint(self, i: int) -> str:
        return f"{self.hosts[i].address}:{self.ports[i]}"

    def status(self, i: int, timeout_s: float = 2) -> dict[str, Any]:
        r = httpx.get(f"http://{self.hosts[i].address}:{self.ports[i] + 1}/status", timeout=timeout_s)
        return r.json()  # type: ignore[no-any-return]


def _models(c: httpx.Client) -> dict[str, dict[str, Any]]:
    return {m["name"]: m for m in c.get("/api/models").json()["models"]}


def _complete(c: httpx.Client, model: str = EMBEDDED_NAME) -> httpx.Response:
    return c.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": TOKENS,
                                           "temperature": 0}, timeout=180)


def _until(what: Callable[[], Any], timeout_s: float, every_s: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = what()
        if got or time.monotonic() > deadline:
            return got
        time.sleep(every_s)


def _single_host_text(model: str, n_ctx: int, flash: bool) -> str:
    """The model's greedy text on this host alone (llama.cpp in a process of its own), with the served plan's
    context and attention (flash attention changes the last bits of the logits, and the greedy text with them)."""
    out = subprocess.run([sys.executable, "-m", "service.testing.rpc", "--tokens", str(TOKENS), "--n-ctx",
                          str(n_ctx), *(["--flash-attn"] if flash else []), model],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return str(json.loads(out.stdout.strip().splitlines()[-1])["text"])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, embedded_model: str, instruct_model: str
            ) -> Iterator[Cluster]:
    why = netns.unavailable()
    if why is not None:
        pytest.skip(why)
    d = tmp_path_factory.mktemp("rpc-netns")
    (d / "models.toml").write_text(f'[models."{EMBEDDED_NAME}"]\ntensor_split = [1, 1]\ngpu = "all"\n')
    with netns.hosts(2, delay_s=(0.0, DELAY_S)) as hosts:
        a, b = hosts
        ports = worker_ports(2)
        runners: list[int] = []
        with contextlib.ExitStack() as stack:
            workers = [stack.enter_context(worker_process(p, host=h.address, prefix=h.command([]), cwd=str(ROOT)))
                       for p, h in zip(ports, hosts)]
            svc = ServiceProcess({"GGUF_MODELS_DIR": str(d), "GGUF_MODELS_FILE": str(d / "models.toml"),
                                  "GGUF_CONTEXT_LENGTH": "2048", "GGUF_LOG_LEVEL": "info",
                                  "GGUF_MAX_LOADED_MODELS": "2",
                                  "GGUF_RPC_WORKERS": ",".join(f"{h.address}:{p}" for p, h in zip(ports, hosts))},
                                 d / "service.log")
            try:
                svc.wait_healthy()
                svc.wait_ready(300)
                # The instruct model on the host: the workers serve gemma's runner (one client each), so its plan
                # leaves them out.
                r = svc.client.post("/api/models/load", json={"model": INSTRUCT_NAME}, timeout=300)
                assert r.status_code == 200, r.text
                chosen = _models(svc.client)[EMBEDDED_NAME]["plan"]["chosen"]
                text = _single_host_text(embedded_model, chosen["n_ctx"], chosen["flash_attn"] == "on")
                yield Cluster(svc, hosts, ports, workers, text)
            finally:
                with contextlib.suppress(Exception):
                    runners = [m["runner"]["pid"] for m in _models(svc.client).values()
                               if (m.get("runner") or {}).get("pid")]
                svc.stop()
                for w in workers:  # a stopped worker is let go on
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(w.pid, signal.SIGCONT)
        # The server, its runners and the workers are gone; nothing else ran in the namespaces.
        assert not [pid for pid in runners if _until(lambda: not process_alive(pid), 10) is False]
        assert a.pids() == [] and b.pids() == [], (a.pids(), b.pids())
    left = netns.namespaces()
    assert a.ns not in left and b.ns not in left, left


def test_the_plan_over_two_hosts_is_allocated_as_predicted_and_answers_as_one_host(cluster: Cluster) -> None:
    svc = cluster.svc
    m = _models(svc.client)[EMBEDDED_NAME]
    assert m["state"] == "loaded" and m["plan"]["verdict"] == "split", m["plan"]["verdict"]
    labels = [f"RPC0[{cluster.endpoint(i)}]" for i in range(2)]
    assert [d["label"] for d in m["plan"]["devices"]] == labels
    rows = {d["device"]: d for d in m["plan"]["estimate"]["devices"]}
    assert all(rows[label]["layers"] for label in labels), rows
    tol = 0.011  # llama.cpp logs each buffer rounded to 0.01 MiB
    for got in m["memory"]:  # what llama.cpp allocated on each device, on another host too, is the plan's
        assert got["predicted_mib"] is not None and abs(got["allocated_mib"] - got["predicted_mib"]) <= 4 * tol, got
    assert {r["device"] for r in m["memory"]} == {"CPU", *labels}
    r = _complete(svc.client)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == cluster.single_host_text, r.text
    for i, h in enumerate(cluster.hosts):  # each worker serves this server's runner, from the root's address
        served = cluster.status(i)["connection"]["served"]
        assert served is not None and served["peer"].startswith(h.gateway + ":"), served
    assert all(w["state"] == "up" and w["serving"] for w in svc.client.get("/api/models").json()["workers"])


def _stream_and_fault(cluster: Cluster, fault: Callable[[], None], repair: Callable[[], None], victim: int) -> None:
    """A long stream of gemma; ``fault`` mid-stream; then what the stream got and when, what the other model and the
    next request get, what /ready, /api/models and the metrics say; ``repair``; served again as one host."""
    svc = cluster.svc
    before = _models(svc.client)[EMBEDDED_NAME]["runner"]
    first = threading.Event()
    got: dict[str, Any] = {}
    body = {"model": EMBEDDED_NAME, "prompt": "Write about the sea.", "max_tokens": 2000, "temperature": 0,
            "ignore_eos": True, "stream": True}
    t = threading.Thread(target=stream_events, args=(svc.url + "/v1/completions", body, first, got),
                         kwargs={"timeout": 180})
    t.start()
    assert first.wait(120)
    time.sleep(0.5)
    t0 = time.monotonic()
    fault()
    t.join(120)
    took_s = time.monotonic() - t0
    assert got["status"] == 200 and got["events"][-1] == "[DONE]", got
    err = json.loads(got["events"][-2])["error"]
    assert err["code"] == "runner_died" and cluster.endpoint(victim) in err["message"], err
    assert took_s < STALL_BOUND_S + SLACK_S, took_s
    print(f"\n{fault.__name__}: the stream ended with runner_died {took_s:.1f} s after the fault")

    r = _complete(svc.client, INSTRUCT_NAME)  # the other model serves meanwhile
    assert r.status_code == 200, r.text
    t1 = time.monotonic()
    r = _complete(svc.client)  # the next request is told at once which worker the model waits for
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready", r.text
    assert cluster.endpoint(victim) in r.json()["error"]["message"] and time.monotonic() - t1 < 5, r.text

    def missing() -> dict[str, Any] | None:
        ready = svc.client.get("/ready").json()
        return next((w for w in ready.get("workers_missing", []) if w["endpoint"] == cluster.endpoint(victim)), None)

    seen = _until(missing, 15)
    assert seen is not None and seen["since_unix_s"] <= time.time() and seen["why"], svc.client.get("/ready").text
    ready = svc.client.get("/ready").json()
    gemma = next(m for m in ready["models"] if m["name"] == EMBEDDED_NAME)
    assert gemma["restarting"] and cluster.endpoint(victim) in gemma["waiting_for_workers"]["why"], ready
    metrics = svc.client.get("/metrics").text
    assert f'gguf_rpc_worker_up{{worker="{cluster.endpoint(victim)}"}} 0.0' in metrics
    assert f'gguf_rpc_worker_missing_since_seconds{{worker="{cluster.endpoint(victim)}"}}' in metrics

    repair()
    t2 = time.monotonic()
    after = _until(lambda: (r := _models(svc.client)[EMBEDDED_NAME]["runner"])["state"] == "loaded" and r, 120)
    assert after and after["pid"] != before["pid"], after
    print(f"{fault.__name__}: served again {time.monotonic() - t2:.1f} s after the repair")
    assert not process_alive(before["pid"])
    r = _complete(svc.client)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == cluster.single_host_text, r.text
    assert _until(lambda: all(w["state"] == "up" for w in svc.client.get("/api/models").json()["workers"]), 15)


def test_a_link_pulled_mid_stream_ends_it_with_the_typed_error_and_the_model_comes_back(cluster: Cluster) -> None:
    def pull_link() -> None:
        cluster.hosts[0].pull()

    _stream_and_fault(cluster, pull_link, cluster.hosts[0].plug, 0)


def test_a_worker_stopped_mid_stream_ends_it_with_the_typed_error_and_the_model_comes_back(cluster: Cluster) -> None:
    def stop_worker() -> None:
        os.kill(cluster.workers[1].pid, signal.SIGSTOP)

    _stream_and_fault(cluster, stop_worker, lambda: os.kill(cluster.workers[1].pid, signal.SIGCONT), 1)


def _during(cluster: Cluster, call: Callable[[], httpx.Response], trigger: Callable[[dict[str, Any]], bool]
            ) -> tuple[httpx.Response, float]:
    """``call`` on a thread; host B's link pulled the moment its worker's /status meets ``trigger``; the answer and
    how long after the pull it came. The link is back and the worker free again on return."""
    got: dict[str, Any] = {}

    def run() -> None:
        got["r"] = call()
        got["at"] = time.monotonic()

    t = threading.Thread(target=run)
    t.start()
    pulled = None
    while t.is_alive() and pulled is None:
        with contextlib.suppress(httpx.HTTPError):
            if trigger(cluster.status(1, timeout_s=1)):
                cluster.hosts[1].pull()
                pulled = time.monotonic()
        time.sleep(0.005)
    t.join(180)
    assert pulled is not None, f"the call ended before the trigger: {got.get('r') and got['r'].text[:300]}"
    cluster.hosts[1].plug()
    assert _until(lambda: not cluster.status(1)["clients"], 30)  # the worker dropped the lost client
    return got["r"], got["at"] - pulled


def test_a_host_gone_during_a_load_fails_it_at_once_naming_the_worker(cluster: Cluster) -> None:
    svc = cluster.svc
    assert svc.client.post("/api/models/unload", json={"model": EMBEDDED_NAME}).status_code == 200
    r, took_s = _during(cluster, lambda: svc.client.post("/api/models/load", json={"model": EMBEDDED_NAME},
                                                          timeout=180),
                        lambda st: st["devices"][-1]["held_bytes"] > 100 << 20)  # the weights are arriving
    print(f"\na host gone during a load: {r.status_code} after {took_s:.1f} s")
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_ready", r.text
    assert cluster.endpoint(1) in r.json()["error"]["message"], r.text
    assert took_s < LOST_LOAD_BOUND_S + SLACK_S, took_s
    r = svc.client.post("/api/models/load", json={"model": EMBEDDED_NAME}, timeout=300)  # the host is back
    assert r.status_code == 200, r.text
    assert _complete(svc.client).json()["choices"][0]["text"] == cluster.single_host_text


def test_a_host_gone_during_the_dry_run_is_not_taken_for_the_configurations_refusal(cluster: Cluster) -> None:
    """The dry run's child aborts (ggml-rpc) and the dry run answers 503 naming the worker. Cached, the crash would
    have refused that configuration for good (400), the worker back or not."""
    svc = cluster.svc
    assert svc.client.post("/api/models/unload", json={"model": EMBEDDED_NAME}).status_code == 200
    body = {"model": EMBEDDED_NAME, "parallel": 3}  # a configuration not measured yet: a dry run
    r, took_s = _during(cluster, lambda: svc.client.post("/api/dry-run", json=body, timeout=180),
                        lambda st: st["clients"] >= 1)
    print(f"\na host gone during the dry run: {r.status_code} after {took_s:.1f} s")
    assert r.status_code == 503 and cluster.endpoint(1) in r.json()["error"]["message"], r.text
    r = svc.client.post("/api/dry-run", json=body, timeout=180)
    assert r.status_code == 200 and r.json()["verdict"] == "split", r.text[:2000]
    r = svc.client.post("/api/models/load", json={"model": EMBEDDED_NAME}, timeout=300)
    assert r.status_code == 200, r.text
