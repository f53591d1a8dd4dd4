"""deploy/haproxy.cfg, run by Debian's HAProxy in front of three real replicas on loopback.

The replicas are the real service (llama.cpp, the embedded GGUF) serving two models: the embedded file
hard-linked into a models directory as ``alpha.gguf`` and ``beta.gguf`` (two replicas of alpha, one of
beta, as in deploy/compose.replicas.yml). The official OpenAI client talks to the router with a plain
``base_url``: the router reads ``model`` from the body. Which replica answered is read from each
replica's own ``/metrics``. Then one alpha replica is killed (SIGKILL) in the middle of the run, and
every request after it must still be answered.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import openai
import pytest

from tests.conftest import free_port
from tests.prom import value

ROOT = Path(__file__).resolve().parents[2]
CFG = ROOT / "deploy" / "haproxy.cfg"
REPLICA_ENV = {"GGUF_CONFIRM_LOADS": "false", "GGUF_CONTEXT_LENGTH": "1024", "GGUF_PARALLEL": "1",
               "GGUF_QUEUE_SIZE": "8"}

pytestmark = pytest.mark.slow


def _models_dir(tmp: Path, source: str) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    for name in ("alpha", "beta"):
        try:
            os.link(source, tmp / f"{name}.gguf")  # the registry refuses links out of the directory
        except OSError:
            shutil.copyfile(source, tmp / f"{name}.gguf")
    return tmp


def _completions(svc: Any) -> float:
    text = httpx.get(svc.url + "/metrics", timeout=30).text
    try:
        return value(text, "gguf_requests_total", method="POST", route="/v1/completions", status="200")
    except AssertionError:
        return 0.0


@pytest.fixture(scope="module")
def cluster(service_factory: Callable[..., Any], embedded_model: str, haproxy_bin: str,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    models = _models_dir(tmp_path_factory.mktemp("router") / "models", embedded_model)
    replicas = {
        name: service_factory(GGUF_MODELS_DIR=str(models), GGUF_DEFAULT_MODEL=model, **REPLICA_ENV)
        for name, model in (("a1", "alpha"), ("a2", "alpha"), ("b1", "beta"))
    }
    for svc in replicas.values():
        svc.wait_ready()
    port, health = free_port(), free_port()
    env = {
        "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/bin"),
        "GGUF_MODEL_A": "alpha", "GGUF_MODEL_B": "beta",
        "REPLICA_A1": f"127.0.0.1:{replicas['a1'].port}", "REPLICA_A2": f"127.0.0.1:{replicas['a2'].port}",
        "REPLICA_B": f"127.0.0.1:{replicas['b1'].port}",
        "ROUTER_BIND": f"127.0.0.1:{port}", "ROUTER_HEALTH_BIND": f"127.0.0.1:{health}",
        # No DNS is asked on loopback (the servers are addresses); the resolver points at a closed local port.
        "DOCKER_DNS": f"127.0.0.1:{free_port()}",
    }
    log = open(tmp_path_factory.mktemp("router-log") / "haproxy.log", "wb")
    proc = subprocess.Popen([haproxy_bin, "-db", "-f", str(CFG)], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, Path(log.name).read_text(errors="replace")
        try:
            if httpx.get(f"http://127.0.0.1:{health}/router-health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    time.sleep(2.5)  # the first health checks (inter 2s) have marked the replicas up
    try:
        yield {"url": url, "replicas": replicas, "log": Path(log.name)}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        for svc in replicas.values():  # not kept for the rest of the session
            svc.stop()


def _ask(client: openai.OpenAI, model: str) -> str:
    r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=2, temperature=0)
    assert r.usage is not None and r.usage.completion_tokens >= 1
    return r.model


def test_requests_for_two_models_reach_their_replicas_and_survive_a_killed_one(cluster: dict[str, Any]) -> None:
    replicas = cluster["replicas"]
    client = openai.OpenAI(base_url=cluster["url"] + "/v1", api_key="unused", max_retries=0, timeout=120)
    before = {n: _completions(s) for n, s in replicas.items()}
    asked = {"alpha": 0, "beta": 0}
    for i in range(6):
        for model in ("alpha", "beta"):
            assert _ask(client, model) == model, "answered by a replica serving that model"
            asked[model] += 1
    after = {n: _completions(s) for n, s in replicas.items()}
    got = {n: after[n] - before[n] for n in replicas}
    assert got["a1"] + got["a2"] == asked["alpha"] and got["b1"] == asked["beta"], got
    assert got["a1"] > 0 and got["a2"] > 0, f"both alpha replicas share the load: {got}"

    # Streaming passes through unbuffered, token by token.
    stream = client.completions.create(model="beta", prompt="Once upon a time", max_tokens=8, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    pieces = [c.choices[0].text for c in stream if c.choices]
    assert len([p for p in pieces if p]) >= 4, pieces

    # A model no replica serves: the router's own 404, in the OpenAI error shape.
    with pytest.raises(openai.NotFoundError) as err:
        _ask(client, "gamma")
    assert err.value.code == "model_not_found"

    # Kill one alpha replica mid-run: every later request is still answered, by the replicas left.
    replicas["a1"].proc.kill()
    replicas["a1"].proc.wait(timeout=30)
    a2_before, b_before = _completions(replicas["a2"]), _completions(replicas["b1"])
    answered = []
    for i in range(8):
        for model in ("alpha", "beta"):
            answered.append(_ask(client, model) == model)
    assert all(answered) and len(answered) == 16
    assert _completions(replicas["a2"]) - a2_before == 8
    assert _completions(replicas["b1"]) - b_before == 8
    log = cluster["log"].read_text(errors="replace")
    assert "pool_a/a1" in log and "pool_a/a2" in log, "HAProxy's log names the replica of each request"
