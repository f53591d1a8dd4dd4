"""The engine each loaded model gets: llama.cpp in a runner process of its own (or in this process)."""

from __future__ import annotations

import time
from typing import Any, Callable

from sizing.plan import Plan

from ..engine.base import Engine, LoadReport
from ..settings import Settings
from ..text.served import ServedModel, text_factory
from .fifo import Runner
from .state import ModelState

EngineFactory = Callable[[Settings], Engine]
"""Builds one engine per loaded model, from the settings (``parallel`` set to the model's slots)."""


def default_engine(settings: Settings) -> Engine:
    """llama.cpp through llama-cpp-python: ``parallel`` slots decoded together, each keeping its prompt's KV; in a
    runner process of its own (``GGUF_RUNNER_PROCESS``, ``service.runner.process``) or in this one."""
    kwargs: dict[str, Any] = dict(n_threads=settings.n_threads, cache_prompt=settings.cache_prompt,
                                  slot_prompt_similarity=settings.slot_prompt_similarity,
                                  embedding_pooling=settings.embedding_pooling,
                                  batch_invariant=settings.batch_invariant, prompt_cache_mib=settings.prompt_cache_mib,
                                  prompt_cache_dir=settings.prompt_cache_dir,
                                  prompt_cache_disk_mib=settings.prompt_cache_disk_mib,
                                  speculative=settings.speculative != "off", draft_max=settings.draft_max,
                                  replay_tolerance=settings.replay_tolerance)
    if settings.runner_process:
        from ..runner.process import ProcessEngine

        return ProcessEngine(kwargs, log_level=settings.log_level, max_restarts=settings.runner_max_restarts,
                             stall_s=settings.runner_stall_s)
    from ..engine.llama import LlamaEngine

    return LlamaEngine(**kwargs)


async def start_engine(settings: Settings, factory: EngineFactory, state: ModelState, plan: Plan,
                       on_event: Callable[[str, str], object]) -> None:
    """A fresh engine and runner (FIFO) for ``state``, and the load (raises what the engine raised); ``on_event``
    hears a runner process's deaths, restarts and final failure, from the process's watcher thread."""
    assert state.path is not None
    slots = max(1, plan.cfg.n_seq_max)
    engine = ServedModel(factory(settings.model_copy(update={
        "parallel": slots, "batch_invariant": state.batch_invariant})), text_factory(settings.chat_template()))
    watch = getattr(engine, "watch", None)
    if watch is not None:  # a runner process: its deaths, restarts and final failure come back (from its thread)
        watch(state.name, on_event)
    runner = Runner(max_waiting=settings.queue_size, workers=slots, name=state.name)
    path = state.path
    try:
        report: LoadReport = await runner.call(lambda: engine.load(path, plan), exclusive=True)
    except BaseException:
        runner.stop()
        raise
    state.engine, state.runner, state.report, state.plan = engine, runner, report, plan
    state.state, state.error, state.since, state.last_used = "loaded", None, time.time(), time.monotonic()
    state.unloaded_why = None
