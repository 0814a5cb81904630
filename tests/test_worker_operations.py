"""The worker under everyday operations: a full worker, hung steps, slow heartbeats, deploys.

Each test drives a real Worker on the test database from an event loop in a thread of
its own, so the test thread can use the ORM and wait on the engine's own signals.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine
from datetime import timedelta
from typing import Any

import pytest

from tests.polling import wait_until
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, current_step, register, store
from workflows_app.engine.worker import Worker
from workflows_app.live import EngineHooks
from workflows_app.models import HistoryRecord, Instance

pytestmark = pytest.mark.django_db(transaction=True)


class LoopThread:
    """An event loop in a thread: the worker lives there, the test talks to it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def loop_thread():
    lt = LoopThread()
    yield lt
    lt.close()


def new_worker(**kwargs: Any) -> Worker:
    return Worker(hooks=EngineHooks(), **kwargs)


def statuses(workflow: str) -> dict[str, str]:
    return dict(Instance.objects.filter(workflow=workflow).values_list("instance_id", "status"))


# --- 1. a full worker waits instead of spinning -------------------------------------------


def test_a_full_worker_with_due_instances_waiting_does_not_spin(
    registered, loop_thread, monkeypatch
):
    gate = threading.Event()
    started = threading.Semaphore(0)

    @register("full-house")
    class FullHouse(WorkflowEntrypoint):
        async def run(self, event, step):
            def hold():
                started.release()
                gate.wait(20)
                return "done"

            return await step.do("hold", hold)

    wf = get_workflow("full-house")
    for n in range(20):
        wf.create(id=f"f{n}")
    queries = []
    real = store.next_wake_at
    monkeypatch.setattr(store, "next_wake_at", lambda: queries.append(1) or real())
    worker = new_worker(concurrency=2, poll_seconds=5)
    stop = asyncio.Event()
    serving = loop_thread.spawn(worker.serve(stop))
    try:
        assert started.acquire(timeout=20) and started.acquire(timeout=20)
        before = len(queries)
        time.sleep(0.5)  # a window to count the loop's turns in, not a wait for an outcome
        spins = len(queries) - before
        assert spins <= 2, f"a full worker asked for the next wake time {spins} times in 0.5 s"
    finally:
        gate.set()
    wait_until(
        lambda: set(statuses("full-house").values()) == {"complete"},
        60,
        "all 20 instances complete",
    )
    loop_thread.loop.call_soon_threadsafe(stop.set)
    serving.result(30)


