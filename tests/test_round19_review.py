"""Round 19 review: behaviour bugs found in this round's changes (real engine, real DB)."""

from __future__ import annotations

from datetime import UTC
from typing import Any

import pytest

from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, register
from workflows_app.engine.errors import InvalidInput

pytestmark = pytest.mark.django_db(transaction=True)


def register_versions(name: str, *versions: int) -> None:
    for version in versions:

        @register(name, version=version)
        class Flow(WorkflowEntrypoint):
            async def run(self, event: Any, step: Any, version: int = version) -> Any:
                return await step.do("v", lambda: version)


def test_a_debounce_that_would_move_a_key_onto_a_version_that_has_it_is_refused_clearly(
    registered,
):
    """A debounce moves the pending instance to the version asked for, as restart(version=)
    does; its idempotency key may be another instance's on that version. Restart refuses
    that move with a clear InvalidInput; the debounce failed on the database's constraint
    and reported, after three tries, that the instance "already exists"."""
    name = "r19-debounce-key"
    register_versions(name, 1, 2)
    wf = get_workflow(name)
    with testing.fake_clock():
        pending = wf.create(
            id="pending", version=1, idempotency_key="k", debounce_key="d", debounce="1 minute"
        )
        wf.create(id="other", version=2, idempotency_key="k")
        with pytest.raises(InvalidInput, match="idempotency key"):
            wf.create(id="next", version=2, debounce_key="d", debounce="1 minute")
        row = pending.row()
        assert (row.version, row.idempotency_key) == (1, "k")


def test_an_old_worker_leaves_the_ticks_of_a_newer_deployed_versions_schedule(registered):
    """Mid-rollout a worker of version 1 (version 2 is deployed: its catalog row is fresh)
    must not fire the declared schedule that version 2's workers own: it started the tick
    on version 1, the old code, with the new version's cron. Once version 2's workers are
    gone (a rollback: its row goes stale) the old workers fire the ticks again."""
    from datetime import datetime, timedelta

    from workflows_app.engine import registry, store
    from workflows_app.engine.store.catalog import VERSION_LIVE
    from workflows_app.models import Instance

    name = "r19-rollout-ticks"

    def register_version(version: int) -> None:
        @register(name, version=version, schedules=["0 * * * *"])
        class Hourly(WorkflowEntrypoint):
            async def run(self, event: Any, step: Any) -> Any:
                return version

    start = datetime(2027, 1, 1, 0, 30, tzinfo=UTC)
    with testing.fake_clock(start=start) as clock:
        register_version(1)
        register_version(2)
        testing.run_until_idle()  # a worker of version 2 starts
        registry.unregister(name, 2)  # this process is an old worker from now on
        clock.advance("1 hour")  # the 01:00 tick is due
        store.touch_versions([(name, 2)])  # version 2's workers are alive
        testing.run_until_idle()
        assert list(Instance.objects.filter(workflow=name).values_list("version", flat=True)) == []
        clock.advance(VERSION_LIVE + timedelta(minutes=1))  # version 2's workers are gone
        testing.run_until_idle()
        assert list(Instance.objects.filter(workflow=name).values_list("version", flat=True)) == [1]
