"""The PostgreSQL fast path: one statement per checkpoint, claim and finish; wake hints
through LISTEN/NOTIFY between processes; the database's clock for leases and timers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone

import pytest
from django.db import connection, transaction
from django.db.models.signals import post_init
from django.test.utils import CaptureQueriesContext

from tests import fleet_workflows  # noqa: F401  (registers fleet-waiter)
from tests.polling import a_backend_waits_for_a_lock, wait_until
from tests.test_fleet import needs_redis, redis_url
from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, clock, register, store
from workflows_app.models import HistoryRecord, Instance, StepRecord

pytestmark = pytest.mark.django_db(transaction=True)


def postgres_only() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL only: SQLite has no LISTEN/NOTIFY and no data-modifying CTEs")


@contextlib.contextmanager
def hints_heard() -> Iterator[list[tuple[str, int | None]]]:
    """The (kind, instance pk) of each wake hint a NOTIFY listener of this database hears
    while the block runs, the listener listening before it starts."""
    heard: list[tuple[str, int | None]] = []
    listener = store.WakeListener(lambda kind, pk: heard.append((kind, pk)))
    listener.start()
    try:
        assert listener.listening.wait(10)
        yield heard
    finally:
        listener.stop()


def test_each_checkpoint_claim_and_finish_is_one_statement_and_the_history_is_whole(registered):
    postgres_only()

    @register("fast-path-steps")
    class FastPathSteps(WorkflowEntrypoint):
        async def run(self, event, step):
            total = 0
            for n in range(5):
                total += await step.do(f"add {n}", lambda n=n: n)
            return total

    inst = get_workflow("fast-path-steps").create(id="one-statement")
    with testing.QueryCounter() as queries:
        testing.run_until_idle()
    assert inst.status().output == 10
    statements = queries.statements
    # Four checkpoints, each one statement; the fifth, the step the workflow ended right
    # after, goes in the finish's one statement; claims one statement each.
    assert sum(sql.startswith("WITH fence AS") for sql in statements) == 4
    (finish,) = [sql for sql in statements if sql.startswith("WITH done AS")]
    assert "step AS (INSERT INTO workflows_app_steprecord" in finish
    assert any(sql.lstrip().startswith("WITH picked AS") for sql in statements)
    # Nothing else writes steps or history (the worker's start-up touches instance rows).
    others = [s for s in statements if not s.lstrip().startswith("WITH")]
    for table in (
        "workflows_app_steprecord",
        "workflows_app_historyrecord",
    ):
        assert not any(
            s.lstrip().upper().startswith(("INSERT", "UPDATE")) and table in s for s in others
        ), [s for s in others if table in s]
    seqs = list(
        HistoryRecord.objects.filter(instance_id=inst.row().pk)
        .order_by("sequence")
        .values_list("sequence", "type")
    )
    assert [s for s, _ in seqs] == list(range(1, len(seqs) + 1))  # no gap, no duplicate
    types = [t for _, t in seqs]
    assert types.count("run.started") == 1 and types.count("step.completed") == 5
    assert types[-1] == "instance.completed"


def test_a_park_is_one_statement_after_its_lock_and_keeps_the_first_wake_time(registered):
    """A run that parks (a wait, a sleep) frees its lease, stores its status and the
    first wake time of its steps in one statement after the row's lock, not in a
    transaction of six trips."""
    postgres_only()

    @register("fast-path-park")
    class Parks(WorkflowEntrypoint):
        async def run(self, event, step):
            await asyncio.gather(
                step.wait_for_event("wait", type="go", timeout="2 hours"),
                step.sleep("nap", "1 hour"),
            )

    inst = get_workflow("fast-path-park").create(id="parks")
    with testing.QueryCounter() as queries:
        testing.run_until_idle()
    row = inst.row()
    assert (row.status, row.lease_token, row.lease_owner) == ("waiting", None, "")
    nap = row.steps.get(name="nap")
    assert row.wake_at == nap.wake_at < row.steps.get(name="wait").wake_at
    parks = [s for s in queries.statements if s.lstrip().startswith("WITH due AS")]
    assert len(parks) == 1
    assert not any(
        "MIN(" in s and "workflows_app_steprecord" in s
        for s in queries.statements
        if s not in parks
    )


def test_an_event_sent_while_the_a_backend_waits_for_a_lock_is_not_lost(registered):
    """A send_event holds the instance row until it commits. A park that waited for the
    row must see its event and leave the instance due at once: a look at the events in
    the same statement as the wait would read what was committed before it, miss the
    event and write the wait's timeout over the send's wake-up."""
    postgres_only()
    import threading

    from django.db import connections

    from workflows_app.engine.store import runs

    @register("fast-path-park-race")
    class Waits(WorkflowEntrypoint):
        async def run(self, event, step):
            return (await step.wait_for_event("wait", type="go", timeout="1 hour")).payload

    inst = get_workflow("fast-path-park-race").create(id="race")
    testing.run_until_idle()
    pk = inst.row().pk
    Instance.objects.filter(pk=pk).update(wake_at=clock.now())
    [(_, token, _)] = store.claim_and_load("probe", 5, 30).runs
    sent, release = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def send_and_hold() -> None:  # the row stays locked until release
        try:
            with transaction.atomic():
                inst.send_event("go", {"n": 1})
                sent.set()
                release.wait(30)
        finally:
            connections.close_all()

    def park() -> None:
        try:
            outcome["parked"] = runs.park(pk, token, False, ["go"], "", {"go": 0})
        finally:
            connections.close_all()

    sender = threading.Thread(target=send_and_hold)
    sender.start()
    assert sent.wait(30)
    parker = threading.Thread(target=park)
    parker.start()

    wait_until(a_backend_waits_for_a_lock, 30, "the park waiting for the instance row")
    release.set()
    sender.join(30)
    parker.join(30)
    status, wake_at = outcome["parked"]
    assert status == "waiting"
    assert wake_at is not None and wake_at <= clock.now()  # due at once: the event wakes it
    testing.run_until_idle()
    assert inst.status().output == {"n": 1}


def test_a_notify_wakes_a_worker_in_another_process_without_redis(workers):
    postgres_only()
    # No Redis for the worker and a 60 s poll: only a NOTIFY can wake it in time.
    (worker,) = workers(1, REDIS_URL="", WFDASH_POLL_SECONDS="60")
    inst = get_workflow("fleet-waiter").create()
    wait_until(lambda: inst.status().status == "waiting", 30, "the worker to park the instance")
    sent = time.monotonic()
    inst.send_event("go", {"from": os.getpid()})
    wait_until(lambda: inst.status().status == "complete", 10, "the notified worker to finish")
    latency = time.monotonic() - sent
    assert inst.status().output == {"payload": {"from": os.getpid()}, "pid": worker.pid}
    assert latency < 5, latency
    print(f"\nevent latency through NOTIFY: {latency * 1000:.0f} ms")


def test_hints_are_delivered_at_commit_and_dropped_with_a_rollback():
    postgres_only()
    with hints_heard() as heard:
        wait_until(lambda: ("wake", None) in heard, 10, "the listener's first wake")
        from django.db import transaction

        with pytest.raises(RuntimeError), transaction.atomic():
            store.hint_workers("event", [41])
            raise RuntimeError("rolled back")
        with transaction.atomic():
            store.hint_workers("terminate", [42])
        wait_until(lambda: ("terminate", 42) in heard, 10, "the committed hint")
        assert ("event", 41) not in heard


def test_a_child_that_ends_tells_every_worker_its_parent_is_due(registered):
    """The parent of a child that ended is due at once, and every worker of the fleet is
    told at the child's commit (NOTIFY "child <parent key>"): the worker that ran the
    child may not run the parent's version, or be full, and the others found the parent
    only at their next poll (5 s by default)."""
    postgres_only()

    @register("notify-child")
    class Child(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.do("work", lambda: 7)

    @register("notify-parent")
    class Parent(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.invoke("child", "notify-child", {})

    with hints_heard() as heard:
        parent = get_workflow("notify-parent").create(id="told")
        testing.run_until_idle()
        assert parent.status().output == 7
        pk = parent.row().pk
        wait_until(lambda: ("child", pk) in heard, 10, "the hint of the child's end")


@pytest.mark.parametrize("action", ["terminate", "cancel"])
def test_children_ended_with_their_parent_are_told_to_every_worker_at_commit(registered, action):
    """A parent's terminate (or cancel with compensation) ends its children in its
    transaction, and every worker hears each child's end at that commit (NOTIFY "terminate"
    or "compensate" <child key>): through the channel layer only, the worker running a
    child in a fleet without Redis went on running it until its next poll."""
    postgres_only()

    @register("notify-cascade-child")
    class Child(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do("book", lambda: 1, compensate=lambda booked: None)
            await step.wait_for_event("go", type="go")

    @register("notify-cascade-parent")
    class Parent(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.start("audit", "notify-cascade-child", {})
            await step.wait_for_event("go", type="go")

    with hints_heard() as heard:
        parent = get_workflow("notify-cascade-parent").create(id=f"cascade-{action}")
        testing.run_until_idle()
        (child,) = parent.children()
        assert child.status().status == "waiting"
        if action == "terminate":
            parent.terminate()
        else:
            parent.cancel(compensate=True)
        expected = "terminate" if action == "terminate" else "compensate"
        pk = child.row().pk
        wait_until(lambda: (expected, pk) in heard, 10, f"the hint of the child's {action}")


def test_instances_a_bulk_terminate_ends_are_told_to_every_worker_at_commit(registered):
    """A bulk terminate ends a batch in a few statements (store.terminate_batch), not
    through terminate(); its instances were announced through the channel layer only, so
    in a fleet without Redis the worker running one went on running its step until its
    next poll, where terminate() of the same instance NOTIFYs every worker at commit."""
    postgres_only()
    from workflows_app import bulk

    @register("notify-bulk-terminate")
    class Waiter(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.wait_for_event("go", type="go")

    with hints_heard() as heard:
        wf = get_workflow("notify-bulk-terminate")
        handles = [wf.create(id=f"bulk-{n}") for n in range(3)]
        testing.run_until_idle()
        job = wf.bulk("terminate", status="waiting")
        assert bulk.process_batch(job.id) is not None
        assert job.refresh().applied == 3
        for handle in handles:
            pk = handle.row().pk
            wait_until(lambda pk=pk: ("terminate", pk) in heard, 10, "the hint of its terminate")


@needs_redis
def test_a_hint_workers_hear_by_notify_is_not_sent_through_redis_as_well(
    registered, settings, monkeypatch
):
    """Every client action NOTIFYs the workers in its transaction; the same hint through
    the channel layer only woke each worker twice (and filled the engine channel when no
    `runworker` read it). With WAKE_NOTIFY off the workers do not LISTEN: Redis carries it."""
    postgres_only()
    from channels.layers import channel_layers

    from wfdash.settings import redis_channel_layer
    from workflows_app import live

    settings.CHANNEL_LAYERS = {"default": redis_channel_layer(redis_url)}
    channel_layers.backends.clear()
    monkeypatch.setattr(channel_layers, "backends", {})  # the test's layer goes with it
    # A dashboard page is open (a hub says so in Redis): page messages are sent. Without
    # it this process's look at Redis decided, and found a page only where another had one.
    asyncio.run(live.mark_pages_open(channel_layers["default"]))

    @register("fast-path-hinted")
    class Hinted(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.wait_for_event("go", type="go")

    sent: list[tuple[str, dict]] = []
    real_send = live._background_send
    monkeypatch.setattr(
        live,
        "_background_send",
        lambda group, message: (sent.append((group, message)), real_send(group, message)),
    )

    def hints() -> list[str]:
        return [m["kind"] for group, m in sent if group == live.WORKERS_GROUP]

    inst = get_workflow("fast-path-hinted").create()
    inst.send_event("go")
    inst.pause()
    assert hints() == []
    # The dashboard's update for the instance still goes through the layer.
    assert live.instance_group(inst.row().pk) in {group for group, _ in sent}

    settings.WFDASH = {**settings.WFDASH, "WAKE_NOTIFY": False}
    inst.resume()
    assert hints() == ["resume"]


class SkewedHostClock(clock.RealClock):
    """A host whose clock is off by `skew` (the engine only sees host_now())."""

    def __init__(self, skew: timedelta) -> None:
        super().__init__()
        self.skew = skew

    def host_now(self) -> datetime:
        return super().host_now() + self.skew


def test_the_engine_clock_reads_the_host_clock_its_offset_and_a_subclass_s_own_host_now():
    """clock.now() reads a RealClock inline (two calls fewer a reading); a subclass with
    its own host_now() (a skewed host, here and in the tests below) and a controllable
    clock must still be asked themselves, on either database."""
    saved = clock.get_clock()
    try:
        real = clock.RealClock()
        real.offset = timedelta(hours=-2)
        clock.set_clock(real)
        before = datetime.now(UTC)
        read = clock.now()
        assert before - timedelta(hours=2) <= read <= datetime.now(UTC) - timedelta(hours=2)
        clock.set_clock(SkewedHostClock(timedelta(days=3)))
        assert clock.now() - datetime.now(UTC) > timedelta(days=2, hours=23)
        fixed = datetime(2030, 1, 2, tzinfo=UTC)
        clock.set_clock(clock.ControllableClock(fixed))
        assert clock.now() == fixed
    finally:
        clock.set_clock(saved)


def database_now() -> datetime:
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        return cursor.fetchone()[0]


def test_a_worker_whose_host_clock_runs_an_hour_ahead_does_not_wake_a_sleep_early(registered):
    postgres_only()

    @register("skew-sleeper")
    class SkewSleeper(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.sleep("nap", "10 minutes")
            return "woke"

    inst = get_workflow("skew-sleeper").create()
    testing.run_until_idle()
    assert inst.status().status == "waiting"
    clock.set_clock(SkewedHostClock(timedelta(hours=1)))
    testing.run_until_idle()  # its worker measures the offset as it starts
    assert inst.status().status == "waiting"
    assert abs(clock.now() - database_now()) < timedelta(seconds=5)


class SlowReadingHostClock(clock.RealClock):
    """A host whose reads of its own clock, while `noisy`, straddle a round trip of 100 ms:
    each read before the database's answer says 50 ms earlier than it is, each after 50 ms
    later."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0
        self.noisy = False

    def host_now(self) -> datetime:
        self.reads += 1
        shift = timedelta(milliseconds=-50 if self.reads % 2 else 50)
        return super().host_now() + (shift if self.noisy else timedelta(0))


