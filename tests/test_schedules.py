"""Cron schedules: declared and runtime, fired by the engine clock once per tick."""

from __future__ import annotations

import asyncio
import threading
from datetime import UTC, datetime, timedelta

import pytest
from django.db import connection, connections

from tests import fleet_workflows  # noqa: F401  (registers fleet-sleeper)
from tests.polling import a_backend_waits_for_a_lock, wait_until
from tests.test_worker_operations import LoopThread
from workflows_app import testing
from workflows_app.client import get_workflow, schedules
from workflows_app.engine import WorkflowEntrypoint, register, store
from workflows_app.engine.errors import (
    InvalidInput,
    ScheduleExists,
    ScheduleNotFound,
    UnknownWorkflow,
)
from workflows_app.engine.worker import Worker
from workflows_app.live import EngineHooks
from workflows_app.models import Instance, Schedule

pytestmark = pytest.mark.django_db(transaction=True)

START = datetime(2026, 6, 1, 2, 50, tzinfo=UTC)


def register_report(name: str = "report", schedules_: list[str] | None = None) -> None:
    @register(name, schedules=schedules_)
    class Report(WorkflowEntrypoint):
        async def run(self, event, step):
            tick = event.scheduled_at
            return {
                "scheduled_at": tick.isoformat() if tick else None,
                "aware": tick is not None and tick.tzinfo is not None,
                "params": event.payload,
            }


def started(workflow: str) -> list[Instance]:
    return list(Instance.objects.filter(workflow=workflow).order_by("scheduled_at", "id"))


def test_a_declared_schedule_starts_one_instance_per_tick_with_scheduled_at(registered):
    register_report("nightly", ["0 3 * * *"])
    with testing.fake_clock(START) as clock:
        testing.run_until_idle()  # a worker start declares the schedule; nothing is due yet
        assert started("nightly") == []
        [declared] = schedules.list(workflow="nightly")
        assert (declared.name, declared.cron, declared.declared) == ("nightly:0", "0 3 * * *", True)
        assert declared.next_run_at == datetime(2026, 6, 1, 3, 0, tzinfo=UTC)
        clock.advance("15 minutes")
        testing.run_until_idle()
        testing.run_until_idle()  # a second look at the same moment fires nothing more
        [instance] = started("nightly")
        assert instance.instance_id == "nightly:0@20260601T030000Z"
        assert instance.status == "complete"
        assert instance.output == {
            "scheduled_at": "2026-06-01T03:00:00+00:00",
            "aware": True,
            "params": None,
        }
        assert schedules.get("nightly:0").last_instance_id == instance.instance_id
        clock.advance("1 day")
        testing.run_until_idle()
        assert [i.scheduled_at for i in started("nightly")] == [
            datetime(2026, 6, 1, 3, 0, tzinfo=UTC),
            datetime(2026, 6, 2, 3, 0, tzinfo=UTC),
        ]


def test_an_instance_not_started_by_a_schedule_sees_scheduled_at_none(registered):
    register_report()
    inst = get_workflow("report").create()
    testing.run_until_idle()
    assert inst.status().output["scheduled_at"] is None


def test_after_downtime_only_the_latest_missed_tick_fires(registered):
    register_report()
    with testing.fake_clock(START) as clock:
        schedules.create("every-5", workflow="report", cron="*/5 * * * *")
        clock.advance("3 hours")  # 36 ticks passed while no worker ran
        testing.run_until_idle()
        [instance] = started("report")
        assert instance.scheduled_at == datetime(2026, 6, 1, 5, 50, tzinfo=UTC)
        assert schedules.get("every-5").next_run_at == datetime(2026, 6, 1, 5, 55, tzinfo=UTC)


