"""max_concurrent_per_key with more busy keys than one admission pass reads.

A pass reads at most ADMISSION_SCAN (1000) queued instances in line, skipping the queues
of keys it found at their bound. With a thousand customers each at their bound and one
instance queued each, those thousand fill the pass: every instance behind them waited
("queued behind the first 1000 instances in line") while its own key had a free place,
until the queue ahead shrank. Not a race: SQLite too.
"""

from __future__ import annotations

import pytest
from django.db import connection, transaction

from tests.test_flow_control import register_gated
from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import clock, registry, store
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


def tuples_read() -> int:
    """Rows and index entries of the instance table this transaction read so far."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_stat_get_xact_tuples_returned(%s::regclass) + (SELECT "
            "coalesce(sum(pg_stat_get_xact_tuples_returned(indexrelid)), 0) FROM pg_index "
            "WHERE indrelid = %s::regclass)",
            [Instance._meta.db_table, Instance._meta.db_table],
        )
        (read,) = cursor.fetchone()
    return read


def test_an_admission_reads_a_bounded_part_of_one_keys_long_backlog(registered):
    """One customer queued 20,000 instances behind its key (max_concurrent_per_key 1).
    The scan skips the key once at its bound, but its next page's filter read past every
    one of them to find the next instance of another key: each create and each run's end
    of the workflow read the whole backlog (100,000: 70 ms a create). Now an admission
    reads a bounded part of the line (ADMISSION_EXAMINE), and a create of a free key
    still starts (_Decided.beyond)."""
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL only: it counts the tuples a transaction read")
    name = "one-long-backlog"
    register_gated(name, max_concurrent_per_key=1)
    wf = get_workflow(name)
    wf.create(id="busy-run", concurrency_key="busy")
    template = wf.create(id="busy-queued", concurrency_key="busy").row()
    table = Instance._meta.db_table
    columns = ", ".join(
        f.column for f in Instance._meta.concrete_fields if f.column not in ("id", "instance_id")
    )
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} ({columns}, instance_id) SELECT {columns}, 'busy-' || g::text "
            f"FROM {table}, generate_series(1, 20000) g WHERE id = %s",
            [template.pk],
        )
        cursor.execute(f"ANALYZE {table}")
    limits = registry.limits_for(name, 1)
    with transaction.atomic():
        before = tuples_read()
        assert store.promote_queued(name, limits, clock.now()) == []
        read = tuples_read() - before
    # ADMISSION_EXAMINE (3,000) in line, each read twice (its window's bound, its pages)
    assert read < 10_000, f"one admission read {read} tuples of a 20,000 backlog"
    assert wf.create(id="free", concurrency_key="free").status().status == "running"


def test_an_admission_cut_short_writes_no_reasons_the_cut_already_wrote(registered):
    """A pass cut short sets every due instance it did not admit to wait (admit_at NULL);
    then it wrote the reasons of the keys it skipped, one UPDATE with a CASE of every such
    key (a thousand) over instances due now, of which none was left. That statement cost a
    create of a workflow with 1000 busy keys 400-700 ms of its 800 (loaded machine; 150
    without it)."""
    from django.test.utils import CaptureQueriesContext

    name = "busy-keys-cost"
    register_gated(name, max_concurrent_per_key=1)
    wf = get_workflow(name)
    busy_customers(wf, name, control.ADMISSION_SCAN + 5)
    with CaptureQueriesContext(connection) as queries:
        wf.create(id="free", concurrency_key="free")
    case_updates = [
        q["sql"][:120]
        for q in queries.captured_queries
        if q["sql"].startswith("UPDATE") and " CASE " in q["sql"]
    ]
    assert case_updates == []
    assert status(wf, "free")[0] == "running"


def test_a_create_behind_a_short_queue_reads_the_queue_once(registered):
    """The windows of a long line (ADMISSION_WINDOW) cost a read of the window's bound;
    a create under flow control with a short queue (the common case) makes none."""
    from django.test.utils import CaptureQueriesContext

    name = "short-queue"
    register_gated(name, max_concurrent_instances=2, max_concurrent_per_key=1)
    wf = get_workflow(name)
    wf.create(id="a", concurrency_key="k")
    with CaptureQueriesContext(connection) as queries:
        wf.create(id="b", concurrency_key="k")
    reads = [q["sql"] for q in queries.captured_queries if "ORDER BY priority, id" in q["sql"]]
    assert len(reads) == 1, reads
    assert status(wf, "b") == ("queued", "max_concurrent_per_key (1) reached for key 'k'")


def test_a_bulk_terminate_of_keyed_instances_reads_their_keys_with_their_rows(registered):
    """terminate_batch (a bulk job's batch) loads only the columns it needs; the keys of
    the places it frees were not among them, so each instance cost one more query."""
    from django.test.utils import CaptureQueriesContext

    name = "bulk-keys"
    register_gated(name, max_concurrent_per_key=1)
    wf = get_workflow(name)
    counts = []
    for size in (3, 9):
        pks = [
            wf.create(id=f"{size}-{n}", concurrency_key=f"{size}-{n}").row().pk for n in range(size)
        ]
        with CaptureQueriesContext(connection) as queries, transaction.atomic():
            assert len(store.terminate_batch(pks)) == size
        counts.append(len(queries.captured_queries))
    assert counts[0] == counts[1], f"queries for 3 and 9 instances: {counts}"
