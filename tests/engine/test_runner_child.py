"""The runner's side of the socket (``service.engine.child.Child``) without llama.cpp: what a generation's messages
look like on the wire, and in which order they arrive.

A generation's first text is written by the engine's scheduler thread itself (``Child.send_now``), everything else
by the sender thread. These tests hold the sender back, so that a first chunk written past it shows, and so would
a message overtaken by it.
"""

from __future__ import annotations

import pickle
import socket
import time
from multiprocessing.connection import Connection
from typing import Any, Iterator

from service.engine.base import Cancel, Chunk, GenerationParams, current_delivery
from service.engine.child import Child

SENDER_HELD_S = 1.5
"""How long the sender thread waits before its first write in these tests."""


class HeldSender(Child):
    def _sender(self) -> None:
        time.sleep(SENDER_HELD_S)
        super()._sender()


class Delivering:
    """An engine that hands ``items`` to the runner's delivery at once, as the scheduler thread does."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def complete(self, prompt: str, params: GenerationParams, cancel: Any) -> Iterator[Chunk]:
        deliver = current_delivery()
        assert deliver is not None
        for item in self.items:
            deliver(item)
        return iter(())


def _generation(items: list[Any]) -> list[tuple[float, tuple[Any, ...]]]:
    """Run one generation through a ``HeldSender`` child (its ``_generate``, as a "gen" message starts it; not its
    ``serve`` loop, which ends the process when the socket closes): its messages as the parent reads them, with
    their arrival time after the start."""
    parent, child = socket.socketpair()
    conn, child_conn = Connection(parent.detach()), Connection(child.detach())
    runner = HeldSender(child_conn, Delivering(items))
    got: list[tuple[float, tuple[Any, ...]]] = []
    t0 = time.monotonic()
    runner._generate(1, "complete", ("a prompt", GenerationParams()), Cancel())
    while not got or got[-1][1][0] != "end":
        assert conn.poll(10), f"the runner stopped sending; so far {got}"
        msg = pickle.loads(conn.recv_bytes())
        for m in msg[1] if msg[0] == "many" else (msg,):
            got.append((time.monotonic() - t0, m))
    conn.close()
    child_conn.close()
    return got


def test_the_first_text_goes_out_before_the_sender_writes() -> None:
    got = _generation([Chunk(text="Hello"), Chunk(text=" world"), Chunk(finish_reason="stop", completion_tokens=2)])
    assert [m for _, m in got] == [("chunk", 1, Chunk(text="Hello")), ("chunk", 1, Chunk(text=" world")),
                                   ("chunk", 1, Chunk(finish_reason="stop", completion_tokens=2)), ("end", 1)]
    first_at, rest_at = got[0][0], got[1][0]
    # Generous: the first chunk is written at once, the rest only once the held sender starts.
    assert first_at < SENDER_HELD_S / 2 <= rest_at, got


def test_nothing_queued_is_overtaken() -> None:
    """A chunk without text queued first (a token whose bytes end inside a character: logprobs, no text yet)
    keeps its place: the text after it waits for the sender too."""
    items = [Chunk(text="", logprobs=()), Chunk(text="é"), Chunk(text="!")]
    got = _generation(items)
    assert [m for _, m in got] == [("chunk", 1, c) for c in items] + [("end", 1)]
