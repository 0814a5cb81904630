"""Pause, resume and admission racing other writers, made deterministic on PostgreSQL (one
thread holds a row or lock, the other is seen waiting for it), and admission's reads at
scale (each test failed before its fix)."""

from __future__ import annotations

import copy
import threading
from datetime import UTC, datetime

import pytest
from django.db import connection, connections, transaction

from tests.polling import a_backend_waits_for_a_lock, wait_until
from workflows_app import testing
from workflows_app.client import schedules
from workflows_app.engine import WorkflowEntrypoint, register, store

pytestmark = pytest.mark.django_db(transaction=True)

START = datetime(2026, 6, 1, 2, 50, tzinfo=UTC)


def _in_thread(target, outcome: dict[str, object], key: str) -> threading.Thread:
    def run() -> None:
        try:
            outcome[key] = target()
        except BaseException as exc:
            outcome[f"{key} error"] = exc
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_resume_racing_a_deploy_that_changes_the_cron_takes_the_new_crons_next_tick(
    registered,
):
    """PostgreSQL. schedules.set_paused read the row without a lock, then wrote paused and
    a next tick it computed from the cron it had read. A worker start of a new release
    (sync_declared) that changed the schedule's cron between that read and the write left
    the new cron with the old one's next tick: a yearly cron made every 5 minutes
    fired nothing until next new year."""
    if connection.vendor != "postgresql":
        pytest.skip("SQLite's IMMEDIATE transactions serialise the resume and the deploy")

    @register("fc-yearly", schedules=["0 0 1 1 *"])
    class Yearly(WorkflowEntrypoint):
        async def run(self, event, step):
            return None

    with testing.fake_clock(START):
        testing.run_until_idle()  # a worker start declares the schedule
        [declared] = schedules.list(workflow="fc-yearly")
        declared.pause()
        held, commit = threading.Event(), threading.Event()
        outcome: dict[str, object] = {}

        def deploy_changes_the_cron() -> None:  # its commit held back
            with transaction.atomic():
                store.schedules.sync_declared([("fc-yearly", 1, ["*/5 * * * *"])])
                held.set()
                assert commit.wait(30)

        deployer = _in_thread(deploy_changes_the_cron, outcome, "deploy")
        try:
            assert held.wait(30), outcome
            resumer = _in_thread(lambda: declared.resume(), outcome, "resume")
            wait_until(a_backend_waits_for_a_lock, 30, "the resume waiting for the schedule row")
        finally:
            commit.set()
            deployer.join(30)
        resumer.join(30)
        assert "deploy error" not in outcome and "resume error" not in outcome, outcome
        row = schedules.get(declared.name)
        assert (row.cron, row.paused) == ("*/5 * * * *", False)
        assert row.next_run_at == datetime(2026, 6, 1, 2, 55, tzinfo=UTC), row.next_run_at


def _pending_debounces(wf, count: int) -> None:
    """`count` instances queued with a debounce that has not ended (an hour), first in line."""
    from workflows_app.models import Instance

    template = wf.create(id="pending", debounce_key="pending", debounce="1 hour").row()
    rows = []
    for n in range(count):
        row = copy.copy(template)
        row.pk, row.instance_id, row.debounce_key = None, f"pending-{n}", f"user-{n}"
        rows.append(row)
    Instance.objects.bulk_create(rows, batch_size=1000)
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(f"ANALYZE {Instance._meta.db_table}")


def test_a_debounce_create_and_an_admission_of_the_due_do_not_read_every_pending_debounce(
    registered,
):
    """The admission pass after a create read the line past every pending debounce ahead
    of the first instance it could start (the first page of _QueueScan has no window):
    100,000 users each with a pending debounce made every create of a debounced workflow
    read them all (39,000 tuples, 157 ms a create; 24 ms behind none), and so did every
    admit_due pass (54,000 tuples, 100 ms). A pending debounce takes no place and frees
    none: its create decides nothing; and with no flow control what is due starts without
    a read of the line."""
    from tests.test_admission_many_keys import tuples_read
    from workflows_app.client import get_workflow
    from workflows_app.engine import clock, registry

    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL only: it counts the tuples a transaction read")

    @register("fc-debounced")
    class Debounced(WorkflowEntrypoint):
        async def run(self, event, step):
            return event.payload

    wf = get_workflow("fc-debounced")
    with testing.fake_clock(START) as fake:
        _pending_debounces(wf, 5000)
        with transaction.atomic():
            before = tuples_read()
            new = wf.create(id="new", debounce_key="new", debounce="10 seconds")
            read = tuples_read() - before
        assert read < 100, f"a debounce create read {read} tuples behind 5,000 pending debounces"
        assert new.status().status == "queued"
        fake.advance("11 seconds")
        with transaction.atomic():
            before = tuples_read()
            started = store.promote_queued(
                "fc-debounced", registry.limits_for("fc-debounced", 1), clock.now(), due=True
            )
            read = tuples_read() - before
        assert started == [new.row().pk]
        assert read < 100, f"an admission of the due read {read} tuples"
        assert new.status().status == "running"