def test_runtime_schedules_use_their_time_zone_and_params(registered):
    register_report("digest")
    with testing.fake_clock(datetime(2026, 1, 10, 12, 0, tzinfo=UTC)) as clock:
        s = schedules.create(
            "eu-digest",
            workflow="digest",
            cron="0 9 * * *",
            params={"region": "eu"},
            timezone="Europe/Paris",
        )
        assert s.next_runs(2) == [
            datetime(2026, 1, 11, 8, 0, tzinfo=UTC),  # 09:00 in Paris is 08:00 UTC in winter
            datetime(2026, 1, 12, 8, 0, tzinfo=UTC),
        ]
        clock.set(datetime(2026, 7, 1, 7, 30, tzinfo=UTC))
        assert s.next_runs(1) == [datetime(2026, 7, 1, 7, 0, tzinfo=UTC) + timedelta(days=1)]
        testing.run_until_idle()  # the latest missed tick: 09:00 in Paris is 07:00 UTC in summer
        [instance] = started("digest")
        assert instance.scheduled_at == datetime(2026, 7, 1, 7, 0, tzinfo=UTC)
        assert instance.output["params"] == {"region": "eu"}
        assert instance.schedule == "eu-digest"


def test_pause_stops_ticks_and_resume_skips_the_ones_missed(registered):
    register_report()
    with testing.fake_clock(START) as clock:
        s = schedules.create("hourly", workflow="report", cron="0 * * * *")
        paused = s.pause()
        assert paused.paused and paused.next_run_at is None
        clock.advance("2 hours")
        testing.run_until_idle()
        assert started("report") == []
        resumed = schedules.get("hourly").resume()
        assert not resumed.paused
        assert resumed.next_run_at == datetime(2026, 6, 1, 5, 0, tzinfo=UTC)
        testing.run_until_idle()
        assert started("report") == []
        clock.advance("10 minutes")
        testing.run_until_idle()
        assert [i.scheduled_at for i in started("report")] == [
            datetime(2026, 6, 1, 5, 0, tzinfo=UTC)
        ]


def test_trigger_starts_one_instance_now_and_delete_removes_the_schedule(registered):
    register_report()
    with testing.fake_clock(START):
        s = schedules.create("manual", workflow="report", cron="0 0 1 1 *", params={"n": 1})
        inst = s.trigger(actor="ops")
        assert inst.created and inst.workflow == "report"
        testing.run_until_idle()
        assert inst.status().output == {
            "scheduled_at": START.isoformat(),
            "aware": True,
            "params": {"n": 1},
        }
        assert [i.instance_id for i in s.instances()] == [inst.id]
        assert schedules.get("manual").last_instance_id == inst.id
        s.delete()
        with pytest.raises(ScheduleNotFound, match="manual"):
            schedules.get("manual")
        assert inst.status().status == "complete"  # its instances stay


def test_a_schedule_made_again_for_another_workflow_lists_only_its_own_instances(registered):
    """Names are unique among the schedules that exist, not forever: instances() filtered
    by name alone, so "shared" made again for "audit" listed the instances the deleted
    "shared" of "report" had started."""
    register_report()
    register_report("audit")
    old = schedules.create("shared", workflow="report", cron="0 0 1 1 *").trigger()
    schedules.get("shared").delete()
    again = schedules.create("shared", workflow="audit", cron="0 0 1 1 *")
    new = again.trigger()
    assert [i.instance_id for i in again.instances()] == [new.id]
    assert Instance.objects.get(workflow="report", instance_id=old.id).schedule == "shared"


def test_a_schedule_deleted_and_made_again_lists_none_of_the_old_ones_instances(registered):
    """Made again under its name for the same workflow, a schedule listed the ticks (and
    triggers) of the one deleted before it as its own: instances were matched to it by
    name and workflow alone. They stay, as instances; the new one lists its own only."""
    register_report()
    with testing.fake_clock(START) as clock:
        schedules.create("hourly", workflow="report", cron="0 * * * *")
        clock.advance("15 minutes")
        testing.run_until_idle()
        old_trigger = schedules.get("hourly").trigger()
        old_ids = {i.instance_id for i in schedules.get("hourly").instances()}
        assert old_ids == {"hourly@20260601T030000Z", old_trigger.id}
        schedules.get("hourly").delete()
        again = schedules.create("hourly", workflow="report", cron="0 * * * *")
        assert again.instances() == []
        clock.advance("1 hour")
        testing.run_until_idle()
        new = again.trigger()
        assert [i.instance_id for i in again.instances()] == [new.id, "hourly@20260601T040000Z"]
        assert [i.instance_id for i in schedules.get("hourly").instances()] == [
            new.id,
            "hourly@20260601T040000Z",
        ]
        kept = Instance.objects.filter(workflow="report", instance_id__in=old_ids)
        assert {(i.schedule, i.status) for i in kept} == {("hourly", "complete")}


