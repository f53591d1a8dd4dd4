"""What the scheduler thread holds for each generation (``Sequence``), and work handed to it (``Call``).

Values and their own small rules only: no llama.cpp calls here.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..base import Cancel, GenerationParams
from ..slots import Slot
from ..speculation import DraftPolicy
from ..vision import ImageChunk

DONE = object()
"""A generation's last item on its queue."""
STOP = object()
"""Tells the scheduler thread to end (an unload)."""
EMBEDDING_MAX_DEFER_S = 1.0
"""An embedding decode that has waited this long behind generations runs between two of their steps (and to its
end: not aborted), so that embeddings progress while generations never stop: at least one piece a second."""


class Call:
    """Work for the scheduler thread, run between two steps: an embedding decode (``Pooler.pool``).

    ``yields``: deferred while a generation is active or waiting, until it has waited ``EMBEDDING_MAX_DEFER_S``
    (``Scheduler``'s embedding turn); ``abort_ctx``: the context whose ``llama_decode`` ``fn`` runs may be aborted
    when something arrives for the scheduler (``fn`` then returns 2 and is run again later: it must be
    repeatable)."""

    def __init__(self, fn: Callable[[], Any], *, yields: bool = False, abort_ctx: Any = None) -> None:
        self.fn, self.done = fn, threading.Event()
        self.yields, self.abort_ctx = yields, abort_ctx
        self.posted = time.monotonic()
        self.result: Any = None
        self.error: BaseException | None = None

    def overdue(self) -> bool:
        return time.monotonic() - self.posted >= EMBEDDING_MAX_DEFER_S

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:  # handed to the caller, who raises it
            self.error = exc
        self.done.set()

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.done.set()


@dataclass(eq=False)
class Sequence:
    """One generation's state (one choice of a request), owned by the scheduler thread after admission."""

    tokens: list[int]
    params: GenerationParams
    cancel: Cancel
    max_new_tokens: int
    grammar: Any
    out: "queue.SimpleQueue[Any]" = field(default_factory=queue.SimpleQueue)
    deliver: Any = None
    """The runner's direct delivery (``base.direct_delivery``): chunks and errors go there, only the end to ``out``."""
    abandoned: bool = False
    """Set by the consumer when it stops iterating (client gone, stop string seen upstream)."""
    slot: Slot | None = None
    n_cached: int = 0
    """Prompt tokens whose KV was reused instead of evaluated."""
    next_token: int | None = None
    """The sampled token not yet decoded (the next step's input)."""
    first_logits: Any = None
    """The whole prompt was cached with its logits: the first token is sampled from these."""
    greedy: bool = False
    """Temperature 0, no penalty, no grammar: the token is the row's argmax (``Sequences.on_logits``)."""
    sampler: Any = None
    """The llama.cpp sampler chain (``sampling.sampler_chain``), or None where ``temperature`` draws instead."""
    temperature: Any = None
    """``sampling.TemperatureSampler`` for plain temperature sampling."""
    n_out: int = 0
    batch_take: int = 0
    batch_logits_idx: int = -1
    t_start: float = 0.0
    t_first: float = 0.0
    t_last: float = 0.0
    index: int = 0
    """The choice this sequence generates (``GenerationParams.n``)."""
    followers: "list[Sequence]" = field(default_factory=list)
    """The other choices of the same prompt: each has a slot reserved and forks from this one's KV and logits
    once its prompt is evaluated (``Sequences.fork``)."""
    seed: int = 0
    drafter: Any = None
    """Self-speculation (``service.engine.speculation.NgramDrafter``), or the plan's draft model or MTP head
    (``service.engine.draft``, ``service.engine.mtp``, shared by the requests): None where it is off."""
    policy: DraftPolicy | None = None
    draft: list[int] = field(default_factory=list)
    """Tokens drafted into this step's batch after ``next_token``, each with its logits row."""
    replay_key: str | None = None
    """What this choice's answer is kept under beside its prompt (``service.engine.replay``): "" greedy, the seed
    and temperature of a seeded temperature draw (``sampling.draw_key``); None: not kept."""
    replay: list[int] | None = None
    """The earlier answer to the same prompt and ``replay_key`` (``service.engine.replay``): taken where its token
    is within the rounding of the row's argmax or the draw, drafted whole; None once the answer leaves it."""
    answer: list[int] = field(default_factory=list)
    """The tokens sent, the end-of-generation token last where it ended the answer (for ``Replays``)."""
    checking: tuple[int, int] = (0, 0)
    """While a draft is verified (``Sequences.verify``): its tokens, and those kept so far, not yet in ``policy``'s
    count; an answer that ends inside it reports them."""
    unverified: bool = False
    """The sequence's KV holds drafted positions past ``slot.tokens`` (dropped when it ends: ``release``)."""
    images: dict[int, ImageChunk] = field(default_factory=dict)
    """The prompt's images by the index each begins at (``service.engine.vision``): evaluated by mtmd, not
    fed as tokens; held from the request's start until it ends."""
    shifts: list[tuple[int, int]] = field(default_factory=list)
    """(index an image ends at, positions the images up to it take fewer than their tokens): M-RoPE images
    (``ImageChunk.n_pos``); empty where a token's position is its index (``pos``)."""

    @property
    def n_past(self) -> int:
        return len(self.slot.tokens) if self.slot is not None else 0

    @property
    def prompting(self) -> bool:
        return self.next_token is None and self.n_past < len(self.tokens)

    @property
    def gone(self) -> bool:
        """The client left, stopped reading, or the API process ended this choice (a stop string it found)."""
        return self.abandoned or self.cancel.cancelled or self.index in self.cancel.ended

    def pos(self, index: int) -> int:
        """The position of the token at ``index`` of the sequence: its index, less what the M-RoPE images before it
        take fewer positions than tokens (``shifts``). Asked at image boundaries and for text."""
        shift = 0
        for end, total in self.shifts:
            if end > index:
                break
            shift = total
        return index - shift

    def image_bound(self, n_keep: int) -> int:
        """``n_keep`` moved back to the start of the image it falls inside of (an image is evaluated whole: mtmd
        decodes its embeddings in one call, non-causally for Gemma 3)."""
        for start, image in self.images.items():
            if start < n_keep < start + len(image.run):
                return start
        return n_keep

    def text_end(self) -> int:
        """Where the prompt's text from ``n_past`` on ends: its next image, or its end."""
        p0 = self.n_past
        return min((start for start in self.images if start >= p0), default=len(self.tokens))
