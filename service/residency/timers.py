"""Idle models unloaded after their keep_alive (the model's, or the last request's: Ollama's semantics).

``KeepAliveTimers`` is the manager's part that times them: its methods run on the manager.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from ..errors import ServiceError
from .state import ModelState

log = logging.getLogger(__name__)


class KeepAliveTimers:
    """A model's keep_alive timer: started when it goes idle, stopped by a request."""

    def _released(self, st: ModelState, keep_alive_s: float | None) -> None:
        st.leases -= 1
        st.last_used = time.monotonic()
        if keep_alive_s is not None:
            st.next_keep_alive_s = keep_alive_s
        if st.leases == 0:
            self._idle(st, None)
            self._kick()

    def _idle(self, st: ModelState, keep_alive_s: float | None) -> None:
        """The model went idle: start its keep_alive (the given one, the last request's, or the model's)."""
        if keep_alive_s is not None:
            st.next_keep_alive_s = keep_alive_s
        if st.timer is not None:
            st.timer.cancel()
            st.timer = None
        ka = st.next_keep_alive_s if st.next_keep_alive_s is not None else st.keep_alive_s
        st.next_keep_alive_s = None
        st.expires_at = None
        if not st.serving or st.pinned or st.busy or math.isinf(ka):
            return
        st.expires_at = time.time() + ka
        st.timer = asyncio.get_running_loop().call_later(ka, self._expire, st)

    def _expire(self, st: ModelState) -> None:
        st.timer = None
        fut = asyncio.ensure_future(self._unload_idle(st))
        self._tasks.add(fut)
        fut.add_done_callback(self._tasks.discard)

    async def _unload_idle(self, st: ModelState) -> None:
        async with self._load_lock:
            if self.models.get(st.name) is not st or not st.serving or st.busy or st.expires_at is None \
                    or st.expires_at > time.time() + 0.05:
                return
            idle_s = time.monotonic() - st.last_used
            try:
                await self._unload_state(st, force=False, wait_s=self.settings.load_wait_s,
                                         why=f"keep_alive: idle {idle_s:.1f} s")
            except ServiceError as exc:  # a request came in meanwhile: it stays
                log.info("keep_alive unload of %s skipped: %s", st.name, exc.message)
