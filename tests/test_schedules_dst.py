"""Schedules across the autumn change of a time zone, whose repeated hour cronsim reads
as its first pass (each test failed before the fix in engine/cron.py)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from workflows_app import testing
from workflows_app.client import schedules
from workflows_app.engine import WorkflowEntrypoint, register
from workflows_app.models import Instance

pytestmark = pytest.mark.django_db(transaction=True)

PARIS = "Europe/Paris"
# 2026-10-25: Paris goes from CEST (+02:00) back to CET (+01:00) at 03:00 CEST = 01:00 UTC,
# so local 02:00-02:59 happens twice. A daily "30 2 * * *" fires once that day, at the first
# 02:30 (00:30 UTC), as Debian cron does and as the schedule's own fire_times says.
FIRST_0230 = datetime(2026, 10, 25, 0, 30, tzinfo=UTC)
SECOND_0210 = datetime(2026, 10, 25, 1, 10, tzinfo=UTC)  # 02:10 CET, the repeated hour
NEXT_DAY_0230 = datetime(2026, 10, 26, 1, 30, tzinfo=UTC)  # 02:30 CET on the 26th


def register_report(name: str = "report") -> None:
    @register(name)
    class Report(WorkflowEntrypoint):
        async def run(self, event, step):
            tick = event.scheduled_at
            return {"scheduled_at": tick.isoformat() if tick else None}


def started(workflow: str) -> list[Instance]:
    return list(Instance.objects.filter(workflow=workflow).order_by("scheduled_at", "id"))


def test_after_downtime_into_the_repeated_autumn_hour_the_missed_0230_tick_fires(registered):
    """SPEC §8: after downtime the most recent missed tick fires. Workers down from before
    the 02:30 CEST tick until 02:10 CET: that tick (00:30 UTC) is the most recent missed
    one, but latest_fire_time() answers the previous day's tick there (the reverse
    iteration from a fold=1 local time), which is older than next_run_at: nothing fires."""
    register_report()
    with testing.fake_clock(datetime(2026, 10, 24, 12, 0, tzinfo=UTC)) as clock:
        s = schedules.create("paris-0230", workflow="report", cron="30 2 * * *", timezone=PARIS)
        assert s.next_run_at == FIRST_0230
        clock.set(SECOND_0210)  # workers come back 40 minutes after the tick
        testing.run_until_idle()
        assert [i.scheduled_at for i in started("report")] == [FIRST_0230]


def test_resuming_in_the_repeated_autumn_hour_neither_schedules_the_past_nor_fires_a_missed_tick(
    registered,
):
    """Pause/resume contract (scheduling.py ScheduleHandle.pause): ticks missed while paused
    never fire, and resume sets the next tick after now. Resumed at 02:10 CET,
    next_fire_time() answers 00:30 UTC (the first 02:30, 40 minutes in the past): the
    schedule's next run is in the past, and the tick missed while paused fires at 01:30 UTC."""
    register_report()
    with testing.fake_clock(datetime(2026, 10, 24, 12, 0, tzinfo=UTC)) as clock:
        s = schedules.create("paris-0230", workflow="report", cron="30 2 * * *", timezone=PARIS)
        s.pause()
        clock.set(SECOND_0210)
        resumed = schedules.get("paris-0230").resume()
        nxt = resumed.next_run_at
        clock.set(datetime(2026, 10, 25, 1, 35, tzinfo=UTC))
        testing.run_until_idle()
        fired = [i.scheduled_at for i in started("report")]
        assert fired == [], f"a tick missed while paused fired (resume set next_run_at={nxt})"
        assert nxt == NEXT_DAY_0230


def test_a_schedule_created_in_the_repeated_autumn_hour_fires_no_tick_from_before_it(registered):
    """ScheduleHandle.next_runs(): 'the next fire times after now'. At 02:10 CET it lists
    00:30 UTC, already 40 minutes gone; a schedule created then gets that past next_run_at
    and fires a tick from before it existed."""
    register_report()
    with testing.fake_clock(SECOND_0210) as clock:
        s = schedules.create("paris-0230", workflow="report", cron="30 2 * * *", timezone=PARIS)
        runs = s.next_runs(1)
        clock.set(datetime(2026, 10, 25, 1, 35, tzinfo=UTC))
        testing.run_until_idle()
        fired = [i.scheduled_at for i in started("report")]
        assert fired == [], f"a tick from before the schedule existed fired: {fired}"
        assert runs == [NEXT_DAY_0230], f"next_runs(1) at {SECOND_0210} lists {runs}"


def test_fire_due_never_answers_a_next_tick_in_the_past(registered):
    """The serving loop waits until fire_due's next tick; one in the past that does not fire
    makes the wait CONTENDED_WAIT_SECONDS (0.02 s): the worker polls the schedules table
    ~50 times a second. At 02:10 CET after downtime, next_run_at (00:30 UTC) is due but
    fire_tick refuses it (see the downtime test), and fire_due answers it as the next tick."""
    from workflows_app.client import get_workflow
    from workflows_app.engine import store

    register_report()
    targets = [store.schedules.Target("report", 1, get_workflow("report").definition().limits())]
    with testing.fake_clock(datetime(2026, 10, 24, 12, 0, tzinfo=UTC)) as clock:
        schedules.create("paris-0230", workflow="report", cron="30 2 * * *", timezone=PARIS)
        clock.set(SECOND_0210)
        fired, next_tick = store.schedules.fire_due(targets)
        assert fired or next_tick > SECOND_0210, (
            f"nothing fired and the next tick {next_tick} is already past: the worker spins"
        )
