"""`manage.py runworker workflows` says what it does on SIGTERM: the drain, each run's end, the exit."""

from __future__ import annotations

import pytest

from tests import fleet_workflows
from tests.polling import wait_until
from workflows_app.client import get_workflow

pytestmark = pytest.mark.django_db(transaction=True)


def test_sigterm_logs_the_runs_finishing_how_each_ended_and_the_exit(workers):
    fleet_workflows.ensure_ledger()
    inst = get_workflow("rel-zombie").create(id="drained")
    pk = inst.row().pk
    # The step "work" takes 1.5 s: long enough to be mid-step when the signal arrives,
    # well inside the engine's 10 s grace period.
    (worker,) = workers(1, FLEET_STEP_SECONDS="1.5")
    wait_until(
        lambda: any(row[1] == "work" and row[4] is None for row in fleet_workflows.ledger_rows()),
        30,
        "the worker to be inside the step",
    )
    assert worker.terminate() == 0
    worker.log.seek(0)
    log = worker.log.read()
    assert (
        f"SIGTERM received; claiming nothing new. 1 run(s) finishing their current step (instances #{pk})"
        in log
    )
    assert f"instance #{pk} parked at a step boundary, due at once for another worker" in log
    assert "drained: 1 parked, 0 finished or cut short; leases released; exiting" in log
    # The step finished inside the grace period and its checkpoint is kept; the rest waits.
    assert [s.name for s in inst.steps() if s.status == "complete"] == ["work"]
    assert inst.row().lease_owner == ""
