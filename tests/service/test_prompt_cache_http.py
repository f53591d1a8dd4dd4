"""The prompt cache beyond the slots through the real service (issue 24): one slot, two conversations taking turns,
restored from host memory; after the model's unload and after a restart of the service, restored from disk; the
plan's line in the dry run and /api/models; the metrics; per API key and per ``cache_salt`` scopes."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import ServiceProcess, loaded_model
from tests.figures import figure

pytestmark = pytest.mark.slow

A = ("The keeper of the lighthouse on the northern cape wrote in his log every evening. "
     "He noted the wind, the height of the waves, the ships that passed and the birds. ") * 5
B = ("A recipe for bread: flour, water, salt and yeast, mixed and kneaded, left to rise overnight, "
     "shaped in the morning and baked in a hot oven until the crust sings. ") * 5
KEYS = ("tenant-one-key", "tenant-two-key")


def _env(tmp: Path, **more: str) -> dict[str, str]:
    (tmp / "models").mkdir(exist_ok=True)
    return {"GGUF_MODELS_DIR": str(tmp / "models"), "GGUF_PARALLEL": "1", "GGUF_CONTEXT_LENGTH": "2048",
            "GGUF_CONFIRM_LOADS": "false", "GGUF_EMBEDDINGS": "off", "GGUF_PROMPT_CACHE_DIR": str(tmp / "kv"), **more}


def _start(tmp: Path, name: str, **more: str) -> ServiceProcess:
    svc = ServiceProcess(_env(tmp, **more), tmp / f"{name}.log")
    svc.wait_healthy()
    svc.wait_ready()
    return svc


def _complete(svc: ServiceProcess, prompt: str, key: str | None = None, **body: Any) -> int:
    """The request's cached prompt tokens."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = svc.client.post("/v1/completions", headers=headers,
                        json={"prompt": prompt, "max_tokens": 4, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def _metric(svc: ServiceProcess, name: str, key: str | None = None, label: str = "") -> float:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    text = svc.client.get("/metrics", headers=headers).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and label in line)


def test_turns_beyond_the_slot_survive_eviction_and_restart(tmp_path: Path) -> None:
    svc = _start(tmp_path, "first")
    try:
        model = loaded_model(svc.client)
        line = model["prompt_cache"]
        assert line["budget_mib"] > 0 and line["ceiling_mib"] == 8192 and line["disk_dir"] == str(tmp_path / "kv")
        dry = svc.client.post("/api/dry-run", json={"model": model["name"]}).json()
        assert dry["prompt_cache"]["budget_mib"] > 0 and "half of" in dry["prompt_cache"]["why"]
        assert _complete(svc, A) <= 1
        assert _complete(svc, B) <= 1  # A leaves the slot for host memory (and its file)
        n = _complete(svc, A + " On the last evening")
        assert n > 150, n  # A came back: only its new tokens evaluated
        assert _metric(svc, "gguf_prompt_cache_hits_total") == 1
        assert _metric(svc, "gguf_prompt_cache_restored_tokens_total") == n
        lookups = {r: _metric(svc, "gguf_prompt_cache_lookups_total", label=f'result="{r}"')
                   for r in ("hit", "partial", "miss")}
        assert lookups == {"hit": 1, "partial": 0, "miss": 2}, lookups  # A and B cold, A's next turn restored
        assert _metric(svc, "gguf_prompt_cache_held_unused_total") == 0
        assert _metric(svc, "gguf_prompt_cache_bytes") > 0  # B, now
        holds = loaded_model(svc.client)["prompt_cache"]["holds"]
        assert holds["entries"] == 1 and holds["hits"] == 1
        # evicted and loaded again: what the slot and the cache held comes back from disk
        assert svc.client.post("/api/models/unload", json={"model": model["name"]}).status_code == 200
        assert svc.client.post("/api/models/load", json={"model": model["name"]}).status_code == 200
        assert _complete(svc, B + " Then the loaves") > 150
    finally:
        svc.stop()  # SIGTERM: the runner unloads, the slots' prompts are written
    svc = _start(tmp_path, "second")
    try:
        assert _complete(svc, A + " On the last evening of all") > 150
        assert _metric(svc, "gguf_prompt_cache_rejected_total") == 0
        assert _metric(svc, "gguf_prompt_cache_disk_entries") >= 2
    finally:
        svc.stop()


LOG = "".join(f"Evening {i}: the keeper noted a wind from the {d}, waves of {i % 7 + 1} feet, {i % 5} ships passing "
              f"and {i % 9 + 2} gulls on the rail. " for i, d in zip(range(60), ["north", "west", "south", "east"] * 15))


