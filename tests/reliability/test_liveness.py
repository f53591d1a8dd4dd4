"""Nothing waits for ever on a runner that stopped (issue 54): the watchdog (``service.runner.process``) ends a runner
whose work makes no progress within its bound, as a dead one; a runner killed during a load gets the restart policy.

Real runner processes of the embedded gemma-3-270m, stopped (SIGSTOP) and killed (SIGKILL) for real. The bound is set
low here (``GGUF_RUNNER_STALL_S``) so the test takes seconds; what it checks is that the detection takes at most the
bound plus the watchdog's period, and what every request and the health routes say meanwhile and after.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from service.runner.process import WATCH_S, ProcessEngine, stall_bound_s
from tests.conftest import EMBEDDED_NAME, ServiceProcess, process_alive
from tests.figures import figure

pytestmark = pytest.mark.slow

STALL_S = 3.0


def _runner(c: httpx.Client) -> dict[str, Any]:
    models = {m["name"]: m for m in c.get("/api/models").json()["models"]}
    return {"state": models[EMBEDDED_NAME]["state"], **(models[EMBEDDED_NAME].get("runner") or {})}


def _wait_loaded(c: httpx.Client, timeout_s: float = 90) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    got: dict[str, Any] = {}
    while time.monotonic() < deadline:
        got = _runner(c)
        if got.get("state") == "loaded" and got.get("pid"):
            return got
        time.sleep(0.1)
    raise AssertionError(f"the runner never came back: {got}")


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory, embedded_model: str) -> Iterator[ServiceProcess]:
    d = tmp_path_factory.mktemp("liveness")
    service = ServiceProcess({"GGUF_CONTEXT_LENGTH": "2048", "GGUF_PARALLEL": "2", "GGUF_CONFIRM_LOADS": "false",
                              "GGUF_RUNNER_STALL_S": str(STALL_S), "GGUF_LOG_LEVEL": "info"}, d / "service.log")
    with service.running():
        yield service


def test_a_stopped_runner_is_ended_within_its_bound_and_served_again(svc: ServiceProcess) -> None:
    c = svc.client
    before = _wait_loaded(c)
    bound = before["stall_bound_s"]
    assert bound >= STALL_S
    assert c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2}).status_code == 200
    pid = before["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        r = httpx.post(svc.url + "/v1/completions", json={"prompt": "Hello there", "max_tokens": 2}, timeout=120)
        waited = time.monotonic() - t0
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "runner_died" and r.headers.get("retry-after"), r.text
        assert "no progress" in r.text or "did not answer" in r.text, r.text
        # At most the bound plus the watchdog's period, plus the kill's and the answer's own time.
        figure(f"SIGSTOPped runner: a request answered 503 runner_died after {waited:.1f} s (stall bound {bound} s, "
               f"GGUF_RUNNER_STALL_S={STALL_S:g} raised by the plan)")
        assert waited <= bound + WATCH_S + 2.0, f"the request waited {waited:.1f} s for a bound of {bound} s"
        # Meanwhile the health routes say so (until the new runner has loaded).
        ready = c.get("/ready")
        runner = _runner(c)
        assert ready.status_code == 503 or runner["state"] == "loaded", (ready.text, runner)
        if ready.status_code == 503:
            assert ready.json()["error"]["state"] == "restarting", ready.text
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    after = _wait_loaded(c)
    assert after["pid"] != pid and after["stalls"] == 1 and "stalled" in after["last_exit"], after
    assert not process_alive(pid), "the stopped runner was killed, not left behind"
    r = c.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert c.get("/ready").status_code == 200


def test_a_busy_runner_is_not_taken_for_a_stopped_one(svc: ServiceProcess) -> None:
    """A request that runs for longer than the bound (a long prompt in several ubatches, then many tokens) moves:
    it is never ended."""
    c = svc.client
    before = _wait_loaded(c)
    prompt = "The lighthouse keeper noted the wind, the waves and the ships that passed. " * 90
    t0 = time.monotonic()
    r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 640, "ignore_eos": True}, timeout=300)
    took = time.monotonic() - t0
    assert r.status_code == 200, r.text
    assert took > before["stall_bound_s"], f"the request took {took:.1f} s: not longer than the bound"
    after = _runner(c)
    assert after["pid"] == before["pid"] and after["stalls"] == before["stalls"], (took, after)


def _runner_children(parent: int) -> set[int]:
    out = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and b"service.runner.child" in cmd:
            out.add(int(entry.name))
    return out


def test_a_runner_killed_during_a_load_is_started_again(svc: ServiceProcess) -> None:
    c = svc.client
    before = _wait_loaded(c)
    known = _runner_children(svc.proc.pid)
    killed: list[int] = []

    def kill_the_next_runner() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            new = _runner_children(svc.proc.pid) - known
            if new:
                pid = min(new)
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.005)

    killer = threading.Thread(target=kill_the_next_runner)
    killer.start()
    # A reload with another option: a new runner loads (the old one is replaced).
    r = c.post("/api/models/load", json={"model": EMBEDDED_NAME, "context_length": 1024}, timeout=180)
    killer.join()
    assert killed, "no runner was seen loading"
    assert r.status_code == 200, r.text
    after = _wait_loaded(c)
    assert after["pid"] not in killed and after["pid"] != before["pid"] and after["restarts"] >= 1, after
    assert c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2}).status_code == 200


def test_the_bound_grows_with_a_slow_plan() -> None:
    class _Cfg:
        n_ubatch = 512

    class _Plan:
        cfg = _Cfg()
        predicted_prompt_tokens_per_s: float | None = 20.0

    assert stall_bound_s(30.0, _Plan()) == pytest.approx(4 * 512 / 20.0)  # type: ignore[arg-type]
    fast = _Plan()
    fast.predicted_prompt_tokens_per_s = 5000.0
    assert stall_bound_s(30.0, fast) == 30.0  # type: ignore[arg-type]
    fast.predicted_prompt_tokens_per_s = None
    assert stall_bound_s(30.0, fast) == 30.0  # type: ignore[arg-type]
    assert stall_bound_s(30.0, None) == 30.0


class _StuckChannel:
    """A runner that answers its pings with ``stuck`` seconds (None: no answer)."""

    def __init__(self, stuck: float | None) -> None:
        self.stuck, self.killed, self.dead, self.stopping, self.pid = stuck, None, None, False, 1

    def stuck_s(self, timeout_s: float) -> float | None:
        return self.stuck

    def kill_stalled(self, why: str) -> None:
        self.killed = why


@pytest.mark.parametrize("stuck, killed", [(None, "did not answer"), (5.0, "no progress"), (0.5, None)])
def test_the_watchdog_kills_what_is_stuck_past_the_bound(stuck: float | None, killed: str | None) -> None:
    engine = ProcessEngine({}, name="m", stall_s=2.0)
    ch = _StuckChannel(stuck)
    engine._ch, engine._state = ch, "loaded"  # type: ignore[assignment]
    thread = threading.Thread(target=engine._watch, daemon=True)
    thread.start()
    deadline = time.monotonic() + WATCH_S * 3
    while ch.killed is None and time.monotonic() < deadline:
        time.sleep(0.05)
    engine._state = "unloaded"
    if killed is None:
        assert ch.killed is None and engine.stalls == 0
    else:
        assert ch.killed is not None and killed in ch.killed and engine.stalls == 1
