"""Prompts beyond the slots (issue 24): idle conversations' KV kept in host memory, and optionally on disk.

When a slot is given to another conversation, what it held would be lost; instead the engine
(``service.engine.llama``) copies the sequence's state out of llama.cpp (``llama_state_seq_get_data``: every
cell of the sequence, both caches of a sliding-window model) into a ``PromptCache`` entry with its tokens. A later
request whose prompt extends an entry's tokens further than any slot's gets it back into its slot
(``llama_state_seq_set_data``) and evaluates only the rest, as llama-server's ``--cache-ram`` does
(tools/server/server-task.cpp ``server_prompt_cache``): an entry fully contained in a new one is dropped, an entry
is not stored twice, the least recently used go first when the byte budget is reached, and a restored entry
leaves host memory (its KV is in the slot again).

An entry is found by its longest common prefix with the new prompt, not only when the prompt extends it: a client
that sends back an assistant turn of its own (edited, trimmed, or simply not the generated text) shares the
entry's prompt but not its generated tokens, so the entry is restored and cut back to the common prefix. For a
sliding-window model the entry also keeps its slot's ``Checkpoint`` (the window right after the prompt was
evaluated, in host memory beside the state, counted in the budget, and in its file after the state): the cut back
to the prompt's end then holds whatever the window lost while the answer was generated or other conversations ran,
a restart too (issue 55).

The budget is planned (``budget``): half of the host memory the model's plan leaves free, at most the ceiling
(``GGUF_PROMPT_CACHE_MIB``, llama-server's 8,192 MiB default), so that the cache cannot be what makes the host
run out; residency can lower it later (``set_budget``).

On disk (``GGUF_PROMPT_CACHE_DIR``): each entry is written as a file of its own, atomically (a temporary file, then
``os.replace``), under a folder named for the entry's *binding*: the exact model file (its size and a hash of its
first and last MiB) and every parameter that shapes the KV (cache types, flash attention, cells per sequence,
SWA mode, the state format). Each file is *sealed* (issue 54): an HMAC-SHA256 under a per-install key
(``install_key``: 32 random bytes in ``KEY_FILE`` at the folder's root, mode 0600) covers the magic, the whole
header (format and binding, scope, token count, ``pos_min``, ``n_canon``, state length, the state's sha256) and
the tokens, and through the sha256 the state. Without the key a file cannot be edited, re-paired (one entry's
tokens before another's state) or moved to another binding's folder or another install: an unsealed sha256 let
all three through. A file whose seal, header, binding, length or state digest does not match is ignored and
counted (``rejected``), logged once, never given to llama.cpp. The disk has a budget of its own; the oldest
files go first. A load reads the files back into host memory, newest first, as far as the memory budget and
``WARM_S`` go, so that the next turn after a restart or a reload restores from memory.

Entries carry a scope (``scope_of``): with API keys configured, a hash of the key, so that one tenant's cached
prefix never shortens another's time to first token (a timing side channel), and a request's ``cache_salt``
(vLLM's field) narrows it further. Pure Python and files: no llama.cpp here.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import queue
import stat
import struct
import threading
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from sizing.units import MIB

from .base import scope_of
from .slots import Checkpoint

log = logging.getLogger(__name__)

FORMAT = 2
"""The file format's version (part of the binding: a file of another format is another model's, never read).
2: sealed with the install's key (issue 54); format 1's folders are left as they are, never read."""
MAGIC = b"GGUFKV2\n"
"""A file: ``MAGIC``, its seal (``SEAL_BYTES``), the header's length (u32 little-endian), the header (JSON), the
tokens (int32), the state, then the checkpoint's state where the header names one. The seal is an HMAC-SHA256 of
everything before the state but itself; the header holds the state's sha256 and the checkpoint's."""
SEAL_BYTES = 32
KEY_FILE = "prompt-cache.key"
"""The install's key, at ``GGUF_PROMPT_CACHE_DIR``'s root beside the binding folders (one key for all of them)."""
KEY_BYTES = 32
MIN_TOKENS = 32
"""Slots holding fewer tokens are not kept: evaluating them again costs less than a restore is worth."""
SUFFIX = ".kv"
REPLAYS_FILE = "replays"
"""In a binding's folder: the greedy answers by prompt (``service.engine.replay``), one file for all scopes:
``REPLAYS_MAGIC``, its seal (an HMAC-SHA256 under the install's key of the magic, the binding and the payload),
the payload (JSON)."""
REPLAYS_MAGIC = b"GGUFRP1\n"
WARM_S = 1.0
"""At most this long of a load reads cached prompts back from disk into memory (a 12 MiB file, gemma-3-270m's
1,800-token f16 state, took 26-36 ms to read and check; 7 ms on an AMD EPYC with SHA extensions, page cache warm,
sealed as unsealed: the seal adds an HMAC of the header and tokens, 5 us); the rest is read when a request needs
it."""


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


class KeyFileRefused(OSError):
    """The install's key file is not one this process can trust (too open, another owner's, not a key): the disk
    tier stays off. An ``OSError``, as a folder that cannot be used is (the engine keeps prompts in memory only)."""


def install_key(root: Path) -> bytes:
    """The key that seals this install's cache files (``root``/``KEY_FILE``), made on first use.

    Made whole or not at all: written to a private temporary file (mode 0600), fsynced, then hard-linked to its
    name, which fails when the name exists; so processes starting at once all read back the one key that was
    linked first, and none ever reads a partial one (``O_CREAT | O_EXCL`` on the name itself would let one read
    a file another is still writing, and leave an empty key after a crash). Where the file system has no hard
    links it falls back to ``O_CREAT | O_EXCL`` on the name.

    A key file readable or writable by anyone but its owner, owned by another user, or not ``KEY_BYTES`` long is
    refused (``KeyFileRefused``), not replaced: whoever could read it could seal files, so it is for the operator
    to see why, fix and remove it; and a replacement cannot be made safely while another process may be reading
    the old key (two processes each replacing it would end with two keys, each rejecting the other's files)."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / KEY_FILE
    if not path.exists():
        _create_key(path)
    return _read_key(path)


def _create_key(path: Path) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, os.urandom(KEY_BYTES))  # 32 bytes to a regular file: written whole
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass  # another process's key came first: it is the install's
    except OSError:  # no hard links here (some network and FUSE file systems)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        else:
            try:
                os.write(fd, tmp.read_bytes())
                os.fsync(fd)
            finally:
                os.close(fd)
    finally:
        tmp.unlink(missing_ok=True)
    try:  # the key's name survives a crash with the files it seals
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def _read_key(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KeyFileRefused(f"the key file {path} is not a regular file; remove it")
        if st.st_uid != os.geteuid():
            raise KeyFileRefused(f"the key file {path} belongs to user {st.st_uid}, not to this process's "
                                 f"({os.geteuid()}); give it to this user with mode 0600, or remove it")
        if st.st_mode & 0o077:
            raise KeyFileRefused(f"the key file {path} has mode {stat.S_IMODE(st.st_mode):04o}: anyone it lets in "
                                 "could seal cache files; make it 0600 (chmod 600), or remove it (the cached "
                                 "prompts it sealed are then no longer read)")
        key = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(key) != KEY_BYTES:
        raise KeyFileRefused(f"the key file {path} holds {len(key)} bytes, not a key of {KEY_BYTES}; remove it")
    return key


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
    """The first position of the sliding window its state holds: the live sequence's ``llama_memory_seq_pos_min``,
    but at least its last position less ``n_swa - 1`` (llama.cpp saves no cell masked for the last position;
    ``service.engine.llama.slotting``)."""
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
    checkpoint: Checkpoint | None = None
    """The sliding window after the prompt's evaluation (``service.engine.slots.Checkpoint``), in host memory with
    ``state``; where only its file holds it, its state is empty (``PromptCache.checkpoint_of`` reads it)."""
    file_checkpoint: tuple[int, int, int] | None = None
    """The checkpoint its file holds after the state: (tokens, window start, bytes); None: none."""

    @property
    def disk_nbytes(self) -> int:
        """What its file's states take (the state, and the checkpoint's)."""
        return self.nbytes + (self.file_checkpoint[2] if self.file_checkpoint is not None else 0)

    @property
    def memory_nbytes(self) -> int:
        """Host memory it holds: its state and its checkpoint (0 on disk only)."""
        if self.state is None:
            return 0
        return self.nbytes + (len(self.checkpoint.state) if self.checkpoint is not None else 0)


@dataclass
class Stats:
    hits: int = 0
    misses: int = 0
    restored_tokens: int = 0
    saved: int = 0
    evicted: int = 0
    rejected: int = 0
    """Files ignored: unsealed (edited, re-paired, another install's), another binding, truncated, corrupt,
    unreadable."""
    restore_failed: int = 0
    """States llama.cpp did not take back (no cells free): served from a cold prompt."""
    disk_written: int = 0
    lookup_hit: int = 0
    """Requests that reused at least half of their prompt's tokens (their slot, another slot, or a restore)."""
    lookup_partial: int = 0
    """Requests that reused ``MIN_TOKENS`` or more of their prompt's tokens, less than half."""
    lookup_miss: int = 0
    """Requests that reused fewer than ``MIN_TOKENS`` of their prompt's tokens."""
    held_unused: int = 0
    """Requests that reused less than half of their prompt although a slot or a cached prompt shared at least half
    of it (a sliding window that no longer reached the cut, a state llama.cpp did not take back)."""


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
    _key: bytes = b""
    """The install's key (``install_key``), which seals the files."""
    _replays_due: Callable[[], bytes] | None = None
    """The replays' payload to write next (``put_replays``): only the latest is written."""

    # -- what it holds ------------------------------------------------------

    @property
    def memory_bytes(self) -> int:
        return sum(e.memory_nbytes for e in self.entries)

    @property
    def memory_entries(self) -> int:
        return sum(1 for e in self.entries if e.state is not None)

    @property
    def disk_bytes(self) -> int:
        with self._lock:
            return sum(e.disk_nbytes for e in self.entries if e.path is not None)

    @property
    def disk_entries(self) -> int:
        with self._lock:
            return sum(1 for e in self.entries if e.path is not None)

    def gauges(self) -> dict[str, int]:
        s = self.stats
        return {"bytes": self.memory_bytes, "entries": self.memory_entries, "budget_bytes": self.budget_bytes,
                "disk_bytes": self.disk_bytes, "disk_entries": self.disk_entries, "hits": s.hits,
                "misses": s.misses, "restored_tokens": s.restored_tokens, "evicted": s.evicted,
                "rejected": s.rejected, "restore_failed": s.restore_failed, "lookup_hit": s.lookup_hit,
                "lookup_partial": s.lookup_partial, "lookup_miss": s.lookup_miss, "held_unused": s.held_unused}

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
            memory: bool = True, checkpoint: Checkpoint | None = None) -> bool:
        """Keep a slot's prompt; entries it contains are dropped; False when it is held already or too large.

        ``memory`` off: on disk only (``write_behind``: the slot still holds it, so host memory need not); the
        state waits in the writer's queue until it is written. An entry of exactly these tokens kept on disk only
        takes the state (and ``checkpoint``) into memory. ``checkpoint``: the slot's, kept with the state in host
        memory when both fit the budget, and in the file."""
        if not self.needs(tokens, scope, memory=memory) or not self.takes(len(state)):
            return False
        to_disk = checkpoint
        if checkpoint is not None and (not memory or len(state) + len(checkpoint.state) > self.budget_bytes):
            checkpoint = None
        n = len(tokens)
        self._clock += 1
        for e in self.entries:
            if e.scope == scope and e.tokens == tokens:  # on disk only (``needs``): into memory too
                e.state, e.checkpoint, e.last_used = state, checkpoint or _on_file(e), self._clock
                self._fit()
                return True
        with self._lock:
            for e in [e for e in self.entries if e.scope == scope and len(e.tokens) <= n and tokens[:len(e.tokens)] == e.tokens]:
                self._drop(e)
        in_memory = memory and len(state) <= self.budget_bytes
        e = Entry(tokens=list(tokens), scope=scope, pos_min=pos_min, n_canon=n_canon, nbytes=len(state),
                  state=state if in_memory else None, last_used=self._clock,
                  checkpoint=checkpoint if in_memory else None)
        with self._lock:
            self.entries.append(e)
        self.stats.saved += 1
        self._fit()
        if self.directory is not None:
            self._write(e, state, to_disk)
        return True

    @property
    def writing(self) -> bool:
        """Whether a write is queued or under way (``write_behind`` queues one at a time)."""
        with self._lock:
            return self._backlog > 0

    def checkpoint_of(self, e: Entry) -> Checkpoint | None:
        """The entry's checkpoint with its state, read from its file where only the file holds it (before ``take``,
        which lets it go); None when it has none or its file no longer reads back as written (counted)."""
        c = e.checkpoint
        if c is None or c.state:
            return c
        with self._io:
            return self._read_checkpoint(e)

    def take(self, e: Entry) -> bytearray | None:
        """The entry's state, to restore into a slot: it leaves host memory (its disk copy stays); None when its
        file no longer reads back as written (counted in ``rejected``, the entry dropped)."""
        state = e.state
        if state is None and e.path is not None:
            state = self._load(e)
            if state is None:
                return None
        e.state, e.checkpoint = None, _on_file(e)
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
            e.state, e.checkpoint = None, _on_file(e)
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
        """Use ``root``/<binding>/ and index the files already there (their headers and tokens, checked against
        their seals, not their states). ``KeyFileRefused`` (an ``OSError``) when the install's key file cannot be
        trusted; nothing is set then."""
        self._key = install_key(root)
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

    # -- the greedy answers by prompt (service.engine.replay) --------------------

    def put_replays(self, payload: Callable[[], bytes]) -> None:
        """Write the replays' payload (computed on the writer thread) into this binding's folder, sealed; a write
        still queued is replaced by this one. Nothing without a folder."""
        if self._writes is None:
            return
        with self._lock:
            queued = self._replays_due is not None
            self._replays_due = payload
            if not queued:
                self._backlog += 1
        if not queued:
            self._writes.put(REPLAYS_FILE)

    def replays(self) -> bytes | None:
        """The replays' payload this binding's folder holds, once its seal holds (else None, counted, logged)."""
        if self.directory is None:
            return None
        path = self.directory / REPLAYS_FILE
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("prompt cache: ignored %s (%s)", path, _why(exc))
            return None
        head = len(REPLAYS_MAGIC) + SEAL_BYTES
        if raw[:len(REPLAYS_MAGIC)] != REPLAYS_MAGIC or len(raw) < head or not hmac.compare_digest(
                raw[len(REPLAYS_MAGIC):head], self._replays_seal(raw[head:])):
            self.stats.rejected += 1
            log.warning("prompt cache: ignored %s (seal does not match)", path)
            return None
        return raw[head:]

    def _replays_seal(self, payload: bytes) -> bytes:
        mac = hmac.new(self._key, REPLAYS_MAGIC, hashlib.sha256)
        mac.update(json.dumps(self._fields, sort_keys=True).encode())
        mac.update(payload)
        return mac.digest()

    def _write_replays(self) -> None:
        with self._lock:
            make, self._replays_due = self._replays_due, None
        if make is None or self.directory is None:
            return
        path = self.directory / REPLAYS_FILE
        payload = make()
        try:
            _write_whole(path, REPLAYS_MAGIC + self._replays_seal(payload), payload)
        except OSError as exc:
            log.warning("prompt cache: could not write %s: %s", path, exc)

    def _header(self, e: Entry, digest: str, checkpoint: Checkpoint | None) -> bytes:
        """The header's length and the header: everything that gives the entry its meaning but its tokens."""
        fields: dict[str, Any] = {"binding": self._fields, "scope": e.scope, "n_tokens": len(e.tokens),
                                  "pos_min": e.pos_min, "n_canon": e.n_canon, "state_bytes": e.nbytes,
                                  "state_sha256": digest}
        if checkpoint is not None:
            fields["checkpoint"] = {"n_tokens": checkpoint.n_tokens, "pos_min": checkpoint.pos_min,
                                    "bytes": len(checkpoint.state),
                                    "sha256": hashlib.sha256(checkpoint.state).hexdigest()}
        head = json.dumps(fields, sort_keys=True).encode()
        return struct.pack("<I", len(head)) + head

    def _seal(self, length_and_head: bytes, tokens: bytes) -> bytes:
        """The HMAC-SHA256 of a file under the install's key: its magic, header (with the state's sha256) and
        tokens."""
        mac = hmac.new(self._key, MAGIC, hashlib.sha256)
        mac.update(length_and_head)
        mac.update(tokens)
        return mac.digest()

    def _write(self, e: Entry, state: bytearray, checkpoint: Checkpoint | None) -> None:
        if self._writes is not None:
            with self._lock:
                self._backlog += 1
            self._writes.put((e, state, checkpoint))

    def _write_loop(self, writes: "queue.SimpleQueue[Any]") -> None:
        while True:
            item = writes.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            if item == REPLAYS_FILE:
                try:
                    self._write_replays()
                finally:
                    with self._lock:
                        self._backlog -= 1
                continue
            e, state, checkpoint = item
            try:
                self._write_one(e, state, checkpoint)
            finally:
                with self._lock:
                    self._backlog -= 1

    def _write_one(self, e: Entry, state: bytearray, checkpoint: Checkpoint | None) -> None:
        with self._lock:
            if e not in self.entries:  # dropped before its turn
                return
        try:
            path = self._store(e, state, checkpoint)
        except OSError as exc:
            log.warning("prompt cache: could not write an entry of %d tokens: %s", len(e.tokens), exc)
            with self._lock:
                if e.state is None and e in self.entries:  # on its way to the disk only: nowhere now
                    self.entries.remove(e)
            return
        with self._lock:
            if e in self.entries:
                e.path = path
                e.file_checkpoint = (None if checkpoint is None else
                                     (checkpoint.n_tokens, checkpoint.pos_min, len(checkpoint.state)))
                if e.checkpoint is None:
                    e.checkpoint = _on_file(e)
                self.stats.disk_written += 1
                self._fit_disk()
            else:
                path.unlink(missing_ok=True)

    def _store(self, e: Entry, state: bytearray, checkpoint: Checkpoint | None) -> Path:
        assert self.directory is not None
        name = hashlib.blake2b(e.scope.encode() + array("i", e.tokens).tobytes(), digest_size=16).hexdigest()
        path = self.directory / (name + SUFFIX)
        head = self._header(e, hashlib.sha256(state).hexdigest(), checkpoint)
        tokens = array("i", e.tokens).tobytes()
        _write_whole(path, MAGIC + self._seal(head, tokens) + head, tokens, state,
                     checkpoint.state if checkpoint is not None else b"")
        return path

    def _fit_disk(self) -> None:
        """Remove the least recently used files until the disk budget holds (called with ``_lock`` held)."""
        on_disk = sorted((e for e in self.entries if e.path is not None), key=lambda e: e.last_used)
        total = sum(e.disk_nbytes for e in on_disk)
        for e in on_disk:
            if total <= self.disk_budget_bytes:
                break
            total -= e.disk_nbytes
            assert e.path is not None
            e.path.unlink(missing_ok=True)
            e.path = None
            if e.state is None:
                self.entries.remove(e)

    def _open_sealed(self, f: Any, size: int) -> tuple[dict[str, Any], list[int]]:
        """A file's header and tokens, read up to its state, once its seal, binding and length hold
        (``ValueError`` naming what does not; nothing of the file's content in it)."""
        if f.read(len(MAGIC)) != MAGIC:
            raise ValueError("not a cache file of this format")
        seal = f.read(SEAL_BYTES)
        raw = f.read(4)
        if len(seal) != SEAL_BYTES or len(raw) != 4:
            raise ValueError("truncated")
        (n,) = struct.unpack("<I", raw)
        if n > MIB or f.tell() + n > size:
            raise ValueError("truncated")
        text = f.read(n)
        try:
            head = json.loads(text)  # unsealed yet: read for the tokens' count only
            n_tokens, n_state = int(head["n_tokens"]), int(head["state_bytes"])
            n_ckpt = int(head["checkpoint"]["bytes"]) if head.get("checkpoint") is not None else 0
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError("header unreadable") from exc
        if min(n_tokens, n_state, n_ckpt) < 0 or f.tell() + 4 * n_tokens + n_state + n_ckpt != size:
            raise ValueError("length other than the header's")  # truncated, or more than was written
        tokens = f.read(4 * n_tokens)
        if not hmac.compare_digest(seal, self._seal(raw + text, tokens)):
            raise ValueError("seal does not match")  # edited, re-paired, or sealed by another install
        if head.get("binding") != self._fields:
            raise ValueError("another model's or parameters'")  # sealed here, for another model or parameters
        ids = array("i")
        ids.frombytes(tokens)
        return head, ids.tolist()

    def _index(self, path: Path) -> Entry | None:
        """An entry for a sealed file of this binding (its state left on disk), or None (counted, logged)."""
        try:
            with open(path, "rb") as f:
                head, tokens = self._open_sealed(f, os.fstat(f.fileno()).st_size)
            c = head.get("checkpoint")
            e = Entry(tokens=tokens, scope=str(head["scope"]), pos_min=int(head["pos_min"]),
                      n_canon=int(head["n_canon"]), nbytes=int(head["state_bytes"]), path=path,
                      file_checkpoint=None if c is None else (int(c["n_tokens"]), int(c["pos_min"]), int(c["bytes"])))
            e.checkpoint = _on_file(e)
            return e
        except (OSError, KeyError, TypeError, ValueError) as exc:
            self.stats.rejected += 1
            log.warning("prompt cache: ignored %s (%s)", path, _why(exc))
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
        """The state of an entry on disk, when the file is still sealed and holds what was indexed."""
        assert e.path is not None
        try:
            with open(e.path, "rb") as f:
                head, tokens = self._open_sealed(f, os.fstat(f.fileno()).st_size)
                if (tokens, head["scope"], head["pos_min"], head["n_canon"], head["state_bytes"]) != \
                        (e.tokens, e.scope, e.pos_min, e.n_canon, e.nbytes):
                    raise ValueError("another entry's since it was indexed")
                state = bytearray(e.nbytes)
                if f.readinto(state) != e.nbytes:
                    raise ValueError("length other than the header's")
            if not hmac.compare_digest(hashlib.sha256(state).hexdigest(), str(head["state_sha256"])):
                raise ValueError("state digest does not match")
            return state
        except (OSError, KeyError, TypeError, ValueError) as exc:
            self.stats.rejected += 1
            log.warning("prompt cache: ignored %s (%s)", e.path, _why(exc))
            return None


    def _read_checkpoint(self, e: Entry) -> Checkpoint | None:
        """The checkpoint after the state in an entry's file, when the file is still sealed and holds what was
        indexed (called with ``_io`` held); None otherwise (counted, logged: the entry's state may still serve)."""
        if e.path is None or e.file_checkpoint is None:
            return None
        n_tokens, pos_min, nbytes = e.file_checkpoint
        try:
            with open(e.path, "rb") as f:
                head, tokens = self._open_sealed(f, os.fstat(f.fileno()).st_size)
                c = head.get("checkpoint") or {}
                if (tokens, head["scope"], head["state_bytes"], c.get("n_tokens"), c.get("pos_min"), c.get("bytes")) \
                        != (e.tokens, e.scope, e.nbytes, n_tokens, pos_min, nbytes):
                    raise ValueError("another entry's since it was indexed")
                f.seek(e.nbytes, os.SEEK_CUR)
                state = bytearray(nbytes)
                if f.readinto(state) != nbytes:
                    raise ValueError("length other than the header's")
            if not hmac.compare_digest(hashlib.sha256(state).hexdigest(), str(c["sha256"])):
                raise ValueError("checkpoint digest does not match")
            return Checkpoint(n_tokens, pos_min, state)
        except (OSError, KeyError, TypeError, ValueError) as exc:
            self.stats.rejected += 1
            log.warning("prompt cache: ignored the checkpoint in %s (%s)", e.path, _why(exc))
            return None


def _write_whole(path: Path, *parts: bytes | bytearray) -> None:
    """``parts`` into ``path`` whole or not at all: a temporary file beside it (``<name>.tmp``, which
    ``open_disk`` removes where a write did not finish), fsynced, then renamed over it."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        for part in parts:
            f.write(part)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _on_file(e: Entry) -> Checkpoint | None:
    """What an entry's checkpoint is once host memory lets it go: its file's, state not read (empty), or none."""
    c = e.file_checkpoint
    return None if c is None or e.path is None else Checkpoint(c[0], c[1], bytearray())


def _why(exc: Exception) -> str:
    """What a rejected file failed, for the log: our own reasons, or an OS error's; never the file's content."""
    if isinstance(exc, OSError):
        return exc.strerror or type(exc).__name__
    if type(exc) is ValueError:
        return str(exc)
    return f"header unreadable ({type(exc).__name__})"


__all__ = ["Entry", "KEY_FILE", "KeyFileRefused", "MIN_TOKENS", "PromptCache", "budget", "binding_of", "install_key",
           "model_fingerprint", "plan_budget", "scope_of"]