def test_a_schedule_made_before_its_bound_was_stored_lists_by_name_and_workflow(registered):
    """started_above_pk NULL (a schedule made before migration 0033, or by a process of
    the release before it): its instances are matched by name and workflow, as before;
    an upgrade hides none."""
    register_report()
    old = schedules.create("legacy", workflow="report", cron="0 0 1 1 *").trigger()
    Schedule.objects.filter(name="legacy").update(started_above_pk=None)
    legacy = schedules.get("legacy")
    assert legacy.started_above_pk is None
    new = legacy.trigger()
    assert [i.instance_id for i in legacy.instances()] == [new.id, old.id]


def test_a_trigger_racing_a_delete_and_a_create_is_not_the_new_schedules(registered, monkeypatch):
    """trigger() read the schedule unlocked: a delete and a create of its name by another
    process while it created its instance left that instance above the new schedule's
    started_above_pk, listed as the new one's. Now the delete waits for the trigger
    (seen waiting for its lock in pg_stat_activity), and the new schedule's bound is
    above the instance."""
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL only: SQLite serialises writers for the whole database")
    register_report()
    schedules.create("raced", workflow="report", cron="0 0 1 1 *")
    remade = threading.Event()

    def delete_and_create() -> None:
        try:
            schedules.get("raced").delete()
            schedules.create("raced", workflow="report", cron="0 0 1 1 *")
            remade.set()
        finally:
            connections.close_all()

    racer = threading.Thread(target=delete_and_create)
    real_create = store.schedules.create_in_transaction

    def create_while_racing(*args, **kwargs):
        racer.start()
        wait_until(
            lambda: remade.is_set() or a_backend_waits_for_a_lock(),
            30,
            "the delete and create to finish, or to wait for the trigger's lock",
        )
        return real_create(*args, **kwargs)

    monkeypatch.setattr(store.schedules, "create_in_transaction", create_while_racing)
    triggered = schedules.get("raced").trigger()
    racer.join(30)
    assert remade.is_set()
    again = schedules.get("raced")
    assert again.instances() == []
    assert Instance.objects.get(instance_id=triggered.id).schedule == "raced"


def test_a_tick_the_deleted_schedule_of_its_name_started_is_not_its_last_instance(registered):
    """Clocks apart (a worker's ahead of the web process's): the deleted schedule fired
    03:00, the one made again under its name then had 03:00 as its next tick, whose
    instance id was taken. The tick starts nothing (its id is its fleet-wide key), and
    the new schedule's last_instance_id named the old one's instance: the API, the
    command and the dashboard's list showed it as the new schedule's last run."""
    from workflows_app import dashboard

    register_report()
    with testing.fake_clock(START) as clock:
        schedules.create("skewed", workflow="report", cron="0 * * * *")
        clock.advance("15 minutes")
        testing.run_until_idle()
        [old] = started("report")
        schedules.get("skewed").delete()
        clock.set(START + timedelta(minutes=5))  # 02:55 by the clock that makes it again
        schedules.create("skewed", workflow="report", cron="0 * * * *")
        clock.advance("10 minutes")
        testing.run_until_idle()
        again = schedules.get("skewed")
        assert started("report") == [old]
        assert again.next_run_at == datetime(2026, 6, 1, 4, 0, tzinfo=UTC)
        assert (again.last_instance_id, again.instances()) == ("", [])
        [row] = dashboard.schedule_rows(workflow="report")
        assert row.last_instance is None