def test_a_run_whose_end_waits_for_its_group_commit_frees_its_place(
    registered, loop_thread, monkeypatch, settings
):
    """A worker's place is held while a run's code runs, not while its end waits for the
    group's commit: with one place, a second instance starts before the first's end lands,
    and both complete once it does."""
    settings.WFDASH = {**settings.WFDASH, "GROUP_COMMIT": True}
    end_started, land = threading.Event(), threading.Event()

    @register("ends-in-group")
    class EndsInGroup(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.do("one", lambda: "done")

    real = store.write_steps

    def gated(writes):
        if any(isinstance(w, store.FinishWrite) for w in writes) and not land.is_set():
            end_started.set()
            land.wait(20)
        return real(writes)

    monkeypatch.setattr(store, "write_steps", gated)
    wf = get_workflow("ends-in-group")
    first, second = wf.create(id="first"), wf.create(id="second")
    worker = new_worker(concurrency=1, db_threads=2)
    try:
        loop_thread.call(worker.start())
        assert loop_thread.call(worker.claim_and_start()) == 1
        assert end_started.wait(20)  # the first run's end is in the database thread
        assert worker.group_commit.ending == 1 and worker.free_slots() == 1
        assert first.status().status == "running"  # its end has not landed
        assert loop_thread.call(worker.claim_and_start()) == 1
        assert set(worker.tasks) == {first.row().pk, second.row().pk}
        land.set()
        loop_thread.call(worker.run_until_idle(timeout=20))
        assert (first.status().status, second.status().status) == ("complete", "complete")
    finally:
        land.set()
        loop_thread.call(worker.stop(grace_seconds=0))


def test_a_serving_worker_looks_for_work_after_a_run_only_when_something_may_be_due(
    registered, loop_thread, monkeypatch, settings
):
    """A run that completes, or parks until after the loop's wait, makes no claim: each such
    claim was a round trip an event sent meanwhile waited behind. A run parked until before
    the loop's wait ends wakes it, and the loop then waits until exactly that time."""
    from workflows_app import testing

    # One hint per change (PostgreSQL's NOTIFY would hint this process's changes twice).
    settings.WFDASH = {**settings.WFDASH, "WAKE_NOTIFY": False}

    @register("done-at-once")
    class DoneAtOnce(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.do("one", lambda: 1)

    @register("naps")
    class Naps(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.sleep("nap", event.payload["nap"])
            return "rested"

    claims = []
    real = store.claim_and_load
    monkeypatch.setattr(store, "claim_and_load", lambda *a, **k: claims.append(1) or real(*a, **k))
    with testing.fake_clock() as clock:
        worker = new_worker(poll_seconds=3600)
        stop = asyncio.Event()
        serving = loop_thread.spawn(worker.serve(stop))
        try:

            def idle() -> bool:
                return worker._waiting_until is not None and not worker.tasks

            wait_until(idle, 20, "the worker to go idle")
            before = len(claims)
            done = get_workflow("done-at-once").create(id="d1")
            wait_until(lambda: done.status().status == "complete" and idle(), 20, "d1 to complete")
            assert len(claims) - before == 1  # the create's hint; its end adds none

            before = len(claims)
            late = get_workflow("naps").create(id="late", params={"nap": "2 hours"})
            wait_until(lambda: late.status().status == "waiting" and idle(), 20, "late to park")
            assert len(claims) - before == 1  # parked past the hour the loop waits: no look
            soon = get_workflow("naps").create(id="soon", params={"nap": "10 minutes"})
            wake_at = soon.row().created_at + timedelta(minutes=10)
            wait_until(
                lambda: (
                    soon.status().status == "waiting"
                    and idle()
                    and worker._waiting_until <= wake_at + timedelta(seconds=1)
                ),
                20,
                "the loop to wait only until soon's nap ends",
            )
            clock.advance(timedelta(minutes=10, seconds=1))
            wait_until(lambda: soon.status().status == "complete", 20, "soon to complete")
            assert late.status().status == "waiting"
        finally:
            loop_thread.loop.call_soon_threadsafe(stop.set)
            serving.result(30)


# --- 2. hung sync steps -------------------------------------------------------------------


def test_hung_sync_steps_take_no_capacity_and_their_timeouts_count_running_time_only(
    registered, loop_thread
):
    release = threading.Event()
    ran: list[str] = []

    @register("hangs")
    class Hangs(WorkflowEntrypoint):
        async def run(self, event, step):
            def hang():
                release.wait(30)  # ignores cancellation: a really hung call
                return "late"

            return await step.do("hang", hang, timeout=100, retries={"limit": 0})

    @register("quick")
    class Quick(WorkflowEntrypoint):
        async def run(self, event, step):
            def work():
                time.sleep(0.05)
                ran.append(current_step().instance_id)
                return "ok"

            return await step.do("work", work, timeout=200, retries={"limit": 0})

    get_workflow("hangs").create(id="h1")
    get_workflow("hangs").create(id="h2")
    worker = new_worker(concurrency=2)
    try:
        loop_thread.call(worker.start())
        loop_thread.call(worker.run_until_idle(timeout=20))
        assert statuses("hangs") == {"h1": "errored", "h2": "errored"}
        # Both threads still hang; an unrelated instance must still get a thread at once.
        quick = get_workflow("quick").create(id="q1")
        loop_thread.call(worker.run_until_idle(timeout=20))
        assert quick.status().status == "complete", quick.status()
        assert ran == ["q1"]
    finally:
        release.set()
        loop_thread.call(worker.stop(grace_seconds=0))


def test_an_abandoned_sync_attempt_sees_it_was_cancelled_and_the_retry_starts_after_it_stops(
    registered,
):
    from workflows_app import testing

    events: list[str] = []

    @register("polite")
    class Polite(WorkflowEntrypoint):
        async def run(self, event, step):
            def careful(ctx):
                events.append(f"start {ctx.attempt}")
                if ctx.attempt == 1:
                    cancelled = ctx.wait_cancelled(10)
                    events.append(f"attempt 1 saw cancelled={cancelled}")
                    return "late"
                return "second"

            return await step.do("careful", careful, timeout=100, retries={"limit": 1, "delay": 0})

    inst = get_workflow("polite").create()
    testing.run_until_idle()
    assert inst.status().output == "second"
    assert events == ["start 1", "attempt 1 saw cancelled=True", "start 2"]


# --- 3. a slow heartbeat aborts only the run whose lease it lost ----------------------------


def test_a_heartbeat_in_flight_across_a_reclaim_does_not_abort_the_new_run(
    registered, loop_thread, monkeypatch
):
    gate_a, gate_b, proceed, in_heartbeat = (threading.Event() for _ in range(4))

    @register("reclaimed")
    class Reclaimed(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do("a", lambda: gate_a.wait(20))
            await step.wait_for_event("go", type="go")
            await step.do("b", lambda: gate_b.wait(20))
            return "done"

    real = store.heartbeat

    def slow_heartbeat(tokens, lease_seconds):
        in_heartbeat.set()
        proceed.wait(20)
        return real(tokens, lease_seconds)

    monkeypatch.setattr(store, "heartbeat", slow_heartbeat)
    inst = get_workflow("reclaimed").create(id="r1")
    worker = new_worker(concurrency=4, db_threads=2)
    try:
        loop_thread.call(worker.start())
        assert loop_thread.call(worker.claim_and_start()) == 1
        first_token = next(iter(worker.tokens.values()))
        beat = loop_thread.spawn(worker.heartbeat_once())  # snapshot: the first run's token
        assert in_heartbeat.wait(10)
        gate_a.set()
        wait_until(
            lambda: inst.status().status == "waiting", 20, "the first run to park on its event wait"
        )
        inst.send_event("go")
        wait_until(
            lambda: loop_thread.call(worker.claim_and_start()) == 1,
            20,
            "the second run to be claimed",
        )
        second = next(iter(worker.runs.values()))
        assert second.token != first_token
        proceed.set()
        assert beat.result(20) == {first_token}
        assert second.abort_reason is None
        gate_b.set()
        loop_thread.call(worker.run_until_idle(timeout=20))
        assert inst.status().status == "complete"
    finally:
        proceed.set()
        gate_a.set()
        gate_b.set()
        loop_thread.call(worker.stop(grace_seconds=0))


# --- 4. a deploy is not a crash -------------------------------------------------------------


def test_three_rolling_deploys_during_one_long_step_do_not_make_the_instance_poison(
    registered, loop_thread
):
    finish = threading.Event()
    attempts: list[int] = []

    @register("long-step")
    class LongStep(WorkflowEntrypoint):
        async def run(self, event, step):
            def long(ctx):
                attempts.append(ctx.attempt)
                if not finish.is_set():
                    ctx.wait_cancelled(30)
                return "done"

            return await step.do("long", long, timeout="10 minutes")

    inst = get_workflow("long-step").create(id="deployed")
    for deploy in range(3):
        worker = new_worker(concurrency=2, lease_seconds=30)
        loop_thread.call(worker.start())
        assert loop_thread.call(worker.claim_and_start()) == 1
        wait_until(
            lambda deploy=deploy: len(attempts) == deploy + 1,
            20,
            f"the step to start under deploy {deploy + 1}",
        )
        loop_thread.call(worker.stop(grace_seconds=0.1))  # SIGTERM: the step outlives the grace
        row = Instance.objects.get(pk=inst.row().pk)
        assert row.lease_token is None, "a drained worker kept its lease"
    finish.set()
    worker = new_worker(concurrency=2)
    loop_thread.call(worker.start())
    try:
        loop_thread.call(worker.run_until_idle(timeout=20))
    finally:
        loop_thread.call(worker.stop(grace_seconds=0))
    row = Instance.objects.get(pk=inst.row().pk)
    assert row.status == "complete", (row.status, row.error_name, row.error_message)
    assert row.unproductive_claims == 0
    assert HistoryRecord.objects.filter(instance=row, type="run.started").count() == 4


# --- 15. bounded work -----------------------------------------------------------------------


def test_a_wait_reads_only_the_buffered_events_of_its_type_and_only_as_far_as_it_needs(
    registered, monkeypatch
):
    from workflows_app import testing
    from workflows_app.models import InboxEvent

    # 1,250 events buffered on purpose: past max_buffered_events' default, which is not
    # what this test is about.
    @register("inbox-reader", limits={"max_buffered_events": None})
    class InboxReader(WorkflowEntrypoint):
        async def run(self, event, step):
            got = await step.wait_for_event(
                "approval", type="go", schema={"type": "object", "required": ["ok"]}
            )
            return got.payload

    inst = get_workflow("inbox-reader").create(id="reader")
    pk = inst.row().pk
    now = Instance.objects.get(pk=pk).created_at
    noise = [
        InboxEvent(instance_id=pk, type="noise", payload_json="{}", created_at=now)
        for _ in range(1000)
    ]
    refused = [
        InboxEvent(instance_id=pk, type="go", payload_json='{"n": 1}', created_at=now)
        for _ in range(250)
    ]
    InboxEvent.objects.bulk_create([*noise, *refused])
    inst.send_event("go", {"ok": True})
    read: list[str] = []
    real = store.unconsumed_events
    monkeypatch.setattr(
        store,
        "unconsumed_events",
        lambda *args: [read.append(e.type) or e for e in real(*args)],
    )
    testing.run_until_idle()
    assert inst.status().output == {"ok": True}
    assert set(read) == {"go"} and len(read) == 251  # three batches, no noise


def test_result_waiters_leave_nothing_behind_once_answered(registered):
    from workflows_app import live, testing

    @register("answered")
    class Answered(WorkflowEntrypoint):
        async def run(self, event, step):
            return 1

    insts = [get_workflow("answered").create() for _ in range(3)]
    testing.run_until_idle()
    assert [i.result(timeout=5) for i in insts] == [1, 1, 1]
    assert len(live.result_waiters) == 0


def test_the_second_copy_of_a_creates_hint_wakes_no_claim_that_would_find_nothing(
    registered, loop_thread
):
    """On PostgreSQL a create's hint reaches a worker of its own process twice: at once,
    and through its NOTIFY, often while the claim the first copy woke is out."""
    gate = threading.Event()

    @register("held-here")
    class HeldHere(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.do("hold", lambda: gate.wait(20) and "done")

    held = get_workflow("held-here").create(id="held").row().pk
    worker = new_worker(concurrency=2, poll_seconds=5)
    claim = worker._admit_then_claim

    def claim_then_hear_the_copy(free: int, exclude: list[int]) -> Any:
        claimed = claim(free, exclude)
        for taken, _, _ in claimed:  # the NOTIFY's copy arrives while the claim is out
            worker.hint("created", taken)
        return claimed

    worker._admit_then_claim = claim_then_hear_the_copy  # type: ignore[method-assign]

    async def hear(kind: str, hinted: int | None) -> bool:
        worker._wake.clear()
        worker._on_hint(kind, hinted)
        return worker._wake.is_set()

    async def woken_then_claim() -> bool:
        worker._wake.clear()
        worker._on_hint("schedule", None)  # while the loop fired ticks, before its claim
        assert await worker.claim_and_start() == 1
        return worker._wake.is_set()

    try:
        loop_thread.call(worker.start())
        assert loop_thread.call(worker.claim_and_start()) == 1
        assert set(worker.tasks) == {held}
        assert not worker._wake.is_set(), "the copy of the hint the claim answered woke the loop"
        assert not loop_thread.call(hear("created", held))  # a late copy: it runs here
        assert loop_thread.call(hear("event", held))  # an event may be for its next wait
        assert loop_thread.call(hear("wake", None))
        other = get_workflow("held-here").create(id="other").row().pk
        assert loop_thread.call(hear("created", other))  # not here
        # Woken before the claim went out: the copy the claim answers (of "other") does
        # not put that wake-up to sleep with it.
        assert loop_thread.call(woken_then_claim())
        assert set(worker.tasks) == {held, other}
    finally:
        gate.set()
        loop_thread.call(worker.stop(grace_seconds=5))


def test_a_result_is_woken_by_the_end_and_a_history_follower_by_every_step():
    from workflows_app import live

    waiters = live.ResultWaiters()
    with (
        waiters.waiting(7) as result,
        waiters.waiting(7, every_change=True) as follower,
        waiters.waiting(8) as other,
    ):
        waiters.wake(7, history_only=True)  # a step's history was written
        assert follower.is_set() and not result.is_set() and not other.is_set()
        follower.clear()
        waiters.wake(7)  # a change of state: the end, a pause, a terminate
        assert follower.is_set() and result.is_set() and not other.is_set()
    assert len(waiters) == 0


def test_a_result_waiting_on_a_running_instance_reads_it_again_only_at_its_end(
    registered, loop_thread, monkeypatch
):
    """Woken by each step's history, result() read the row once a step, in the caller's
    thread, while the engine ran the next one (each step waited for that read)."""
    from workflows_app.client import InstanceHandle

    def pause_a_little() -> None:
        time.sleep(0.02)  # steps far enough apart that each one's wake-up is read alone

    @register("twenty-steps")
    class TwentySteps(WorkflowEntrypoint):
        async def run(self, event, step):
            for n in range(20):
                await step.do(f"s{n}", pause_a_little)
            return "done"

    handle = get_workflow("twenty-steps").create(id="twenty")
    reads = []
    real_row = InstanceHandle.row
    monkeypatch.setattr(
        InstanceHandle, "row", lambda self, *a: reads.append(1) or real_row(self, *a)
    )
    worker = new_worker(poll_seconds=5)
    stop = asyncio.Event()
    serving = loop_thread.spawn(worker.serve(stop))
    try:
        assert handle.result(timeout=30) == "done"
    finally:
        loop_thread.loop.call_soon_threadsafe(stop.set)
        serving.result(30)
    # Its key, the first look, the end's wake-up, and one more for each second of the
    # run (the re-read that covers other processes); a read a step was 21 or more.
    assert len(reads) <= 5, f"result() read the instance {len(reads)} times for 20 steps"


def test_pending_hints_fold_wakes_into_one_and_stay_bounded():
    from workflows_app.live import PendingHints

    hints = PendingHints()
    for pk in range(20_000):
        hints.put({"type": "wf.hint", "kind": "created", "pk": pk})
    assert len(hints) == 1
    for pk in range(PendingHints.MAX + 50):
        hints.put({"type": "wf.hint", "kind": "terminate", "pk": pk})
    assert len(hints) == PendingHints.MAX
    taken = hints.take()
    assert taken[-1][1]["pk"] == PendingHints.MAX + 49 and len(hints) == 0


def test_an_event_for_a_waiting_step_comes_with_the_load_without_a_read_of_its_own(
    registered, monkeypatch
):
    from workflows_app import testing

    @register("preloaded")
    class Preloaded(WorkflowEntrypoint):
        async def run(self, event, step):
            got = await step.wait_for_event("approval", type="go")
            return got.payload

    inst = get_workflow("preloaded").create()
    testing.run_until_idle()  # parks in the wait
    inst.send_event("noise", {"n": 0})
    inst.send_event("go", {"ok": True})
    reads: list[str] = []
    real = store.unconsumed_events
    monkeypatch.setattr(store, "unconsumed_events", lambda *a: reads.append(a[1]) or real(*a))
    testing.run_until_idle()
    assert inst.status().output == {"ok": True}
    assert reads == []
    loaded = store.load_run(inst.row().pk)  # finished: nothing waits, nothing is read
    assert loaded.events == {}


def test_a_heartbeat_finds_its_leases_through_an_index_not_a_table_scan(registered):
    from django.db import connection, transaction

    @register("leased")
    class Leased(WorkflowEntrypoint):
        async def run(self, event, step):
            return 1

    for n in range(50):
        get_workflow("leased").create(id=f"l{n}")
    # All leased: instance_lease_expiry holds them all too, and only the token's index
    # finds one lease without reading the others.
    claimed = store.claim_runnable("w", 50, lease_seconds=30)
    assert len(claimed) == 50
    token = claimed[0][1]
    sql, params = (
        Instance.objects.filter(lease_token__in=[token])
        .values_list("id", "lease_token")
        .query.sql_with_params()
    )
    with transaction.atomic(), connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute("SET LOCAL enable_seqscan = off")  # a tiny table: ask what it can use
            cursor.execute("EXPLAIN " + sql, params)
        else:
            cursor.execute("EXPLAIN QUERY PLAN " + sql, params)
        plan = " ".join(str(cell) for row in cursor.fetchall() for cell in row)
    assert "instance_leased" in plan, plan
    assert store.heartbeat([token], 30) == set()


async def test_database_threads_answer_each_call_and_cancel_the_queued_ones_at_close():
    """The worker's database calls: results and errors come back to the caller's loop; at
    close, calls still queued behind busy threads are cancelled, not left waiting forever."""
    from workflows_app.engine.worker import ConnectionThreads

    threads = ConnectionThreads(1, "test-db-calls")
    release = threading.Event()
    try:
        assert await threads(lambda a, b: a + b, 2, 3) == 5
        with pytest.raises(ZeroDivisionError):
            await threads(lambda: 1 / 0)
        started = threading.Event()

        def hold() -> bool:
            started.set()
            return release.wait(30)

        busy = asyncio.ensure_future(threads(hold))
        queued = asyncio.ensure_future(threads(lambda: "never"))
        await asyncio.sleep(0)  # both are handed to the one thread's queue
        assert started.wait(10)  # the first is running, the second waits behind it
        threads.close()
        release.set()
        assert await busy is True  # a call that had started runs to its end
        with pytest.raises(asyncio.CancelledError):
            await queued
        with pytest.raises(RuntimeError, match="closed"):
            await threads(lambda: 1)
    finally:
        release.set()


async def test_a_free_database_thread_takes_claims_and_heartbeats_first():
    """Calls queued behind a busy thread: those of the FIRST lane (claims, heartbeats) run
    before the NORMAL ones (checkpoints, span stores) queued earlier; within a lane, in
    the order they came. The worker sends its claims and heartbeats in the FIRST lane."""
    from workflows_app.engine.worker import ConnectionThreads

    threads = ConnectionThreads(1, "test-db-lanes")
    release, started = threading.Event(), threading.Event()
    order: list[str] = []

    def hold() -> None:
        started.set()
        assert release.wait(30)

    try:
        busy = asyncio.ensure_future(threads(hold))
        await asyncio.sleep(0)
        assert started.wait(10)
        calls = [
            asyncio.ensure_future(threads(order.append, "write 1")),
            asyncio.ensure_future(threads.in_lane(threads.FIRST, order.append, "claim")),
            asyncio.ensure_future(threads(order.append, "spans")),
            asyncio.ensure_future(threads.in_lane(threads.FIRST, order.append, "heartbeat")),
            asyncio.ensure_future(threads.in_lane(threads.NORMAL, order.append, "write 2")),
        ]
        await asyncio.sleep(0)  # all handed to the queue while the one thread is busy
        release.set()
        await asyncio.gather(busy, *calls)
        assert order == ["claim", "heartbeat", "write 1", "spans", "write 2"]
    finally:
        release.set()
        threads.close()

    worker = Worker(hooks=None)
    lanes: list[tuple[int, str]] = []

    class Recording:
        async def in_lane(self, lane, fn, *args):
            lanes.append((lane, getattr(fn, "__name__", "")))
            return [] if fn.__name__ == "_admit_then_claim" else set()

    worker.db = Recording()
    worker.tokens = {1: "token"}
    await worker.claim_and_start()
    await worker.heartbeat_once()
    assert lanes == [
        (ConnectionThreads.FIRST, "_admit_then_claim"),
        (ConnectionThreads.FIRST, "heartbeat"),
    ]


async def test_a_background_flush_runs_one_at_a_time_and_flush_now_waits_for_it():
    """The serve loop stores spans without waiting (an event sent meanwhile is claimed at
    once); a forced flush asked for during one runs after it; flush_now returns only when
    everything queued was stored."""
    from workflows_app.engine.worker import ConnectionThreads

    release = threading.Event()
    flushed: list[str] = []

    class Hooks:
        def flush(self) -> None:
            flushed.append("start")
            assert release.wait(10)
            flushed.append("end")

    worker = Worker(hooks=Hooks())
    worker.db = ConnectionThreads(1, "test-flush")
    try:
        worker.flush_in_background(force=True)
        worker.flush_in_background(force=True)  # one is in flight: runs once more after it
        worker.flush_in_background(force=False)
        await asyncio.sleep(0)
        release.set()
        await worker.flush_now()
        assert flushed == ["start", "end"] * 3  # the background one, its rerun, flush_now's
    finally:
        release.set()
        worker.db.close()


def test_the_first_worker_of_a_process_tunes_the_garbage_collector_once(monkeypatch):
    """Freeze what is alive and collect the youngest generation less often; once per
    process, never over a larger threshold, never with the collector off."""
    import gc

    from workflows_app.engine import worker

    saved = gc.get_threshold()
    try:
        monkeypatch.setattr(worker, "_gc_tuned", False)
        gc.set_threshold(700, 10, 10)
        worker.tune_garbage_collector()
        assert gc.get_threshold() == (worker.GC_FIRST_GENERATION, 10, 10)
        assert gc.get_freeze_count() > 0
        gc.set_threshold(700, 10, 10)
        worker.tune_garbage_collector()  # done already in this process
        assert gc.get_threshold() == (700, 10, 10)

        monkeypatch.setattr(worker, "_gc_tuned", False)
        gc.set_threshold(worker.GC_FIRST_GENERATION * 2, 5, 5)
        worker.tune_garbage_collector()
        assert gc.get_threshold() == (worker.GC_FIRST_GENERATION * 2, 5, 5)

        monkeypatch.setattr(worker, "_gc_tuned", False)
        gc.set_threshold(700, 10, 10)
        gc.disable()
        try:
            worker.tune_garbage_collector()
        finally:
            gc.enable()
        assert gc.get_threshold() == (700, 10, 10)
    finally:
        gc.set_threshold(*saved)


def test_a_stop_that_comes_between_a_claim_and_its_runs_reaches_those_runs(
    registered, loop_thread, monkeypatch
):
    """A stop signal handled while a claim's answer was on its way to the loop (a busy
    server: SIGTERM then SIGINT to runserver just as its worker claimed) stopped the runs
    there were, none: the claimed run registered afterwards, neither drained nor cut short,
    and started its step; the second signal's hurry was lost and the drain waited out its
    whole grace. A run registered once the worker is stopping now drains (and, hurried,
    is cut short) before it starts any work, its lease given back."""
    started = threading.Event()
    release = threading.Event()

    @register("long-step")
    class LongStep(WorkflowEntrypoint):
        async def run(self, event, step):
            def work():
                started.set()
                release.wait(30)
                return "done"

            return await step.do("work", work, retries={"limit": 0})

    inst = get_workflow("long-step").create(id="late")
    worker = new_worker()
    claim = store.claim_and_load

    def claim_then_signals(*args: Any, **kwargs: Any) -> Any:
        result = claim(*args, **kwargs)
        if result.runs:  # both signals, handled before the loop sees this claim's answer
            worker.ask_to_stop("SIGTERM")
            worker.ask_to_stop("SIGINT")
            loop_thread.loop.call_soon_threadsafe(worker.hurry)
        return result

    monkeypatch.setattr(store, "claim_and_load", claim_then_signals)
    try:
        loop_thread.call(worker.start())
        loop_thread.call(worker.run_until_idle(timeout=20))
        assert not started.is_set(), "the claimed run started its step after the stop"
        loop_thread.call(worker.stop(grace_seconds=30), timeout=10)
        row = Instance.objects.get(pk=inst.row().pk)
        assert (row.lease_token, row.lease_owner) == (None, "")
        assert row.status == "running"  # due at once for another worker
    finally:
        release.set()