def test_admit_due_starts_more_than_a_page_of_due_debounces_at_once(registered):
    """With no flow control an admission of the due reads a page of them (no read of the
    line): admit_due takes the next page at once, as the pass that read the line did."""
    from workflows_app.client import get_workflow
    from workflows_app.engine import registry
    from workflows_app.engine.store import control
    from workflows_app.models import Instance

    @register("fc-many-due")
    class ManyDue(WorkflowEntrypoint):
        async def run(self, event, step):
            return event.payload

    wf = get_workflow("fc-many-due")
    count = control.ADMISSION_PAGE + 50
    with testing.fake_clock(START) as fake:
        for n in range(count):
            wf.create(id=f"d-{n}", debounce_key=f"user-{n}", debounce="10 seconds")
        fake.advance("11 seconds")
        started, _ = store.admit_due([("fc-many-due", registry.limits_for("fc-many-due", 1))])
        assert len(started) == count
        assert set(
            Instance.objects.filter(workflow="fc-many-due").values_list("status", flat=True)
        ) == {"running"}


def test_the_places_taken_are_counted_no_further_than_the_limit(registered):
    """Admission counted every instance holding a place under max_concurrent_instances: a
    limit lowered to 10 under 100,000 sleeping instances cost each create and each run's
    end a count of all of them (100,000 tuples, 84 ms; now 10 tuples, 3 ms)."""
    from tests.test_admission_many_keys import tuples_read
    from workflows_app.client import get_workflow
    from workflows_app.engine import registry
    from workflows_app.engine.store import control
    from workflows_app.models import Instance

    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL only: it counts the tuples a transaction read")

    @register("fc-lowered", limits={"max_concurrent_instances": 5})
    class Lowered(WorkflowEntrypoint):
        async def run(self, event, step):
            return None

    wf = get_workflow("fc-lowered")
    template = wf.create(id="sleeping").row()
    Instance.objects.filter(pk=template.pk).update(status="waiting", wake_at=None)
    rows = []
    for n in range(2000):  # started before the limit was lowered to 5
        row = Instance.objects.get(pk=template.pk)
        row.pk, row.instance_id = None, f"sleeping-{n}"
        rows.append(row)
    Instance.objects.bulk_create(rows, batch_size=1000)
    with transaction.atomic():
        before = tuples_read()
        assert control._free_slots("fc-lowered", registry.limits_for("fc-lowered", 1)) == 0
        read = tuples_read() - before
    assert read < 100, f"counting the places taken read {read} tuples"
    assert wf.create(id="new").status().status == "queued"


def test_the_places_taken_of_a_key_are_counted_no_further_than_its_limit(registered):
    """Admission counted every instance holding a place of a key under
    max_concurrent_per_key: a limit lowered to 10 while 50,000 of one key run cost each
    create and run's end of the workflow a count of all 50,000. Now no further than the
    limit, for the places held by status and the started paused ones alike."""
    from tests.test_admission_many_keys import tuples_read
    from workflows_app.client import get_workflow
    from workflows_app.engine import registry
    from workflows_app.engine.store import control
    from workflows_app.models import Instance

    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL only: it counts the tuples a transaction read")

    @register("fc-key-lowered", limits={"max_concurrent_per_key": 5})
    class KeyLowered(WorkflowEntrypoint):
        async def run(self, event, step):
            return None

    wf = get_workflow("fc-key-lowered")
    template = wf.create(id="sleeping", concurrency_key="busy").row()
    Instance.objects.filter(pk=template.pk).update(status="waiting", wake_at=None, started_at=START)
    rows = []
    for n in range(2000):  # started before the limit was lowered to 5, half paused since
        row = Instance.objects.get(pk=template.pk)
        row.pk, row.instance_id = None, f"sleeping-{n}"
        row.status = "paused" if n % 2 else "waiting"
        rows.append(row)
    for n in range(300):  # other customers, one instance each
        row = Instance.objects.get(pk=template.pk)
        row.pk, row.instance_id, row.concurrency_key = None, f"customer-{n}", f"c{n}"
        rows.append(row)
    Instance.objects.bulk_create(rows, batch_size=1000)
    with connection.cursor() as cursor:  # the visibility map, as autovacuum keeps it
        cursor.execute(f"VACUUM ANALYZE {Instance._meta.db_table}")
    limits = registry.limits_for("fc-key-lowered", 1)
    # Two keys, and a page's many keys. ("busy" has 1,000 paused entries in its index
    # before its first waiting one: a status IN (...) planned as a filter read them all.)
    for keys in [{"busy", "free"}, {"busy", "free", *(f"c{n}" for n in range(20))}]:
        with transaction.atomic():
            admission = control.Admission("fc-key-lowered", limits, START)
            before = tuples_read()
            admission.learn_keys(keys)
            read = tuples_read() - before
        assert read < 100, f"counting the places taken of {len(keys)} keys read {read} tuples"
        assert admission.keys_at_bound() == {"busy"}
        assert admission.key_active["free"] == 0
    held_back = wf.create(id="new", concurrency_key="busy")
    assert held_back.status().status == "queued"
    assert held_back.row().waiting_reason == "max_concurrent_per_key (5) reached for key 'busy'"
    assert wf.create(id="other", concurrency_key="free").status().status != "queued"


