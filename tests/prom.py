"""Reading ``/metrics`` in tests: the exposition parsed by prometheus-client's own parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def families(text: str) -> dict[str, str]:
    """Family name -> type (``counter``, ``gauge``, ``histogram``, ...)."""
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """(sample name, labels) -> value, for every sample of the exposition."""
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float:
    """The value of the one sample ``name`` with exactly ``labels``; AssertionError when it is absent."""
    key = (name, frozenset(labels.items()))
    got = samples(text)
    assert key in got, f"{name}{labels or ''} not in metrics: {sorted(n for n, _ in got if n.startswith(name[:8]))}"
    return got[key]


def series(text: str, name: str) -> list[dict[str, str]]:
    """The label sets of every sample called ``name``."""
    return [dict(labels) for (n, labels) in samples(text) if n == name]
