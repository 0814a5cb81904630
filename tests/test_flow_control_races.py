"""Pause, resume and admission racing other writers, made deterministic on PostgreSQL (one
thread holds a row or lock, the other is seen waiting for it), and admission's reads at
scale (each test failed before its fix)."""

from __future__ import annotations

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
