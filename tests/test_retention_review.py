"""Review: retention and pruning, deleting instances, the django.tasks backend, testing helpers."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection, connections
from django.test import override_settings

from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, clock, register, store
from workflows_app.models import Instance

pytestmark = pytest.mark.django_db(transaction=True)

START = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.fixture
def family(registered):
    @register("rr-child")
    class Child(WorkflowEntrypoint):
        async def run(self, event, step):
            got = await step.wait_for_event("go", type="go")
            return {"child": got.payload}

    @register("rr-parent")
    class Parent(WorkflowEntrypoint):
        async def run(self, event, step):
            out = await step.invoke("kid", "rr-child", id=f"{event.instance_id}-kid")
            return {"parent got": out}

    return get_workflow("rr-parent"), get_workflow("rr-child")


@override_settings(WFDASH={"RETENTION": "1 hour"})
def test_prune_keeps_a_finished_child_whose_parent_has_not_taken_its_output(family):
    """A child that completed while its parent was paused is pruned once its retention
    passes, although the parent's step.invoke still waits for it (StepRecord WAITING):
    store.prune (workflows_app/engine/store/catalog.py:97) selects every instance with
    expires_at <= now, with no regard for a parent that still needs it. On resume the
    parent's invoke finds no child (engine/step.py:806-808) and the parent errors with
    ChildWorkflowFailed "the child instance no longer exists" instead of completing with
    the child's output."""
    parents, children = family
    with testing.fake_clock(START) as clock:
        parent = parents.create(id="p")
        testing.run_until_idle()  # parent parks on its invoke; the child waits for "go"
        parent.pause()
        children.get("p-kid").send_event("go", 7)
        testing.run_until_idle()
        assert children.get("p-kid").status().status == "complete"
        assert parent.status().status == "paused"
        clock.advance("2 hours")  # the child's retention has passed; the parent is paused
        store.prune()
        parent.resume()
        testing.run_until_idle()
        status = parent.status()
        assert status.status == "complete", status
        assert status.output == {"parent got": {"child": 7}}


@pytest.fixture
def waiter(registered):
    @register("rr-waiter")
    class Waiter(WorkflowEntrypoint):
        async def run(self, event, step):
            got = await step.wait_for_event("go", type="go")
            return got.payload

    return get_workflow("rr-waiter")


