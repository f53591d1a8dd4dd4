"""The engine protocol: what the HTTP layer needs from a model runtime.

Values only here; ``service.engine.llama`` is the llama.cpp implementation
and ``service.engine.fake`` a small fake for the paths a CPU cannot reach.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol

from sizing.plan import Plan


@dataclass(frozen=True)
class Allocation:
    """What llama.cpp reported allocating on one device (parsed from its log)."""

    device: str
    weights_bytes: int = 0
    kv_bytes: int = 0
    compute_bytes: int = 0
    output_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.compute_bytes + self.output_bytes


@dataclass(frozen=True)
class LoadReport:
    """The result of a load: the real n_ctx and the allocations beside the plan."""

    n_ctx: int
    allocations: tuple[Allocation, ...]
    offloaded_layers: tuple[int, int] | None = None
    load_seconds: float = 0.0
    log_lines: tuple[str, ...] = ()


@dataclass(frozen=True)
class GenerationParams:
    """Sampling and stopping parameters of one request (OpenAI names)."""

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: int | None = None
    grammar: str | None = None


@dataclass(frozen=True)
class Chunk:
    """One step of a generation: text, and when finished the reason and usage."""

    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: Any = None
    role: str | None = None


@dataclass
class Cancel:
    """Set by the HTTP layer when the client goes away; checked between tokens."""

    event: threading.Event = field(default_factory=threading.Event)

    def set(self) -> None:
        self.event.set()

    @property
    def cancelled(self) -> bool:
        return self.event.is_set()


class Engine(Protocol):
    """A loaded model that generates. Not thread-safe: the caller serialises requests."""

    @property
    def n_ctx(self) -> int: ...

    def load(self, path: str, plan: Plan) -> LoadReport: ...

    def unload(self) -> None: ...

    def count_tokens(self, text: str) -> int: ...

    def count_chat_tokens(self, messages: list[dict[str, Any]]) -> int: ...

    def complete(self, prompt: str, params: GenerationParams, cancel: Cancel) -> Iterator[Chunk]: ...

    def chat(self, messages: list[dict[str, Any]], params: GenerationParams, cancel: Cancel) -> Iterator[Chunk]: ...
