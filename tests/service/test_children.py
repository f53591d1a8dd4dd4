"""service.children.Child: the one way the service starts and ends its children (runner, dry run, grammar zygote)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from service.children import Child

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
MODULE = "tests.service.child_script"


def _wait(cond, timeout_s: float = 30.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_the_last_stderr_lines_are_kept_and_the_exit_status_comes_back() -> None:
    child = Child(MODULE, ["stderr", "30", "3"], name="test child", env=ENV, tail_lines=5)
    assert child.reap() == 3
    assert list(child.tail) == [f"line {i}" for i in range(25, 30)]
    assert child.last_lines(2) == "line 28 | line 29"
    assert not child.alive()


def test_a_child_that_ended_counts_as_exited_before_it_is_reaped() -> None:
    child = Child(MODULE, ["stderr", "1", "0"], name="test child", env=ENV)
    assert _wait(child.exited), "a zombie is an ended child"
    assert child.returncode is None  # nobody reaped it yet
    assert child.reap() == 0


def test_text_pipes_carry_lines_both_ways() -> None:
    child = Child(MODULE, ["echo"], name="test child", env=ENV, stdin=True, stdout=True, text=True)
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write("hello\n")
    child.stdin.flush()
    assert child.stdout.readline() == "HELLO\n"
    assert child.reap() == 0


def test_a_child_that_does_not_exit_within_its_grace_is_killed_and_reaped() -> None:
    child = Child(MODULE, ["stubborn"], name="test child", env=ENV)
    assert _wait(lambda: "ready" in child.tail), list(child.tail)
    child.proc.send_signal(signal.SIGTERM)  # ignored: only the kill ends it
    t0 = time.monotonic()
    rc = child.end(0.3)
    # Generous bound (the grace is 0.3 s; the kill and the reap take milliseconds on an idle machine): the point
    # is that end() does not wait for a child that will never exit.
    assert time.monotonic() - t0 < 10
    assert rc == -signal.SIGKILL
    assert child.exited() and not child.alive()