def _timed(svc: ServiceProcess, prompt: str) -> tuple[float, int]:
    """Seconds to a one-token answer, and its cached prompt tokens."""
    t0 = time.perf_counter()
    cached = _complete(svc, prompt, max_tokens=1)
    return time.perf_counter() - t0, cached


def test_a_turn_survives_the_server_killed_after_it(tmp_path: Path) -> None:
    """SIGKILL to the server and its runner after a turn (no unload, no eviction: what the OOM killer or a lost node
    does): the turn's prompt was written behind to the disk while the server was idle, and the next turn after the
    restart restores it. Its time against a cold prompt of the same length is bounded at 0.3x here, twice
    bench/prompt_cache_bench.py's 0.15x target, since the other test worker shares the cores."""
    svc = _start(tmp_path, "first", GGUF_CONTEXT_LENGTH="4096")
    try:
        _complete(svc, LOG, max_tokens=8)
        deadline = time.monotonic() + 60
        while _metric(svc, "gguf_prompt_cache_disk_entries") < 1:
            assert time.monotonic() < deadline, "the turn was never written to the disk"
            time.sleep(0.05)
        runner = loaded_model(svc.client)["runner"]["pid"]
        files = sorted((tmp_path / "kv").rglob("*.kv"))
        assert len(files) == 1
    finally:
        for pid in (svc.proc.pid, runner):
            os.kill(pid, signal.SIGKILL)
        svc.stop()
    assert not sorted((tmp_path / "kv").rglob("*.tmp"))
    svc = _start(tmp_path, "second", GGUF_CONTEXT_LENGTH="4096")
    try:
        n_log = len(svc.client.post("/tokenize", json={"content": LOG}).json()["tokens"])
        warm, cached = _timed(svc, LOG + " Evening 60: calm.")
        cold, cold_cached = _timed(svc, "On another cape, " + LOG + " Evening 60: calm.")
        assert n_log > 1000 and cached >= n_log - 2, (cached, n_log)
        assert cold_cached <= 1
        figure(f"prompt cache after SIGKILL: next turn of {n_log} cached tokens {warm * 1e3:.0f} ms, cold "
               f"{cold * 1e3:.0f} ms ({warm / cold:.3f}x; beside the other worker)")
        assert warm <= 0.3 * cold, (warm, cold)
        assert _metric(svc, "gguf_prompt_cache_rejected_total") == 0
    finally:
        svc.stop()


def test_a_cached_prompt_is_not_shared_across_keys_or_salts(tmp_path: Path) -> None:
    svc = _start(tmp_path, "keys", GGUF_API_KEYS=",".join(KEYS), GGUF_PROMPT_CACHE_DIR="")
    try:
        one, two = KEYS
        assert _complete(svc, A, one) <= 1
        assert _complete(svc, A, two) <= 1  # the slot holds A for tenant one: tenant two evaluates it all
        assert _complete(svc, A, one) > 150  # tenant one's A, kept when tenant two took the slot
        name = loaded_model(svc.client, headers={"Authorization": f"Bearer {one}"})["name"]
        client = openai.OpenAI(base_url=svc.url + "/v1", api_key=one, http_client=httpx.Client(timeout=120))
        salted = client.completions.create(model=name, prompt=A, max_tokens=4, temperature=0,
                                           extra_body={"cache_salt": "session-9"})
        assert salted.usage is not None and salted.usage.prompt_tokens_details is not None
        assert (salted.usage.prompt_tokens_details.cached_tokens or 0) <= 1  # same key, another salt
        again = client.completions.create(model=name, prompt=A, max_tokens=4, temperature=0,
                                          extra_body={"cache_salt": "session-9"})
        assert again.usage.prompt_tokens_details.cached_tokens > 150  # type: ignore[union-attr]
        pid = svc.proc.pid
        for salt in ("x" * 100_000, 7, ["a"], {"$ne": ""}, "\u0000\ud800"):  # huge, not a string, hostile
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "cache_salt": salt}
            r = svc.client.post("/v1/chat/completions", content=json.dumps(body),  # escapes a lone surrogate
                                headers={"Authorization": f"Bearer {one}", "Content-Type": "application/json"})
            assert 400 <= r.status_code < 500 or (isinstance(salt, str) and len(salt) < 256 and r.status_code == 200), \
                (repr(salt)[:40], r.status_code, r.text[:200])
        assert svc.proc.poll() is None and svc.proc.pid == pid
        assert _complete(svc, A, one) > 150  # still serving, its cache intact
    finally:
        svc.stop()
