"""Task queues: a worker started for some Django task queues only (`runworker --queues`,
WFDASH["EMBEDDED_WORKER_QUEUES"], `testing.run_until_idle(queues=...)`) runs the tasks of
those queues and nothing else; a worker started without runs everything."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import override_settings

from workflows_app import testing
from workflows_app.engine import WorkflowEntrypoint, register, store
from workflows_app.engine.worker import CONTENDED_WAIT_SECONDS, Worker
from workflows_app.models import Instance
from workflows_app.tasks import InvalidTask, TaskResultStatus

pytestmark = pytest.mark.django_db(transaction=True)

START = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)

QUEUED_TASKS = {
    "default": {
        "BACKEND": "workflows_app.tasks.WorkflowTaskBackend",
        "QUEUES": ["default", "emails", "reports"],
    }
}


@pytest.fixture
def tasks(registered):
    from tests import task_functions

    with override_settings(TASKS=QUEUED_TASKS):
        yield task_functions


def plain_workflow() -> str:
    @register("queues-plain", version=1)
    class Plain(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.do("one", lambda: "done")

    return "queues-plain"


def test_a_worker_of_some_queues_runs_only_their_tasks_and_the_others_stay_ready(tasks):
    from workflows_app.client import get_workflow

    emails = tasks.add.using(queue_name="emails").enqueue(1, 2)
    reports = tasks.add.using(queue_name="reports").enqueue(3, 4)
    plain = get_workflow(plain_workflow()).create()
    assert Instance.objects.get(instance_id=emails.id).queue == "emails"
    assert Instance.objects.get(instance_id=plain.id).queue is None

    assert testing.run_until_idle(queues=["emails"]) == 1
    assert tasks.add.get_result(emails.id).status == TaskResultStatus.SUCCESSFUL
    assert tasks.add.get_result(reports.id).status == TaskResultStatus.READY
    row = Instance.objects.get(instance_id=reports.id)
    assert (row.run_count, row.lease_token) == (0, None)  # never claimed
    assert (
        plain.status().status == "running"
        and Instance.objects.get(instance_id=plain.id).run_count == 0
    )

    assert testing.run_until_idle(queues="reports") == 1  # a string of names, as --queues
    assert tasks.add.get_result(reports.id).return_value == 7
    assert Instance.objects.get(instance_id=plain.id).run_count == 0  # other workflows: not theirs

    assert testing.run_until_idle() == 1  # a worker of every queue runs everything
    assert plain.status().status == "complete"


def test_a_worker_of_several_queues_takes_the_earliest_due_of_them(tasks):
    with testing.fake_clock(START) as clock:
        late = tasks.add.using(queue_name="emails").enqueue(1, 1)
        clock.advance("1 second")
        early_other = tasks.add.using(queue_name="default").enqueue(2, 2)
        clock.advance("1 second")
        reports = tasks.add.using(queue_name="reports").enqueue(3, 3)
        assert testing.run_until_idle(queues=["emails", "reports"], concurrency=1) == 2
        assert tasks.add.get_result(late.id).is_finished
        assert tasks.add.get_result(reports.id).is_finished
        assert tasks.add.get_result(early_other.id).status == TaskResultStatus.READY


def test_a_worker_of_some_queues_waits_for_their_timers_only(tasks):
    """Its idle wait ends at its own queues' next timer: another queue's task (due, with
    no worker of its queue) or another workflow's timer woke it to claim nothing, every
    CONTENDED_WAIT_SECONDS."""
    with testing.fake_clock(START):
        tasks.add.using(queue_name="reports").enqueue(1, 1)  # due now, nobody for it here
        tasks.add.using(queue_name="emails", run_after=START + timedelta(hours=1)).enqueue(2, 2)
        get_plain = plain_workflow()
        from workflows_app.client import get_workflow

        get_workflow(get_plain).create()  # due now, not a task
        testing.run_until_idle(queues=["emails"])  # the emails task sleeps until run_after
        assert store.next_wake_at() == START
        assert store.next_wake_at(["emails"]) == START + timedelta(hours=1)
        assert store.next_wake_at(["nothing-here"]) is None

        async def waits() -> float:
            worker = Worker(worker_id="emails-only", queues=["emails"], poll_seconds=5)
            await worker.start()
            try:
                assert await worker.claim_and_start() == 0
                assert await worker.db(worker._next_wake_at) == START + timedelta(hours=1)
                return await worker._contended_wait()
            finally:
                await worker.stop(grace_seconds=0)

        waited = asyncio.run(waits())
    assert waited > CONTENDED_WAIT_SECONDS  # the poll interval, not a spin


def test_enqueue_refuses_a_queue_name_the_instance_cannot_keep(registered):
    from tests import task_functions

    anything = {"default": {"BACKEND": "workflows_app.tasks.WorkflowTaskBackend", "QUEUES": []}}
    with override_settings(TASKS=anything):
        with pytest.raises(InvalidTask, match="queue_name must be a string of 1-100"):
            task_functions.add.using(queue_name="q" * 101).enqueue(1, 2)
        assert task_functions.add.using(queue_name="q" * 100).enqueue(1, 2).task.queue_name
    assert Instance.objects.count() == 1


def test_worker_queues_are_checked():
    with pytest.raises(ValueError, match="a queue name is empty"):
        Worker(queues="emails,,reports")
    with pytest.raises(ValueError, match="expected queue names"):
        Worker(queues=["emails", 3])
    assert Worker(queues=" emails , reports,emails").queues == ("emails", "reports")
    assert Worker().queues is None


def test_runworker_queues_are_checked_against_the_task_backends(tasks, monkeypatch):
    from workflows_app.management.commands import runworker

    with pytest.raises(CommandError, match=r"no task backend in TASKS has the queue\(s\) mails"):
        call_command("runworker", "workflows", "--queues", "emails,mails")
    with pytest.raises(CommandError, match="a queue name is empty"):
        call_command("runworker", "workflows", "--queues", "emails,")
    with pytest.raises(CommandError, match="--queues is for the 'workflows' channel"):
        call_command("runworker", "other", "--queues", "emails")

    started = []
    monkeypatch.setattr(runworker.EngineChannelsWorker, "run", lambda self: started.append(self))
    call_command("runworker", "workflows", "--queues", "emails,reports")
    call_command("runworker", "workflows")
    assert [worker.queues for worker in started] == [("emails", "reports"), None]


def test_the_embedded_worker_takes_its_queues_from_the_setting(tasks):
    from workflows_app import embedded

    with override_settings(WFDASH={"EMBEDDED_WORKER_QUEUES": ["emails"]}):
        assert embedded.embedded_queues() == ("emails",)
    with (
        override_settings(WFDASH={"EMBEDDED_WORKER_QUEUES": ""}),
        pytest.raises(ValueError, match=r'WFDASH\["EMBEDDED_WORKER_QUEUES"\]'),
    ):
        embedded.embedded_queues()
    with override_settings(WFDASH={}):
        assert embedded.embedded_queues() is None


def test_the_claim_of_a_worker_of_some_queues_reads_by_their_index_on_postgresql(
    tasks, monkeypatch
):
    """The generic plan of its claim finds each queue's due tasks of each priority by
    instance_unleased_queue_prio, never by reading the table; the claim of every queue
    is the statement it was."""
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL only")
    from tests.test_postgres_fast_path import _bulk_instances, _generic_plan
    from workflows_app.engine import clock
    from workflows_app.engine.store import leases

    _bulk_instances("plans", 3000)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE workflows_app_instance")
    now = clock.now()
    params = leases._claim_params(
        "w", 50, now, now + timedelta(seconds=30), [], None, queues=["emails"]
    )
    plan = _generic_plan(leases.CLAIM_IN_QUEUES_SQL, params)
    # each (queue, priority) by instance_unleased_queue_prio, or with no tasks to tell
    # them apart (this table) each priority by instance_unleased_task_prio
    assert "instance_unleased_queue_prio" in plan or "instance_unleased_task_prio" in plan, plan
    assert "Seq Scan on workflows_app_instance" not in plan, plan
    assert "queues" not in leases._claim_params("w", 50, now, now, [], None)
    every = leases._claim_params("w", 50, now, now + timedelta(seconds=30), [], None)
    plan = _generic_plan(leases.CLAIM_BY_PRIORITY_SQL, every)
    assert "instance_unleased_task_prio" in plan, plan  # a worker that runs tasks (this one)
    assert leases._claim_statement(None, with_rows=False) == leases.CLAIM_BY_PRIORITY_SQL
    assert leases._claim_statement(["emails"], False) == leases.CLAIM_IN_QUEUES_SQL
    # a worker of no tasks claims by the statement it always did
    monkeypatch.setattr(leases.registry, "resolved_prefixes", list)
    assert leases._claim_statement(None, with_rows=True) == leases.CLAIM_WITH_ROWS_SQL


def test_the_migration_gives_unfinished_tasks_made_before_it_their_queue(tasks):
    from tests.test_migrations import migrate

    waiting = tasks.add.using(queue_name="emails").enqueue(1, 2)
    done = tasks.add.using(queue_name="reports").enqueue(3, 4)
    testing.run_until_idle(queues=["reports"])
    migrate([("workflows_app", "0019_live_instances_index")])  # the column goes
    migrate()  # and comes back, filled in from the params
    queues = dict(Instance.objects.values_list("instance_id", "queue"))
    assert queues == {waiting.id: "emails", done.id: None}  # a finished task needs none
    assert testing.run_until_idle(queues=["emails"]) == 1


def started_order(results) -> list[str]:
    """The results' task ids in the order their instances' runs started."""
    from workflows_app.models import HistoryRecord

    ids = dict(
        Instance.objects.filter(instance_id__in=[r.id for r in results]).values_list(
            "id", "instance_id"
        )
    )
    started = HistoryRecord.objects.filter(instance_id__in=ids, type="run.started").order_by("id")
    return [ids[pk] for pk in started.values_list("instance_id", flat=True)]


@pytest.mark.parametrize("queues", [None, ["default"]], ids=["every-queue", "queue-worker"])
def test_due_tasks_of_one_queue_run_by_priority_then_in_the_order_they_came_due(tasks, queues):
    """One worker, one run at a time: the more urgent first whatever the order they were
    enqueued in; the same priority (Django's 0 and 1 are one level) first come first."""
    with testing.fake_clock(START) as clock:
        enqueued = []
        for label, priority in [("low", -100), ("default", 0), ("high", 100), ("also-default", 1)]:
            result = tasks.urgent.using(priority=priority).enqueue(label)
            enqueued.append(result)
            clock.advance("1 second")
        clock.advance("1 second")
        assert testing.run_until_idle(concurrency=1, queues=queues) == 4
    low, default, high, also_default = (r.id for r in enqueued)
    assert started_order(enqueued) == [high, default, also_default, low]


def test_a_workflow_keeps_its_place_among_tasks_and_priority_ages(tasks):
    """Priority orders tasks among tasks: a workflow due before them runs before them, and
    a task's place goes to a more urgent task. A flood of urgent tasks cannot starve a
    lower one: a task ranks PRIORITY_AGING later per level (9 levels from Django's 100 to
    -100), so it waits behind urgent tasks that came due up to that long after it only."""
    from workflows_app.client import get_workflow
    from workflows_app.engine.store.leases import PRIORITY_AGING
    from workflows_app.models import HistoryRecord

    with testing.fake_clock(START) as clock:
        plain = get_workflow(plain_workflow()).create()
        clock.advance("1 second")
        low = tasks.urgent.using(priority=-100).enqueue("low")
        clock.advance("1 second")
        flood = [tasks.urgent.using(priority=100).enqueue(f"flood-{n}") for n in range(3)]
        clock.advance(PRIORITY_AGING * 9)  # urgent tasks due from now on rank after it
        late = tasks.urgent.using(priority=100).enqueue("late")
        clock.advance("1 second")
        assert testing.run_until_idle(concurrency=1) == 6
    assert started_order([low, *flood, late]) == [*(r.id for r in flood), low.id, late.id]
    first = HistoryRecord.objects.filter(type="run.started").order_by("id").first()
    assert first.instance.instance_id == plain.id


@pytest.mark.parametrize("queues", [None, ["emails"]], ids=["every-queue", "queue-worker"])
def test_a_task_claim_and_its_next_timer_read_none_of_the_fleets_leased_tasks(tasks, queues):
    """A running task stays due (its wake_at is kept for the run after a crash), so the
    claim's read of the first due tasks of each priority (of each queue: a queue worker),
    and a queue worker's read of its next timer, went past every task the fleet's workers
    held before the first they could take: 2,000 leased tasks read at each level. Now the
    unleased tasks are read by indexes of their own and those whose lease ran out by
    instance_lease_expiry, as the plain claim's; the claim still takes both, by rank."""
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL only: it counts the tuples a transaction read")
    from django.db import transaction

    from tests.test_admission_many_keys import tuples_read
    from tests.test_postgres_fast_path import _generic_plan
    from workflows_app.engine import clock
    from workflows_app.engine.store import leases

    template = Instance.objects.get(
        instance_id=tasks.add.using(queue_name="emails").enqueue(1, 2).id
    )
    now = clock.now()
    table = Instance._meta.db_table
    written = ("id", "instance_id", "wake_at", "lease_token", "lease_expires_at", "status")
    copied = [
        f.column for f in Instance._meta.concrete_fields if f.column not in (*written, "priority")
    ]
    columns = ", ".join(copied)

    def clone(prefix: str, count: int, wake_at, token: str, expires) -> None:
        """count running tasks like the template, leased, of every level of priority."""
        with connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {table} ({columns}, instance_id, wake_at, lease_token, "
                f"lease_expires_at, status, priority) SELECT {columns}, %s || g::text, "
                "%s - g * interval '1 millisecond', %s || g::text, %s, 'running', g %% 10 "
                f"FROM {table}, generate_series(1, %s) g WHERE id = %s",
                [prefix, wake_at, token, expires, count, template.pk],
            )

    # Held by other workers: due long ago, leases live for another minute.
    clone("held-", 2000, now - timedelta(hours=1), "other-", now + timedelta(minutes=1))
    # A worker that died: its leases ran out a minute ago.
    clone("orphan-", 3, now - timedelta(minutes=30), "dead-", now - timedelta(minutes=1))
    Instance.objects.filter(pk=template.pk).update(wake_at=now - timedelta(minutes=10))
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {table}")
    with transaction.atomic():
        before = tuples_read()
        next_wake = store.next_wake_at(queues)
        claimed = leases._claim("w-test", 50, 30, (), None, queues)
        read = tuples_read() - before
    assert next_wake == now - timedelta(minutes=10)
    taken = dict(
        Instance.objects.filter(pk__in=[pk for pk, *_ in claimed]).values_list(
            "instance_id", "lease_owner"
        )
    )
    assert set(taken) == {"orphan-1", "orphan-2", "orphan-3", template.instance_id}
    assert set(taken.values()) == {"w-test"}
    assert Instance.objects.filter(lease_token__startswith="other-").count() == 2000
    # The 4 rows taken, through 2 indexes, and the next timer's: not 2,000 at each level.
    assert read < 200, f"{read} rows and index entries read"
    # So does the plan the server keeps for the statement once it is prepared.
    params = leases._claim_params("w", 50, now, now + timedelta(seconds=30), [], None, queues)
    plan = _generic_plan(leases._claim_statement(queues, with_rows=False), params)
    assert "instance_lease_expiry" in plan, plan
    assert "instance_unleased_queue_prio" in plan or "instance_unleased_task_prio" in plan, plan
    assert "Seq Scan on workflows_app_instance" not in plan, plan


@pytest.mark.parametrize("queues", [None, ["emails"]], ids=["every-queue", "queue-worker"])
def test_tasks_whose_lease_ran_out_are_claimed_again_by_rank_beside_the_unleased(tasks, queues):
    """The claim reads the unleased tasks and those whose lease ran out apart (each by an
    index of its own) and takes the first of both by rank; a live lease is left alone."""
    from workflows_app.engine.store import leases

    def claim(worker: str, limit: int) -> list[str]:
        rows = leases._claim(worker, limit, 30, (), None, queues)
        pks = [pk for pk, *_ in rows]
        return sorted(Instance.objects.filter(pk__in=pks).values_list("instance_id", flat=True))

    with testing.fake_clock(START) as clock:
        urgent, low = (
            tasks.urgent.using(queue_name="emails", priority=p).enqueue(f"lost-{p}")
            for p in (100, -100)
        )
        assert claim("w-dead", 10) == sorted([urgent.id, low.id])
        clock.advance("20 seconds")
        held = tasks.urgent.using(queue_name="emails").enqueue("held")
        assert claim("w-live", 10) == [held.id]
        clock.advance("20 seconds")  # w-dead's leases ran out, w-live's lives
        fresh = tasks.urgent.using(queue_name="emails", priority=0).enqueue("fresh")
        # by rank: the urgent lost one (due first, level 0), the fresh one (level 5), then
        # the low lost one (level 9: 9 minutes behind)
        assert claim("w-new", 2) == sorted([urgent.id, fresh.id])
        assert claim("w-new", 10) == [low.id]
    assert Instance.objects.get(instance_id=held.id).lease_owner == "w-live"