def test_a_declared_schedule_keeps_its_instances_through_each_sync_of_its_declaration(
    registered,
):
    """A declared schedule is its declaration (workflow and position): a worker's sync at
    a redeploy, a changed cron, or a deploy that dropped it and a rollback that brought it
    back leave the instances it started listed under it."""
    register_report("nightly", ["0 3 * * *"])
    with testing.fake_clock(START) as clock:
        testing.run_until_idle()  # a worker's start declares it
        clock.advance("15 minutes")
        testing.run_until_idle()
        first = ["nightly:0@20260601T030000Z"]
        assert [i.instance_id for i in schedules.get("nightly:0").instances()] == first
        testing.run_until_idle()  # a redeploy: another worker starts and syncs
        store.schedules.sync_declared([("nightly", 1, ["30 4 * * *"])])  # the cron changed
        assert [i.instance_id for i in schedules.get("nightly:0").instances()] == first
        store.schedules.sync_declared([("nightly", 1, [])])  # a deploy without it
        assert not Schedule.objects.filter(name="nightly:0").exists()
        store.schedules.sync_declared([("nightly", 1, ["0 3 * * *"])])  # rolled back
        assert [i.instance_id for i in schedules.get("nightly:0").instances()] == first


def test_a_runtime_schedule_made_after_a_declared_one_of_its_name_lists_its_own_only(
    registered,
):
    """A deploy dropped the declaration "report:0"; a runtime schedule then took the name
    for the same workflow: the declared one's ticks are not its."""
    register_report("report", ["0 3 * * *"])
    with testing.fake_clock(START) as clock:
        testing.run_until_idle()
        clock.advance("15 minutes")
        testing.run_until_idle()
        assert Instance.objects.filter(schedule="report:0").count() == 1
        store.schedules.sync_declared([("report", 1, [])])
        runtime = schedules.create("report:0", workflow="report", cron="0 0 1 1 *")
        assert runtime.instances() == []
        new = runtime.trigger()
        assert [i.instance_id for i in runtime.instances()] == [new.id]


def register_short_ids(version: int, max_length: int) -> None:
    @register("short-ids", version=version, limits={"max_instance_id_length": max_length})
    class ShortIds(WorkflowEntrypoint):
        async def run(self, event, step):
            return version


def test_a_tick_s_instance_id_holds_to_max_instance_id_length(registered, caplog):
    """The digest form of a tick's id is 29 characters: under a lower max_instance_id_length
    it was stored anyway, where a create (even of an id it makes up) is held to the limit.
    Now a schedule that cannot fit its ticks' ids is refused, and a tick whose id a limit
    lowered since cannot hold is skipped, saying so, like one whose params break a limit."""
    from workflows_app.engine.errors import LimitExceeded

    register_short_ids(1, 29)
    with testing.fake_clock(START) as clock:
        long_name = "n" * 80  # its readable id (97 characters) does not fit: the digest does
        schedules.create(long_name, workflow="short-ids", cron="0 3 * * *")
        clock.advance("15 minutes")
        testing.run_until_idle()
        [fired] = started("short-ids")
        assert len(fired.instance_id) == 29 and fired.scheduled_at is not None
        register_short_ids(2, 20)
        with pytest.raises(LimitExceeded, match="max_instance_id_length is 20, got 29"):
            schedules.create("short", workflow="short-ids", cron="0 3 * * *")
        with pytest.raises(LimitExceeded, match="max_instance_id_length is 20, got 36"):
            schedules.get(long_name).trigger()  # its uuid, as a create's made-up id
        clock.advance("1 day")
        testing.run_until_idle()
        assert [i.instance_id for i in started("short-ids")] == [fired.instance_id]
        assert "max_instance_id_length is 20, got 29" in caplog.text
        assert schedules.get(long_name).next_run_at == datetime(2026, 6, 3, 3, 0, tzinfo=UTC)
    with pytest.raises(InvalidInput, match="max_instance_id_length of at least 29"):

        @register("short-declared", limits={"max_instance_id_length": 28}, schedules=["0 3 * * *"])
        class ShortDeclared(WorkflowEntrypoint):
            async def run(self, event, step):
                return None


