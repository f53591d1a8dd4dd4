"""Stored responses of OpenAI's Responses API: what ``previous_response_id``, ``GET /v1/responses/{id}`` and its
``input_items`` read back.

One least-recently-used store per API key (``owner``: a digest of the key the request presented; one owner when no
keys are configured), each within ``GGUF_RESPONSES_STORE_MIB``: an id is found only by the key that created it (to
another key it does not exist, as at OpenAI), and one tenant's traffic never evicts another's. An entry holds its
response object, its own input items and the whole conversation as chat messages (the earlier turns' message
objects are shared with the entry before it, not copied); it is charged the conversation's JSON size, so the store
never holds more than its budget however a chain of entries is evicted. In memory only: a restart forgets them
(a request naming one then gets ``previous_response_not_found``, and can send the whole conversation instead).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_ENTRIES = 100_000
"""Most entries of one owner, whatever their size (a bound on the store's own overhead)."""


@dataclass(frozen=True)
class StoredResponse:
    """One response as it was answered, and what a later turn continues from."""

    response: dict[str, Any]
    """The response object (``object: "response"``) as the client received it."""
    input_items: list[dict[str, Any]]
    """This request's own input items, each with an ``id``."""
    messages: list[dict[str, Any]]
    """The conversation up to and including this response's output, as chat messages (no ``instructions``: a later
    turn does not carry them over, as OpenAI documents it)."""
    nbytes: int


def owner_of(key: bytes | None) -> str:
    """The store's owner for a presented API key (a digest, so the store keeps no key); "" without keys."""
    return hashlib.sha256(key).hexdigest() if key else ""


def size_of(response: dict[str, Any], input_items: list[dict[str, Any]], messages: list[dict[str, Any]]) -> int:
    return sum(len(json.dumps(v, ensure_ascii=False, separators=(",", ":")).encode()) for v in (response, input_items,
                                                                                                 messages))


class ResponseStore:
    """Per-owner LRU stores of ``StoredResponse`` within ``budget_bytes`` each (0: nothing is stored)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._owners: dict[str, OrderedDict[str, StoredResponse]] = {}
        self._bytes: dict[str, int] = {}
        self._lock = threading.Lock()

    def put(self, owner: str, rid: str, entry: StoredResponse) -> bool:
        """Keep ``entry`` under ``rid`` for ``owner``, evicting that owner's least recently used entries to make room;
        False (nothing kept) when it alone is beyond the budget."""
        if entry.nbytes > self.budget_bytes:
            return False
        with self._lock:
            entries = self._owners.setdefault(owner, OrderedDict())
            old = entries.pop(rid, None)
            used = self._bytes.get(owner, 0) - (old.nbytes if old else 0)
            while entries and (used + entry.nbytes > self.budget_bytes or len(entries) >= MAX_ENTRIES):
                _, evicted = entries.popitem(last=False)
                used -= evicted.nbytes
            entries[rid] = entry
            self._bytes[owner] = used + entry.nbytes
        return True

    def get(self, owner: str, rid: str) -> StoredResponse | None:
        with self._lock:
            entries = self._owners.get(owner)
            entry = entries.get(rid) if entries else None
            if entry is not None:
                entries.move_to_end(rid)  # type: ignore[union-attr]
            return entry

    def delete(self, owner: str, rid: str) -> bool:
        with self._lock:
            entries = self._owners.get(owner)
            entry = entries.pop(rid, None) if entries else None
            if entry is None:
                return False
            self._bytes[owner] -= entry.nbytes
            return True

    def usage(self, owner: str) -> tuple[int, int]:
        """(entries, bytes) held for ``owner``."""
        with self._lock:
            return len(self._owners.get(owner, ())), self._bytes.get(owner, 0)


__all__ = ["MAX_ENTRIES", "ResponseStore", "StoredResponse", "owner_of", "size_of"]
