"""Stop strings over generated text: what may be shown now, and what must be held back. Pure.

A stop string may arrive split over several tokens, so text that could be the start of one is held back until
the next token says whether it is (llama-server's ``find_stopping_strings`` with partial matches,
tools/server/server-context.cpp of the llama.cpp that llama-cpp-python 0.3.36 vendors).
"""

from __future__ import annotations


def split_stop(text: str, stops: list[str]) -> tuple[str, str, bool]:
    """(text safe to emit, text held back, stopped): hold back a suffix that may start a stop string."""
    if not stops:
        return text, "", False
    first = -1
    for s in stops:
        i = text.find(s)
        if i != -1 and (first == -1 or i < first):
            first = i
    if first != -1:
        return text[:first], "", True
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return text[: len(text) - hold], text[len(text) - hold :], False


def first_stop(text: str, stops: list[str]) -> str | None:
    """The stop string found first in ``text`` (what ``split_stop`` cut at)."""
    best, at = None, -1
    for s in stops:
        i = text.find(s)
        if i != -1 and (at == -1 or i < at):
            best, at = s, i
    return best


__all__ = ["first_stop", "split_stop"]