def test_create_refuses_a_taken_name_bad_cron_bad_zone_and_unknown_workflow(registered):
    register_report()
    schedules.create("taken", workflow="report", cron="* * * * *")
    with pytest.raises(ScheduleExists, match="taken"):
        schedules.create("taken", workflow="report", cron="0 * * * *")
    with pytest.raises(InvalidInput, match=r"'61 \* \* \* \*' does not parse"):
        schedules.create("bad-cron", workflow="report", cron="61 * * * *")
    with pytest.raises(InvalidInput, match="'every day' does not parse"):
        schedules.create("bad-cron", workflow="report", cron="every day")
    with pytest.raises(InvalidInput, match="Mars/Olympus"):
        schedules.create("bad-zone", workflow="report", cron="* * * * *", timezone="Mars/Olympus")
    with pytest.raises(UnknownWorkflow):
        schedules.create("nobody", workflow="no-such-workflow", cron="* * * * *")
    with pytest.raises(InvalidInput, match="schedule name"):
        schedules.create("has space", workflow="report", cron="* * * * *")
    with pytest.raises(InvalidInput, match="JSON"):
        schedules.create("bad-params", workflow="report", cron="* * * * *", params={1, 2})
    with pytest.raises(InvalidInput, match="count"):
        schedules.get("taken").next_runs(0)
    # Unchecked, -1 was a ValueError from the ORM and None read every instance it started.
    for limit in (-1, 0, None, 10**6, "5"):
        with pytest.raises(InvalidInput, match="limit"):
            schedules.get("taken").instances(limit)
    assert [s.name for s in schedules.list()] == ["taken"]


def test_register_refuses_an_unparseable_declared_cron(registered):
    with pytest.raises(InvalidInput, match="'0 3 \\* \\*' does not parse"):
        register_report("broken", ["0 3 * *"])


def test_register_refuses_a_declared_cron_listed_twice(registered):
    with pytest.raises(InvalidInput, match=r"'0 3 \* \* \*' twice"):
        register_report("doubled", ["0 3 * * *", "*/5 * * * *", "0  3 * * *"])
    register_report("distinct", ["0 3 * * *", "0 4 * * *"])
    testing.run_until_idle()
    assert {s.name for s in schedules.list() if s.workflow == "distinct"} == {
        "distinct:0",
        "distinct:1",
    }


def test_a_declared_schedule_cannot_be_deleted_but_can_be_paused(registered):
    register_report("declared", ["*/10 * * * *"])
    testing.run_until_idle()
    s = schedules.get("declared:0")
    with pytest.raises(InvalidInput, match="declared in code"):
        s.delete()
    assert s.pause().paused
    testing.run_until_idle()  # the next worker start keeps it paused
    assert schedules.get("declared:0").paused


def test_declared_schedules_follow_the_code(registered):
    register_report("evolving", ["0 3 * * *", "0 4 * * *"])
    testing.run_until_idle()
    assert [s.cron for s in schedules.list(workflow="evolving")] == ["0 3 * * *", "0 4 * * *"]
    from workflows_app.engine import registry

    registry.unregister("evolving")
    register_report("evolving", ["30 5 * * *"])
    testing.run_until_idle()
    assert [(s.name, s.cron) for s in schedules.list(workflow="evolving")] == [
        ("evolving:0", "30 5 * * *")
    ]
    registry.unregister("evolving")
    register_report("evolving", [])  # the code declares none any more: none is left
    testing.run_until_idle()
    assert schedules.list(workflow="evolving") == []


