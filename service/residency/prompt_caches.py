"""The residents' prompt caches around a load that needs room: emptied beyond the slots before it (their disk copies
stay), and each given an even share of the host memory left afterwards (``service.engine.prompt_cache``)."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from sizing.probe import host_memory
from sizing.units import MIB

from ..errors import ServiceError
from ..settings import Settings
from .state import ModelState

log = logging.getLogger(__name__)


async def shrink_prompt_caches(loaded: Callable[[], list[ModelState]], key: str) -> bool:
    """Empty the residents' prompt caches beyond the slots (service.engine.prompt_cache; their disk copies
    stay) before a load evicts a model or is refused for memory. True when any held something."""
    def work() -> list[str]:
        emptied = []
        for st in loaded():
            gauges = getattr(st.engine, "prompt_cache_gauges", None) or {}
            if gauges.get("bytes", 0) > 0:
                st.engine.set_prompt_cache_budget(0)  # type: ignore[union-attr]
                emptied.append(f"{st.name} ({gauges['bytes'] / MIB:.0f} MiB)")
        return emptied

    emptied = await asyncio.to_thread(work)
    if emptied:
        log.info("emptied the prompt caches of %s to make room for %s", ", ".join(emptied), key)
    return bool(emptied)


async def rebudget_prompt_caches(settings: Settings, loaded: Callable[[], list[ModelState]], key: str) -> None:
    """After a load that needed room: each resident's prompt cache gets an even share of half the host memory
    left free, at most the ceiling (GGUF_PROMPT_CACHE_MIB)."""
    def work() -> None:
        if not settings.cache_prompt or settings.prompt_cache_mib <= 0:
            return
        states = [st for st in loaded() if hasattr(st.engine, "set_prompt_cache_budget")]
        if not states:
            return
        share = min(settings.prompt_cache_mib * MIB, host_memory().free_bytes // (2 * len(states)))
        for st in states:
            try:
                st.engine.set_prompt_cache_budget(share)  # type: ignore[union-attr]
            except ServiceError as exc:  # unloaded meanwhile, or its runner restarting: its next load plans anew
                log.info("prompt cache of %s not resized: %s", st.name, exc)

    await asyncio.to_thread(work)
