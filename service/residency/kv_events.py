"""KV events in vLLM's format: which prompt blocks each loaded model holds, for a router that routes by prefix.

llm-d's precise prefix-cache scorer (and NVIDIA Dynamo's router) subscribe to each replica's events over ZeroMQ and
send a request where most of its leading blocks are held. The format is vLLM's (``vllm/distributed/kv_events.py``
of vLLM 0.34.0): a PUB socket sends ``(topic, sequence as 8 bytes big-endian, payload)``; the payload is a msgpack
``KVEventBatch``, the array ``[ts, events]``, each event a map tagged by ``type``: ``BlockStored`` (the blocks'
hashes, the parent's hash, their token ids, ``block_size``, ``lora_id``, ``medium``, ``lora_name``),
``BlockRemoved`` (hashes and ``medium``) or ``AllBlocksCleared``.

llama.cpp has no blocks: a slot holds a run of tokens. Here a held prompt is cut into blocks of ``block_size``
tokens (``GGUF_KV_EVENTS_BLOCK_SIZE``; only whole blocks, as vLLM publishes them), each hashed with its parent's
hash and the prompt's scope (the API key's and ``cache_salt``'s: requests of another scope cannot reuse it), so a
block is named by everything before it. The media: ``GPU`` for a slot's KV (llama.cpp's cache, on the cards or in
host memory on a CPU-only load), ``CPU`` for a prompt saved in host memory beyond the slots and ``STORAGE`` (vLLM's
name) for one on disk (``service.engine.prompt_cache``).

The publisher reads what each model holds (``Engine.cached_prompts``) whenever its gauges moved, and sends the
difference from what it published last: stored blocks in chain order (a parent before its children), removed
ones. The process's first batch starts with ``AllBlocksCleared`` (a subscriber may still hold what an earlier
server process published); after that a model's own losses are ``BlockRemoved`` of everything it had published,
never ``AllBlocksCleared`` (llm-d's router clears every model of the pod on that event): when its runner process
dies (its slots and host memory went with it; the disk's blocks come back with the restart), when it is reloaded,
and when it is unloaded. One topic per model
(``GGUF_KV_EVENTS_TOPIC``, by default ``kv@<host>@<model>``, llm-d's convention). Not built: vLLM's replay socket
(a subscriber that missed batches cannot ask for them again; the next change still brings its state).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from ..engine.base import CachedPrompt

log = logging.getLogger(__name__)

MEDIA = {"GPU": "GPU", "CPU": "CPU", "DISK": "STORAGE"}
"""The engine's media under vLLM's names (``MEDIUM_GPU``, ``MEDIUM_CPU``, ``MEDIUM_STORAGE``)."""
DEFAULT_TOPIC = "kv@{host}@{model}"
"""A model's topic unless ``GGUF_KV_EVENTS_TOPIC`` says otherwise (llm-d's convention)."""
POLL_S = 0.2
"""How often the publisher reads each loaded model's gauges (one round trip to its runner)."""


@dataclass(frozen=True)
class Block:
    hash: int
    parent: int | None
    tokens: tuple[int, ...]


def block_hash(parent: int | None, scope: str, tokens: Sequence[int]) -> int:
    """A block's name: the first 8 bytes of SHA-256 over its parent's hash, the scope and its token ids, as a
    signed 64-bit integer (vLLM's ``ExternalBlockHash`` may be an int)."""
    h = hashlib.sha256()
    h.update(b"-" if parent is None else parent.to_bytes(8, "big", signed=True))
    h.update(scope.encode("utf-8") + b"\0")
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return int.from_bytes(h.digest()[:8], "big", signed=True)


def blocks_of(prompt: CachedPrompt, block_size: int) -> list[Block]:
    """A held prompt's whole blocks, in order."""
    out: list[Block] = []
    parent: int | None = None
    for start in range(0, len(prompt.tokens) - block_size + 1, block_size):
        tokens = prompt.tokens[start:start + block_size]
        h = block_hash(parent, prompt.scope, tokens)
        out.append(Block(h, parent, tokens))
        parent = h
    return out


def held_blocks(prompts: Iterable[CachedPrompt], block_size: int) -> dict[str, dict[int, Block]]:
    """vLLM's medium -> hash -> block, for everything a model holds."""
    out: dict[str, dict[int, Block]] = {}
    for p in prompts:
        by_hash = out.setdefault(MEDIA[p.medium], {})
        for b in blocks_of(p, block_size):
            by_hash.setdefault(b.hash, b)
    return out


def stored_events(new: dict[int, Block], block_size: int, medium: str) -> list[dict[str, Any]]:
    """``BlockStored`` events for ``new`` blocks: runs along each chain, a parent before its children."""
    children: dict[int | None, list[Block]] = {}
    for b in new.values():
        children.setdefault(b.parent, []).append(b)
    roots = [b for b in new.values() if b.parent not in new]
    events: list[dict[str, Any]] = []
    stack = sorted(roots, key=lambda b: b.hash)
    while stack:
        run = [stack.pop()]
        while True:  # follow the chain while it does not fork
            nxt = sorted(children.get(run[-1].hash, []), key=lambda b: b.hash)
            if len(nxt) != 1:
                stack.extend(nxt)
                break
            run.append(nxt[0])
        events.append({"type": "BlockStored", "block_hashes": [b.hash for b in run],
                       "parent_block_hash": run[0].parent, "token_ids": [t for b in run for t in b.tokens],
                       "block_size": block_size, "lora_id": None, "medium": medium, "lora_name": None})
    return events


