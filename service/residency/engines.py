"""The engine each loaded model gets: llama.cpp in a runner process of its own (or in this process)."""

from __future__ import annotations

from typing import Any, Callable

from ..engine.base import Engine
from ..settings import Settings

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
                                  speculative=settings.speculative != "off", draft_max=settings.draft_max)
    if settings.runner_process:
        from ..runner.process import ProcessEngine

        return ProcessEngine(kwargs, log_level=settings.log_level, max_restarts=settings.runner_max_restarts)
    from ..engine.llama import LlamaEngine

    return LlamaEngine(**kwargs)