def race_to_fire(targets, racers: int) -> tuple[list[int], list[BaseException]]:
    """Call fire_due from several threads at once (each its own connection)."""
    barrier = threading.Barrier(racers)
    fired: list[int] = []
    failures: list[BaseException] = []

    def fire() -> None:
        try:
            barrier.wait(10)
            fired.extend(f.instance_pk for f in store.schedules.fire_due(targets)[0])
        except BaseException as exc:
            failures.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=fire) for _ in range(racers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return fired, failures


def test_racing_tick_firings_start_exactly_one_instance_per_tick(registered):
    """Several processes' workers looking at the same due tick at once: one instance.
    On PostgreSQL the calls really overlap (a connection per thread)."""
    register_report()
    targets = [store.schedules.Target("report", 1, get_workflow("report").definition().limits())]
    with testing.fake_clock(START) as clock:
        schedules.create("raced", workflow="report", cron="* * * * *")
        for _ in range(5):
            clock.advance("1 minute")
            fired, failures = race_to_fire(targets, racers=4)
            assert failures == []
            assert len(fired) == 1
    ticks = [i.scheduled_at for i in started("report")]
    assert len(ticks) == len(set(ticks)) == 5


def test_two_workers_serving_at_once_fire_each_tick_once(registered):
    register_report()
    with testing.fake_clock(START) as clock:
        schedules.create("two-workers", workflow="report", cron="* * * * *")
        loops = [LoopThread(), LoopThread()]
        workers = [Worker(worker_id=f"w{n}", hooks=EngineHooks()) for n in range(2)]
        stop = [asyncio.Event(), asyncio.Event()]
        serving = [lt.spawn(w.serve(s)) for lt, w, s in zip(loops, workers, stop)]
        try:
            for minute in range(1, 4):
                clock.advance("1 minute")  # both workers hear the clock move
                wait_until(
                    lambda m=minute: (
                        Instance.objects.filter(workflow="report", status="complete").count() == m
                    ),
                    20,
                    f"{minute} scheduled instance(s) complete",
                )
        finally:
            for lt, s in zip(loops, stop):
                lt.loop.call_soon_threadsafe(s.set)
            for future in serving:
                future.result(30)
            for lt in loops:
                lt.close()
    ticks = [i.scheduled_at for i in started("report")]
    assert ticks == [START + timedelta(minutes=m) for m in (1, 2, 3)]


def test_an_idle_worker_wakes_for_the_next_tick_not_its_poll_interval(registered):
    register_report()
    loop_thread = LoopThread()
    worker = Worker(worker_id="idle", hooks=EngineHooks(), poll_seconds=120)
    stop = asyncio.Event()
    serving = loop_thread.spawn(worker.serve(stop))
    try:
        schedules.create("every-second", workflow="report", cron="* * * * * *")
        wait_until(
            lambda: Instance.objects.filter(workflow="report", status="complete").exists(),
            10,
            "a tick of an every-second schedule to start and finish an instance",
        )
    finally:
        loop_thread.loop.call_soon_threadsafe(stop.set)
        serving.result(30)
        loop_thread.close()
    assert worker.next_tick is not None


@pytest.mark.skipif(connection.vendor != "postgresql", reason="fleet race needs PostgreSQL")
def test_worker_processes_on_postgresql_start_one_instance_per_tick(workers):
    schedules.create("fleet-ticks", workflow="fleet-sleeper", cron="* * * * * *", params={})
    workers(3)
    wait_until(
        lambda: Instance.objects.filter(schedule="fleet-ticks").count() >= 4,
        30,
        "four ticks of an every-second schedule",
    )
    schedules.get("fleet-ticks").pause()
    ticks = list(
        Instance.objects.filter(schedule="fleet-ticks").values_list("scheduled_at", flat=True)
    )
    assert len(ticks) == len(set(ticks))
    assert Schedule.objects.get(name="fleet-ticks").last_tick_at == max(ticks)


def test_a_re_created_schedule_never_starts_a_tick_twice(registered):
    register_report()
    with testing.fake_clock(START) as clock:
        schedules.create("again", workflow="report", cron="0 * * * *")
        clock.advance("15 minutes")
        testing.run_until_idle()
        schedules.get("again").delete()
        clock.set(START)  # a clock set back: the same tick comes due again for the new schedule
        schedules.create("again", workflow="report", cron="0 * * * *")
        clock.advance("15 minutes")
        testing.run_until_idle()
        assert [i.instance_id for i in started("report")] == ["again@20260601T030000Z"]
        assert schedules.get("again").next_run_at == datetime(2026, 6, 1, 4, 0, tzinfo=UTC)


def test_a_declared_schedule_whose_workflow_left_the_code_can_be_removed(registered):
    """A workflow class deleted from the code: sync_declared only looks at the workflows
    registered now, so its declared schedule stays (listed, not paused, overdue), and
    delete_schedule refuses it because it is declared ('remove it there, or pause it') -
    it was removed there. Nothing but SQL gets rid of it."""
    from workflows_app.engine import registry
    from workflows_app.engine.errors import InvalidInput

    @register("retired", schedules=["0 3 * * *"])
    class Retired(WorkflowEntrypoint):
        async def run(self, event, step):
            return None

    testing.run_until_idle()  # a worker start declares it
    assert [s.name for s in schedules.list()] == ["retired:0"]
    registry.unregister("retired")  # the class is deleted from the code; workers restart
    testing.run_until_idle()
    left = [s.name for s in schedules.list()]
    if left:
        try:
            schedules.get("retired:0").delete()
        except InvalidInput as exc:
            pytest.fail(f"orphan declared schedule {left} stays and cannot be deleted: {exc}")


def test_workflows_whose_names_share_a_slug_keep_a_declared_schedule_each(registered):
    """declared_name cut a workflow name to a 70-character slug: "billing/monthly" and
    "billing-monthly", or two long names alike in their first 70 characters, shared one
    schedule row, and each worker start gave it to the workflow synced last."""
    long = "com.example.billing.workflows.monthly_invoice_generation_for_enterprise_"
    names = ["billing/monthly", "billing-monthly", long + "customers", long + "partners"]
    for i, name in enumerate(names):
        register_report(name, [f"{i} 3 * * *"])
    testing.run_until_idle()
    for i, name in enumerate(names):
        [declared] = schedules.list(workflow=name)
        assert (declared.cron, declared.declared) == (f"{i} 3 * * *", True), name
        assert len(declared.name) <= 80
    assert schedules.get("billing-monthly:0").workflow == "billing-monthly"  # a slug as it is


def test_a_declared_schedule_under_its_unhashed_name_is_renamed_keeping_its_state(registered):
    """A row an earlier release made for an odd name ("nightly report:0" → "nightly-report:0")
    is renamed to the hashed name, paused state and started instances with it: not
    deleted and made again (which loses a pause and the schedule's history)."""
    with testing.fake_clock(START):
        store.schedules.create_schedule(
            "nightly-report:0",
            "nightly report",
            "0 3 * * *",
            "UTC",
            "null",
            "code",
            declared=True,
        )
        Schedule.objects.filter(name="nightly-report:0").update(paused=True, next_run_at=None)
        register_report("nightly report", ["0 3 * * *"])
        started_before = get_workflow("nightly report").create(id="from-the-old-row")
        Instance.objects.filter(pk=started_before.row().pk).update(schedule="nightly-report:0")
        testing.run_until_idle()
    [renamed] = schedules.list(workflow="nightly report")
    assert renamed.name == store.schedules.declared_name("nightly report", 0) != "nightly-report:0"
    assert renamed.paused and Schedule.objects.count() == 1
    assert [i.instance_id for i in schedules.get(renamed.name).instances()] == ["from-the-old-row"]


def test_next_runs_of_a_rare_expression_end_with_the_calendar_not_an_overflow(registered):
    """A fifth Monday in February comes about four times a century: the thousand next runs
    a caller may ask for go past the year 9999, where cronsim raised OverflowError out of
    next_runs (and any surface asking for them)."""
    register_report()
    with testing.fake_clock(START):
        s = schedules.create("leap-mondays", workflow="report", cron="0 0 * 2 1#5")
        runs = s.next_runs(1000)
    assert runs[:2] == [datetime(2044, 2, 29, tzinfo=UTC), datetime(2072, 2, 29, tzinfo=UTC)]
    assert 200 < len(runs) < 1000 and runs[-1].year == 9988
    assert runs == sorted(set(runs))


def test_a_stored_next_tick_this_process_rules_do_not_give_is_waited_out_not_rewritten(
    registered,
):
    """next_run_at is computed with the time zone rules of the process that stored it; after
    a tzdata update (a country moving or dropping its daylight-saving time), or between
    processes with different tzdata, it may not be a tick of the cron as read here.
    fire_tick neither fired nor moved it: it stayed due, fire_due answered it (in the
    past) as the next tick, and every worker polled the schedules without pause until the
    next tick came (up to a day for a daily schedule). Rewriting it by this process's
    rules would lose the tick of a process whose rules gave it: it is left as it is, and
    this process waits for its own next tick of the cron."""
    register_report()
    targets = [store.schedules.Target("report", 1, get_workflow("report").definition().limits())]
    stored = datetime(2026, 6, 1, 3, 30, tzinfo=UTC)
    with testing.fake_clock(START) as clock:
        schedules.create("hourly", workflow="report", cron="0 * * * *")
        # As rules half an hour off would have it: 03:30, not a tick of "0 * * * *" in UTC.
        Schedule.objects.filter(name="hourly").update(next_run_at=stored)
        clock.set(datetime(2026, 6, 1, 3, 31, tzinfo=UTC))
        fired, next_tick = store.schedules.fire_due(targets)
        assert fired == []  # 03:00 is before the tick the schedule waits for: not fired
        assert next_tick == datetime(2026, 6, 1, 4, 0, tzinfo=UTC)  # not 03:30, in the past
        assert schedules.get("hourly").next_run_at == stored  # another process's to fire
        clock.set(datetime(2026, 6, 1, 4, 0, tzinfo=UTC))
        testing.run_until_idle()
        assert [i.scheduled_at for i in started("report")] == [next_tick]
        assert schedules.get("hourly").next_run_at == datetime(2026, 6, 1, 5, 0, tzinfo=UTC)


def test_a_schedule_this_process_cannot_evaluate_does_not_stop_the_others(registered, caplog):
    """A zone missing from this worker's tzdata, or a cron its cronsim does not read (the
    process that stored them could): fire_tick raised out of fire_due, so every schedule
    after it in next-tick order never fired, on every worker running that code."""
    register_report()
    targets = [store.schedules.Target("report", 1, get_workflow("report").definition().limits())]
    with testing.fake_clock(START) as clock:
        schedules.create("zone-gone", workflow="report", cron="*/5 * * * *")  # due 02:55
        schedules.create("cron-gone", workflow="report", cron="*/5 * * * *")
        schedules.create("healthy", workflow="report", cron="0 3 * * *")  # due 03:00
        Schedule.objects.filter(name="zone-gone").update(timezone="Mars/Olympus")
        Schedule.objects.filter(name="cron-gone").update(cron="*/5 * * * * * *")
        clock.set(datetime(2026, 6, 1, 3, 1, tzinfo=UTC))
        fired, next_tick = store.schedules.fire_due(targets)
    assert [f.schedule for f in fired] == ["healthy"]
    assert next_tick == datetime(2026, 6, 2, 3, 0, tzinfo=UTC)  # not the unreadable 02:55
    logged = caplog.text
    assert "'zone-gone'" in logged and "'cron-gone'" in logged and "cannot be evaluated" in logged


def test_a_new_schedule_refuses_a_zone_that_is_no_place_but_a_stored_one_still_fires(
    registered,
):
    """The zone database answers "localtime" with each host's own zone (workers in
    different zones fired one schedule at different instants), "Factory" with "-00" and
    the right/ zones with leap seconds (~27 s off). A new schedule refuses them; one stored
    before (when they passed) still fires, rather than stopping at the upgrade."""
    register_report()
    for name in ("localtime", "Factory", "right/Europe/Paris"):
        with pytest.raises(InvalidInput, match=f"{name!r} is not a place's clock"):
            schedules.create("bad-zone", workflow="report", cron="0 9 * * *", timezone=name)
    targets = [store.schedules.Target("report", 1, get_workflow("report").definition().limits())]
    with testing.fake_clock(START) as clock:
        schedules.create("stored-factory", workflow="report", cron="0 3 * * *")
        Schedule.objects.filter(name="stored-factory").update(timezone="Factory")
        assert schedules.get("stored-factory").next_runs(1)
        clock.set(datetime(2026, 6, 1, 3, 1, tzinfo=UTC))
        fired, _ = store.schedules.fire_due(targets)
    assert [f.schedule for f in fired] == ["stored-factory"]