def test_a_noisy_measurement_of_the_offset_does_not_move_the_clock_back():
    """A noisy measurement only knows the offset within its round trip: the clock keeps
    the tighter bound it had (no step back from jitter); one the measurement shows ahead
    is corrected to the measurement's bound, behind the database's clock."""
    postgres_only()
    host = SlowReadingHostClock()
    clock.set_clock(host)
    store.measure_clock_offset(force=True)
    tight = host.offset
    assert timedelta(milliseconds=-40) < tight <= timedelta(0)  # host and database agree
    host.noisy = True
    store.measure_clock_offset(force=True)
    assert tight - timedelta(milliseconds=1) < host.offset <= tight
    host.offset = timedelta(milliseconds=200)  # the measurement shows it wrong
    store.measure_clock_offset(force=True)
    assert timedelta(milliseconds=-150) < host.offset <= timedelta(0)


class AsymmetricRoundTripHostClock(SkewedHostClock):
    """A host an hour behind whose next measurement's request takes `slow_request` longer
    than its answer: the read of the host's clock before the round trip is that much
    earlier than the database's read of its own (the read after is exact)."""

    def __init__(self, slow_request: timedelta) -> None:
        super().__init__(timedelta(hours=-1))
        self.early_reads: list[timedelta] = [-slow_request]

    def host_now(self) -> datetime:
        shift = self.early_reads.pop() if self.early_reads else timedelta(0)
        return super().host_now() + shift


