"""Prompts beyond the slots (issue 24): idle conversations' KV kept in host memory, and optionally on disk.

When a slot is given to another conversation, what it held would be lost; instead the engine
(``service.engine.llama``) copies the sequence's state out of llama.cpp (``llama_state_seq_get_data``: every
cell of the sequence, both caches of a sliding-window model) into a ``PromptCache`` entry with its tokens. A later
request whose prompt extends an entry's tokens further than any slot's gets it back into its slot
(``llama_state_seq_set_data``) and evaluates only the rest, as llama-server's ``--cache-ram`` does
(tools/server/server-task.cpp ``server_prompt_cache``): an entry fully contained in a new one is dropped, an entry
is not stored twice, the least recently used go first when the byte budget is reached, and a restored entry
leaves host memory (its KV is in the slot again).

The budget is planned (``budget``): half of the host memory the model's plan leaves free, at most the ceiling
(``GGUF_PROMPT_CACHE_MIB``, llama-server's 8,192 MiB default), so that the cache cannot be what makes the host
run out; residency can lower it later (``set_budget``).

On disk (``GGUF_PROMPT_CACHE_DIR``): each entry is written as a file of its own, atomically (a temporary file, then
``os.replace``), under a folder named for the entry's *binding*: the exact model file (its size and a hash of its
first and last MiB) and every parameter that shapes the KV (cache types, flash attention, cells per sequence,
SWA mode, the state format). A file whose header, binding, length or checksum does not match is ignored and
counted (``rejected``), never given to llama.cpp. The disk has a budget of its own; the oldest files go first.
A load reads the files back into host memory, newest first, as far as the memory budget and ``WARM_S`` go, so
that the next turn after a restart or a reload restores from memory.

Entries carry a scope (``scope_of``): with API keys configured, a hash of the key, so that one tenant's cached
prefix never shortens another's time to first token (a timing side channel), and a request's ``cache_salt``
(vLLM's field) narrows it further. Pure Python and files: no llama.cpp here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from sizing.units import MIB

from .base import scope_of

log = logging.getLogger(__name__)

FORMAT = 1
"""The file format's version (part of the binding: a file of another format is another model's, never read)."""
MAGIC = b"GGUFKV1\n"
MIN_TOKENS = 32
"""Slots holding fewer tokens are not kept: evaluating them again costs less than a restore is worth."""
SUFFIX = ".kv"
WARM_S = 1.0
"""At most this long of a load reads cached prompts back from disk into memory (a 12 MiB file, gemma-3-270m's
1,800-token f16 state, took 26-36 ms to read and check); the rest is read when a request needs it."""


def budget(ceiling_bytes: int, host_free_bytes: int, plan_host_bytes: int) -> int:
    """The host memory a model's prompt cache may hold: half of what its plan leaves free on the host, at most
    ``ceiling_bytes`` (0: off)."""
    if ceiling_bytes <= 0:
        return 0
    return max(0, min(ceiling_bytes, (host_free_bytes - plan_host_bytes) // 2))


def plan_budget(plan: Any, ceiling_bytes: int) -> int:
    """``budget`` for a plan (``sizing.plan.Plan``): its host's free memory less what it places there."""
    host = plan.estimate.host.total_bytes if plan.estimate is not None else 0
    return budget(ceiling_bytes, plan.host.free_bytes, host)


def model_fingerprint(path: str) -> str:
    """The model file's identity: its size and a hash of its first and last MiB (cheap on any size; a GGUF's
    header names its tensors and their offsets, so another file with the same ends is the same model)."""
    size = os.path.getsize(path)
    h = hashlib.blake2b(digest_size=16)
    h.update(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(MIB))
        if size > 2 * MIB:
            f.seek(size - MIB)
            h.update(f.read(MIB))
    return h.hexdigest()


