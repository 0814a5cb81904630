"""Declared schedules in a rolling deploy: the newest deployed version's code owns them.

Each worker syncs the schedules its newest version declares when it starts. An old
worker restarting while a rollout is under way (a crash, an autoscaler) put back the old
crons the new version had changed. The catalog's rows, kept fresh by each version's
workers, say which versions are deployed. Real engine and database, the fake clock.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest

from workflows_app import testing
from workflows_app.engine import WorkflowEntrypoint, register, registry, store
from workflows_app.engine.store.catalog import VERSION_LIVE, VERSION_TOUCH
from workflows_app.engine.worker import Worker
from workflows_app.live import EngineHooks
from workflows_app.models import Schedule, WorkflowVersion

pytestmark = pytest.mark.django_db(transaction=True)

NAME = "rollout-report"
OLD_CRON, NEW_CRON = "0 3 * * *", "30 4 * * *"


def register_version(version: int, cron: str) -> None:
    @register(NAME, version=version, schedules=[cron])
    class Report(WorkflowEntrypoint):
        async def run(self, event: Any, step: Any) -> Any:
            return version


def crons() -> list[str]:
    return list(
        Schedule.objects.filter(workflow=NAME, declared=True).values_list("cron", flat=True)
    )


@pytest.fixture
def rolled_out(registered: list[str]) -> Any:
    """Version 1's workers ran, then version 2's; this process now holds version 1 only,
    as an old worker of the rollout does."""
    with testing.fake_clock() as clock:
        register_version(1, OLD_CRON)
        testing.run_until_idle()  # a worker of version 1 starts
        assert crons() == [OLD_CRON]
        register_version(2, "30 4 * * *")
        testing.run_until_idle()  # a worker of version 2 starts
        assert crons() == [NEW_CRON]
        registry.unregister(NAME, 2)
        yield clock


def test_an_old_worker_starting_mid_rollout_leaves_the_new_versions_crons(rolled_out):
    testing.run_until_idle()  # an old worker restarts while version 2's run
    assert crons() == [NEW_CRON]


def test_after_a_rollback_the_old_versions_crons_come_back(rolled_out):
    """Version 2's workers are gone: its catalog row is no longer kept fresh."""
    rolled_out.advance(VERSION_LIVE + timedelta(minutes=1))
    testing.run_until_idle()
    assert crons() == [OLD_CRON]


def test_a_serving_worker_keeps_its_versions_fresh_and_syncs_again(registered):
    """keep_catalog_once, every VERSION_TOUCH of the serve loop: the row's last_seen_at
    moves on (other workers see the version as deployed), and the declarations are synced
    again (a rollback's old workers take the schedules back without a restart)."""
    with testing.fake_clock() as clock:
        register_version(1, OLD_CRON)

        async def serve_a_while() -> list[Any]:
            worker = Worker(worker_id="keeper", hooks=EngineHooks())
            await worker.start()
            try:
                seen = [await worker.db(last_seen)]
                await worker.db(
                    lambda: Schedule.objects.filter(workflow=NAME).update(cron="*/5 * * * *")
                )
                await worker.keep_catalog_once()  # not due yet: nothing happens
                seen.append(await worker.db(last_seen))
                changed = await worker.db(crons)  # its threads: closed when it stops
                clock.advance(VERSION_TOUCH)
                await worker.keep_catalog_once()
                seen.append(await worker.db(last_seen))
                return [seen, changed, await worker.db(crons)]
            finally:
                await worker.stop(grace_seconds=0)

        def last_seen() -> Any:
            return WorkflowVersion.objects.get(name=NAME, version=1).last_seen_at

        (first, untouched, touched), before, after = asyncio.run(serve_a_while())
        assert untouched == first and touched == first + VERSION_TOUCH
        assert before == ["*/5 * * * *"] and after == [OLD_CRON]


def test_touching_versions_names_each_one_exactly(registered):
    register_version(1, OLD_CRON)
    register_version(2, NEW_CRON)
    testing.run_until_idle()
    with testing.fake_clock() as clock:
        clock.advance(timedelta(hours=1))
        store.touch_versions([(NAME, 2)])
        seen = dict(
            WorkflowVersion.objects.filter(name=NAME).values_list("version", "last_seen_at")
        )
        assert seen[2] == clock.now() and seen[1] < clock.now()
