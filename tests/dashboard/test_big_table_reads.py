"""The dashboard's reads over the whole instance table stay bounded on a big table: the
live overview re-reads its counts as seldom as their cost asks and in one read for every
changed workflow. Figures at 1.07M instances are in the commits that made each change."""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import UTC, datetime

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from workflows_app import dashboard, fanout
from workflows_app.models import Instance

pytestmark = pytest.mark.django_db(transaction=True)

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def instance(workflow: str, instance_id: str, **fields) -> Instance:
    fields = {"version": 1, "created_at": NOW, "updated_at": NOW, **fields}
    return Instance.objects.create(workflow=workflow, instance_id=instance_id, **fields)


def test_the_overview_reads_every_changed_workflow_in_one_read_not_one_per_workflow():
    # It read each changed workflow's counts on its own: with a fleet busy in eight
    # workflows, eight reads of the instance table per window instead of one.
    names = {f"wf-{n}" for n in range(8)}
    for name in names:
        instance(name, "done", status="complete", finished_at=NOW)
        instance(name, "failed", status="errored", finished_at=NOW)
        instance(name, "going", status="running")
    instance("unchanged", "x", status="running")
    with CaptureQueriesContext(connection) as queries:
        read = fanout.read_workflow_summaries(names)
    assert len(queries.captured_queries) == 3, [q["sql"] for q in queries.captured_queries]
    assert sorted(s["name"] for s in read) == sorted(names)  # the unchanged one not among them
    apart = {s.name: s.as_json() for n in names for s in dashboard.workflow_summaries(only=n)}
    assert {s["name"]: s for s in read} == apart
    assert read[0]["counts"] == {"complete": 1, "errored": 1, "running": 1}


async def test_the_overview_reads_again_no_sooner_than_its_last_read_cost_asks(monkeypatch):
    # A read that took `spent` spaces the next one by BUSY_FACTOR * spent (up to
    # MAX_OVERVIEW_WINDOW_SECONDS): re-read every OVERVIEW_WINDOW_SECONDS whatever it cost,
    # the counts of 1M instances (287-480 ms a read) kept one open overview on a core.
    monkeypatch.setattr(fanout, "BUSY_FACTOR", 5.0)
    monkeypatch.setattr(fanout, "OVERVIEW_WINDOW_SECONDS", 0.05)
    monkeypatch.setattr(fanout, "MAX_OVERVIEW_WINDOW_SECONDS", 10.0, raising=False)
    starts: list[float] = []
    read_twice = threading.Event()

    def slow_read(names):
        starts.append(time.monotonic())
        time.sleep(0.1)  # what the read costs: the next one waits 5 x 0.1 s or more
        if len(starts) == 2:
            read_twice.set()
        return []

    monkeypatch.setattr(fanout, "read_workflow_summaries", slow_read)
    hub = fanout.Hub()
    hub.streams[fanout.OVERVIEW_STREAM] = set()
    flushing = asyncio.ensure_future(hub.flush_workflows())
    try:
        for _ in range(2):
            hub.dirty_workflows.add("a")
            hub.workflows_changed.set()
            while hub.dirty_workflows:
                await asyncio.sleep(0.01)
        assert await asyncio.to_thread(read_twice.wait, 10)
        # The hub times a read from before its thread starts: a read whose thread started
        # d late cost 0.1 + d, and the next starts 5 x (0.1 + d) after the first was asked
        # for, so at least 0.5 + 4d after it began, however loaded the machine. Without
        # the spacing, 0.15 s.
        assert starts[1] - starts[0] >= 0.49
    finally:
        flushing.cancel()
    assert fanout.overview_window(0.0) == fanout.OVERVIEW_WINDOW_SECONDS
    assert fanout.overview_window(10.0) == fanout.MAX_OVERVIEW_WINDOW_SECONDS


async def test_the_overview_reads_a_card_again_for_a_change_of_status_not_for_every_step():
    # Every change of an instance (a step bumps updated_at) marked its workflow's card to
    # be read again: a fleet of running instances taking steps recounted their workflows
    # every window. The card counts statuses and the hour's finishes: only those count.
    from datetime import timedelta

    from channels.db import database_sync_to_async

    row = await database_sync_to_async(instance)("busy", "stepping", status="running")
    hub = fanout.Hub()
    hub.streams[fanout.OVERVIEW_STREAM] = set()

    async def window(**fields) -> set[str]:
        if fields:
            await database_sync_to_async(Instance.objects.filter(pk=row.pk).update)(**fields)
        hub.mark(row.pk, None)
        await hub.flush_window()
        marked, hub.dirty_workflows = hub.dirty_workflows, set()
        return marked

    try:
        assert await window() == {"busy"}  # first seen: its card is read
        for n in range(1, 4):  # steps: the instance's row changes, its card does not
            assert await window(updated_at=NOW + timedelta(seconds=n)) == set()
        assert await window(status="waiting") == {"busy"}
        assert await window(status="complete", finished_at=NOW) == {"busy"}
        # Restarted and finished again between two reads: the hour's chart moved.
        assert await window(finished_at=NOW + timedelta(minutes=5)) == {"busy"}
    finally:
        await database_sync_to_async(fanout.close_reader_connections)()
