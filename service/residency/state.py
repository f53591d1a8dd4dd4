"""One model's state in the residency, and a request's hold on it.

States: unloaded -> loading -> loaded | failed; a loaded model goes back to unloaded when it is unloaded, evicted
or idle past its keep_alive (``service.residency.manager``).
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from sizing.plan import Holding, Plan

from ..catalog.models import ModelEntry
from ..engine.base import LoadReport
from ..text.served import ServedModel
from .fifo import Runner


State = Literal["unloaded", "loading", "loaded", "unloading", "failed"]


@dataclass(eq=False)
class ModelState:
    """One model's state; while loaded, its engine, runner, plan and what llama.cpp allocated."""

    name: str
    state: State = "unloaded"
    plan: Plan | None = None
    report: LoadReport | None = None
    error: str | None = None
    since: float = field(default_factory=time.time)
    path: str | None = None
    confirmation: dict[str, Any] | None = None
    """llama.cpp's dry-run figures for the plan, beside the predicted ones."""
    entry: ModelEntry | None = None
    batch_invariant: bool = False
    """Its engine runs batch-invariant (the load's options over the model's over the settings': the plan's)."""
    engine: ServedModel | None = None
    runner: Runner | None = None
    pinned: bool = False
    keep_alive_s: float = math.inf
    """Idle seconds before it is unloaded (the model's; ``math.inf``: never)."""
    next_keep_alive_s: float | None = None
    """The last finished request's keep_alive, for this idle period (None: the model's)."""
    last_used: float = field(default_factory=time.monotonic)
    leases: int = 0
    """Requests routed to it and not finished: while any, it is busy and never evicted."""
    expires_at: float | None = None
    """Wall-clock time its keep_alive unloads it (None: it stays)."""
    unloaded_why: str | None = None
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)
    loaded_at: float = 0.0
    """Monotonic time it began serving (its slice before it yields to a swap counts from there)."""
    embedding_tokens_per_s: float | None = None
    """Tokens per second its embedding requests were evaluated at (the engine's time, yields to generations
    included; a moving average): what bounds the next one's time before it runs (``service.api.openai.embed``)."""
    load_s: float = 0.0
    """Seconds its load took, as the manager timed it (planning, llama.cpp's confirmation, the unloads it needed and
    the load with its runner's start; not a reload's wait for running generations): what a swap to it costs."""

    @property
    def busy(self) -> bool:
        return self.leases > 0

    @property
    def serving(self) -> bool:
        return self.state == "loaded" and self.engine is not None and self.runner is not None and not self.runner.closed

    def holding(self) -> Holding | None:
        if self.plan is None or self.plan.estimate is None:
            return None
        return Holding(self.name, self.plan.estimate, self.last_used, self.busy, self.pinned)


class Lease:
    """A request's hold on a loaded model: busy (never evicted) until ``release``, which the runner calls when the
    generation ends (or the route, when the request ends before it was queued). Idempotent."""

    def __init__(self, state: ModelState, on_release: Callable[[ModelState, float | None], None]) -> None:
        """``on_release``: told once, with this request's keep_alive, when the lease ends (the keep-alive timers)."""
        assert state.engine is not None and state.runner is not None
        self._on_release = on_release
        self.state = state
        self.engine: ServedModel = state.engine
        self.runner: Runner = state.runner
        self.keep_alive_s: float | None = None
        """This request's keep_alive (None: the model's)."""
        self.queued = False
        """Set once the generation is queued: from then on the runner releases the lease when it ends."""
        self._released = False
        state.leases += 1
        state.last_used = time.monotonic()
        if state.timer is not None:
            state.timer.cancel()
            state.timer = None
            state.expires_at = None

    @property
    def name(self) -> str:
        return self.state.name

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._on_release(self.state, self.keep_alive_s)
