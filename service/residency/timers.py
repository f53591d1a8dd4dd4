"""Idle models unloaded after their keep_alive (the model's, or the last request's: Ollama's semantics).

``KeepAliveTimers`` is owned by the manager: it starts and stops each model's timer and, when one fires, calls the
``unload_idle`` it was given (the manager's, under its load lock); ``released`` is what a ``Lease`` calls.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any, Awaitable, Callable

from .state import ModelState


class KeepAliveTimers:
    """Each model's keep_alive timer: started when it goes idle, stopped by a request (``Lease``)."""

    def __init__(self, unload_idle: Callable[[ModelState], Awaitable[None]], kick: Callable[[], None]) -> None:
        """``unload_idle``: unload a model whose timer fired (it checks again that the model is still idle);
        ``kick``: tell the swap scheduler that a model went idle."""
        self._unload_idle = unload_idle
        self._kick = kick
        self._tasks: set[asyncio.Future[Any]] = set()

    def released(self, st: ModelState, keep_alive_s: float | None) -> None:
        """A lease on ``st`` ended (``keep_alive_s``: the request's own, None: the model's). The last request
        decides: one without keep_alive puts the model back on its configured one (an earlier request's value does
        not outlive it)."""
        st.leases -= 1
        st.last_used = time.monotonic()
        st.next_keep_alive_s = keep_alive_s
        if st.leases == 0:
            self.idle(st, None)
            self._kick()

    def idle(self, st: ModelState, keep_alive_s: float | None) -> None:
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
