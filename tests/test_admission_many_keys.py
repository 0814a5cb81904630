"""max_concurrent_per_key with more busy keys than one admission pass reads.

A pass reads at most ADMISSION_SCAN (1000) queued instances in line, skipping the queues
of keys it found at their bound. With a thousand customers each at their bound and one
instance queued each, those thousand fill the pass: every instance behind them waited
("queued behind the first 1000 instances in line") while its own key had a free place,
until the queue ahead shrank. Not a race: SQLite too.
"""

from __future__ import annotations

import pytest

from tests.test_flow_control import register_gated
from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import registry, store
from workflows_app.engine.store import control
from workflows_app.models import Instance

pytestmark = pytest.mark.django_db(transaction=True)


def busy_customers(wf, name: str, count: int) -> None:
    """`count` keys, each with one instance holding its place and one queued behind it."""
    running = wf.create(id="busy-run", concurrency_key="busy").row()
    queued = wf.create(id="busy-queued", concurrency_key="busy").row()
    assert (running.status, queued.status) == ("running", "queued")
    rows = []
    for n in range(count):
        for template, status in ((running, "running"), (queued, "queued")):
            row = Instance.objects.get(pk=template.pk)
            row.pk, row.instance_id = None, f"{status}-{n}"
            row.concurrency_key, row.wake_at = f"customer-{n}", None  # no worker runs them
            rows.append(row)
    Instance.objects.bulk_create(rows)
    Instance.objects.filter(pk=running.pk).update(wake_at=None)
    assert Instance.objects.filter(workflow=name, status="queued").count() > control.ADMISSION_SCAN


def status(wf, instance_id: str) -> tuple[str, str]:
    row = Instance.objects.get(workflow=wf.name, instance_id=instance_id)
    return row.status, row.waiting_reason


def test_instances_behind_a_thousand_busy_keys_start_when_their_key_has_a_place(registered):
    name = "many-busy-keys"
    register_gated(name, max_concurrent_per_key=1)
    wf = get_workflow(name)
    with testing.fake_clock() as fake:
        busy_customers(wf, name, control.ADMISSION_SCAN + 5)

        # A create of a key nobody holds.
        wf.create(id="free", concurrency_key="free")
        assert status(wf, "free")[0] == "running", status(wf, "free")

        # The next of a key whose place a run's end frees.
        wf.create(id="late-0", concurrency_key="late")
        wf.create(id="late-1", concurrency_key="late")
        assert status(wf, "late-1") == (
            "queued",
            "max_concurrent_per_key (1) reached for key 'late'",
        )
        testing.run_until_idle()
        wf.get("late-0").send_event("go")
        testing.run_until_idle()
        assert status(wf, "late-0")[0] == "complete"
        assert status(wf, "late-1")[0] in ("running", "waiting"), status(wf, "late-1")

        # The next of a key whose place a terminate frees.
        wf.create(id="term-0", concurrency_key="term")
        wf.create(id="term-1", concurrency_key="term")
        assert status(wf, "term-1")[0] == "queued"
        wf.get("term-0").terminate()
        assert status(wf, "term-1")[0] == "running", status(wf, "term-1")

        # One paused while queued, resumed once its key has a place.
        wf.create(id="paused-0", concurrency_key="paused")
        wf.create(id="paused-1", concurrency_key="paused")
        wf.get("paused-1").pause()
        wf.get("paused-0").terminate()
        wf.get("paused-1").resume()
        assert status(wf, "paused-1")[0] == "running", status(wf, "paused-1")

        # One whose debounce ends.
        wf.create(id="debounced", concurrency_key="d", debounce_key="d", debounce="5 seconds")
        assert status(wf, "debounced")[0] == "queued"
        fake.advance("6 seconds")
        store.admit_due([(name, registry.limits_for(name, 1))])
        assert status(wf, "debounced")[0] == "running", status(wf, "debounced")

        # Those of busy keys still wait for their key.
        assert status(wf, "queued-7")[0] == "queued"