def diff_events(before: dict[str, dict[int, Block]], after: dict[str, dict[int, Block]],
                block_size: int) -> list[dict[str, Any]]:
    """What turns the published state ``before`` into ``after``: removals first, then stores."""
    events: list[dict[str, Any]] = []
    for medium in sorted(set(before) | set(after)):
        gone = [h for h in before.get(medium, {}) if h not in after.get(medium, {})]
        if gone:
            events.append({"type": "BlockRemoved", "block_hashes": sorted(gone), "medium": medium})
    for medium in sorted(after):
        new = {h: b for h, b in after[medium].items() if h not in before.get(medium, {})}
        if new:
            events.extend(stored_events(new, block_size, medium))
    return events


@dataclass
class _Model:
    incarnation: tuple[Any, ...]
    gauges: Any = None
    published: dict[str, dict[int, Block]] = field(default_factory=dict)


class KvEventPublisher:
    """One PUB socket for the server; a topic and a published state per loaded model."""

    def __init__(self, endpoint: str, *, block_size: int, topic: str) -> None:
        import msgspec
        import zmq

        self.block_size, self.topic = block_size, topic
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        last = self._pub.getsockopt(zmq.LAST_ENDPOINT)
        self.endpoint = last.decode() if isinstance(last, bytes) else str(last)
        """Where it listens (a ``tcp://*:0`` endpoint gets its port here)."""
        self._encode = msgspec.msgpack.Encoder().encode
        self._seq = 0
        self._models: dict[str, _Model] = {}
        self._started = False

    def topic_of(self, model: str) -> bytes:
        return self.topic.format(host=socket.gethostname(), model=model).encode("utf-8")

    def send(self, model: str, events: list[dict[str, Any]]) -> None:
        """One ``KVEventBatch`` on the model's topic."""
        if not events:
            return
        payload = self._encode([time.time(), events])
        self._pub.send_multipart([self.topic_of(model), self._seq.to_bytes(8, "big"), payload])
        self._seq += 1

    def update(self, model: str, incarnation: tuple[Any, ...], prompts: Sequence[CachedPrompt]) -> None:
        """Publish what ``model`` holds now (``incarnation`` changes when its cache was emptied: a load, a
        runner's restart; what it had published is removed then, and the new state stored)."""
        m = self._models.get(model)
        events: list[dict[str, Any]] = []
        if not self._started:  # this process's first batch: a subscriber may hold what an earlier one published
            events.append({"type": "AllBlocksCleared"})
            self._started = True
        before = m.published if m is not None else {}
        if m is None or m.incarnation != incarnation:  # reloaded or restarted: what it held is gone
            m = self._models[model] = _Model(incarnation)
        held = held_blocks(prompts, self.block_size)
        events.extend(diff_events(before, held, self.block_size))
        m.published = held
        self.send(model, events)

    def down(self, model: str) -> None:
        """``model``'s runner process died: its slots and its prompt cache in memory went with it (the disk's
        blocks come back with the restart)."""
        m = self._models.get(model)
        if m is not None and m.published:
            self.send(model, diff_events(m.published, {}, self.block_size))
            m.published, m.gauges = {}, None

    def gone(self, model: str) -> None:
        """``model`` was unloaded: its blocks are all gone."""
        m = self._models.pop(model, None)
        if m is not None:
            self.send(model, diff_events(m.published, {}, self.block_size))

    def changed(self, model: str, incarnation: tuple[Any, ...], gauges: Any) -> bool:
        """Whether the model's gauges (or incarnation) moved since its last publication (``poll`` records them only
        once what they describe is published: a read that failed is tried again)."""
        m = self._models.get(model)
        return m is None or m.incarnation != incarnation or m.gauges != gauges

    def close(self) -> None:
        self._pub.close(0)
        self._ctx.term()

    async def run(self, manager: Any) -> None:
        """Follow the loaded models until cancelled."""
        while True:
            try:
                await self.poll(manager)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a runner dying mid-read: the next poll sees its restart
                log.warning("KV events: a read of the models failed (%s: %s); trying again", type(exc).__name__, exc)
            await asyncio.sleep(POLL_S)

    async def poll(self, manager: Any) -> None:
        loaded = {s.name: s for s in manager.loaded()}
        for name in [n for n in self._models if n not in loaded]:
            self.gone(name)
        for name, state in loaded.items():
            engine = state.engine
            runner = getattr(engine, "runner_json", None)
            info = runner() if runner is not None else {}
            if info.get("state", "loaded") != "loaded":
                self.down(name)
                continue
            incarnation = (id(engine), info.get("restarts"))
            gauges = await asyncio.to_thread(engine.gauges)
            key = (gauges.kv_cells_used, gauges.prompt_tokens_evaluated, tuple(sorted(gauges.prompt_cache.items())))
            if not self.changed(name, incarnation, key):
                continue
            prompts = await asyncio.to_thread(engine.cached_prompts)
            self.update(name, incarnation, prompts)
            m = self._models.get(name)
            if m is not None:
                m.gauges = key


__all__ = ["DEFAULT_TOPIC", "KvEventPublisher", "block_hash", "blocks_of", "diff_events", "held_blocks"]
