"""Figures from samples, for the bench's measurements (no Django: DBOS's side uses it too)."""

from __future__ import annotations


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile, nearest rank: a sample that was measured, not an interpolation."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))]
