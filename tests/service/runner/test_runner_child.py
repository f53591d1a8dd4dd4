"""The runner's side of the socket (``service.runner.child.Child``) without llama.cpp: what a generation's messages
look like on the wire, and in which order they arrive.

A step's chunks are written by the engine's scheduler thread itself when it flushes its delivery
(``Child._flush_step``), a generation's end by the sender thread. These tests hold the sender back, so that chunks
written past it show, and so would a message overtaken by it.
"""

from __future__ import annotations

import pickle
import socket
import time
from multiprocessing.connection import Connection
from typing import Any, Iterator

from service.engine.base import Cancel, Chunk, GenerationParams, TokenScore, current_delivery
from service.runner.child import Child
from service.errors import EngineFailure, NotReady

SENDER_HELD_S = 1.5
"""How long the sender thread waits before its first write in these tests."""


class HeldSender(Child):
    def _sender(self) -> None:
        time.sleep(SENDER_HELD_S)
        super()._sender()


class Delivering:
    """An engine that hands ``items`` to the runner's delivery at once, as the scheduler thread does, and flushes it
    (``flush``: as ``LlamaEngine._flush`` before its next decode) or not; then fails with ``raises``, if given."""

    def __init__(self, items: list[Any], flush: bool = True, raises: BaseException | None = None) -> None:
        self.items = items
        self.flush = flush
        self.raises = raises

    def generate(self, tokens: list[int], params: GenerationParams, cancel: Any) -> Iterator[Chunk]:
        deliver = current_delivery()
        assert deliver is not None
        for item in self.items:
            deliver(item)
        if self.flush:
            deliver.flush()  # type: ignore[attr-defined]
        if self.raises is not None:
            raise self.raises
        return iter(())


def _generation(items: list[Any], **engine: Any) -> list[tuple[float, tuple[Any, ...]]]:
    """Run one generation through a ``HeldSender`` child (its ``_generate``, as a "gen" message starts it; not its
    ``serve`` loop, which ends the process when the socket closes): its messages as the parent reads them, with
    their arrival time after the start."""
    parent, child = socket.socketpair()
    conn, child_conn = Connection(parent.detach()), Connection(child.detach())
    runner = HeldSender(child_conn, Delivering(items, **engine))
    got: list[tuple[float, tuple[Any, ...]]] = []
    t0 = time.monotonic()
    runner._generate(1, "generate", ([2, 9259], GenerationParams()), Cancel())
    while not got or got[-1][1][0] != "end":
        assert conn.poll(10), f"the runner stopped sending; so far {got}"
        msg = pickle.loads(conn.recv_bytes())
        for m in msg[1] if msg[0] == "many" else (msg,):
            got.append((time.monotonic() - t0, m))
    conn.close()
    child_conn.close()
    return got


def test_a_steps_chunks_go_out_at_the_flush_not_through_the_sender() -> None:
    items = [Chunk(text="Hello"), Chunk(text=" world"), Chunk(finish_reason="stop", completion_tokens=2)]
    got = _generation(items)
    assert [m for _, m in got] == [("chunk", 1, c) for c in items] + [("end", 1)]
    chunks_at, end_at = got[2][0], got[3][0]
    # Generous: the chunks are written at the flush, the end only once the held sender starts.
    assert chunks_at < SENDER_HELD_S / 2 <= end_at, got


def test_what_was_not_flushed_still_goes_out_before_the_end() -> None:
    """An engine that never flushes (it ended between steps): the generation's thread writes what was delivered,
    then the end follows."""
    items = [Chunk(text="", logprobs=()), Chunk(text="é"), Chunk(text="!")]
    got = _generation(items, flush=False)
    assert [m for _, m in got] == [("chunk", 1, c) for c in items] + [("end", 1)]


def test_a_delivered_error_and_a_raised_one_keep_their_place() -> None:
    err = NotReady("the model was unloaded")
    got = _generation([Chunk(text="a"), err])
    assert [m[0] for _, m in got] == ["chunk", "err", "end"]
    assert isinstance(got[1][1][2], NotReady) and str(got[1][1][2]) == str(err)
    got = _generation([Chunk(text="a"), Chunk(text="b")], flush=False, raises=RuntimeError("boom"))
    assert [m[0] for _, m in got] == ["chunk", "chunk", "err", "end"]
    assert isinstance(got[2][1][2], EngineFailure) and "RuntimeError: boom" in str(got[2][1][2])


def test_a_steps_tokens_of_one_choice_go_out_as_one_chunk_and_nothing_else_is_joined() -> None:
    """A drafted step delivers a chunk per token; they cross the process as one, in order (``one_per_step``). Not
    joined: another choice's tokens, a chunk with text or a reason, tokens past an error, scored with unscored."""
    score = TokenScore(7, -0.5)
    items: list[Any] = [Chunk(tokens=(5,)), Chunk(tokens=(6,)), Chunk(tokens=(7, 8)),
                        Chunk(tokens=(9,), index=1), Chunk(tokens=(10,), index=1),
                        Chunk(tokens=(11,)), Chunk(tokens=(12,), scores=(score,)),
                        NotReady("gone"), Chunk(tokens=(13,)), Chunk(finish_reason="length", completion_tokens=9)]
    got = [m for _, m in _generation(items)]
    assert [m[0] for m in got] == ["chunk"] * 4 + ["err", "chunk", "chunk", "end"]
    assert [(m[2].tokens, m[2].scores, m[2].index) for m in got[:4]] == [
        ((5, 6, 7, 8), (), 0), ((9, 10), (), 1), ((11,), (), 0), ((12,), (score,), 0)]
    assert got[5][2] == Chunk(tokens=(13,)) and got[6][2] == items[-1]


def test_a_steps_joined_chunk_keeps_every_score_beside_its_token() -> None:
    scores = [TokenScore(t, -t / 10, ((t, -t / 10), (t + 1, -3.0))) for t in (3, 4, 5)]
    got = [m for _, m in _generation([Chunk(tokens=(s.token,), scores=(s,)) for s in scores])]
    assert got[0] == ("chunk", 1, Chunk(tokens=(3, 4, 5), scores=tuple(scores))) and got[1] == ("end", 1)