def test_a_measurement_of_the_offset_never_puts_the_clock_ahead_of_the_databases():
    """Where in the round trip the database read its clock is unknown: a midpoint guess
    would put the clock ahead by half a lopsided round trip, and a timer due by it would
    end before its wake time by the database's clock. The offset is the bound that errs
    late: the database's time less the host's time after the answer."""
    postgres_only()
    host = AsymmetricRoundTripHostClock(slow_request=timedelta(seconds=2))
    clock.set_clock(host)
    store.measure_clock_offset(force=True)
    assert timedelta(minutes=59) < host.offset <= timedelta(hours=1)
    assert clock.now() <= database_now()


def test_a_host_clock_stepped_forward_after_a_measurement_is_not_kept_ahead():
    """A kept offset must still agree with the new measurement: a host clock that jumped
    forward a second since makes the old offset a second too late, and the clock would
    run ahead of the database's."""
    postgres_only()
    host = SkewedHostClock(timedelta(0))
    clock.set_clock(host)
    store.measure_clock_offset(force=True)
    host.skew = timedelta(seconds=1)
    store.measure_clock_offset(force=True)
    assert clock.now() <= database_now()
    assert database_now() - clock.now() < timedelta(milliseconds=500)


def test_a_worker_whose_host_clock_runs_an_hour_behind_writes_leases_that_are_not_over(registered):
    postgres_only()

    @register("skew-lease")
    class SkewLease(WorkflowEntrypoint):
        async def run(self, event, step):
            return 1

    inst = get_workflow("skew-lease").create()
    clock.set_clock(SkewedHostClock(timedelta(hours=-1)))
    store.measure_clock_offset(force=True)
    ((pk, _token),) = store.claim_runnable("behind", 1, 30)
    assert pk == inst.row().pk
    lease = inst.row().lease_expires_at
    assert timedelta(seconds=25) < lease - database_now() <= timedelta(seconds=31)


