"""Subscriptions: inst.subscribe(cursor) / asubscribe yield history from the cursor, then
live records as they are written, and end after a finished instance's last record."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.db import connection, transaction

from workflows_app import live, testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, register, store
from workflows_app.engine.errors import InvalidInput
from workflows_app.engine.store.subscriptions import history_listener
from workflows_app.models import HistorySubscriber

pytestmark = pytest.mark.django_db(transaction=True)
SIGNAL_TIMEOUT = 20  # seconds: a bound on waiting for a completion signal, not a sleep


@pytest.fixture
def approval(registered: list[str]) -> Any:
    @register("sub-approval")
    class SubApproval(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            await step.do("prepare", lambda: "ready")
            got = await step.wait_for_event("approval", type="approve")
            return {"ok": got.payload}

    return get_workflow("sub-approval")


class Collector(threading.Thread):
    """Iterates a subscription in its own thread, as a caller blocked on it would."""

    def __init__(self, subscription: Any, until: int) -> None:
        super().__init__(daemon=True)
        self.subscription = subscription
        self.until = until  # signal once this many records have arrived
        self.records: list[Any] = []
        self.reached = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for record in self.subscription:
                self.records.append(record)
                if len(self.records) >= self.until:
                    self.reached.set()
        except BaseException as exc:  # shown by the test
            self.error = exc
        finally:
            self.reached.set()
            from django.db import connections

            connections.close_all()


def test_subscribe_yields_history_then_live_records_and_ends_when_the_instance_finishes(
    approval,
):
    inst = approval.create(id="s1")
    testing.run_until_idle()  # prepared, now waiting for the event
    before = len(inst.history())
    collector = Collector(inst.subscribe(cursor=0), until=before)
    collector.start()
    assert collector.reached.wait(SIGNAL_TIMEOUT)
    assert [r.sequence for r in collector.records] == list(range(1, before + 1))
    assert collector.is_alive()  # the instance is waiting: the subscription waits too

    inst.send_event("approve", {"by": "ann"})
    testing.run_until_idle()
    collector.join(SIGNAL_TIMEOUT)
    assert not collector.is_alive() and collector.error is None
    history = inst.history()
    assert [(r.sequence, r.type, r.data) for r in collector.records] == [
        (h.sequence, h.type, h.data) for h in history
    ]
    assert collector.records[-1].type == "instance.completed"
    assert HistorySubscriber.objects.count() == 0  # the row (PostgreSQL) went with it


def test_a_cursor_skips_what_was_seen_and_a_finished_instance_ends_at_once(approval):
    inst = approval.create(id="s2")
    testing.run_until_idle()
    inst.send_event("approve", True)
    testing.run_until_idle()
    history = inst.history()
    assert [r.sequence for r in inst.subscribe(cursor=3)] == [h.sequence for h in history[3:]]
    assert list(inst.subscribe(cursor=history[-1].sequence)) == []


def test_a_caller_that_stops_early_leaves_nothing_behind(approval):
    inst = approval.create(id="s3")
    testing.run_until_idle()
    subscription = inst.subscribe()
    first = next(subscription)
    assert first.sequence == 1
    subscription.close()
    assert HistorySubscriber.objects.count() == 0
    assert len(live.result_waiters) == 0


@pytest.mark.parametrize("cursor", [-1, "3", 1.5, True, 2**63])
def test_a_bad_cursor_is_refused(approval, cursor):
    inst = approval.create(id="s4")
    with pytest.raises(InvalidInput, match="cursor must be a history sequence"):
        next(inst.subscribe(cursor=cursor))


async def test_asubscribe_waits_without_a_thread_and_wakes_on_new_records(approval):
    inst = await sync_to_async(approval.create)(id="s5")
    await sync_to_async(testing.run_until_idle)()
    before = len(await inst.ahistory())
    seen: list[Any] = []
    subscription = inst.asubscribe(cursor=0)
    async for record in subscription:
        seen.append(record)
        if len(seen) == before:
            # Caught up: the next record comes from an event sent now, while it waits.
            await sync_to_async(inst.send_event)("approve", "yes")
            await sync_to_async(testing.run_until_idle)()
    assert [r.sequence for r in seen] == [h.sequence for h in await inst.ahistory()]
    assert seen[-1].type == "instance.completed"


@pytest.mark.skipif(
    connection.vendor != "postgresql", reason="NOTIFY is PostgreSQL's; SQLite subscribers poll"
)
def test_postgresql_notifies_history_of_watched_instances_only(approval):
    watched = approval.create(id="watched").row()
    unwatched = approval.create(id="unwatched").row()
    HistorySubscriber.objects.create(instance_id=watched.pk, expires_at="2100-01-01T00:00:00Z")
    heard: list[int] = []
    arrived = threading.Event()

    def wake(pk: int) -> None:
        heard.append(pk)
        arrived.set()

    try:
        assert history_listener.ensure_started(wake)
        for row in (unwatched, watched):  # committed in this order, heard in this order
            with transaction.atomic():
                store.append_history(row.pk, [store.History("test.note", {"n": 1})])
        assert arrived.wait(SIGNAL_TIMEOUT)
        assert heard == [watched.pk]
    finally:
        history_listener.ensure_started(live.result_waiters.wake)
