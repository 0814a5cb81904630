"""Control operations racing a running run: a cancel that compensates, a pause of the head
of a queue a finish admits (each test failed before its fix)."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter

import pytest

from tests.engine_thread import run_engine_in_background
from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, register, store
from workflows_app.models import Instance

pytestmark = pytest.mark.django_db(transaction=True)

effects: Counter[str] = Counter()
LIVE = {"queued", "running", "paused", "waiting", "waitingForPause", "compensating", "unknown"}


@pytest.fixture(autouse=True)
def _reset_effects():
    effects.clear()


def test_a_child_started_by_a_run_a_cancel_with_compensation_overtook_is_not_left_running(
    registered, monkeypatch
):
    """SPEC §8: cancelling a parent terminates its unfinished children. The run's start_child
    is not fenced by its lease; it only refuses a parent that is *finished*. A
    cancel(compensate=True) that commits between the run's last checkpoint and its
    start_child leaves the parent `compensating`, so the child is created anyway, after
    cancel's _terminate_children looked: the parent ends terminated, the child lives on.
    (A plain terminate in the same place is refused: test_children's
    test_a_parent_that_ended_while_its_step_ran_starts_no_orphan_child.)"""

    @register("rc-audit")
    class Audit(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.sleep("long", "1 day")
            return "audited"

    @register("rc-saga")
    class Saga(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do(
                "charge", lambda: "charged", compensate=lambda out: effects.update(["refund"])
            )
            await step.start("audit", "rc-audit")
            return "done"

    parent = get_workflow("rc-saga").create(id="rc-p")
    real_start_child = store.start_child

    def cancel_commits_first(*args, **kwargs):
        # The operator's cancel commits just before the run's start_child transaction
        # (the "charge" checkpoint has landed: the run settles before starting a child).
        if not effects["cancelled"]:
            effects["cancelled"] += 1
            assert parent.cancel(compensate=True) == "compensating"
        return real_start_child(*args, **kwargs)

    monkeypatch.setattr(store, "start_child", cancel_commits_first)
    with testing.fake_clock():
        testing.run_until_idle()
    assert effects["cancelled"] == 1
    assert parent.status().status == "terminated"
    assert effects["refund"] == 1
    children = Instance.objects.filter(parent_id=parent.row().pk)
    live = [(c.instance_id, c.status) for c in children if c.status in LIVE]
    assert live == [], f"children of a cancelled parent left running: {live}"


def test_cancel_with_compensation_stops_the_running_step_or_compensates_it(registered):
    """cancel(compensate=True) tells the workers "wake", not "cancel" (client.py cancel), so
    the run whose step is running is not aborted: the step goes on and its side effect
    happens after the cancel, its checkpoint is then refused (lease gone), and the
    compensation run undoes only the steps checkpointed complete: that effect is never
    undone. terminate() in the same place cancels the running async step."""
    started, release, step_cancelled = threading.Event(), threading.Event(), threading.Event()

    async def ship():
        started.set()
        try:
            while not release.is_set():
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            step_cancelled.set()
            raise
        effects["shipped"] += 1
        return "shipped"

    @register("rc-cancel-running")
    class Saga(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do(
                "charge", lambda: "charged", compensate=lambda out: effects.update(["refund"])
            )
            await step.do("ship", ship, compensate=lambda out: effects.update(["unship"]))
            return "done"

    inst = get_workflow("rc-cancel-running").create()
    thread, box = run_engine_in_background()
    assert started.wait(10)
    assert inst.cancel(compensate=True) == "compensating"
    step_cancelled.wait(5)  # a terminate's abort cancels it within milliseconds
    release.set()
    thread.join(40)
    assert not thread.is_alive() and "error" not in box, box
    assert inst.status().status == "terminated"
    assert effects["refund"] == 1
    # Every effect that happened is undone: ship was either cancelled or compensated.
    assert effects["shipped"] == effects["unship"], dict(effects)


def test_a_queued_instance_paused_while_a_finish_admits_it_does_not_take_the_free_place(
    registered,
):
    """PostgreSQL. A run's finish under max_concurrent_instances promotes the queue in its
    transaction (promote_queued): it reads the queue, decides, then UPDATEs the admitted
    rows WHERE status = 'queued'. A pause of the head of the queue that commits between the
    read and the UPDATE (pause takes the row lock, not the workflow's admission lock) makes
    the UPDATE skip it, yet promote_queued appends instance.started to it and counts its
    place as taken: the next queued instance is not started although a place is free, and
    stays queued until something else looks at the queue (stuck)."""
    from django.db import connection, connections, transaction

    from tests.polling import a_backend_waits_for_a_lock, wait_until

    if connection.vendor != "postgresql":
        pytest.skip("SQLite serialises the pause and the finish's promotion")

    @register("rc-limited", limits={"max_concurrent_instances": 1})
    class Limited(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.do("work", lambda: event.instance_id)

    wf = get_workflow("rc-limited")
    a, b, c = (wf.create(id=name) for name in ("a", "b", "c"))
    assert [i.status().status for i in (a, b, c)] == ["running", "queued", "queued"]

    paused, commit = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def pause_b_and_hold_the_row() -> None:  # an operator's pause, its commit held back
        try:
            with transaction.atomic():
                outcome["pause"] = b.pause()
                paused.set()
                commit.wait(30)
        except BaseException as exc:
            outcome["error"] = exc
        finally:
            paused.set()
            connections.close_all()

    pauser = threading.Thread(target=pause_b_and_hold_the_row)
    pauser.start()
    assert paused.wait(30) and "error" not in outcome, outcome
    engine, box = run_engine_in_background()  # a runs and finishes; its finish admits b
    try:
        wait_until(a_backend_waits_for_a_lock, 30, "the finish's promotion waiting for b's row")
    finally:
        commit.set()
        pauser.join(30)
        engine.join(40)
    assert outcome.get("pause") == "paused" and "error" not in box, (outcome, box)
    assert a.status().status == "complete"
    assert b.status().status == "paused"
    b_history = [h.type for h in b.history()]
    # A place is free (a finished, b paused before it ever started): c starts.
    assert c.status().status == "running" or c.status().status == "complete", (
        c.row().status,
        c.row().waiting_reason,
        b_history,
    )


def test_a_bulk_terminate_of_a_child_locks_its_parent_before_it(registered):
    """terminate_batch locked the batch's rows, then woke the parent of a child it ended
    (wake_parent's UPDATE of the parent's row): a child locked before its parent, where
    terminate(), a parent's cascade and a child's finish lock the parent first. A
    transaction holding the parent and then wanting the child (the parent's terminate)
    deadlocked with it on PostgreSQL. Here a transaction holds the parent's row; the
    batch must wait for it before it locks the child, so the child can still be locked."""
    from django.db import DatabaseError, connection, connections, transaction

    from tests.polling import a_backend_waits_for_a_lock, wait_until
    from workflows_app.engine.store.dialect import lock_rows

    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL only: SQLite locks the whole database, never a row")

    @register("lo-child")
    class Child(WorkflowEntrypoint):
        async def run(self, event, step):
            return (await step.wait_for_event("go", type="go")).payload

    @register("lo-parent")
    class Parent(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.invoke("child", "lo-child")

    parent = get_workflow("lo-parent").create(id="p")
    testing.run_until_idle()
    [child] = parent.children()
    assert (parent.status().status, child.status().status) == ("waiting", "waiting")
    parent_pk, child_pk = parent.row().pk, child.row().pk
    held, release = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def hold_the_parent() -> None:
        try:
            with transaction.atomic():
                list(lock_rows(Instance.objects.filter(id=parent_pk)).values_list("id"))
                held.set()
                release.wait(30)
        finally:
            held.set()
            connections.close_all()

    def terminate_the_child() -> None:
        try:
            with transaction.atomic():
                outcome["terminated"] = [row.pk for row in store.terminate_batch([child_pk])]
        except Exception as exc:
            outcome["error"] = exc
        finally:
            connections.close_all()

    holder, batch = (threading.Thread(target=f) for f in (hold_the_parent, terminate_the_child))
    holder.start()
    try:
        assert held.wait(30)
        batch.start()
        wait_until(
            lambda: not batch.is_alive() or a_backend_waits_for_a_lock(),
            30,
            "the batch to wait for the parent's row",
        )
        try:
            with transaction.atomic():  # the batch must not hold the child meanwhile
                Instance.objects.select_for_update(nowait=True, no_key=True).get(id=child_pk)
            child_free = True
        except DatabaseError:
            child_free = False
    finally:
        release.set()
        holder.join(30)
        batch.join(30)
    assert child_free, "the batch locked the child before the parent"
    assert outcome == {"terminated": [child_pk]}, outcome
    assert child.status().status == "terminated"
    assert Instance.objects.get(id=parent_pk).wake_at is not None  # woken to see it
