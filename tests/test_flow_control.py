"""Flow control (SPEC §8): priority, max_concurrent_per_key, rate_limit and debounce."""

from __future__ import annotations

from datetime import timedelta

import pytest

from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, register, store
from workflows_app.engine.errors import InvalidInput, LimitExceeded
from workflows_app.engine.limits import Limits
from workflows_app.models import Instance

pytestmark = pytest.mark.django_db(transaction=True)


def register_gated(name: str, **limits) -> None:
    """A workflow that holds its place until it gets a "go" event, then returns its params."""

    @register(name, limits=limits)
    class Gated(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.wait_for_event("go", type="go", timeout="1 day")
            return event.payload


def statuses(insts) -> list[str]:
    return [i.status().status for i in insts]


def test_lower_priority_starts_first_and_equal_priorities_in_creation_order(registered):
    register_gated("prio", max_concurrent_instances=1)
    wf = get_workflow("prio")
    first = wf.create(id="first")
    later = [
        wf.create(id="b5", priority=5),
        wf.create(id="c1", priority=1),
        wf.create(id="d9", priority=9),
        wf.create(id="e1", priority=1),
        wf.create(id="f5"),
    ]
    assert first.status().status == "running"
    assert statuses(later) == ["queued"] * 5
    order = []
    current = first
    for _ in later:
        testing.run_until_idle()
        current.send_event("go")
        testing.run_until_idle()
        current = next(i for i in later if i.status().status == "waiting")
        order.append(current.id)
    assert order == ["c1", "e1", "b5", "f5", "d9"]


def test_priority_orders_batch_items_and_is_recorded_in_history(registered):
    register_gated("prio-batch", max_concurrent_instances=1)
    wf = get_workflow("prio-batch")
    a, b, c = wf.create_batch(
        [{"id": "a", "priority": 9}, {"id": "b", "priority": 0}, {"id": "c", "priority": 3}]
    )
    assert statuses([a, b, c]) == ["queued", "running", "queued"]
    assert b.history()[0].data["priority"] == 0
    assert "max_concurrent_instances (1) reached" in a.status().waiting_reason


def test_priority_and_keys_are_validated_with_the_field_named(registered):
    register_gated("prio-bad")
    wf = get_workflow("prio-bad")
    for bad in (10, -1, "1", True, 2.5):
        with pytest.raises(InvalidInput, match="priority must be an integer from 0 to 9"):
            wf.create(priority=bad)
    with pytest.raises(InvalidInput, match="concurrency_key must be a string"):
        wf.create(concurrency_key="")
    with pytest.raises(InvalidInput, match="debounce_key and debounce go together"):
        wf.create(debounce_key="k")
    with pytest.raises(LimitExceeded, match="max_sleep"):
        wf.create(debounce_key="k", debounce="400 days")
    with pytest.raises(InvalidInput, match="same debounce_key twice"):
        wf.create_batch(
            [
                {"debounce_key": "k", "debounce": "1 second"},
                {"debounce_key": "k", "debounce": "1 second"},
            ]
        )
    assert wf.list().instances == []  # nothing stored


def test_limits_refuse_a_bad_rate_limit_or_key_bound():
    with pytest.raises(InvalidInput, match="rate_limit must be"):
        Limits.build({"rate_limit": {"limit": 3}})
    with pytest.raises(InvalidInput, match="rate_limit limit must be a positive integer"):
        Limits.build({"rate_limit": {"limit": 0, "period": "1 minute"}})
    with pytest.raises(InvalidInput, match="max_concurrent_per_key must be a positive integer"):
        Limits.build({"max_concurrent_per_key": 0})
    assert (
        Limits.build({"rate_limit": {"limit": 3, "period": "1 minute"}}).rate_limit.period_ms
        == 60_000
    )


@pytest.mark.parametrize(
    ("limits", "named"),
    [
        # Shown as written in the reason queued instances wait: 507 characters, past the
        # 500 of waiting_reason (PostgreSQL: DataError at the admission that reached it).
        ({"rate_limit": {"limit": 1, "period": "1" + " " * 500 + "minute"}}, "rate_limit period"),
        # Passed to SQL as a LIMIT: "bigint out of range" (PostgreSQL), OverflowError
        # (SQLite) at every create.
        ({"max_concurrent_instances": 10**600}, "max_concurrent_instances"),
        ({"rate_limit": {"limit": 10**600, "period": "1 minute"}}, "rate_limit limit"),
        ({"max_concurrent_per_key": 2**63}, "max_concurrent_per_key"),
        ({"max_buffered_events": 2**31}, "max_buffered_events"),
    ],
)
def test_register_refuses_a_count_or_rate_period_the_engine_cannot_store(registered, limits, named):
    with pytest.raises(InvalidInput, match=named):
        register_gated("unbounded", **limits)


def test_the_largest_accepted_limits_create_and_queue_on_both_databases(registered):
    """The largest count passes to SQL and the longest period fits the reason it shows."""
    from workflows_app.engine.limits import MAX_COUNT_LIMIT, MAX_PERIOD_CHARS

    period = "1" + " " * (MAX_PERIOD_CHARS - 7) + "minute"
    register_gated(
        "widest",
        max_concurrent_instances=MAX_COUNT_LIMIT,
        rate_limit={"limit": 1, "period": period},
    )
    wf = get_workflow("widest")
    with testing.fake_clock():
        first, second = wf.create(), wf.create()
        assert statuses([first, second]) == ["running", "queued"]
        assert second.status().waiting_reason.startswith(f"rate_limit (1 per {period}) reached")
        second.terminate()
        assert statuses([first, second]) == ["running", "terminated"]


def test_max_concurrent_per_key_bounds_active_instances_sharing_a_key(registered):
    register_gated("per-key", max_concurrent_per_key=2)
    wf = get_workflow("per-key")
    a1, a2, a3 = (wf.create(id=f"a{n}", concurrency_key="customer-a") for n in range(1, 4))
    b1 = wf.create(id="b1", concurrency_key="customer-b")
    free = wf.create(id="free")  # no key: not bounded
    assert statuses([a1, a2, a3, b1, free]) == [
        "running",
        "running",
        "queued",
        "running",
        "running",
    ]
    assert a3.status().waiting_reason == ("max_concurrent_per_key (2) reached for key 'customer-a'")
    testing.run_until_idle()
    a2.pause()  # a paused instance that had started still holds its place
    testing.run_until_idle()
    assert a3.status().status == "queued"
    a1.send_event("go")
    testing.run_until_idle()
    assert statuses([a1, a3]) == ["complete", "waiting"]
    assert a3.status().waiting_reason == ""


def test_a_key_at_its_bound_does_not_hold_back_other_keys_behind_it(registered):
    register_gated("per-key-fair", max_concurrent_per_key=1, max_concurrent_instances=3)
    wf = get_workflow("per-key-fair")
    insts = [wf.create(id=f"x{n}", concurrency_key="x") for n in range(3)]
    y = wf.create(id="y", concurrency_key="y")
    assert statuses([*insts, y]) == ["running", "queued", "queued", "running"]


def test_rate_limit_starts_at_most_limit_per_period_and_the_rest_as_the_window_opens(registered):
    register_gated("rated", rate_limit={"limit": 2, "period": "1 minute"})
    wf = get_workflow("rated")
    with testing.fake_clock() as clock:
        insts = [wf.create(id=f"r{n}") for n in range(5)]
        assert statuses(insts) == ["running", "running", "queued", "queued", "queued"]
        reason = insts[2].status().waiting_reason
        assert reason.startswith("rate_limit (2 per 1 minute) reached; next start at ")
        testing.run_until_idle()
        admitted, next_at = store.admit_due([("rated", wf.definition().limits())])
        assert admitted == [] and next_at == clock.now() + timedelta(minutes=1)
        clock.advance("59 seconds")
        testing.run_until_idle()
        assert statuses(insts)[2:] == ["queued"] * 3
        clock.advance("1 second")
        testing.run_until_idle()  # the worker admits the queued ones as the window opens
        assert statuses(insts) == ["waiting", "waiting", "waiting", "waiting", "queued"]
        clock.advance("1 minute")
        testing.run_until_idle()
        assert statuses(insts)[4] == "waiting"


def test_a_worker_waits_for_the_rate_window_and_wakes_when_it_opens(registered):
    register_gated("rated-wake", rate_limit={"limit": 1, "period": "10 seconds"})
    wf = get_workflow("rated-wake")
    with testing.fake_clock() as clock:
        wf.create(id="one")
        wf.create(id="two")
        testing.run_until_idle()
        # What the serve loop reads to size its idle wait: the window's opening.
        from workflows_app.engine.worker import Worker

        async def next_admission():
            worker = Worker(worker_id="probe")
            await worker.start()
            try:
                await worker.claim_and_start()
                return worker.next_admission_at
            finally:
                await worker.stop(grace_seconds=0)

        import asyncio

        assert asyncio.run(next_admission()) == clock.now() + timedelta(seconds=10)


def test_debounce_updates_the_pending_instance_and_moves_its_start(registered):
    register_gated("debounced")
    wf = get_workflow("debounced")
    with testing.fake_clock() as clock:
        first = wf.create(params={"n": 1}, debounce_key="user-7", debounce="5 seconds")
        assert first.created and first.status().status == "queued"
        assert first.status().waiting_reason.startswith("debounced until ")
        other = wf.create(params={"n": 9}, debounce_key="user-8", debounce="5 seconds")
        assert other.id != first.id
        clock.advance("3 seconds")
        again = wf.create(params={"n": 2}, debounce_key="user-7", debounce="5 seconds")
        assert (again.id, again.created) == (first.id, False)
        clock.advance("4 seconds")  # 7 s after the first create, 4 s after the second
        testing.run_until_idle()
        assert first.status().status == "queued"
        assert other.status().status == "waiting"
        clock.advance("1 second")
        testing.run_until_idle()
        assert first.status().status == "waiting"
        first.send_event("go")
        testing.run_until_idle()
        assert first.status().output == {"n": 2}
        assert [h.type for h in first.history()][:3] == [
            "instance.created",
            "instance.debounced",
            "instance.started",
        ]
        # Once started, the key starts a new instance (after its own debounce).
        third = wf.create(params={"n": 3}, debounce_key="user-7", debounce="5 seconds")
        assert third.created and third.id != first.id


def test_a_retried_create_that_a_debounce_merged_returns_the_same_instance(registered):
    """A create merged into a pending instance keeps its own idempotency key: retried
    (a timeout, a redelivered request), before or after the instance started, it
    returns that instance and changes nothing, as any keyed create's retry does."""
    register_gated("debounced-keyed")
    wf = get_workflow("debounced-keyed")
    with testing.fake_clock() as clock:

        def create(n: int, key: str):
            return wf.create(
                params={"n": n}, idempotency_key=key, debounce_key="user-7", debounce="5 seconds"
            )

        first = create(1, "call-1")
        clock.advance("3 seconds")
        merged = create(2, "call-2")
        assert (merged.id, merged.created) == (first.id, False)
        clock.advance("1 second")
        retried = create(2, "call-2")
        assert (retried.id, retried.created) == (first.id, False)
        # The retry is the same call: it does not move the start again.
        assert first.row().admit_at == clock.now() + timedelta(seconds=4)
        assert [h.type for h in first.history()] == ["instance.created", "instance.debounced"]
        clock.advance("4 seconds")
        testing.run_until_idle()
        assert first.status().status == "waiting"
        late = create(2, "call-2")  # started: a new call of the key would start another
        assert (late.id, late.created) == (first.id, False)
        plain = wf.create(params={"n": 2}, idempotency_key="call-2")
        assert (plain.id, plain.created) == (first.id, False)
        first.send_event("go")
        testing.run_until_idle()
        assert first.status().output == {"n": 2}
    assert Instance.objects.filter(workflow="debounced-keyed").count() == 1


def test_a_debounce_that_ends_while_the_limit_is_full_waits_for_a_place(registered):
    register_gated("debounced-limited", max_concurrent_instances=1)
    wf = get_workflow("debounced-limited")
    with testing.fake_clock() as clock:
        holder = wf.create(id="holder")
        late = wf.create(id="late", debounce_key="k", debounce="1 second")
        clock.advance("2 seconds")
        testing.run_until_idle()
        assert late.status().status == "queued"
        assert late.status().waiting_reason == "max_concurrent_instances (1) reached"
        assert late.row().admit_at is None  # not due again until a place frees
        holder.send_event("go")
        testing.run_until_idle()
        assert late.status().status == "waiting"


def test_a_debounce_that_ended_takes_its_place_in_line_by_priority(registered):
    """The line's pages read the queue without any debounce (instance_in_line); one
    that ended and admit_due has not decided yet is read beside them, in line by
    priority: here ahead of an instance queued before it."""
    register_gated("debounced-in-line", max_concurrent_instances=1)
    wf = get_workflow("debounced-in-line")
    with testing.fake_clock() as clock:
        holder = wf.create(id="holder")
        plain = wf.create(id="plain")
        urgent = wf.create(id="urgent", priority=1, debounce_key="k", debounce="1 second")
        clock.advance("2 seconds")  # no admit_due: the run's end below finds it due
        assert urgent.row().waiting_reason.startswith("debounced until ")
        holder.terminate()
        assert (urgent.status().status, plain.status().status) == ("running", "queued")


def test_more_debounces_ending_at_once_than_a_pass_reads_start_by_priority(registered, monkeypatch):
    """More debounces ended than a pass reads (ADMISSION_SCAN, made 2 here: no worker
    admitted for a while): the pages read them in line, so the first by priority
    starts, not the first to have ended."""
    from workflows_app.engine.store import control

    register_gated("many-ended", max_concurrent_instances=1)
    wf = get_workflow("many-ended")
    monkeypatch.setattr(control, "ADMISSION_SCAN", 2)
    with testing.fake_clock() as clock:
        holder = wf.create(id="holder")
        ended = [
            wf.create(id=f"p{priority}", priority=priority, debounce_key=f"k{n}", debounce=after)
            for n, (priority, after) in enumerate(
                [(9, "1 second"), (8, "2 seconds"), (7, "3 seconds"), (1, "4 seconds")]
            )
        ]
        clock.advance("5 seconds")
        holder.terminate()
        assert [e.status().status for e in ended] == ["queued", "queued", "queued", "running"]


def test_the_api_creates_with_priority_and_keys_and_refuses_bad_ones_naming_the_field(registered):
    from django.test import Client

    from tests.test_api import Api, error_of
    from workflows_app import tokens

    register_gated("api-flow", max_concurrent_per_key=1)
    _, secret = tokens.issue("service")
    api = Api(Client(enforce_csrf_checks=True), secret)
    path = "/api/workflows/api-flow/instances"
    made = api.post(path, {"id": "a", "priority": 0, "concurrency_key": "k"})
    assert made.status_code == 201
    second = api.post(path, {"id": "b", "priority": 2, "concurrency_key": "k"})
    assert second.json()["result"]["status"] == "queued"
    shown = api.get(f"{path}/b").json()["result"]
    assert (shown["priority"], shown["concurrency_key"]) == (2, "k")
    assert "max_concurrent_per_key (1)" in shown["waiting_reason"]
    for body, field in (
        ({"priority": 12}, "priority"),
        ({"priority": "high"}, "priority"),
        ({"concurrency_key": 5}, "concurrency_key"),
        ({"debounce": "5 seconds"}, "debounce_key"),
        ({"debounce_key": "d", "debounce": "soon"}, "soon"),
    ):
        status, _code, message = error_of(api.post(path, body))
        assert status == 400 and field in message, (body, message)
    assert sorted(i.id for i in get_workflow("api-flow").list().instances) == ["a", "b"]
    debounced = api.post(path, {"debounce_key": "d", "debounce": "1 minute", "params": 1})
    again = api.post(path, {"debounce_key": "d", "debounce": "1 minute", "params": 2})
    assert (debounced.status_code, again.status_code) == (201, 200)
    assert again.json()["result"]["id"] == debounced.json()["result"]["id"]


def test_wf_start_takes_priority_and_a_concurrency_key(registered):
    import json
    from io import StringIO

    from django.core.management import call_command
    from django.core.management.base import CommandError

    register_gated("cli-flow", max_concurrent_instances=1)
    out = StringIO()
    call_command("wf", "start", "cli-flow", "--id", "first", stdout=out)
    call_command("wf", "start", "cli-flow", "--id", "low", "--priority", "8", stdout=out)
    call_command(
        "wf", "start", "cli-flow", "--id", "high", "--priority", "1", "--json",
        "--concurrency-key", "c", stdout=(out := StringIO()),
    )  # fmt: skip
    assert json.loads(out.getvalue())["status"] == "queued"
    wf = get_workflow("cli-flow")
    assert (wf.get("high").row().priority, wf.get("high").row().concurrency_key) == (1, "c")
    with pytest.raises(
        (CommandError, InvalidInput), match="priority must be an integer from 0 to 9"
    ):
        call_command("wf", "start", "cli-flow", "--priority", "11", stdout=StringIO())
    wf.get("first").send_event("go")
    testing.run_until_idle()
    assert statuses([wf.get("high"), wf.get("low")]) == ["waiting", "queued"]


def test_a_serving_worker_wakes_by_itself_when_a_debounce_ends(registered):
    """The poll interval is an hour: only the admit_at the worker read can wake it."""
    import asyncio

    from tests.polling import wait_until
    from tests.test_worker_operations import LoopThread
    from workflows_app.engine.worker import Worker

    @register("debounce-serve")
    class Quick(WorkflowEntrypoint):
        async def run(self, event, step):
            return event.payload

    loop_thread = LoopThread()
    worker = Worker(worker_id="debounce-serve", poll_seconds=3600)
    stop = asyncio.Event()
    serving = loop_thread.spawn(worker.serve(stop))
    try:
        wait_until(lambda: worker._loop is not None, 10, "the worker to start")
        inst = get_workflow("debounce-serve").create(
            params="late", debounce_key="k", debounce="300 ms"
        )
        assert inst.status().status == "queued"
        wait_until(lambda: inst.status().status == "complete", 10, "the debounced instance")
        assert inst.status().output == "late"
    finally:
        loop_thread.loop.call_soon_threadsafe(stop.set)
        serving.result(30)
        loop_thread.close()


def test_a_serving_worker_wakes_when_a_run_s_end_gives_the_queue_a_rate_window(registered):
    """One place, two starts a second: a's end starts b; b's end finds the place free but
    the window full, and gives c the window's opening as its time to start. A run's end
    hints nothing, so the worker (its poll an hour) must hear that c has a time."""
    import asyncio

    from tests.polling import wait_until
    from tests.test_worker_operations import LoopThread, new_worker

    @register(
        "rated-ends",
        limits={"max_concurrent_instances": 1, "rate_limit": {"limit": 2, "period": "1 second"}},
    )
    class Quick(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.do("one", lambda: "done")

    loop_thread = LoopThread()
    worker = new_worker(worker_id="rated-ends", poll_seconds=3600)  # its hooks wake result()
    stop = asyncio.Event()
    serving = loop_thread.spawn(worker.serve(stop))
    try:
        wait_until(lambda: worker._loop is not None, 10, "the worker to start")
        wf = get_workflow("rated-ends")
        _, b, c = (wf.create(id=name) for name in "abc")  # the window opens again 1 s after a's
        assert b.result(timeout=10) == "done"
        assert c.row().admit_at is not None  # b's end gave it the window's opening
        wait_until(lambda: c.status().status == "complete", 10, "c, once the window opens")
    finally:
        loop_thread.loop.call_soon_threadsafe(stop.set)
        serving.result(30)
        loop_thread.close()


def test_admission_counts_the_places_held_as_the_lifecycle_rule_says(registered):
    """Admission counts places in SQL (it runs on every create); the count must be the
    lifecycle's rule: every status that holds a place, a paused instance only once started."""
    from workflows_app.engine import clock, lifecycle
    from workflows_app.engine.store import control
    from workflows_app.models import Instance, Status

    register_gated("places", max_concurrent_instances=100, max_concurrent_per_key=100)
    wf = get_workflow("places")
    rows = []
    for n, status in enumerate(sorted(Status.values)):
        for started in (False, True):
            inst = wf.create(id=f"{status}-{started}", concurrency_key=f"k{n % 3}")
            rows.append((inst.row().pk, status, started))
    for pk, status, started in rows:
        Instance.objects.filter(pk=pk).update(
            status=status, started_at=clock.now() if started else None
        )
    held = [pk for pk, status, started in rows if lifecycle.holds_place(status, started)]
    assert 0 < len(held) < len(rows)
    limits = Limits(max_concurrent_instances=100, max_concurrent_per_key=100)
    assert control._free_slots("places", limits) == 100 - len(held)
    admission = control.Admission("places", limits, clock.now(), keys={"k0", "k1", "k2"})
    by_key = {f"k{n}": 0 for n in range(3)}
    for pk in held:
        by_key[Instance.objects.get(pk=pk).concurrency_key] += 1
    assert admission.key_active == by_key


def test_a_keys_places_held_are_counted_up_to_its_bound_and_decide_as_before(registered):
    """Each key's count stops at max_concurrent_per_key (a limit lowered under many active
    instances of a key counted them all at every admission); the decisions are the same:
    a key at or past its bound, counting the paused instances that started, holds back its
    new instance; a key under it starts one."""
    from workflows_app.engine import clock
    from workflows_app.engine.store import control

    register_gated("key-cap", max_concurrent_per_key=100)
    wf = get_workflow("key-cap")
    held = {  # key: (statuses of its instances, started)
        "past": [("waiting", True)] * 7 + [("paused", True)] * 3,
        "at": [("running", True), ("waiting", True), ("paused", True)],
        "under": [("waiting", True), ("paused", False), ("complete", True)],
    }
    for key, rows in held.items():
        for n, (status, started) in enumerate(rows):
            pk = wf.create(id=f"{key}-{n}", concurrency_key=key).row().pk
            Instance.objects.filter(pk=pk).update(
                status=status, started_at=clock.now() if started else None, wake_at=None
            )
    register_gated("key-cap", max_concurrent_per_key=3)  # lowered under them
    limits = Limits(max_concurrent_per_key=3)
    admission = control.Admission("key-cap", limits, clock.now(), keys=set(held) | {"none"})
    assert admission.key_active == {"past": 3, "at": 3, "under": 1, "none": 0}
    past, at, under, none = (
        wf.create(id=f"new-{key}", concurrency_key=key) for key in [*held, "none"]
    )
    assert statuses([past, at, under, none]) == ["queued", "queued", "running", "running"]
    assert past.status().waiting_reason == "max_concurrent_per_key (3) reached for key 'past'"
    assert at.status().waiting_reason == "max_concurrent_per_key (3) reached for key 'at'"