def test_the_starts_in_a_rate_window_are_counted_no_further_than_the_limit(registered):
    """Admission counted every start its rate window's log held: a rate_limit lowered
    from 100,000 an hour to 5 counted them all at every create and run's end for an
    hour. Now no further than the limit (and the first start by the index)."""
    from datetime import timedelta

    from workflows_app.client import get_workflow
    from workflows_app.engine import clock
    from workflows_app.models import RateLimitStart

    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL only: it counts the tuples a transaction read")

    @register("fc-rate-lowered", limits={"rate_limit": {"limit": 5, "period": "1 hour"}})
    class RateLowered(WorkflowEntrypoint):
        async def run(self, event, step):
            return None

    table = RateLimitStart._meta.db_table

    def rate_tuples_read() -> int:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_stat_get_xact_tuples_returned(%s::regclass) + (SELECT "
                "coalesce(sum(pg_stat_get_xact_tuples_returned(indexrelid)), 0) FROM pg_index "
                "WHERE indrelid = %s::regclass)",
                [table, table],
            )
            return cursor.fetchone()[0]

    with testing.fake_clock(START):
        earlier = clock.now() - timedelta(minutes=10)  # started under the old limit
        RateLimitStart.objects.bulk_create(
            [RateLimitStart(workflow="fc-rate-lowered", started_at=earlier)] * 2000,
            batch_size=1000,
        )
        with transaction.atomic():
            before = rate_tuples_read()
            new = get_workflow("fc-rate-lowered").create(id="new")
            read = rate_tuples_read() - before
        assert read < 100, f"an admission read {read} tuples of the rate window's log"
        assert new.row().waiting_reason.startswith(
            "rate_limit (5 per 1 hour) reached; next start at"
        )
        assert new.row().admit_at == earlier + timedelta(hours=1)


def test_a_flow_controlled_admission_reads_a_page_not_every_pending_debounce(registered):
    """Under flow control every create and run's end reads the head of the line; through
    the queue index its first page's filter read every pending debounce ahead of the
    instances it kept (100,000 of them: 100,000 rows, 134 ms), and so did the look for
    stranded queues of a workflow under no flow control, every 5 s (36 ms). The line's
    index (instance_in_line) holds no pending debounce: 5 rows, 0.04 ms."""
    from tests.test_admission_many_keys import tuples_read
    from tests.test_flow_control import register_gated
    from workflows_app.client import get_workflow
    from workflows_app.engine import clock, registry
    from workflows_app.models import Instance

    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL only: it counts the tuples a transaction read")
    register_gated("fc-line", max_concurrent_instances=2)
    register_gated("fc-free")
    line, free = get_workflow("fc-line"), get_workflow("fc-free")
    with testing.fake_clock(START):
        holder = line.create(id="holder")
        _pending_debounces(line, 3000)
        _pending_debounces(free, 3000)
        with transaction.atomic():
            before = tuples_read()
            second = line.create(id="second")
            read = tuples_read() - before
        assert (holder.status().status, second.status().status) == ("running", "running")
        assert read < 300, f"a create read {read} tuples behind 3,000 pending debounces"
        third = line.create(id="third")
        with transaction.atomic():  # a run's end with no place freed
            before = tuples_read()
            limits = registry.limits_for("fc-line", 1)
            assert store.promote_queued("fc-line", limits, clock.now()) == []
            read = tuples_read() - before
        assert read < 300, f"an admission read {read} tuples behind 3,000 pending debounces"
        assert third.status().status == "queued"

        stranded = [("fc-free", registry.limits_for("fc-free", 1))]
        with transaction.atomic():
            before = tuples_read()
            assert store.promote_stranded_queues(stranded) == 0
            read = tuples_read() - before
        assert read < 50, f"a look for stranded queues read {read} tuples"
        # What a process of the previous release queued (a limit this one dropped) starts.
        left = free.create(id="left").row()
        Instance.objects.filter(pk=left.pk).update(status="queued", wake_at=None)
        assert store.promote_stranded_queues(stranded) == 1
        assert Instance.objects.get(pk=left.pk).status == "running"
