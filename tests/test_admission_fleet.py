"""Flow control across worker processes: admission is decided under a per-workflow lock
in the database, so however many workers admit and finish at once, no committed state
ever has more active instances than allowed, overall or per concurrency key."""

from __future__ import annotations

import random
import threading

import pytest
from django.db import connection, connections

from tests import fleet_workflows
from tests.polling import wait_until
from workflows_app.client import get_workflow
from workflows_app.models import Instance

pytestmark = pytest.mark.django_db(transaction=True)
# Sized to finish well inside the suite's 120 s per-test timeout on a loaded 2-core box.
INSTANCES = 120 if connection.vendor == "postgresql" else 60
KEYS = ["k0", "k1", "k2", "k3", "k4"]


def test_several_workers_never_run_more_than_the_limits_allow_overall_or_per_key(workers):
    fleet_workflows.ensure_admission_ledger()
    wf = get_workflow("fleet-admission")
    workers(3)
    rng = random.Random(15)

    def create(start: int) -> None:
        try:  # creates race the workers' admissions and finishes
            for n in range(start, INSTANCES, 2):
                wf.create(id=f"a{n}", concurrency_key=rng.choice(KEYS), priority=rng.randrange(10))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=create, args=(s,)) for s in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wait_until(
        lambda: (
            Instance.objects.filter(workflow="fleet-admission", status="complete").count()
            == INSTANCES
        ),
        240,
        "every admission instance to complete",
    )
    samples = fleet_workflows.admission_samples()
    assert len(samples) >= INSTANCES * 3  # steps are at-least-once: a takeover may rerun one
    limits = fleet_workflows.ADMISSION_LIMITS
    most = max(active for _, _, active, _ in samples)
    most_per_key = max(per_key for _, _, _, per_key in samples)
    print(f"\nadmission fleet: {INSTANCES} instances, 3 workers; most active seen {most} "
          f"(limit {limits['max_concurrent_instances']}), per key {most_per_key} "
          f"(limit {limits['max_concurrent_per_key']})")  # fmt: skip
    assert most <= limits["max_concurrent_instances"]
    assert most_per_key <= limits["max_concurrent_per_key"]
    # Not vacuous: the limits were reached, so they were what held instances back.
    assert most == limits["max_concurrent_instances"]
    assert most_per_key == limits["max_concurrent_per_key"]


def test_parents_parked_on_children_are_woken_by_whichever_worker_finishes_the_child(workers):
    fleet_workflows.ensure_ledger()
    parents = 24 if connection.vendor == "postgresql" else 16
    wf = get_workflow("fleet-parent")
    wf.create_batch([{"id": f"p{n}"} for n in range(parents)])
    workers(3)
    wait_until(
        lambda: (
            Instance.objects.filter(workflow="fleet-parent", status="complete").count() == parents
        ),
        180,
        "every parent to complete",
    )
    children = Instance.objects.filter(workflow="fleet", parent__workflow="fleet-parent")
    assert children.count() == parents * 2  # one per step: no replay started a second
    assert all(wf.get(f"p{n}").status().output["child"] == "done" for n in range(parents))
    wait_until(
        lambda: children.filter(status="complete").count() == parents * 2,
        20,
        "the started children to complete too",
    )