class OtherSession(threading.Thread):
    """Runs fn on its own connection (another database session)."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.out = fn, {}

    def run(self):
        try:
            self.out["value"] = self.fn()
        except BaseException as exc:
            self.out["error"] = exc
        finally:
            connections.close_all()

    def done_or_blocked(self, deadline=20.0):
        """Until the session has finished, or waits for a row lock (pg_stat_activity)."""
        import time

        end = time.monotonic() + deadline
        while time.monotonic() < end:
            if not self.is_alive():
                return "done"
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE pid <> pg_backend_pid() "
                    "AND datname = current_database() AND wait_event_type = 'Lock'"
                )
                if cursor.fetchone()[0]:
                    return "blocked"
            time.sleep(0.01)
        raise AssertionError("the other session neither finished nor waited for a lock")


def test_prune_does_not_delete_an_instance_restarted_while_it_prunes(waiter, monkeypatch):
    """An expired instance restarted after prune selected it, but before prune deleted it,
    is deleted while live: store.prune (engine/store/catalog.py:104) reads the expired ids
    without a row lock and delete_rows (catalog.py:114) deletes them by id without checking
    again that they are still finished and expired. restart() (store/control.py:1050-1094) locks
    the row, clears expires_at and commits in between (PostgreSQL: nothing stops it). The
    restarted, running instance vanishes with its history while restart() reported
    "running"; on SQLite prune's IMMEDIATE transaction serialises the two, so this is
    PostgreSQL only. (Either outcome is fine: the restart wins and the instance stays, or
    prune wins and the restart finds no instance.)"""
    if connection.vendor != "postgresql":
        pytest.skip("SQLite serialises writers: prune holds the write lock from BEGIN")
    from workflows_app.engine.errors import InstanceNotFound
    from workflows_app.engine.store import catalog

    with testing.fake_clock(START) as clock:
        inst = waiter.create(id="w", retention="1 hour")
        testing.run_until_idle()
        inst.send_event("go", 1)
        testing.run_until_idle()
        assert inst.status().status == "complete"
        clock.advance("2 hours")

        real_delete_rows = catalog.delete_rows
        session = OtherSession(lambda: waiter.get("w").restart())

        def restart_then_delete(pks):
            # Another session restarts the instance between prune's SELECT and its DELETE.
            session.start()
            session.done_or_blocked()
            return real_delete_rows(pks)

        monkeypatch.setattr(catalog, "delete_rows", restart_then_delete)
        store.prune()
        monkeypatch.undo()
        session.join(30)
        exists = Instance.objects.filter(workflow="rr-waiter", instance_id="w").exists()
        if "error" in session.out:
            assert isinstance(session.out["error"], InstanceNotFound), session.out["error"]
            assert not exists
        else:
            assert session.out["value"] == "running"
            assert exists, "prune deleted an instance that a restart had made live again"


# --- admin delete ----------------------------------------------------------------------------


def test_admin_delete_takes_the_spans_stored_before_the_instance_with_it(waiter, admin_client):
    """The admin's delete of a finished instance goes through Django's own obj.delete()
    (InstanceAdmin overrides neither delete_model nor delete_queryset, workflows_app/admin.py
    lines 381-393), not store.delete_rows (engine/store/catalog.py:114): the spans stored before
    their instance was known (instance NULL, found by trace id) stay behind as orphans that
    nothing ever deletes, and no "deleted" live update is sent. client.delete() and prune
    take them (tests/test_operating.py covers that path)."""
    from django.urls import reverse

    from workflows_app.models import Span

    inst = waiter.create(id="w")
    testing.run_until_idle()
    inst.send_event("go", 1)
    testing.run_until_idle()
    row = inst.row()
    when = datetime(2026, 1, 1, tzinfo=UTC)
    Span.objects.create(
        trace_id=row.trace_id,
        start_time=when,
        end_time=when,
        span_id="1" * 16,
        name="create rr-waiter",
        kind="PRODUCER",
    )
    response = admin_client.post(
        reverse("admin:workflows_app_instance_delete", args=[row.pk]), {"post": "yes"}
    )
    assert response.status_code == 302
    assert not Instance.objects.filter(pk=row.pk).exists()
    assert not Span.objects.filter(trace_id=row.trace_id).exists(), "orphan spans left behind"


# --- django.tasks backend --------------------------------------------------------------------


@pytest.fixture
def rtasks(registered):
    from tests import review_task_functions

    return review_task_functions


def test_a_task_s_context_says_attempt_1_and_started_during_its_first_attempt(rtasks):
    """Django's contract (and its ImmediateBackend): while a task runs, its context's
    task_result has started_at set and attempts == 1 on the first attempt (worker_ids
    holds the worker running it). wfdash builds the context from get_result before the
    step has a record (workflows_app/tasks.py:100 -> get_result, tasks.py:205-213): step is
    None, so worker_ids is [] (tasks.py:213 `if step`) and started_at is None:
    context.attempt is 0, which breaks the usual `if context.attempt > 1:` retry logic."""
    from workflows_app.tasks import TaskResultStatus

    result = rtasks.attempt_info.enqueue()
    testing.run_until_idle()
    done = rtasks.attempt_info.get_result(result.id)
    assert done.status == TaskResultStatus.SUCCESSFUL
    assert done.return_value == {"attempt": 1, "started": True, "status": "RUNNING"}


def test_a_task_with_run_after_that_ran_once_counts_one_attempt(rtasks):
    """A task enqueued with run_after runs its function once, yet get_result reports
    attempts == 2 and the same worker twice: tasks.py:207-213 counts every run.started
    history record, including the run that only parked on the run_after sleep."""
    from datetime import timedelta

    from workflows_app.tasks import TaskResultStatus

    with testing.fake_clock(START) as clock:
        result = rtasks.echo.using(run_after=START + timedelta(hours=1)).enqueue(3)
        testing.run_until_idle()
        clock.advance("2 hours")
        testing.run_until_idle()
        done = rtasks.echo.get_result(result.id)
    assert done.status == TaskResultStatus.SUCCESSFUL and done.return_value == 3
    assert done.attempts == 1, done.worker_ids


def test_run_after_beyond_max_sleep_is_refused_at_enqueue(rtasks):
    """enqueue() accepts a run_after more than max_sleep (365 days) away (tasks.py:158-183
    never checks it); the instance is created and fails later, when a worker reaches
    step.sleep_until (tasks.py:90), with LimitExceeded: the caller's enqueue() succeeded and
    the task silently becomes FAILED. It should be refused as InvalidTask at enqueue."""
    from datetime import timedelta

    from workflows_app.tasks import InvalidTask

    with testing.fake_clock(START), pytest.raises(InvalidTask):
        rtasks.echo.using(run_after=START + timedelta(days=400)).enqueue(1)
    assert not Instance.objects.exists()


def test_a_nan_argument_is_refused_as_invalid_task(rtasks):
    """Arguments that are not JSON are refused with InvalidTask (README, test_tasks), but a
    NaN or infinite float passes the check (tasks.py:167: json.dumps allows NaN) and
    create() then raises the engine's InvalidInput instead: `except InvalidTask` misses it."""
    from workflows_app.tasks import InvalidTask

    with pytest.raises(InvalidTask):
        rtasks.echo.enqueue(float("nan"))


def test_a_span_that_ends_after_its_instance_was_deleted_is_not_kept_for_ever(waiter):
    """A span of an instance that is flushed after the instance was deleted (terminate a
    running instance, then delete it at once: the cancelled run's spans end and are
    flushed by the worker afterwards) is stored with instance NULL
    (workflows_app/tracing.py:257-262, "NULL if it was deleted meanwhile") and its trace
    id. delete_rows (engine/store/catalog.py:114) only removes such spans at delete time,
    and nothing else ever deletes them: orphan spans accumulate for ever. Simulated here
    by a span of the instance's trace that ends after the delete, then a flush. Prune now
    deletes spans with no instance a day old (store.catalog.ORPHAN_SPAN_AGE)."""
    from workflows_app import tracing
    from workflows_app.engine import spans
    from workflows_app.models import Span

    inst = waiter.create(id="w")
    testing.run_until_idle()
    inst.terminate()
    row = inst.row()
    tracing.flush_spans()
    inst.delete()
    # The cancelled run's span ends now, after the delete, and the worker flushes it.
    spans.creation_span(row.trace_id, row.pk, "rr-waiter", "w")
    tracing.flush_spans()
    orphans = Span.objects.filter(trace_id=row.trace_id)
    assert orphans.filter(instance__isnull=True).count() == 1  # shown nowhere
    store.prune(clock.now() + timedelta(hours=23))
    assert orphans.exists()  # a span with no instance yet may be one not committed yet
    store.prune(clock.now() + timedelta(days=1, minutes=1))
    assert not orphans.exists(), "orphan span kept"