def binding_of(fields: dict[str, Any]) -> str:
    """The binding's folder name: a hash of the model fingerprint and KV-shaping parameters (``fields``)."""
    text = json.dumps({"format": FORMAT, **fields}, sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


@dataclass(eq=False)
class Entry:
    """A cached prompt: its tokens and llama.cpp's state of their sequence (in memory, on disk, or both)."""

    tokens: list[int]
    scope: str
    pos_min: int
    """``llama_memory_seq_pos_min`` when it was saved: what a sliding-window cache still held."""
    n_canon: int
    """Batch-invariant mode: leading tokens computed as a cold evaluation computes them."""
    nbytes: int
    state: bytearray | None = None
    """In host memory (None: on disk only)."""
    path: Path | None = None
    """On disk (None: in memory only)."""
    last_used: int = 0
    logits: Any = None
    logits_at: int = 0
    """As a slot's (``service.engine.slots.reusable`` reads them): an entry keeps no logits."""


@dataclass
class Stats:
    hits: int = 0
    misses: int = 0
    restored_tokens: int = 0
    saved: int = 0
    evicted: int = 0
    rejected: int = 0
    """Files ignored: another binding, truncated, corrupt, unreadable."""
    restore_failed: int = 0
    """States llama.cpp did not take back (no cells free): served from a cold prompt."""
    disk_written: int = 0


@dataclass
class PromptCache:
    """Entries within a byte budget in host memory, least recently used evicted first, optionally on disk."""

    budget_bytes: int
    directory: Path | None = None
    """This binding's folder (None: memory only)."""
    disk_budget_bytes: int = 0
    binding: str = ""
    entries: list[Entry] = field(default_factory=list)
    stats: Stats = field(default_factory=Stats)
    _clock: int = 0
    _writes: "queue.SimpleQueue[Any] | None" = None
    _writer: threading.Thread | None = None
    _io: threading.Lock = field(default_factory=threading.Lock)
    """One file read at a time (``_load``)."""
    _lock: threading.Lock = field(default_factory=threading.Lock)
    """The entries against the writer thread (which only sets ``path`` and reads ``disk bytes``)."""
    _backlog: int = 0
    """Writes queued and not yet done."""

    # -- what it holds ------------------------------------------------------

    @property
    def memory_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries if e.state is not None)

    @property
    def memory_entries(self) -> int:
        return sum(1 for e in self.entries if e.state is not None)

    @property
    def disk_bytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self.entries if e.path is not None)

    @property
    def disk_entries(self) -> int:
        with self._lock:
            return sum(1 for e in self.entries if e.path is not None)

    def gauges(self) -> dict[str, int]:
        s = self.stats
        return {"bytes": self.memory_bytes, "entries": self.memory_entries, "budget_bytes": self.budget_bytes,
                "disk_bytes": self.disk_bytes, "disk_entries": self.disk_entries, "hits": s.hits,
                "misses": s.misses, "restored_tokens": s.restored_tokens, "evicted": s.evicted,
                "rejected": s.rejected, "restore_failed": s.restore_failed}

    def takes(self, nbytes: int) -> bool:
        """Whether a state this large can be kept: in memory within the budget, else on disk."""
        return nbytes <= self.budget_bytes or self.directory is not None

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0 or self.directory is not None

    # -- lookups and changes (the engine's scheduler thread) ----------------------

    def best(self, tokens: list[int], scope: str, usable: Callable[[Entry, list[int]], int], floor: int
             ) -> tuple[Entry | None, int]:
        """The entry of ``scope`` whose usable prefix of ``tokens`` is longest and longer than ``floor``."""
        best, n_best = None, floor
        for e in self.entries:
            if e.scope != scope or len(e.tokens) <= n_best or (e.state is None and e.path is None):
                continue  # another's, too short, or its state still on its way to the disk
            k = usable(e, tokens)
            if k > n_best:
                best, n_best = e, k
        return best, n_best

    def contains(self, tokens: list[int], scope: str) -> bool:
        """Whether an entry already holds ``tokens`` (or a longer prompt they begin)."""
        n = len(tokens)
        return any(e.scope == scope and len(e.tokens) >= n and e.tokens[:n] == tokens for e in self.entries)

    def needs(self, tokens: list[int], scope: str, *, memory: bool = True) -> bool:
        """Whether a slot holding ``tokens`` has a state to add: no entry holds them (nor a longer prompt they
        begin), or (``memory``) the entry of exactly these tokens is on disk only and host memory has room for it
        (a prompt written behind while its slot still held it, now leaving the slot)."""
        n = len(tokens)
        if n < MIN_TOKENS:
            return False
        for e in self.entries:
            if e.scope == scope and len(e.tokens) >= n and e.tokens[:n] == tokens:
                return memory and e.state is None and len(e.tokens) == n and e.nbytes <= self.budget_bytes
        return True

    def put(self, tokens: list[int], state: bytearray, *, scope: str, pos_min: int, n_canon: int,
            memory: bool = True) -> bool:
        """Keep a slot's prompt; entries it contains are dropped; False when it is held already or too large.

        ``memory`` off: on disk only (``write_behind``: the slot still holds it, so host memory need not); the
        state waits in the writer's queue until it is written. An entry of exactly these tokens kept on disk only
        takes the state into memory."""
        if not self.needs(tokens, scope, memory=memory) or not self.takes(len(state)):
            return False
        n = len(tokens)
        self._clock += 1
        for e in self.entries:
            if e.scope == scope and e.tokens == tokens:  # on disk only (``needs``): into memory too
                e.state, e.last_used = state, self._clock
                self._fit()
                return True
        with self._lock:
            for e in [e for e in self.entries if e.scope == scope and len(e.tokens) <= n and tokens[:len(e.tokens)] == e.tokens]:
                self._drop(e)
        e = Entry(tokens=list(tokens), scope=scope, pos_min=pos_min, n_canon=n_canon, nbytes=len(state),
                  state=state if memory and len(state) <= self.budget_bytes else None, last_used=self._clock)
        with self._lock:
            self.entries.append(e)
        self.stats.saved += 1
        self._fit()
        if self.directory is not None:
            self._write(e, state)
        return True

    @property
    def writing(self) -> bool:
        """Whether a write is queued or under way (``write_behind`` queues one at a time)."""
        with self._lock:
            return self._backlog > 0

    def take(self, e: Entry) -> bytearray | None:
        """The entry's state, to restore into a slot: it leaves host memory (its disk copy stays); None when its
        file no longer reads back as written (counted in ``rejected``, the entry dropped)."""
        state = e.state
        if state is None and e.path is not None:
            state = self._load(e)
            if state is None:
                return None
        e.state = None
        if e.path is None:
            with self._lock:
                self._drop(e)
        self._clock += 1
        e.last_used = self._clock
        return state

    def clear(self) -> None:
        """Forget every entry, in memory and on disk."""
        with self._lock:
            for e in list(self.entries):
                self._drop(e)

    def set_budget(self, budget_bytes: int) -> None:
        """A new host-memory budget (residency lowers it before it refuses or evicts a model)."""
        self.budget_bytes = max(0, budget_bytes)
        self._fit()

    def _fit(self) -> None:
        """Evict from host memory, least recently used first, until the entries fit the budget."""
        while self.memory_bytes > self.budget_bytes:
            e = min((e for e in self.entries if e.state is not None), key=lambda e: e.last_used)
            e.state = None
            self.stats.evicted += 1
            if e.path is None:
                with self._lock:
                    self._drop(e)

    def _drop(self, e: Entry) -> None:
        """Forget an entry, its file too (called with ``_lock`` held)."""
        if e in self.entries:
            self.entries.remove(e)
        if e.path is not None:
            try:
                e.path.unlink()
            except OSError:
                pass
            e.path = None

    # -- disk -------------------------------------------------------------------

    def open_disk(self, root: Path, binding_fields: dict[str, Any], disk_budget_bytes: int) -> None:
        """Use ``root``/<binding>/ and index the files already there (their headers and tokens, not their states)."""
        self.binding = binding_of(binding_fields)
        self.directory = root / self.binding
        self.disk_budget_bytes = disk_budget_bytes
        self._fields = {"format": FORMAT, **binding_fields}
        self.directory.mkdir(parents=True, exist_ok=True)
        found = []
        for p in sorted(self.directory.iterdir()):
            if p.suffix != SUFFIX:
                if p.name.endswith(".tmp"):
                    p.unlink(missing_ok=True)  # a write that did not finish
                continue
            e = self._index(p)
            if e is None:
                self.stats.rejected += 1
                log.warning("prompt cache: ignored %s (not a cache file of this model and parameters)", p)
                continue
            found.append((p.stat().st_mtime_ns, e))
        for i, (_, e) in enumerate(sorted(found, key=lambda t: t[0])):
            e.last_used = i + 1
            self.entries.append(e)
        self._clock = len(found)
        self._writes = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, args=(self._writes,), name="prompt-cache-writer",
                                        daemon=True)
        self._writer.start()
        self._warm(time.monotonic() + WARM_S)

    def close(self) -> None:
        """Finish the pending writes (the disk copies outlive this process)."""
        if self._writes is not None and self._writer is not None:
            self._writes.put(None)
            self._writer.join()
            self._writes = self._writer = None

    def flush(self) -> None:
        """Wait until every write queued so far is on disk."""
        if self._writes is not None:
            done = threading.Event()
            self._writes.put(done)
            done.wait()

    def _header(self, e: Entry, digest: str) -> bytes:
        head = json.dumps({"binding": self._fields, "scope": e.scope, "n_tokens": len(e.tokens), "pos_min": e.pos_min,
                           "n_canon": e.n_canon, "state_bytes": e.nbytes, "sha256": digest}, sort_keys=True).encode()
        return MAGIC + struct.pack("<I", len(head)) + head

    def _write(self, e: Entry, state: bytearray) -> None:
        if self._writes is not None:
            with self._lock:
                self._backlog += 1
            self._writes.put((e, state))

    def _write_loop(self, writes: "queue.SimpleQueue[Any]") -> None:
        while True:
            item = writes.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            e, state = item
            try:
                self._write_one(e, state)
            finally:
                with self._lock:
                    self._backlog -= 1

    def _write_one(self, e: Entry, state: bytearray) -> None:
        with self._lock:
            if e not in self.entries:  # dropped before its turn
                return
        try:
            path = self._store(e, state)
        except OSError as exc:
            log.warning("prompt cache: could not write an entry of %d tokens: %s", len(e.tokens), exc)
            with self._lock:
                if e.state is None and e in self.entries:  # on its way to the disk only: nowhere now
                    self.entries.remove(e)
            return
        with self._lock:
            if e in self.entries:
                e.path = path
                self.stats.disk_written += 1
                self._fit_disk()
            else:
                path.unlink(missing_ok=True)

    def _store(self, e: Entry, state: bytearray) -> Path:
        assert self.directory is not None
        name = hashlib.blake2b(e.scope.encode() + array("i", e.tokens).tobytes(), digest_size=16).hexdigest()
        path = self.directory / (name + SUFFIX)
        tmp = path.with_name(path.name + ".tmp")
        digest = hashlib.sha256(state).hexdigest()
        with open(tmp, "wb") as f:
            f.write(self._header(e, digest))
            f.write(array("i", e.tokens).tobytes())
            f.write(state)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return path

    def _fit_disk(self) -> None:
        """Remove the least recently used files until the disk budget holds (called with ``_lock`` held)."""
        on_disk = sorted((e for e in self.entries if e.path is not None), key=lambda e: e.last_used)
        total = sum(e.nbytes for e in on_disk)
        for e in on_disk:
            if total <= self.disk_budget_bytes:
                break
            total -= e.nbytes
            assert e.path is not None
            e.path.unlink(missing_ok=True)
            e.path = None
            if e.state is None:
                self.entries.remove(e)

    def _read_head(self, f: Any) -> dict[str, Any] | None:
        if f.read(len(MAGIC)) != MAGIC:
            return None
        raw = f.read(4)
        if len(raw) != 4:
            return None
        (n,) = struct.unpack("<I", raw)
        if n > MIB:
            return None
        try:
            head = json.loads(f.read(n))
        except ValueError:
            return None
        return head if isinstance(head, dict) and head.get("binding") == self._fields else None

    def _index(self, path: Path) -> Entry | None:
        """An entry for a file of this binding (its state left on disk), or None."""
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                head = self._read_head(f)
                if head is None:
                    return None
                n_tokens, n_state = int(head["n_tokens"]), int(head["state_bytes"])
                if f.tell() + 4 * n_tokens + n_state != size:
                    return None  # truncated, or more than was written
                tokens = array("i")
                tokens.frombytes(f.read(4 * n_tokens))
            return Entry(tokens=tokens.tolist(), scope=str(head["scope"]), pos_min=int(head["pos_min"]),
                         n_canon=int(head["n_canon"]), nbytes=n_state, path=path)
        except (OSError, KeyError, TypeError, ValueError):
            return None

    def _load(self, e: Entry) -> bytearray | None:
        """An entry's state from its file, read and checked once whoever asks first (the scheduler's restore or
        the warm-up); a file that fails the check drops its entry."""
        with self._io:
            if e.state is not None:
                return e.state
            with self._lock:
                if e not in self.entries or e.path is None:
                    return None
            state = self._read(e)
            if state is None:
                with self._lock:
                    self._drop(e)
            return state

    def _warm(self, deadline: float) -> None:
        """At load, the files' states into host memory, most recently used first, as far as the budget and
        ``WARM_S`` go: the next turn of a conversation from before a restart or a reload then restores from
        memory. In the load, not beside it: a background read took a core from the first request's evaluation
        (the next turn after a reload went from 232 to 294 ms, bench/prompt_cache_bench.py)."""
        for e in sorted(list(self.entries), key=lambda e: -e.last_used):
            if time.monotonic() > deadline:
                return
            with self._lock:
                if e not in self.entries or e.state is not None or self.memory_bytes + e.nbytes > self.budget_bytes:
                    continue
            state = self._load(e)
            if state is not None:
                with self._lock:
                    if e in self.entries and e.state is None and self.memory_bytes + e.nbytes <= self.budget_bytes:
                        e.state = state

    def _read(self, e: Entry) -> bytearray | None:
        """The state of an entry on disk, when the file still holds what its header promises."""
        assert e.path is not None
        try:
            with open(e.path, "rb") as f:
                head = self._read_head(f)
                if head is None or int(head["n_tokens"]) != len(e.tokens):
                    raise ValueError("header")
                tokens = array("i")
                tokens.frombytes(f.read(4 * len(e.tokens)))
                state = bytearray(e.nbytes)
                if f.readinto(state) != e.nbytes or f.read(1):
                    raise ValueError("length")
            if tokens.tolist() != e.tokens or len(state) != e.nbytes or \
                    hashlib.sha256(state).hexdigest() != head["sha256"]:
                raise ValueError("content")
            return state
        except (OSError, KeyError, TypeError, ValueError) as exc:
            self.stats.rejected += 1
            log.warning("prompt cache: ignored %s (%s does not match)", e.path, exc)
            return None


__all__ = ["Entry", "MIN_TOKENS", "PromptCache", "budget", "binding_of", "model_fingerprint", "plan_budget",
           "scope_of"]
