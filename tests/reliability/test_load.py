"""Load: a cancellation storm, clients beyond the queue, and a soak; on the real service (embedded model, CPU)."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Callable

import httpx
import pytest

from service.api.admission import WORKERS as ADMISSION_WORKERS
from tests.conftest import EMBEDDED_NAME, ServiceProcess
from tests.prom import value

from .conftest import rss_kib, threads_of
from tests.figures import figure

pytestmark = pytest.mark.slow

BASE_ENV = {"GGUF_CONFIRM_LOADS": "false", "GGUF_CONTEXT_LENGTH": "2048"}
SOAK_S = float(os.environ.get("GGUF_SOAK_S", "600"))


async def _cancelled_stream(client: httpx.AsyncClient, i: int, after_s: float) -> int:
    body = {"prompt": f"Story number {i}:", "max_tokens": 200, "ignore_eos": True, "stream": True}
    try:
        async with asyncio.timeout(after_s):
            async with client.stream("POST", "/v1/completions", json=body) as r:
                status = r.status_code
                async for _ in r.aiter_bytes():
                    pass
                return status
    except TimeoutError:
        return 0  # cancelled by the client, as intended


@pytest.mark.timeout(300)
def test_cancellation_storm(service_factory: Callable[..., ServiceProcess]) -> None:
    svc = service_factory(GGUF_QUEUE_SIZE="256", **BASE_ENV)
    svc.wait_ready()
    pid = svc.proc.pid
    warm = {"prompt": "Hello", "max_tokens": 8}
    assert svc.client.post("/v1/completions", json=warm).status_code == 200
    rss0, threads0 = rss_kib(pid), threads_of(pid)

    async def storm() -> list[int]:
        limits = httpx.Limits(max_connections=250)
        async with httpx.AsyncClient(base_url=svc.url, timeout=60, limits=limits) as c:
            return await asyncio.gather(*(_cancelled_stream(c, i, 0.5) for i in range(200)))

    figures = []
    for round_ in range(2):
        t0 = time.monotonic()
        statuses = asyncio.run(storm())
        storm_s = time.monotonic() - t0
        assert statuses.count(0) >= 150, statuses  # most were still running or queued when cancelled
        assert all(s in (0, 200, 429) for s in statuses), set(statuses)
        t1 = time.monotonic()
        fresh = svc.client.post("/v1/completions", json={"prompt": "After the storm", "max_tokens": 4}, timeout=90)
        fresh_s = time.monotonic() - t1
        # Generous (vLLM's storm test asks 5 s; this machine's load varies and bench/cancellation_bench.py
        # measures it alone): had the 200 cancelled streams not been stopped, they would take many minutes.
        assert fresh.status_code == 200 and fresh_s < 60.0, (fresh.status_code, fresh_s)
        for _ in range(50):  # the worker lowers its gauge just after it hands over the last chunk
            metrics = svc.client.get("/metrics").text
            gauges = [value(metrics, "gguf_queue_depth", model=EMBEDDED_NAME), value(metrics, "gguf_running", model=EMBEDDED_NAME)]
            if gauges == [0, 0]:
                break
            time.sleep(0.1)
        assert gauges == [0, 0], gauges
        figures.append((storm_s, fresh_s, threads_of(pid), rss_kib(pid)))
    (s1, f1, threads1, rss1), (s2, f2, threads2, rss2) = figures
    # A storm may grow the HTTP layer's worker pool (anyio: at most 40 threads, reused) and the tokenizing pool
    # (service.api.admission: at most WORKERS), in the first storm or the second; a leak would grow past them.
    pool = 40 + ADMISSION_WORKERS
    assert threads1 <= threads0 + pool + 1 and threads2 <= max(threads1, threads0 + pool) + 2, (threads0, threads1, threads2)
    assert rss2 - rss1 < 32 * 1024 and rss2 - rss0 < 96 * 1024, (rss0, rss1, rss2)
    figure(f"storm: 2 x 200 streams cancelled at 0.5 s, in {s1:.1f} s and {s2:.1f} s; fresh request "
           f"{f1:.2f} s and {f2:.2f} s after; threads {threads0} -> {threads1} -> {threads2}; "
           f"RSS {rss0 / 1024:.0f} -> {rss1 / 1024:.0f} -> {rss2 / 1024:.0f} MiB")


def _ask(client: httpx.Client, prompt: str) -> httpx.Response:
    return client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0})


PROMPTS = [f"Fact {i}: the {w} is" for i, w in enumerate(
    ["sun", "moon", "sea", "river", "forest", "city", "mountain", "desert", "winter", "summer", "train", "book",
     "garden", "bridge", "market", "castle", "island", "storm", "harbor", "violin", "engine", "planet", "candle", "clock"])]


async def _burst(url: str, prompts: list[str]) -> list[tuple[str, int, str]]:
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=100)) as c:
        async def one(p: str) -> tuple[str, int, str]:
            r = await c.post("/v1/completions", json={"prompt": p, "max_tokens": 8, "temperature": 0})
            return p, r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.json()["error"]["code"]
        return await asyncio.gather(*(one(p) for p in prompts))


def _load_round(svc: ServiceProcess, alone: dict[str, str]) -> tuple[int, int]:
    results = asyncio.run(_burst(svc.url, list(alone)))
    ok = sum(1 for _, s, _ in results if s == 200)
    busy = sum(1 for _, s, _ in results if s == 429)
    for prompt, status, text in results:
        assert status in (200, 429), (prompt, status, text)
        if status == 200:
            assert text == alone[prompt], f"mixed-up output for {prompt!r}: {text!r} != {alone[prompt]!r}"
        else:
            assert text == "queue_full"
    return ok, busy


@pytest.fixture(scope="module")
def small_queue(service_factory: Callable[..., ServiceProcess]) -> tuple[ServiceProcess, dict[str, str]]:
    # One slot, every prompt evaluated whole, outputs independent of the batch: each answer must equal its prompt's
    # answer alone, exactly. With several slots a request's logits depend on the batch it shares, and with prefix
    # reuse on the prompt that was cached before ("Fact 2" is a prefix of "Fact 20": docs/batching.md), so greedy
    # texts may differ; so they may with speculation (its drafts are verified in batches of several rows, which an
    # AVX2 build of llama.cpp rounds otherwise than one row: "a great place to live" for "to be" once the n-gram
    # pool held answers), which the batch-invariant mode turns off.
    svc = service_factory(GGUF_QUEUE_SIZE="4", GGUF_PARALLEL="1", GGUF_CACHE_PROMPT="false",
                          GGUF_BATCH_INVARIANT="true", **BASE_ENV)
    svc.wait_ready()
    alone = {}
    for p in PROMPTS:
        r = _ask(svc.client, p)
        assert r.status_code == 200
        alone[p] = r.json()["choices"][0]["text"]
    return svc, alone


@pytest.mark.timeout(300)
def test_clients_beyond_the_queue_get_their_own_answer_or_429(
    small_queue: tuple[ServiceProcess, dict[str, str]]
) -> None:
    svc, alone = small_queue
    ok, busy = _load_round(svc, alone)
    # The queue (4) was served, and the running one where the engine took it before the burst filled the queue (on
    # a loaded machine all 24 arrived first once: 4 served); the rest 429.
    assert ok >= 4 and busy >= 1 and ok + busy == len(alone), (ok, busy)
    assert len(set(alone.values())) > 1, "distinct prompts give distinct answers (else the check proves little)"
    figure(f"load: {len(alone)} concurrent clients, queue 4: {ok} answered (each equal to its prompt alone), "
           f"{busy} got 429, 0 errors")


def _soak(svc: ServiceProcess, alone: dict[str, str], duration_s: float) -> tuple[list[int], int, int]:
    pid = svc.proc.pid
    samples, ok_total, busy_total = [rss_kib(pid)], 0, 0
    t_end = time.monotonic() + duration_s
    next_sample = time.monotonic() + max(duration_s / 10, 2)
    while time.monotonic() < t_end:
        ok, busy = _load_round(svc, alone)
        ok_total, busy_total = ok_total + ok, busy_total + busy
        if time.monotonic() >= next_sample:
            samples.append(rss_kib(pid))
            next_sample += max(duration_s / 10, 2)
    samples.append(rss_kib(pid))
    return samples, ok_total, busy_total


@pytest.mark.timeout(120)
def test_short_soak_rss_flat(small_queue: tuple[ServiceProcess, dict[str, str]]) -> None:
    svc, alone = small_queue
    _load_round(svc, alone)  # warm: allocator pools reach their steady size
    samples, ok, busy = _soak(svc, alone, 20)
    growth_mib = (samples[-1] - samples[0]) / 1024
    assert growth_mib < 32, samples
    figure(f"short soak 20 s: {ok} answered, {busy} 429; RSS MiB {[round(s / 1024) for s in samples]}")


@pytest.mark.soak
@pytest.mark.timeout(int(SOAK_S) + 300)
def test_soak_rss_flat(small_queue: tuple[ServiceProcess, dict[str, str]]) -> None:
    svc, alone = small_queue
    _load_round(svc, alone)
    samples, ok, busy = _soak(svc, alone, SOAK_S)
    growth_mib = (samples[-1] - samples[1]) / 1024
    assert growth_mib < 32, samples
    figure(f"soak {SOAK_S:.0f} s: {ok} answered, {busy} 429; RSS MiB {[round(s / 1024) for s in samples]}")