def test_an_event_is_stored_made_due_recorded_and_hinted_in_one_statement(registered):
    postgres_only()

    @register("one-statement-waiter")
    class Waiter(WorkflowEntrypoint):
        async def run(self, event, step):
            got = await step.wait_for_event("wait", type="go", timeout="1 hour")
            return got.payload

    inst = get_workflow("one-statement-waiter").create()
    testing.run_until_idle()
    assert inst.status().status == "waiting"
    with hints_heard() as heard:
        connection.close()  # the counter sees the statements of connections opened under it
        with testing.QueryCounter() as queries:
            inst.send_event("go", {"n": 1})
        pk = inst.row().pk
        wait_until(lambda: ("event", pk) in heard, 10, "the event's hint")
    writes = [s for s in queries.statements if "clock_timestamp" not in s]
    assert len(writes) == 1 and writes[0].lstrip().startswith("WITH inst AS"), writes
    sent = HistoryRecord.objects.get(instance_id=pk, type="event.sent")
    assert sent.data["type"] == "go" and inst.row().wake_at is not None
    testing.run_until_idle()
    assert inst.status().output == {"n": 1}


def test_a_send_that_waited_for_a_typed_waits_checkpoint_still_checks_its_schema(registered):
    """The send's one statement reads the instance row as it is once locked but the steps
    as they were when it began. A typed wait committed while it waited for the row (the
    run's checkpoint holds it) must still refuse a payload its schema rejects and store
    nothing: such a send takes the long way, which reads the steps after the lock."""
    postgres_only()
    import json
    import threading

    from django.db import connections

    from workflows_app.engine.errors import EventPayloadInvalid
    from workflows_app.models import InboxEvent, Status, StepKind, StepStatus

    schema = {"type": "object", "required": ["n"]}

    @register("fast-path-typed-race")
    class TypedWait(WorkflowEntrypoint):
        async def run(self, event, step):
            got = await step.wait_for_event("wait", type="go", timeout="1 hour", schema=schema)
            return got.payload

    inst = get_workflow("fast-path-typed-race").create(id="typed-race")
    pk = inst.row().pk
    written, commit = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def checkpoint_a_typed_wait() -> None:  # as a run's checkpoint: the row held till commit
        try:
            with transaction.atomic():
                Instance.objects.filter(pk=pk).update(status=Status.WAITING)
                StepRecord.objects.create(
                    instance_id=pk,
                    name="wait",
                    kind=StepKind.WAIT_FOR_EVENT,
                    seq=1,
                    status=StepStatus.WAITING,
                    started_at=clock.now(),
                    event_type="go",
                    event_schema_json=json.dumps(schema),
                )
                written.set()
                commit.wait(30)
        finally:
            written.set()
            connections.close_all()

    def send() -> None:
        try:
            inst.send_event("go", {"x": 1})
            outcome["sent"] = True
        except Exception as exc:
            outcome["error"] = exc
        finally:
            connections.close_all()

    checkpoint = threading.Thread(target=checkpoint_a_typed_wait)
    checkpoint.start()
    assert written.wait(30)
    sender = threading.Thread(target=send)
    sender.start()

    try:
        wait_until(a_backend_waits_for_a_lock, 30, "the send waiting for the instance row")
    finally:
        commit.set()
        checkpoint.join(30)
        sender.join(30)
    assert isinstance(outcome.get("error"), EventPayloadInvalid), outcome
    assert not InboxEvent.objects.filter(instance_id=pk).exists()
    assert not HistoryRecord.objects.filter(instance_id=pk, type="event.sent").exists()
    inst.send_event("go", {"n": 1})  # a payload the schema takes is stored
    assert InboxEvent.objects.filter(instance_id=pk).count() == 1


