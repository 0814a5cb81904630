"""Measurements of SPEC §9 (operating at scale): attribute-filtered lists, bulk jobs."""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

from django.db import connection, transaction

from workflows_app.client import WorkflowBinding
from workflows_app.engine import clock, store
from workflows_app.models import Instance, InstanceAttribute

Figures = dict[str, Any]
PLANS = ("free", "pro", "enterprise")
CUSTOMERS = 2000  # 100,000 rows: 50 per customer


def _median_ms(fn: Callable[[], Any], runs: int = 7) -> float:
    fn()  # warm the statement and page caches, as a serving process would be
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def insert_tagged(workflow: str, n: int, batch: int = 5000) -> None:
    """n finished or waiting instances with attributes, inserted directly (no engine work)."""
    now = clock.now()
    for start in range(0, n, batch):
        with transaction.atomic():
            rows = Instance.objects.bulk_create(
                Instance(
                    workflow=workflow,
                    instance_id=f"{workflow}-{i}",
                    version=1,
                    status="waiting" if i % 10 == 0 else "complete",
                    created_at=now,
                    updated_at=now,
                    trace_id=uuid.uuid4().hex,
                    attributes={
                        "customer": f"c-{i % CUSTOMERS}",
                        "plan": PLANS[i % len(PLANS)],
                        "seats": i % 100,
                    },
                )
                for i in range(start, min(n, start + batch))
            )
            store.index_attributes(rows)  # the rows list filters read, as create writes them
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            for model in (Instance, InstanceAttribute):
                cursor.execute(f"ANALYZE {model._meta.db_table}")


def attribute_filter(n: int) -> Figures:
    """wf.list() server time over n instances of one workflow: unfiltered (the baseline),
    then by a rare attribute (n / 2000 matches), a common one (a third), a rare one with a
    status, a value nobody has, and a common key with a rare one (given in that order)."""
    workflow = f"bench-attrs-{uuid.uuid4().hex[:6]}"
    t0 = time.perf_counter()
    insert_tagged(workflow, n)
    inserted_s = time.perf_counter() - t0
    wf = WorkflowBinding(workflow)
    try:
        figures: Figures = {
            "attr_rows": n,
            "attr_insert_s": inserted_s,
            "attr_list_baseline_ms": _median_ms(lambda: wf.list(limit=50)),
            "attr_list_rare_ms": _median_ms(lambda: wf.list(attributes={"customer": "c-7"})),
            "attr_list_common_ms": _median_ms(lambda: wf.list(attributes={"plan": "pro"})),
            "attr_list_rare_status_ms": _median_ms(
                lambda: wf.list(attributes={"customer": "c-7"}, status="waiting")
            ),
            "attr_list_none_ms": _median_ms(lambda: wf.list(attributes={"customer": "nobody"})),
            "attr_list_common_rare_ms": _median_ms(
                lambda: wf.list(attributes={"plan": "pro", "customer": "c-7"})
            ),
        }
        assert len(wf.list(attributes={"customer": "c-7"}).instances) == n // CUSTOMERS
    finally:
        InstanceAttribute.objects.filter(instance__workflow=workflow)._raw_delete(connection.alias)
        Instance.objects.filter(workflow=workflow)._raw_delete(connection.alias)
    return figures


def attribute_create(n: int, block: int = 50) -> Figures:
    """What the attribute rows cost a create: create() one at a time with three attributes
    against none, in alternating blocks of the same run (machine noise falls on both).
    Per create, ms; the instances are never run and are deleted after."""
    from workflows_app.client import get_workflow

    binding = get_workflow("bench-step1")
    prefix = f"attr-create-{uuid.uuid4().hex[:6]}"
    spent = {"plain": 0.0, "tagged": 0.0}
    try:
        for start in range(0, n, block):
            for kind in ("plain", "tagged") if start // block % 2 == 0 else ("tagged", "plain"):
                t0 = time.perf_counter()
                for i in range(start, min(n, start + block)):
                    attributes = (
                        {"customer": f"c-{i % CUSTOMERS}", "plan": PLANS[i % 3], "seats": i % 100}
                        if kind == "tagged"
                        else None
                    )
                    binding.create(id=f"{prefix}-{kind}-{i}", attributes=attributes)
                spent[kind] += time.perf_counter() - t0
    finally:
        Instance.objects.filter(workflow="bench-step1", instance_id__startswith=prefix).delete()
    plain, tagged = spent["plain"] * 1000 / n, spent["tagged"] * 1000 / n
    return {
        "attr_create_plain_ms": plain,
        "attr_create_tagged_ms": tagged,
        "attr_create_ratio": tagged / plain,
    }


def bulk_terminate(n: int) -> Figures:
    """wf.bulk("terminate", status="waiting") over n parked instances (each waiting for an
    event, as a run leaves them), applied batch by batch in this process as a worker does:
    instances / second from the job's start to its last batch; the snapshot (creating the
    job) is timed on its own."""
    from workflows_app import bulk

    from .measures import bulk_park

    workflow = f"bench-bulk-{uuid.uuid4().hex[:6]}"
    bulk_park(workflow, workflow, n, "waitForEvent", "wait", None, None, event_type="go")
    wf = WorkflowBinding(workflow)
    t0 = time.perf_counter()
    job = wf.bulk("terminate", status="waiting")
    t1 = time.perf_counter()
    while bulk.process_batch(job.id) is not None:
        pass
    t2 = time.perf_counter()
    job.refresh()
    assert (job.done, job.applied) == (True, n), job
    try:
        return {
            "bulk_instances": n,
            "bulk_snapshot_ms": (t1 - t0) * 1000,
            "bulk_terminate_s": t2 - t0,
            "bulk_terminate_per_s": n / (t2 - t0),
        }
    finally:
        Instance.objects.filter(workflow=workflow).delete()
