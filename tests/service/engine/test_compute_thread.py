"""Every ``llama_decode`` of an engine runs on its scheduler thread, and with another engine loaded that thread
ends when idle (service/engine/llama.py, "One compute thread"): llama.cpp's OpenMP team belongs to the calling
thread and lives as long as it, and one more team than the machine has CPUs made libgomp stop spinning at its
barriers, which slowed generation by a quarter on 2 cores (``bench/openmp_bench.py`` measures it)."""

from __future__ import annotations

import threading
import time
from typing import Any, Iterator

import pytest

import service.engine.llama.scheduler as llama_engine
from service.engine.base import Cancel, GenerationParams
from service.engine.llama import LlamaEngine
from service.text.served import ServedModel
from sizing.probe.devices import host_memory
from sizing.probe import probe_path
from sizing.plan.make import PlanRequest, make_plan

pytestmark = pytest.mark.slow

GREEDY = GenerationParams(max_tokens=8, temperature=0.0, cache_prompt=False)


def _load(path: str, embedding_tokens: int = 0) -> LlamaEngine:
    plan = make_plan(probe_path(path), [], host_memory(),
                     PlanRequest(n_ctx=1024, n_seq_max=2, kv_unified=True, min_ctx=256, embedding_tokens=embedding_tokens))
    eng = ServedModel.of(LlamaEngine(n_threads=2))
    eng.load(path, plan)
    return eng


def _text(eng: LlamaEngine, prompt: str = "The capital of France is") -> str:
    return "".join(c.text for c in eng.complete(prompt, GREEDY, Cancel()))


def _schedulers() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "llama-scheduler")


def _wait_for(predicate: Any, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.fixture
def decode_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The name of the thread of every ``llama_decode`` call from here on."""
    import llama_cpp

    names: list[str] = []
    real = llama_cpp.llama_decode

    def recording(ctx: Any, batch: Any) -> int:
        names.append(threading.current_thread().name)
        return int(real(ctx, batch))

    monkeypatch.setattr(llama_cpp, "llama_decode", recording)
    yield names


def test_embeddings_and_generations_decode_on_the_scheduler_thread(embedded_model: str,
                                                                   decode_threads: list[str]) -> None:
    eng = _load(embedded_model, embedding_tokens=128)
    try:
        box: dict[str, Any] = {}

        def embed() -> None:  # as the service's runner does: from a thread of its own, which stays alive
            box["vectors"] = eng.embed([eng.tokenize("a sentence to embed"), eng.tokenize("another one")], Cancel()).vectors

        t = threading.Thread(target=embed, name="runner-worker")
        t.start()
        t.join(120)
        assert len(box["vectors"]) == 2 and len(box["vectors"][0]) == eng.embedding_limits()[0]
        assert _text(eng)
        assert decode_threads and set(decode_threads) == {"llama-scheduler"}, sorted(set(decode_threads))
    finally:
        eng.unload()


def test_an_idle_engine_ends_its_thread_only_beside_another(embedded_model: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llama_engine, "SCHEDULER_IDLE_EXIT_S", 0.05)
    before = _schedulers()
    a = _load(embedded_model)
    b = None
    try:
        first = _text(a)
        time.sleep(0.5)
        assert _schedulers() == before + 1  # alone: it keeps its thread (a new one costs the next first token)
        b = _load(embedded_model)
        assert _text(b) == first
        assert _wait_for(lambda: _schedulers() == before), "two idle engines kept their threads (and OpenMP teams)"
        assert _text(a) == first and _text(b) == first  # a request starts a new thread, output unchanged
        assert _wait_for(lambda: _schedulers() == before)
        b.unload()
        b = None
        assert _text(a) == first
        time.sleep(0.5)
        assert _schedulers() == before + 1  # alone again: the thread stays
    finally:
        a.unload()
        if b is not None:
            b.unload()
    assert _schedulers() == before

