"""The slot policy and stop-string handling without llama.cpp (``service.engine.slots``, ``service.text.stops``):
llama-server's choices, checked on plain values."""

from __future__ import annotations

import subprocess
import sys

from hypothesis import given
from hypothesis import strategies as st

from service.engine.slots import (INVARIANT_MIN_ROWS, Cells, Slot, common_prefix, longer_prefix, lru_idle_with_cells,
                                  pick_slot, reusable)
from service.text.stops import first_stop, split_stop

ALWAYS = lambda slot, k: True  # noqa: E731  (no sliding window: every position is held)


def test_the_policy_modules_load_no_llama_cpp() -> None:
    code = ("import sys, service.engine.slots, service.text.stops; "
            "print(any(m in sys.modules for m in ('llama_cpp', 'numpy')))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_a_request_goes_to_the_idle_slot_covering_most_of_its_prompt() -> None:
    a, b, c = Slot(0, tokens=[1, 2, 3, 4]), Slot(1, tokens=[1, 2, 9]), Slot(2)
    prompt = [1, 2, 3, 4, 5, 6]
    assert pick_slot([a, b, c], prompt, similarity=0.1, reuse=True) is a
    a.req = object()  # busy: the next best idle one
    assert pick_slot([a, b, c], prompt, similarity=0.1, reuse=True) is b
    # Under the similarity threshold, or without reuse: the least recently used, lowest id first.
    a.req = None
    a.last_used, b.last_used, c.last_used = 5, 3, 3
    assert pick_slot([a, b, c], prompt, similarity=0.9, reuse=True) is b
    assert pick_slot([a, b, c], prompt, similarity=0.1, reuse=False) is b
    for s in (a, b, c):
        s.req = object()
    assert pick_slot([a, b, c], prompt, similarity=0.1, reuse=True) is None


def test_a_slot_keeps_the_common_prefix_less_the_last_token_unless_it_kept_the_logits() -> None:
    s = Slot(0, tokens=[1, 2, 3, 4])
    assert reusable(s, [1, 2, 3, 4], batch_invariant=False, holds=ALWAYS) == 3
    s.logits, s.logits_at = object(), 4  # the same prompt again: its logits too
    assert reusable(s, [1, 2, 3, 4], batch_invariant=False, holds=ALWAYS) == 4
    assert reusable(s, [1, 2, 9], batch_invariant=False, holds=ALWAYS) == 2
    # A sliding window that no longer holds what the next token attends to: nothing.
    assert reusable(s, [1, 2, 3, 4, 5], batch_invariant=False, holds=lambda slot, k: False) == 0


def test_batch_invariant_mode_keeps_only_canonical_tokens_and_leaves_enough_to_evaluate() -> None:
    toks = list(range(40))
    s = Slot(0, tokens=toks[:30], n_canon=20)
    assert reusable(s, toks, batch_invariant=True, holds=ALWAYS) == 20
    s.n_canon = 30
    assert reusable(s, toks[:34], batch_invariant=True, holds=ALWAYS) == 34 - INVARIANT_MIN_ROWS


def test_a_longer_prefix_held_by_another_slot_is_found() -> None:
    mine, other, short = Slot(0, tokens=[1, 2]), Slot(1, tokens=[1, 2, 3, 4, 5]), Slot(2, tokens=[1])
    prompt = [1, 2, 3, 4, 5, 6]

    def usable(slot: Slot, tokens: list[int]) -> int:
        return reusable(slot, tokens, batch_invariant=False, holds=ALWAYS)

    assert longer_prefix([mine, other, short], mine, prompt, usable(mine, prompt), usable) == (other, 5)
    assert longer_prefix([mine, short], mine, prompt, 2, usable) == (None, 2)


def test_a_full_cache_clears_the_least_recently_used_idle_slot_first() -> None:
    a, b, c = Slot(0, tokens=[1], last_used=4), Slot(1, tokens=[2], last_used=2), Slot(2, last_used=1)
    assert lru_idle_with_cells([a, b, c]) is b  # c holds nothing
    b.req = object()
    assert lru_idle_with_cells([a, b, c]) is a
    assert lru_idle_with_cells([b, c]) is None


def test_cells_count_shared_cells_once() -> None:
    cells = Cells()
    ids = cells.new(5)
    shared = cells.share(ids[:3])
    assert cells.used == 5
    cells.drop(ids)
    assert cells.used == 3  # still held by the sharing sequence
    cells.drop(shared)
    assert cells.used == 0


@given(st.lists(st.integers(0, 3), max_size=30), st.lists(st.integers(0, 3), max_size=30))
def test_common_prefix_is_the_longest_equal_prefix(a: list[int], b: list[int]) -> None:
    k = common_prefix(a, b)
    assert a[:k] == b[:k] and (k == min(len(a), len(b)) or a[k] != b[k])


def test_stop_strings_hold_back_what_may_start_one() -> None:
    assert split_stop("Hello wor", ["world"]) == ("Hello ", "wor", False)
    assert split_stop("Hello world!", ["world"]) == ("Hello ", "", True)
    assert split_stop("abc", []) == ("abc", "", False)
    assert first_stop("x END y STOP", ["STOP", "END"]) == "END"


def test_a_checkpoint_reaches_a_cut_the_window_no_longer_does() -> None:
    """A sliding-window sequence of 1,208 tokens (n_swa 512) whose window now starts at 697 reaches no cut below
    1,208; its checkpoint, taken at the prompt's end (1,200 tokens, window from 0), reaches the new prompt's common
    prefix up to the prompt's end, never past it (the generated tokens after it are not in the checkpoint)."""
    from service.engine.slots import Checkpoint, reusable_via, window_holds

    prompt, generated = list(range(1200)), [7] * 8
    ckpt = Checkpoint(1200, 0, bytearray(1))
    slot = Slot(0, tokens=prompt + generated, n_canon=1208, checkpoint=ckpt)
    window = lambda s, k: window_holds(697, k, 512)  # noqa: E731
    client = prompt + [9] * 20  # the client's own assistant turn instead of the generated one
    assert reusable_via(slot, client, batch_invariant=False, holds=window, n_swa=512) == (1200, ckpt)
    assert reusable_via(slot, prompt + generated + [9], batch_invariant=False, holds=window, n_swa=512) == (1208, None)
    assert reusable_via(slot, prompt[:600] + [9] * 5, batch_invariant=False, holds=window, n_swa=512) == (600, ckpt)
    late = Checkpoint(1200, 800, bytearray(1))  # a window already cut to 800 when it was taken: reaches 1,311 on
    slot.checkpoint = late
    assert reusable_via(slot, client, batch_invariant=False, holds=window, n_swa=512) == (0, None)
    assert not window_holds(-1, 10, 512) and window_holds(0, 10, 0) and window_holds(689, 1200, 512)
