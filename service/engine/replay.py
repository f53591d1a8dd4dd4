"""A greedy or seeded request asked again answers what it answered before (issue 55: the same answer twice).
Pure: no llama.cpp.

At temperature 0 the answer is the argmax of each row, and on the CPU the rows' rounding depends on how they were
computed: a prompt evaluated cold or taken from the cache, a token decoded alone or among a draft's rows, beside
other requests or not (docs/batching.md, "kernel by kernel"). The same request then comes out otherwise from the
first token where two candidates were within that rounding of each other: asked again and drafted from its first
answer, the embedded gemma-3-270m answer was cut at a token whose logit the earlier answer's token trailed by
0.08, 0.13 and 0.17 (bench/speculative_bench.py's prose and code, traced), and of 20 chats sent cold, again,
streamed, beside others, from host memory and from disk after a restart, 16 gave more than one text on
gemma-3-270m and 9 on SmolLM2-135M (bench/repeatability_bench.py; 0 of 20 on each with the replay).

``Replays`` keeps, per cache scope, the last answers of greedy requests by their prompt; a request with the same
prompt takes the earlier answer's token wherever its logit is within ``TOLERANCE`` of the row's largest (the two
are the same answer to within the rounding), and the earlier answer drafts its next tokens whole
(``Drafting.reserve``). Where the row's own choice leads by more, it stands and the replay ends there. One
tenant's answers never steer another's (the scope, as the prompt cache's and the draft pool's).

A seeded temperature draw (OpenAI's ``seed``: "repeated requests with the same seed and parameters should return
the same result") is kept the same way, under its prompt, temperature and seed (``sampling.draw_key``): asked again
it draws the same numbers, and ``TemperatureSampler.sample`` takes the earlier token wherever the draw picks it
with each logit moved by at most half the tolerance, the greedy rule's bound. Without it the same seeded request
came out otherwise where a drafted step's rows rounded a draw across a boundary, and it could not draft from its
earlier answer for that reason (``Drafting.assign``). A draw by llama.cpp's chain (top_k, top_p, min_p, penalties,
a grammar) is not kept.
"""

from __future__ import annotations

import hashlib
import json
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

TOLERANCE = 1.0
"""How far (in logits) the earlier answer's token may trail the row's largest and still be taken
(``GGUF_REPLAY_TOLERANCE``): above the largest gaps traced between the same request's rows computed in other
shapes (0.74 over bench/repeatability_bench.py's 20 chats on gemma-3-270m; ggml-cpu's 4-row repacked gemm moved
one logit by 0.78 against a single row, docs/batching.md). Between two tokens that lead a row, 1.0 is a
probability ratio of 2.7: the earlier answer is kept only where the model all but hesitated."""
ANSWERS = 256
"""Prompts whose answer is kept per scope, the least recently asked dropped first."""


def prompt_key(prompt: Sequence[int], draw: str = "") -> str:
    """A prompt's key: a hash of its tokens (a long prompt is not held twice), and of ``draw`` for a seeded
    temperature draw's answer (``sampling.draw_key``; "" for a greedy one, whose keys are as before it)."""
    h = hashlib.blake2b(array("i", prompt).tobytes(), digest_size=16)
    if draw:
        h.update(b"\0" + draw.encode())
    return h.hexdigest()


@dataclass
class Replays:
    """The last greedy answer of each prompt, per cache scope; with ``persist``, on disk beside the prompt
    cache's files, so that the same request after a restart answers the same too."""

    tolerance: float = TOLERANCE
    """How far the earlier answer's token may trail the argmax (``prefer``); 0: nothing kept, nothing replayed."""
    answers: int = ANSWERS
    persist: Callable[[Callable[[], bytes]], None] | None = None
    """Given what to write (run on the prompt cache's writer thread) after every change (``PromptCache.put_replays``)."""
    _scopes: dict[str, "OrderedDict[str, array[int]]"] = field(default_factory=dict)
    """Per scope, by ``prompt_key``, the answer's tokens (4 bytes each: 256 answers of 4,096 tokens are 4 MiB)."""
    _lock: threading.Lock = field(default_factory=threading.Lock)
    """Requests find on their own threads while the scheduler's thread adds (``LlamaEngine.generate``) and the
    prompt cache's writer reads them (``_payload``); taken before the cache's own lock, never while holding it."""

    def find(self, scope: str, prompt: Sequence[int], draw: str = "") -> list[int] | None:
        """The answer last given to ``prompt`` in ``scope`` (its tokens, an end-of-generation token last where it
        ended so), greedy or by the seeded draw ``draw`` (``prompt_key``), or None."""
        if self.tolerance <= 0:
            return None
        key = prompt_key(prompt, draw)
        with self._lock:
            kept = self._scopes.get(scope)
            if kept is None or key not in kept:
                return None
            kept.move_to_end(key)
            return kept[key].tolist()

    def add(self, scope: str, prompt: Sequence[int], answer: Sequence[int], draw: str = "") -> None:
        if self.answers <= 0 or self.tolerance <= 0 or not prompt or not answer:
            return
        key = prompt_key(prompt, draw)
        tokens = array("i", answer)
        with self._lock:
            kept = self._scopes.setdefault(scope, OrderedDict())
            was = kept.get(key)
            # An answer cut shorter (a smaller max_tokens) that agrees with the kept one keeps the longer.
            if was is not None and tokens == was[:len(tokens)]:
                kept.move_to_end(key)
                return
            kept[key] = tokens
            while len(kept) > self.answers:
                kept.popitem(last=False)
            self._changed()

    def clear(self) -> None:
        with self._lock:
            self._scopes.clear()
            self._changed()

    def _changed(self) -> None:
        """Called with ``_lock`` held: ``persist`` only queues ``_payload``, which takes the lock on the writer."""
        if self.persist is not None:
            self.persist(self._payload)

    def _payload(self) -> bytes:
        """What ``persist`` writes, as the answers are when it runs: on the prompt cache's writer thread, once for
        all the changes queued meanwhile (``PromptCache.put_replays``), not on the scheduler's at every answer.
        The writer holds none of the cache's locks while it runs this."""
        with self._lock:
            snapshot = {scope: list(kept.items()) for scope, kept in self._scopes.items()}  # arrays not changed later
        return json.dumps({scope: [(k, v.tolist()) for k, v in items] for scope, items in snapshot.items()},
                          separators=(",", ":")).encode()

    def load(self, payload: bytes | None) -> None:
        """What ``persist`` wrote (checked by its writer: sealed, this model's); a payload of another shape is
        ignored."""
        if not payload:
            return
        try:
            data: Any = json.loads(payload)
            scopes = {str(scope): OrderedDict((str(k), array("i", v)) for k, v in items)
                      for scope, items in data.items()}
        except (ValueError, TypeError, AttributeError, OverflowError):
            return
        with self._lock:
            self._scopes = scopes


def prefer(row: Any, chosen: int, earlier: int, tolerance: float = TOLERANCE) -> int:
    """``earlier`` where its logit in ``row`` is within ``tolerance`` of ``chosen``'s (the row's argmax), else
    ``chosen``."""
    if earlier == chosen or not 0 <= earlier < len(row):
        return chosen
    return earlier if float(row[earlier]) >= float(row[chosen]) - tolerance else chosen


__all__ = ["ANSWERS", "TOLERANCE", "Replays", "prefer", "prompt_key"]
