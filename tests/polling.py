"""Bounded polling for the multi-process tests: wait for a condition, never for time."""

from __future__ import annotations

import time
from collections import Counter

from tests.workers import WorkerProcess


def instance_summary() -> str:
    """What the instances look like now: counts by workflow, status and lease holder."""
    from workflows_app.models import Instance

    rows = Instance.objects.values_list("workflow", "status", "lease_owner")
    counts = Counter((workflow, status, owner or "-") for workflow, status, owner in rows)
    return (
        "; ".join(f"{w} {s} owner={o}: {n}" for (w, s, o), n in sorted(counts.items()))
        or "no instances"
    )


def a_backend_waits_for_a_lock() -> bool:
    """PostgreSQL: whether a session of the test database is waiting for a lock (a race
    made deterministic: one thread holds a row, the other is seen waiting for it)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND datname = current_database()"
        )
        return cursor.fetchone()[0] > 0


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05):
    """Poll a condition with a bound; fail naming what never happened and what was there instead."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout} s waiting for {what}; instances: {instance_summary()}; "
                + ("; ".join(w.describe() for w in WorkerProcess.live) or "no worker processes")
            )
        time.sleep(interval)
