"""Bounded polling for the multi-process tests: wait for a condition, never for time."""

from __future__ import annotations

import time


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05):
    """Poll a condition with a bound; fail naming what never happened."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)