def test_a_herd_of_timers_due_at_one_instant_is_claimed_in_batches_and_each_run_once(registered):
    postgres_only()

    @register("fast-path-herd")
    class SleepThenStep(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.sleep("nap", "1 hour")
            return await step.do("after", lambda: "woke")

    herd, concurrency = 120, 50
    with testing.fake_clock() as fake:
        workflow = get_workflow("fast-path-herd")
        handles = [
            h
            for start in (0, 60)
            for h in workflow.create_batch([{"id": f"herd-{n}"} for n in range(start, start + 60)])
        ]
        testing.run_until_idle(concurrency=concurrency)
        unparked = Instance.objects.filter(workflow="fast-path-herd").exclude(status="waiting")
        assert not unparked.exists(), list(
            unparked.values_list("instance_id", "status", "lease_owner", "run_count")
        )
        fake.advance(timedelta(hours=1))  # every timer is due at the same instant
        with testing.QueryCounter() as queries:
            testing.run_until_idle(concurrency=concurrency)
    assert {h.status().output for h in handles} == {"woke"}
    claims = [s for s in queries.statements if s.lstrip().startswith("WITH picked AS")]
    # Each claim takes as many as there are free places (the first all 50, later ones
    # what the finished runs freed): a handful of statements, never one per instance.
    assert len(claims) <= herd // 10, len(claims)
    started = HistoryRecord.objects.filter(
        instance__workflow="fast-path-herd", type="run.started"
    ).count()
    assert started == 2 * herd  # the first run, and one after the wake: nobody ran twice


def test_a_claims_lease_tokens_are_its_random_base_and_a_count_and_its_loads_find_them(
    registered,
):
    """One random base a claim (not one random token per run it might take), the n-th run
    claimed holding base + n: unique within and across claims; the claim's pipelined
    loads find its rows by the same tokens, made in SQL (PostgreSQL)."""

    @register("fast-path-tokens")
    class Waits(WorkflowEntrypoint):
        async def run(self, event, step):
            return (await step.wait_for_event("wait", type="go")).payload

    workflow = get_workflow("fast-path-tokens")
    for n in range(5):
        workflow.create(id=f"tok-{n}")
    first = store.claim_and_load("probe", 3, 30).runs
    second = store.claim_and_load("probe", 10, 30).runs
    assert (len(first), len(second)) == (3, 2)
    for claim in (first, second):
        tokens = sorted(token for _, token, _ in claim)
        base = tokens[0][:24]
        assert tokens == [f"{base}{n:08x}" for n in range(1, len(claim) + 1)]
        assert all(int(token, 16) and len(token) == 32 for token in tokens)
        for pk, token, loaded in claim:  # the loads found each claimed row by its token
            assert loaded is not None and loaded.instance.pk == pk
            assert loaded.instance.lease_token == token and "wait" not in loaded.steps
    assert first[0][1][:24] != second[0][1][:24]
    assert store.heartbeat([token for _, token, _ in first + second], 30) == set()


def test_a_create_is_one_statement_and_a_taken_id_or_key_still_takes_the_long_way(registered):
    postgres_only()
    from workflows_app.engine.errors import InstanceAlreadyExists

    @register("fast-path-create")
    class Plain(WorkflowEntrypoint):
        async def run(self, event, step):
            return event.payload

    workflow = get_workflow("fast-path-create")
    connection.ensure_connection()  # its set-up statements are not the create's
    with CaptureQueriesContext(connection) as queries:
        first = workflow.create(id="c-1", params={"n": 1}, idempotency_key="key-1")
    statements = [q["sql"] for q in queries.captured_queries]
    # One statement writes the instance, its history and the NOTIFY; the rest store the
    # create span (no engine runs in this process to store it later).
    assert statements[0].startswith("WITH new AS (INSERT"), statements
    writes = [sql for sql in statements[1:] if sql.startswith(("INSERT", "UPDATE", "WITH"))]
    assert all(sql.startswith("INSERT INTO workflows_app_span") for sql in writes), statements
    made = first.row(refresh=False)  # as create() returned it, before any read
    row = first.row()
    assert made is not row
    assert (row.status, row.params_json, row.idempotency_key) == ("running", '{"n":1}', "key-1")
    # The statement returns the id only; the row built for it is the row stored.
    assert not made._state.adding and made._state.db == "default"
    fields = [f.attname for f in Instance._meta.concrete_fields]
    assert [getattr(made, f) for f in fields] == [getattr(row, f) for f in fields]
    assert list(HistoryRecord.objects.filter(instance=row).values_list("sequence", "type")) == [
        (1, "instance.created")
    ]
    with pytest.raises(InstanceAlreadyExists, match="c-1"):
        workflow.create(id="c-1", params={"n": 2})
    again = workflow.create(id="c-2", params={"n": 3}, idempotency_key="key-1")
    assert again.id == "c-1"  # the key's instance, not a new one
    assert Instance.objects.filter(workflow="fast-path-create").count() == 1
    assert HistoryRecord.objects.filter(instance=row).count() == 1
    tagged = workflow.create(id="c-3", attributes={"customer": "acme", "tier": 2})
    assert [
        i.id for i in workflow.list(attributes={"customer": "acme", "tier": 2.0}).instances
    ] == [tagged.id]  # the attribute rows were written by the same statement
    testing.run_until_idle()
    assert first.status().output == {"n": 1}


def test_rows_read_as_sql_come_back_as_the_orm_would_give_them(registered):
    """The claim's load, a wait's first look for events and the one-statement create read
    raw rows, on both databases: every column comes back as an ORM read gives it (JSON
    through the field's own conversion; timestamps parsed in C, by psycopg or from
    SQLite's text, as the same aware UTC instants)."""

    @register("fast-path-rows")
    class Waits(WorkflowEntrypoint):
        async def run(self, event, step):
            return (await step.wait_for_event("wait", type="go")).payload

    inst = get_workflow("fast-path-rows").create(id="rows", attributes={"customer": "acme"})
    testing.run_until_idle()
    inst.send_event("go", {"n": 1})
    [(pk, _, loaded)] = store.claim_and_load("probe", 5, 30).runs
    assert loaded.instance.attributes == {"customer": "acme"}
    assert [e.payload_json for e in loaded.events["go"][0]] == ['{"n":1}']
    assert loaded.steps["wait"].status == "waiting"
    assert store.load_runs([pk])[pk].instance.attributes == {"customer": "acme"}
    row = Instance.objects.get(pk=pk)
    pairs = [
        (loaded.instance, row),
        (loaded.steps["wait"], row.steps.get(name="wait")),
        (loaded.events["go"][0][0], row.events.get()),
        (store.unconsumed_events(pk, "go", 0, 10)[0], row.events.get()),
    ]
    for read, orm in pairs:
        for field in type(orm)._meta.concrete_fields:
            value, expected = getattr(read, field.attname), getattr(orm, field.attname)
            assert value == expected and type(value) is type(expected), field.name
            if isinstance(value, datetime):
                assert value.utcoffset() == timedelta(0), field.name
    assert loaded.instance.lease_expires_at is not None  # a datetime was compared, not None
    for read, orm in pairs:  # made without Model.__init__: as loaded by the ORM all the same
        assert read._state.adding is False and read._state.db == orm._state.db
    assert loaded.steps["wait"].instance == row  # the foreign key reads as the ORM's

    seen: list[StepRecord] = []

    def saw(sender, instance, **kwargs):
        seen.append(instance)

    post_init.connect(saw, sender=StepRecord)  # a project listening: from_db, signals and all
    try:
        reloaded = store.load_runs([pk])[pk]
    finally:
        post_init.disconnect(saw, sender=StepRecord)
    assert seen == [reloaded.steps["wait"]] and seen[0] is reloaded.steps["wait"]


def test_datetimes_written_by_raw_sql_are_what_the_orm_writes_and_read_back_the_same():
    """db_time's short way (aware UTC on SQLite in UTC) writes Django's own text, and
    from_db_time reads SQLite's text back as the same instant, aware in UTC."""
    from zoneinfo import ZoneInfo

    from workflows_app.engine.store.dialect import db_time, from_db_time

    now = datetime.now(UTC)
    values = [
        now,
        now.replace(microsecond=0),
        datetime(1999, 1, 2, 3, 4, 5, 6, tzinfo=UTC),
        now.astimezone(timezone(timedelta(hours=-5))),
        now.astimezone(ZoneInfo("UTC")),
    ]
    for value in values:
        written = db_time(value)
        django_writes = connection.ops.adapt_datetimefield_value(value)
        assert written == django_writes and type(written) is type(django_writes), value
        read = from_db_time(written)  # SQLite: text; PostgreSQL: the driver's datetime
        assert read == value, value
        if isinstance(written, str):
            assert read.tzinfo is UTC, value
    assert db_time(None) is None and from_db_time(None) is None


def test_a_new_step_record_is_what_the_model_itself_makes():
    """new_step_record builds the object without Model.__init__: every field as the
    model's own constructor gives it, unsaved; with a post_init receiver, the constructor."""
    from workflows_app.engine.step import new_step_record

    made = new_step_record("s", "do", "running", 3)
    orm = StepRecord(name="s", kind="do", status="running", seq=3, started_at=made.started_at)
    for field in StepRecord._meta.concrete_fields:
        assert getattr(made, field.attname) == getattr(orm, field.attname), field.name
    assert made._state.adding is True and made._state.db is None and made.pk is None
    seen: list[StepRecord] = []

    def saw(sender, instance, **kwargs):
        seen.append(instance)

    post_init.connect(saw, sender=StepRecord)
    try:
        signalled = new_step_record("t", "do", "running", 4)
    finally:
        post_init.disconnect(saw, sender=StepRecord)
    assert seen == [signalled] and seen[0] is signalled


def test_a_new_instance_row_and_its_insert_values_are_what_django_makes_of_them():
    """new_model_object makes what Instance(**values) makes (a callable default made anew
    for each object), and the create's column writers give what get_db_prep_save gives,
    for every column, on both databases (PostgreSQL's typed integers included)."""
    from zoneinfo import ZoneInfo

    from workflows_app.engine.store import control, new_model_object

    now = datetime.now(UTC)
    given = {
        "workflow": "w",
        "instance_id": "i-1",
        "version": 3,
        "status": "running",
        "params_json": "{}",
        "created_at": now,
        "updated_at": now.astimezone(ZoneInfo("Europe/Paris")),
        "wake_at": now.astimezone(timezone(timedelta(hours=-5))),
        "started_at": None,
        "history_seq": 1,
        "compensate_on_cancel": True,
        "priority": 7,
        "parent_id": None,
        "retention_ms": 10**12,
    }
    made, orm = new_model_object(Instance, dict(given)), Instance(**given)
    for field in Instance._meta.concrete_fields:
        assert getattr(made, field.attname) == getattr(orm, field.attname), field.name
    assert made._state.adding is True and made._state.db is None and made.pk is None
    other = new_model_object(Instance, {"workflow": "w"})
    assert other.attributes == {} and other.attributes is not made.attributes
    made.attributes = {"customer": "acme", "tier": 2}

    columns, writers = control._instance_columns()
    fields = [f for f in Instance._meta.concrete_fields if not f.primary_key]
    assert columns == tuple(f.column for f in fields)
    for field, write in zip(fields, writers, strict=True):
        expected = field.get_db_prep_save(field.pre_save(made, True), connection)
        written = write(made, connection)
        assert repr(written) == repr(expected) and type(written) is type(expected), field.name


def test_the_claim_reads_the_next_timer_in_its_own_round_trip(registered):
    """The worker's idle wait needs the next timer: read beside the claim in one pipeline,
    not in a trip of its own while the claimed runs start."""
    postgres_only()

    @register("fast-path-timer")
    class Naps(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.sleep("nap", event.payload["nap"])
            return "woke"

    workflow = get_workflow("fast-path-timer")
    workflow.create(id="long", params={"nap": "2 hours"})
    testing.run_until_idle()
    soonest = store.next_wake_at()
    assert soonest is not None
    workflow.create(id="due")  # claimable now; no timer of its own yet
    with CaptureQueriesContext(connection) as queries:
        claimed = store.claim_and_load("probe", 5, 30)
    assert [loaded.instance.instance_id for _, _, loaded in claimed.runs] == ["due"]
    assert claimed.looked_for_next_wake and claimed.next_wake == soonest
    assert sum("MIN(wake_at)" in q["sql"] for q in queries.captured_queries) == 1


def test_a_claim_after_a_hint_reads_when_a_queue_admits_next_in_its_own_round_trip(registered):
    """admit_due's look after a create's hint (is a debounce or rate window over, and when
    is the next?) goes down the claim's pipeline, not in a trip of its own before it."""
    postgres_only()
    from tests.test_flow_control import register_gated

    register_gated("fast-path-debounced")
    with testing.fake_clock():
        queued = get_workflow("fast-path-debounced").create(debounce_key="k", debounce="1 minute")
        get_workflow("fleet-waiter").create(id="plain")
        with CaptureQueriesContext(connection) as queries:
            claimed = store.claim_and_load(
                "probe", 5, 30, admission=["fast-path-debounced", "fleet-waiter"]
            )
        assert [loaded.instance.instance_id for _, _, loaded in claimed.runs] == ["plain"]
        assert claimed.first_admit_at == queued.row().admit_at is not None
        assert sum("MIN(admit_at)" in q["sql"] for q in queries.captured_queries) == 1
        with CaptureQueriesContext(connection) as queries:
            store.claim_and_load("probe", 5, 30)
        assert not any("MIN(admit_at)" in q["sql"] for q in queries.captured_queries)


def test_the_engine_prepares_its_hot_statements_once_per_connection(registered, settings):
    """The claim, its reads and the next-timer read are planned once per connection (the
    instance table's planning cost more than running them); WFDASH_PG_PREPARE=0 turns it
    off for a pooler that cannot keep prepared statements."""
    postgres_only()

    def prepared() -> list[str]:
        with connection.cursor() as cursor:
            cursor.execute("SELECT statement FROM pg_prepared_statements")
            return [sql for (sql,) in cursor.fetchall()]

    get_workflow("fleet-waiter").create(id="prepared")
    connection.ensure_connection()
    with connection.cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")
    settings.WFDASH = {**settings.WFDASH, "PG_PREPARE": False}
    assert len(store.claim_and_load("probe", 5, 30).runs) == 1
    assert prepared() == []
    settings.WFDASH = {**settings.WFDASH, "PG_PREPARE": True}
    store.claim_and_load("probe", 5, 30)
    first = prepared()
    assert any("picked AS" in sql for sql in first), first
    assert any("MIN(wake_at)" in sql for sql in first), first
    store.claim_and_load("probe", 5, 30)
    assert sorted(prepared()) == sorted(first)  # reused, not prepared again


def test_a_claim_commits_without_waiting_for_the_flush_and_only_the_claim_does(registered):
    """The claim's transaction alone turns synchronous_commit off (a later checkpoint's
    flush makes it durable); the connection's other transactions keep it on."""
    postgres_only()
    get_workflow("fleet-waiter").create(id="async-claim")

    def synchronous_commit() -> str:
        with connection.cursor() as cursor:
            cursor.execute("SHOW synchronous_commit")
            return cursor.fetchone()[0]

    assert synchronous_commit() == "on"
    with transaction.atomic():
        assert len(store.claim_runnable("probe", 5, 30)) == 1
        assert synchronous_commit() == "off"
    assert synchronous_commit() == "on"
    assert Instance.objects.get(instance_id="async-claim").lease_owner == "probe"


def test_a_pipeline_whose_connection_the_server_ends_raises_djangos_error(registered):
    """The pipelined claim and group commit meet a terminated backend as Django's
    OperationalError, which runs retry and the worker releases leases for (psycopg's own,
    raised at the pipeline's exit, is neither: instances stayed leased until their leases
    ran out)."""
    postgres_only()
    from django.db import OperationalError

    from workflows_app.engine.store import dialect

    try:
        with pytest.raises(OperationalError) as raised, dialect.pipeline():
            dialect.statement_cursor().execute("SELECT pg_terminate_backend(pg_backend_pid())")
        assert store.transient(raised.value)
    finally:
        connection.close()


def _bulk_instances(workflow: str, count: int) -> None:
    """count bare instances of a workflow in one insert (a table to plan against)."""
    now = clock.now()
    Instance.objects.bulk_create(
        Instance(
            workflow=workflow,
            instance_id=f"{workflow}-{n}",
            version=1,
            trace_id=f"{n:032x}",
            created_at=now,
            updated_at=now,
        )
        for n in range(count)
    )


def _server_side(sql: str, params: dict) -> tuple[str, str]:
    """A statement of the engine with $n placeholders, and its parameters as literals."""
    from psycopg import ClientCursor
    from psycopg._queries import PostgresQuery
    from psycopg.adapt import Transformer

    connection.ensure_connection()
    conn = connection.connection
    query = PostgresQuery(Transformer(conn))
    query.convert(sql, params)
    literals = ClientCursor(conn)
    args = ", ".join(literals.mogrify("%s", [params[name]]) for name in query._order)
    return query.query.decode(), args


def _explain_execute(cursor, name: str, args: str) -> str:
    cursor.execute(f"EXPLAIN (COSTS OFF) EXECUTE {name}({args})")
    return "\n".join(row[0] for row in cursor.fetchall())


def _generic_plan(sql: str, params: dict) -> str:
    """EXPLAIN of the generic plan of a statement of the engine, with these parameters."""
    statement, args = _server_side(sql, params)
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        cursor.execute("PREPARE engine_statement AS " + statement)
        plan = _explain_execute(cursor, "engine_statement", args)
        cursor.execute("DEALLOCATE engine_statement")
    return plan


def test_a_claim_plan_kept_since_the_table_was_empty_is_made_anew_once_it_grows(
    registered, monkeypatch
):
    """A connection keeps its claim's plan; one made while the instance table was empty
    reads the whole table, and kept it until autovacuum's next analysis (a minute or
    more). The workers' look at the tables' growth analyzes the grown table, and the
    server plans the kept statement again, by index; a table that has not grown since is
    left alone."""
    postgres_only()
    from workflows_app.engine.store import leases, plans

    monkeypatch.setattr(plans, "_asked_at_pages", {})
    now = clock.now()
    statement, args = _server_side(
        leases.CLAIM_SQL, leases._claim_params("w", 50, now, now + timedelta(seconds=30), [], None)
    )
    table_scan = "Seq Scan on workflows_app_instance"
    with connection.cursor() as cursor:
        # Only this test analyzes the table meanwhile, first while it is empty (as
        # autovacuum does a new database's tables early on).
        cursor.execute("ALTER TABLE workflows_app_instance SET (autovacuum_enabled = false)")
        assert not Instance.objects.exists()
        cursor.execute("ANALYZE workflows_app_instance")
        cursor.execute("SET plan_cache_mode = force_generic_plan")
        cursor.execute("PREPARE kept_claim AS " + statement)
        try:
            assert table_scan in _explain_execute(cursor, "kept_claim", args)
            _bulk_instances("growth", 3000)
            assert table_scan in _explain_execute(cursor, "kept_claim", args)  # still kept
            assert "workflows_app_instance" in store.analyze_grown_tables()
            assert table_scan not in _explain_execute(cursor, "kept_claim", args)
            assert "workflows_app_instance" not in store.analyze_grown_tables()
        finally:
            cursor.execute("DEALLOCATE kept_claim")
            cursor.execute("RESET plan_cache_mode")
            cursor.execute("ALTER TABLE workflows_app_instance RESET (autovacuum_enabled)")


def test_the_engines_statements_keep_their_generic_plans_and_those_read_by_index(registered):
    """The engine's connections keep the plan made once (plan_cache_mode): after ANALYZE
    the server had planned the claim anew on every call. And the generic plans of the
    claim and of a group's ends find instances by id, never by reading the table (their
    joins scanned every instance once the table had statistics)."""
    postgres_only()
    from workflows_app.engine.store import dialect, leases, runs

    with dialect.statement_cursor() as cursor:
        cursor.execute("SHOW plan_cache_mode")
        assert cursor.fetchone() == ("force_generic_plan",)
    _bulk_instances("plans", 3000)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE workflows_app_instance")
    now = clock.now()
    claim = _generic_plan(
        leases.CLAIM_SQL, leases._claim_params("w", 50, now, now + timedelta(seconds=30), [], None)
    )
    ends = _generic_plan(
        runs._finish_many_sql(),
        {**runs._finish_many_params([], now), "rows": '[{"pk": 1, "token": "t"}]'},
    )
    for plan in (claim, ends):
        assert "Seq Scan on workflows_app_instance" not in plan, plan
        assert "Index Cond: (parent_id IS NULL)" not in plan, plan


async def test_a_worker_looks_at_the_tables_growth_between_claims_every_few_seconds(
    registered, monkeypatch
):
    """The serve loop's look (Worker.refresh_plans_once) analyzes the grown instance table
    in a database thread, then not again before PLAN_CHECK_SECONDS have passed."""
    from asgiref.sync import sync_to_async

    from workflows_app.engine.store import plans
    from workflows_app.engine.worker import ConnectionThreads, Worker

    postgres_only()
    monkeypatch.setattr(plans, "_asked_at_pages", {})
    analyzed: list[list[str]] = []

    def counted() -> list[str]:
        analyzed.append(plans.analyze_grown_tables())
        return analyzed[-1]

    monkeypatch.setattr(store, "analyze_grown_tables", counted)
    await sync_to_async(_bulk_instances)("looked-at", 3000)
    worker = Worker()
    worker.db = ConnectionThreads(1, "test-plans")
    try:
        await worker.refresh_plans_once()
        await worker.refresh_plans_once()  # within PLAN_CHECK_SECONDS: no look
        assert len(analyzed) == 1 and "workflows_app_instance" in analyzed[0]
        worker._next_plan_check = 0.0  # the seconds have passed
        await worker.refresh_plans_once()
        assert analyzed[1] == []  # not grown since
    finally:
        await asyncio.get_running_loop().run_in_executor(None, worker.db.close)


def test_a_claim_and_the_next_timer_read_none_of_the_fleets_leased_rows(registered):
    """A running instance stays due (its wake_at is kept for the run after a crash), so
    the claim's read by wake_at, and the idle wait's read of the next timer, went past
    every row the fleet's workers held before the first they could take: 2,000 leased
    rows read twice a claim. Now the unleased due rows and those whose lease ran out are
    read by indexes of their own (instance_unleased_runnable, instance_lease_expiry); the
    claim still takes both, in wake_at order."""
    postgres_only()
    from tests.test_admission_many_keys import tuples_read

    wf = get_workflow("fleet")
    template = wf.create(id="template").row()
    now = clock.now()
    table = Instance._meta.db_table
    copied = [
        f.column
        for f in Instance._meta.concrete_fields
        if f.column
        not in ("id", "instance_id", "wake_at", "lease_token", "lease_expires_at", "status")
    ]
    columns = ", ".join(copied)

    def clone(prefix: str, count: int, wake_at, token: str | None, expires, status: str) -> None:
        with connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {table} ({columns}, instance_id, wake_at, lease_token, "
                f"lease_expires_at, status) SELECT {columns}, %s || g::text, "
                "%s - g * interval '1 millisecond', "
                "CASE WHEN %s::text IS NULL THEN NULL ELSE %s || g::text END, %s, %s "
                f"FROM {table}, generate_series(1, %s) g WHERE id = %s",
                [prefix, wake_at, token, token, expires, status, count, template.pk],
            )

    # Held by other workers: due long ago, leases live for another minute.
    clone("held-", 2000, now - timedelta(hours=1), "other-", now + timedelta(minutes=1), "running")
    # A worker that died: its leases ran out a minute ago.
    clone("orphan-", 3, now - timedelta(minutes=30), "dead-", now - timedelta(minutes=1), "running")
    Instance.objects.filter(pk=template.pk).update(wake_at=now - timedelta(minutes=10))
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {table}")
    with transaction.atomic():
        before = tuples_read()
        next_wake = store.next_wake_at()
        claimed = store.claim_runnable("w-test", 50, 30)
        read = tuples_read() - before
    assert next_wake == now - timedelta(minutes=10)
    taken = dict(
        Instance.objects.filter(pk__in=[pk for pk, _ in claimed]).values_list(
            "instance_id", "lease_owner"
        )
    )
    assert sorted(taken) == ["orphan-1", "orphan-2", "orphan-3", "template"]
    assert set(taken.values()) == {"w-test"}
    assert Instance.objects.filter(lease_token__startswith="other-").count() == 2000
    # The 4 rows taken, through 2 indexes, and the next timer's: not 2,000 twice.
    assert read < 100, f"{read} rows and index entries read"
    # So does the plan the server keeps for the statement once it is prepared.
    from workflows_app.engine.store import leases

    params = leases._claim_params("w", 50, now, now + timedelta(seconds=30), [], None)
    for sql in (leases.CLAIM_SQL, leases.CLAIM_BY_PRIORITY_SQL):
        plan = _generic_plan(sql, params)
        assert "instance_unleased_runnable" in plan and "instance_lease_expiry" in plan, plan
        assert "using instance_runnable" not in plan, plan
