"""Figures the tests measure, printed in the session's terminal summary.

A test calls ``figure("storm: ...")`` for a measured line and ``accuracy(what, err, case)`` for the memory model's
errors against llama.cpp (the worst of each ``what`` is kept). Under pytest-xdist each worker keeps its own and hands
them to the controller when it ends (``tests/conftest.py``), so ``make test`` prints them the same with or without
workers."""

from __future__ import annotations

from typing import Any

FIGURES: list[str] = []
ACCURACY: dict[str, tuple[float, str]] = {}


def figure(line: str) -> None:
    FIGURES.append(line)


def accuracy(what: str, err: float, case: str) -> None:
    if what not in ACCURACY or err > ACCURACY[what][0]:
        ACCURACY[what] = (err, case)


def state() -> dict[str, Any]:
    """What a worker sends to the controller (plain lists and dicts: execnet carries them)."""
    return {"figures": list(FIGURES), "accuracy": {k: list(v) for k, v in ACCURACY.items()}}


def merge(other: dict[str, Any] | None) -> None:
    if not other:
        return
    FIGURES.extend(other.get("figures", []))
    for what, (err, case) in other.get("accuracy", {}).items():
        accuracy(what, err, case)


def summary(reporter: Any) -> None:
    """Both sections, on pytest's terminal reporter."""
    if FIGURES:
        reporter.section("figures measured")
        for line in FIGURES:
            reporter.write_line("FIGURE " + line)
    if ACCURACY:
        reporter.section("memory model vs llama.cpp dry run")
        for what, (err, case) in sorted(ACCURACY.items()):
            reporter.write_line(f"{what:<28} {err:8.4f}  {case}")
