"""The engine's core behaviour: replay, retries, sleeps, events, parking."""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest

from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import NonRetryableError, WorkflowEntrypoint, current_step, register
from workflows_app.engine.errors import EventTimeout
from workflows_app.models import HistoryRecord, Instance, StepRecord

pytestmark = pytest.mark.django_db(transaction=True)

calls: Counter[str] = Counter()


@pytest.fixture(autouse=True)
def _reset_calls():
    calls.clear()


def counted(name, value=None):
    def fn():
        calls[name] += 1
        return value if value is not None else name

    return fn


def test_a_crash_between_steps_resumes_at_the_next_step_without_rerunning_earlier_ones(registered):
    @register("crashy")
    class Crashy(WorkflowEntrypoint):
        async def run(self, event, step):
            a = await step.do("one", counted("one", 1))
            b = await step.do("two", counted("two", 2))
            c = await step.do("three", counted("three", 3))
            return a + b + c

    inst = get_workflow("crashy").create()
    # Simulate a worker that died after step two: run only two steps under a lease that
    # then expires, by mocking step three to kill the run (a BaseException the engine
    # does not handle, like a process dying).
    with testing.fake_clock() as clock:
        Instance.objects.filter(instance_id=inst.id).update(
            lease_token="dead",
            lease_owner="crashed",
            lease_expires_at=clock.now() + timedelta(seconds=30),
        )
        StepRecord.objects.bulk_create(
            [
                StepRecord(
                    instance=inst.row(),
                    name="one",
                    kind="do",
                    seq=1,
                    status="complete",
                    output_json="1",
                    attempts=1,
                    started_at=clock.now(),
                ),
                StepRecord(
                    instance=inst.row(),
                    name="two",
                    kind="do",
                    seq=2,
                    status="complete",
                    output_json="2",
                    attempts=1,
                    started_at=clock.now(),
                ),
            ]
        )
        assert testing.run_until_idle() == 0  # the lease is still live: nobody may take it
        clock.advance("31 seconds")  # the crashed worker's lease expires
        assert testing.run_until_idle() == 1
    assert inst.status().status == "complete"
    assert inst.status().output == 6
    assert calls == {"three": 1}


def test_replay_returns_checkpoints_and_runs_each_callable_once(registered):
    @register("replayer")
    class Replayer(WorkflowEntrypoint):
        async def run(self, event, step):
            a = await step.do("a", counted("a", {"n": 1}))
            await step.sleep("nap", "1 hour")
            b = await step.do("b", counted("b", [1, None, "x"]))
            nothing = await step.do("none", lambda: calls.update(["none"]))
            return {"a": a, "b": b, "none": nothing}

    inst = get_workflow("replayer").create()
    with testing.fake_clock() as clock:
        testing.run_until_idle()
        assert inst.status().status == "waiting"
        clock.advance("1 hour")
        testing.run_until_idle()
    assert inst.status().output == {"a": {"n": 1}, "b": [1, None, "x"], "none": None}
    assert calls == {"a": 1, "b": 1, "none": 1}


def test_a_run_loads_checkpoints_in_a_constant_number_of_queries(
    registered, django_assert_max_num_queries
):
    from workflows_app.engine import store

    @register("many-steps")
    class ManySteps(WorkflowEntrypoint):
        async def run(self, event, step):
            for i in range(30):
                await step.do(f"s{i}", lambda i=i: i)

    inst = get_workflow("many-steps").create()
    testing.run_until_idle()
    pk = inst.row().pk
    with django_assert_max_num_queries(3):
        loaded = store.load_run(pk)
    assert len(loaded.steps) == 30


def test_a_step_failing_twice_then_succeeding_completes_with_three_attempts(registered):
    @register("flaky")
    class Flaky(WorkflowEntrypoint):
        async def run(self, event, step):
            def flaky():
                if current_step().attempt < 3:
                    raise ConnectionError(f"attempt {current_step().attempt}")
                return "ok"

            return await step.do(
                "flaky", flaky, retries={"limit": 5, "delay": "1 second", "backoff": "constant"}
            )

    inst = get_workflow("flaky").create()
    with testing.fake_clock() as clock:
        testing.run_until_idle()
        assert inst.status().status == "waiting"  # a retry wait parks the instance
        clock.advance("1 second")
        testing.run_until_idle()
        clock.advance("1 second")
        testing.run_until_idle()
    assert inst.status().status == "complete"
    (record,) = inst.steps()
    assert record.attempts == 3
    assert record.last_error_name == "ConnectionError"
    failures = [h.data for h in inst.history() if h.type == "step.failed"]
    assert [f["attempt"] for f in failures] == [1, 2]
    scheduled = [h.data for h in inst.history() if h.type == "step.retry_scheduled"]
    assert [(r["step"], r["delay_ms"]) for r in scheduled] == [("flaky", 1000), ("flaky", 1000)]


@pytest.mark.parametrize(
    ("backoff", "expected_ms"),
    [
        ("constant", [1000, 1000, 1000]),
        ("linear", [1000, 2000, 3000]),
        ("exponential", [1000, 2000, 4000]),
    ],
)
def test_retry_waits_follow_the_backoff(registered, backoff, expected_ms):
    @register(f"backoff-{backoff}")
    class Backoff(WorkflowEntrypoint):
        async def run(self, event, step):
            def always_fails():
                raise ValueError("nope")

            return await step.do(
                "fail", always_fails, retries={"limit": 3, "delay": 1000, "backoff": backoff}
            )

    inst = get_workflow(f"backoff-{backoff}").create()
    with testing.fake_clock() as clock:
        waits = []
        for _ in range(4):
            testing.run_until_idle()
            record = inst.steps()[0]
            if record.status == "failed":
                break
            waits.append(round((record.wake_at - clock.now()).total_seconds() * 1000))
            clock.advance(waits[-1])
    assert waits == expected_ms
    status = inst.status()
    assert status.status == "errored"
    assert status.error == {"name": "ValueError", "message": "nope"}
    assert inst.steps()[0].attempts == 4  # limit counts retries: limit + 1 runs


def test_non_retryable_error_fails_the_instance_at_once(registered):
    @register("fatal")
    class Fatal(WorkflowEntrypoint):
        async def run(self, event, step):
            def boom():
                calls["boom"] += 1
                raise NonRetryableError("card declined", "CardDeclined")

            await step.do("charge", boom, retries={"limit": 5, "delay": 0})
            await step.do("never", counted("never"))

    inst = get_workflow("fatal").create()
    testing.run_until_idle()
    status = inst.status()
    assert status.status == "errored"
    assert status.error == {"name": "CardDeclined", "message": "card declined"}
    assert calls == {"boom": 1}


def test_a_very_long_non_retryable_error_name_is_shortened_and_the_instance_errors(registered):
    long_name = "Declined" + "X" * 300  # longer than the 200 characters an error name column holds

    @register("long-error-name")
    class LongErrorName(WorkflowEntrypoint):
        async def run(self, event, step):
            def boom():
                raise NonRetryableError("card declined", name=long_name)

            await step.do("charge", boom)

    inst = get_workflow("long-error-name").create()
    testing.run_until_idle()
    status = inst.status()
    assert status.status == "errored"
    assert status.error["message"] == "card declined"
    assert len(status.error["name"]) == 200
    assert status.error["name"].startswith("DeclinedXXX") and status.error["name"].endswith("…")
    assert inst.steps()[0].last_error_name == status.error["name"]


def test_a_non_retryable_error_subclass_is_reported_under_its_own_name(registered):
    class CardDeclined(NonRetryableError):
        pass

    @register("subclassed-error")
    class SubclassedError(WorkflowEntrypoint):
        async def run(self, event, step):
            def boom():
                raise CardDeclined("card declined")

            await step.do("charge", boom)

    inst = get_workflow("subclassed-error").create()
    testing.run_until_idle()
    assert inst.status().error == {"name": "CardDeclined", "message": "card declined"}
    assert NonRetryableError("plain").error_name == "NonRetryableError"
    assert CardDeclined("named", name="Other").error_name == "Other"


def test_a_step_exceeding_its_timeout_counts_as_a_failed_attempt(registered):
    @register("slow")
    class Slow(WorkflowEntrypoint):
        async def run(self, event, step):
            async def slow():
                calls["slow"] += 1
                if calls["slow"] == 1:
                    await asyncio.sleep(5)
                return "fast enough"

            return await step.do("slow", slow, timeout=50, retries={"limit": 1, "delay": 0})

    inst = get_workflow("slow").create()
    testing.run_until_idle()
    assert inst.status().output == "fast enough"
    record = inst.steps()[0]
    assert record.attempts == 2
    assert record.last_error_name == "StepTimeout"


def test_a_sync_step_past_its_timeout_is_abandoned_and_its_late_result_discarded(registered):
    import threading

    release = threading.Event()

    @register("slow-sync")
    class SlowSync(WorkflowEntrypoint):
        async def run(self, event, step):
            def slow():
                calls["slow"] += 1
                if calls["slow"] == 1:
                    release.wait(5)
                    return "late"
                return "second"

            return await step.do("slow", slow, timeout=50, retries={"limit": 1, "delay": 0})

    inst = get_workflow("slow-sync").create()
    testing.run_until_idle()
    release.set()
    assert inst.status().output == "second"


def test_sleep_parks_the_instance_until_the_clock_reaches_its_end(registered):
    @register("sleeper")
    class Sleeper(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.sleep("nap", "2 hours")
            return await step.do("after", counted("after"))

    inst = get_workflow("sleeper").create()
    with testing.fake_clock() as clock:
        testing.run_until_idle()
        assert inst.status().status == "waiting"
        clock.advance("1 hour")
        assert testing.run_until_idle() == 0
        assert inst.status().status == "waiting"
        clock.advance("1 hour")
        assert testing.run_until_idle() == 1
    assert inst.status().status == "complete"


def test_sleep_until_parks_until_the_instant_and_replays_the_stored_wake_time(registered):
    start = datetime(2026, 12, 1, tzinfo=UTC)

    @register("until")
    class Until(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.sleep_until("launch", datetime(2027, 1, 1, tzinfo=UTC))
            return "launched"

    with testing.fake_clock(start) as clock:
        inst = get_workflow("until").create()
        testing.run_until_idle()
        assert inst.steps()[0].wake_at == datetime(2027, 1, 1, tzinfo=UTC)
        clock.set(datetime(2026, 12, 31, 23, 59, tzinfo=UTC))
        assert testing.run_until_idle() == 0
        clock.set(datetime(2027, 1, 1, tzinfo=UTC))
        testing.run_until_idle()
    assert inst.status().output == "launched"


def test_skip_sleep_wakes_a_sleep_at_once(registered):
    @register("skippable")
    class Skippable(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.sleep("long", "365 days")
            return "awake"

    inst = get_workflow("skippable").create()
    testing.run_until_idle()
    assert inst.status().status == "waiting"
    assert inst.skip_sleep() == 1
    testing.run_until_idle()
    assert inst.status().output == "awake"


def test_wait_for_event_parks_and_the_event_resumes_it(registered):
    @register("approval")
    class Approval(WorkflowEntrypoint):
        async def run(self, event, step):
            got = await step.wait_for_event("approve", type="approval", timeout="1 hour")
            return {"payload": got.payload, "type": got.type}

    inst = get_workflow("approval").create()
    testing.run_until_idle()
    assert inst.status().status == "waiting"
    assert [(p.name, p.type) for p in inst.pending_events()] == [("approve", "approval")]
    inst.send_event("approval", {"ok": True})
    testing.run_until_idle()
    assert inst.status().output == {"payload": {"ok": True}, "type": "approval"}
    assert inst.pending_events() == []


def test_a_sent_event_is_written_without_the_orm_on_either_database(registered):
    """PostgreSQL: one statement; SQLite: an UPDATE that takes the instance and returns the
    record's sequence, then the event's and the record's INSERTs (the ORM's seven
    statements cost 1.4 ms of query building a send)."""
    from django.db import connection

    @register("raw-send")
    class Waiter(WorkflowEntrypoint):
        async def run(self, event, step):
            got = await step.wait_for_event("wait", type="go", timeout="1 hour")
            return got.payload

    inst = get_workflow("raw-send").create()
    testing.run_until_idle()
    pk = inst.row().pk
    history_before = HistoryRecord.objects.filter(instance_id=pk).count()
    connection.close()  # the counter sees the statements of connections opened under it
    with testing.QueryCounter() as queries:
        inst.send_event("go", {"n": 1})
    writes = [s.lstrip().split(None, 2)[:2] for s in queries.statements]
    writes = [w for w in writes if w[0].upper() != "BEGIN" and "clock_timestamp" not in " ".join(w)]
    if connection.vendor == "postgresql":
        assert [w[0] for w in writes] == ["WITH"], queries.statements
    else:
        assert [w[0] for w in writes] == ["UPDATE", "INSERT", "INSERT"], queries.statements
    sent = HistoryRecord.objects.get(instance_id=pk, type="event.sent")
    assert sent.sequence == history_before + 1 and sent.data["type"] == "go"
    assert inst.row().wake_at is not None
    testing.run_until_idle()
    assert inst.status().output == {"n": 1}


def send_null_once_the_wait_is_parked() -> str:
    """A step of "self-sent": once the other branch's wait is written (it looked for an
    event and found none), send the event it waits for to this instance."""
    from tests.polling import wait_until

    ctx = current_step()
    assert ctx is not None
    wait_until(
        lambda: StepRecord.objects.filter(
            instance__instance_id=ctx.instance_id, name="wait", status="waiting"
        ).exists(),
        30,
        "the wait's record",
    )
    get_workflow("self-sent").get(ctx.instance_id).send_event("null", {"n": 1})
    return "sent"


def test_an_event_sent_after_the_wait_looked_but_before_the_run_parked_wakes_it(registered):
    """The park sees an awaited event the run did not read (it came while the run went
    on) and makes the instance due at once: the wait gets it in the next run. Its type is
    "null", which a PostgreSQL array written as text would read as NULL and miss."""

    @register("self-sent")
    class SelfSent(WorkflowEntrypoint):
        async def run(self, event, step):
            async def waiter():
                return (await step.wait_for_event("wait", type="null", timeout="1 hour")).payload

            return await asyncio.gather(
                waiter(), step.do("send", send_null_once_the_wait_is_parked)
            )

    inst = get_workflow("self-sent").create()
    testing.run_until_idle()
    assert inst.status().output == [{"n": 1}, "sent"]
    assert [h.type for h in inst.history()].count("run.started") == 2


def test_an_event_sent_before_the_wait_is_consumed_by_it(registered):
    @register("early")
    class Early(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.sleep("first", "1 minute")
            got = await step.wait_for_event("approve", type="approval")
            return got.payload

    inst = get_workflow("early").create()
    with testing.fake_clock() as clock:
        testing.run_until_idle()
        inst.send_event("approval", "early bird")
        assert inst.status().status == "waiting"  # still sleeping: the event is buffered
        clock.advance("1 minute")
        testing.run_until_idle()
    assert inst.status().output == "early bird"


def test_a_wait_timeout_fails_the_step_with_a_clear_error(registered):
    @register("impatient")
    class Impatient(WorkflowEntrypoint):
        async def run(self, event, step):
            try:
                await step.wait_for_event("approve", type="approval", timeout="10 seconds")
            except EventTimeout as exc:
                return f"caught: {exc}"

    inst = get_workflow("impatient").create()
    with testing.fake_clock() as clock:
        testing.run_until_idle()
        clock.advance("10 seconds")
        testing.run_until_idle()
    assert inst.status().status == "complete"
    assert "timed out" in inst.status().output and "approval" in inst.status().output
    assert any(h.type == "event.timeout" for h in inst.history())


def test_an_uncaught_wait_timeout_errors_the_instance(registered):
    @register("impatient2")
    class Impatient2(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.wait_for_event("approve", type="approval", timeout="1 second")

    inst = get_workflow("impatient2").create()
    with testing.fake_clock() as clock:
        testing.run_until_idle()
        clock.advance("1 second")
        testing.run_until_idle()
    assert inst.status().status == "errored"
    assert inst.status().error["name"] == "EventTimeout"


def test_parallel_steps_under_gather_replay_correctly(registered):
    @register("parallel")
    class Parallel(WorkflowEntrypoint):
        async def run(self, event, step):
            async def slow_a():
                await asyncio.sleep(0.02)
                calls["a"] += 1
                return "a"

            a, b = await asyncio.gather(step.do("a", slow_a), step.do("b", counted("b")))
            await step.sleep("pause", "1 minute")
            c = await step.do("c", counted("c"))
            return [a, b, c]

    inst = get_workflow("parallel").create()
    with testing.fake_clock() as clock:
        testing.run_until_idle()
        clock.advance("1 minute")
        testing.run_until_idle()
    assert inst.status().output == ["a", "b", "c"]
    assert calls == {"a": 1, "b": 1, "c": 1}


def test_parallel_branches_progress_while_another_sleeps(registered):
    @register("branches")
    class Branches(WorkflowEntrypoint):
        async def run(self, event, step):
            async def sleeper():
                await step.sleep("nap", "1 hour")
                return await step.do("after nap", counted("after nap"))

            async def worker():
                out = []
                for i in range(3):
                    out.append(await step.do(f"work {i}", counted(f"work {i}", i)))
                return out

            return await asyncio.gather(sleeper(), worker())

    inst = get_workflow("branches").create()
    with testing.fake_clock() as clock:
        testing.run_until_idle()
        assert inst.status().status == "waiting"
        assert calls == {"work 0": 1, "work 1": 1, "work 2": 1}
        clock.advance("1 hour")
        testing.run_until_idle()
    assert inst.status().output == ["after nap", [0, 1, 2]]


def test_a_changed_workflow_fails_with_a_non_determinism_error(registered):
    @register("changing")
    class V1(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do("thing", counted("thing"))
            await step.sleep("nap", "1 minute")

    inst = get_workflow("changing").create()
    with testing.fake_clock() as clock:
        testing.run_until_idle()
        from workflows_app.engine import registry

        registry.unregister("changing")

        @register("changing")
        class V1Changed(WorkflowEntrypoint):
            async def run(self, event, step):
                await step.sleep("thing", "1 minute")  # same name, another kind

        from django.conf import settings

        settings.WFDASH["STRICT_VERSIONS"] = False
        try:
            clock.advance("1 minute")
            testing.run_until_idle()
        finally:
            settings.WFDASH["STRICT_VERSIONS"] = True
    status = inst.status()
    assert status.status == "errored"
    assert status.error["name"] == "NonDeterminismError"
    assert "thing" in status.error["message"]


def test_duplicate_step_names_raise_an_error_naming_the_step(registered):
    @register("dupes")
    class Dupes(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do("same", counted("x"))
            await step.do("same", counted("y"))

    inst = get_workflow("dupes").create()
    testing.run_until_idle()
    assert inst.status().error["name"] == "DuplicateStepName"
    assert '"same"' in inst.status().error["message"]


def test_history_is_gap_free_and_replays_add_no_duplicates(registered):
    @register("historian")
    class Historian(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do("one", counted("one"))
            await step.sleep("nap", "1 minute")
            await step.do("two", counted("two"))

    inst = get_workflow("historian").create()
    with testing.fake_clock() as clock:
        testing.run_until_idle()
        clock.advance("1 minute")
        testing.run_until_idle()
    sequences = list(
        HistoryRecord.objects.filter(instance=inst.row())
        .order_by("sequence")
        .values_list("sequence", flat=True)
    )
    assert sequences == list(range(1, len(sequences) + 1))
    types = [h.type for h in inst.history()]
    assert types.count("step.completed") == 2
    assert types.count("sleep.started") == 1 and types.count("sleep.completed") == 1
    assert types[0] == "instance.created" and types[-1] == "instance.completed"
    assert types.count("run.started") == 2


def test_a_lambda_returning_a_coroutine_has_the_coroutine_awaited_as_the_step(registered):
    async def fetch(n):
        await asyncio.sleep(0)
        calls["fetch"] += 1
        return {"n": n, "step": current_step().step_name}

    async def too_slow():
        await asyncio.sleep(5)

    @register("lambda-async")
    class LambdaAsync(WorkflowEntrypoint):
        async def run(self, event, step):
            plain = await step.do("plain", lambda: fetch(1))
            with_context = await step.do("with-context", lambda ctx: fetch(ctx.attempt))
            try:
                await step.do("slow", lambda: too_slow(), timeout="50 ms", retries={"limit": 0})
            except Exception as exc:
                return [plain, with_context, str(exc)]

    inst = get_workflow("lambda-async").create()
    testing.run_until_idle()
    status = inst.status()
    assert status.status == "complete", status.error
    plain, with_context, slow_error = status.output
    assert plain == {"n": 1, "step": "plain"}
    assert with_context == {"n": 1, "step": "with-context"}
    assert "timed out after 50 ms" in slow_error
    assert calls == {"fetch": 2}


def test_a_workflow_whose_constructor_raises_errors_in_its_first_run(registered):
    @register("bad-constructor")
    class BadConstructor(WorkflowEntrypoint):
        def __init__(self, instance_id=""):
            super().__init__(instance_id)
            raise KeyError("MISSING_SETTING")

        async def run(self, event, step):
            return "never"

    inst = get_workflow("bad-constructor").create()
    assert testing.run_until_idle() == 1
    row = inst.row()
    assert (row.status, row.run_count) == ("errored", 1)
    assert inst.status().error == {"name": "KeyError", "message": "'MISSING_SETTING'"}
    assert row.lease_token is None


def test_the_decorator_form_of_step_do_works(registered):
    @register("decorated")
    class Decorated(WorkflowEntrypoint):
        async def run(self, event, step):
            @step.do("charge", retries={"limit": 0})
            async def charge():
                return {"amount": 5}

            result = await charge()
            return result["amount"]

    inst = get_workflow("decorated").create()
    testing.run_until_idle()
    assert inst.status().output == 5


def test_a_step_callable_taking_one_argument_gets_its_context(registered):
    @register("ctx")
    class Ctx(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.do("keyed", lambda ctx: ctx.idempotency_key)

    inst = get_workflow("ctx").create(id="order-7")
    testing.run_until_idle()
    assert inst.status().output == "order-7:keyed"


def test_the_orm_works_inside_sync_steps(registered):
    @register("orm")
    class Orm(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.do("count", lambda: Instance.objects.filter(workflow="orm").count())

    inst = get_workflow("orm").create()
    testing.run_until_idle()
    assert inst.status().output == 1


def test_a_sleep_ending_within_a_second_is_waited_for_in_its_run_not_parked(registered):
    @register("short-nap")
    class ShortNap(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.sleep("nap", "200 milliseconds")
            return "rested"

    inst = get_workflow("short-nap").create()
    testing.run_until_idle()
    assert inst.status().status == "complete" and inst.status().output == "rested"
    history = list(
        HistoryRecord.objects.filter(instance_id=inst.row().pk)
        .order_by("sequence")
        .values_list("type", flat=True)
    )
    assert history.count("run.started") == 1  # no park, no second run
    assert history.index("sleep.started") < history.index("sleep.completed")
    nap = StepRecord.objects.get(instance_id=inst.row().pk, name="nap")
    assert nap.completed_at >= nap.wake_at  # not early


def test_a_sleep_longer_than_a_second_still_parks_its_instance(registered):
    @register("long-nap")
    class LongNap(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.sleep("nap", "5 seconds")
            return "rested"

    parked = get_workflow("long-nap").create()
    testing.run_until_idle()
    assert parked.status().status == "waiting"
    assert (
        HistoryRecord.objects.filter(instance_id=parked.row().pk, type="run.started").count() == 1
    )


def test_a_step_callable_takes_the_context_when_it_has_one_required_positional_argument():
    """The fast answer from the code object agrees with inspect.signature on every shape."""
    import functools

    from workflows_app.engine.step import _takes_context

    class Steps:
        def with_context(self, ctx):
            return ctx

        def without(self):
            return 1

        def __call__(self, ctx):
            return ctx

    def decorated(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return fn(*args, **kwargs)

        return wrapper

    def one(ctx):
        return ctx

    takes = [
        one,
        Steps().with_context,
        Steps(),
        decorated(one),
        functools.partial(lambda a, b: a, 1),
    ]
    takes_not = [
        lambda: 1,
        lambda ctx=None: ctx,
        lambda a, b: a,
        lambda *args: args,
        lambda *, ctx: ctx,
        Steps().without,
        decorated(lambda: 1),
        print,
    ]
    assert [_takes_context(fn) for fn in takes] == [True] * len(takes)
    assert [_takes_context(fn) for fn in takes_not] == [False] * len(takes_not)


def test_a_step_callable_is_async_as_inspect_says_on_every_shape():
    """_is_async answers a plain function from its code's flag (inspect's ten calls were
    a step's largest share of the engine's own calls in a herd of timers); every other
    shape goes through inspect as before. Both must agree with inspect's own answer."""
    import functools
    import inspect
    import sys

    from workflows_app.engine.step import _is_async

    async def coroutine_fn():
        return 1

    def plain():
        return 1

    async def agen():
        yield 1

    def gen():
        yield 1

    class AsyncCall:
        async def __call__(self):
            return 1

        async def method(self):
            return 1

    def decorated(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return fn(*args, **kwargs)

        return wrapper

    def expected(fn):
        target = fn.func if isinstance(fn, functools.partial) else fn
        return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(
            type(target).__call__
        )

    with_attribute = lambda: 1  # noqa: E731
    with_attribute.note = "an attribute"
    shapes = [
        coroutine_fn,
        plain,
        agen,
        gen,
        lambda: 1,
        with_attribute,
        AsyncCall(),
        AsyncCall().method,
        decorated(coroutine_fn),
        decorated(plain),
        functools.partial(coroutine_fn),
        functools.partial(plain),
        print,
    ]
    if sys.version_info >= (3, 12):
        marked = lambda: 1  # noqa: E731
        shapes.append(inspect.markcoroutinefunction(marked))
    assert [_is_async(fn) for fn in shapes] == [expected(fn) for fn in shapes]
    assert _is_async(coroutine_fn) and not _is_async(plain) and not _is_async(agen)


def test_a_new_step_record_is_the_record_keywords_would_make():
    """new_step_record passes its values by position (Model.__init__'s fast path): every
    field must hold what the keyword form with the model's defaults gives."""
    from workflows_app.engine.step import new_step_record
    from workflows_app.models import StepKind, StepStatus

    made = new_step_record("charge", StepKind.DO, StepStatus.RUNNING, 7)
    expected = StepRecord(
        name="charge",
        kind=StepKind.DO,
        status=StepStatus.RUNNING,
        seq=7,
        started_at=made.started_at,
    )
    fields = [f.attname for f in StepRecord._meta.concrete_fields]
    assert [getattr(made, f) for f in fields] == [getattr(expected, f) for f in fields]
    assert made._state.adding and made._state.db is None
    made.attempts += 1  # records share no mutable default
    assert new_step_record("other", StepKind.DO, StepStatus.RUNNING, 8).attempts == 0


def test_the_stores_raw_sql_cursor_converts_placeholders_as_django_does():
    """sql_cursor: on SQLite the format-to-qmark conversion is cached per statement text;
    every result must be the one Django's own cursor gives."""
    from django.db import connection

    from workflows_app.engine.store import dialect

    query = "SELECT %s, %s || '%%', 'a%%s'"
    for _ in range(2):  # converted, then from the cache
        with dialect.sql_cursor() as cursor:
            cursor.execute(query, [1, "x"])
            ours = cursor.fetchone()
        with connection.cursor() as cursor:
            cursor.execute(query, [1, "x"])
            assert ours == cursor.fetchone() == (1, "x%", "a%s")
    if connection.vendor == "sqlite":
        assert dialect._QMARK_QUERIES[query] == "SELECT ?, ? || '%', 'a%s'"


def test_the_hot_statements_conversion_is_cached_whatever_their_size(settings):
    """statement_cursor (PostgreSQL): psycopg's `%s` to `$n` conversion is cached per text
    even for a statement over psycopg's own limits (4,096 bytes, 50 parameters), and a
    statement from the cache binds as psycopg binds it uncached."""
    from django.db import connection

    from workflows_app.engine.store import dialect

    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL only: the cursor of SQLite is Django's (see the test above)")
    settings.WFDASH = {**getattr(settings, "WFDASH", {}), "PG_PREPARE": True}
    values = list(range(60))
    padding = " " * 4100  # over psycopg's length limit too
    query = "SELECT " + ", ".join(["%s + 1"] * len(values)) + ", '%%s'" + padding
    for _ in range(2):  # converted, then from the cache
        with dialect.statement_cursor() as cursor:
            cursor.execute(query, values)
            assert cursor.fetchone() == (*(v + 1 for v in values), "%s")
    converted = dialect._PG_QUERIES[(query, connection.connection.info.encoding)]
    assert converted[0].startswith(b"SELECT $1 + 1, $2 + 1")


def test_a_plain_create_writes_its_row_record_and_attributes_and_a_taken_id_or_key_is_told(
    registered,
):
    """The short create (raw SQL, no ORM insert) on either database: the row it hands back
    is the row stored; a taken id raises, a used idempotency key returns its instance."""
    from workflows_app.engine.errors import InstanceAlreadyExists

    @register("plain-create")
    class PlainCreate(WorkflowEntrypoint):
        async def run(self, event, step):
            return event.payload

    workflow = get_workflow("plain-create")
    first = workflow.create(id="p-1", params={"n": 1}, idempotency_key="k-1")
    made = first.row(refresh=False)
    stored = first.row()
    fields = [f.attname for f in Instance._meta.concrete_fields]
    assert [getattr(made, f) for f in fields] == [getattr(stored, f) for f in fields]
    assert not made._state.adding
    assert [
        (h.sequence, h.type, h.data) for h in HistoryRecord.objects.filter(instance=stored)
    ] == [(1, "instance.created", {"version": 1, "status": "running"})]
    with pytest.raises(InstanceAlreadyExists, match="p-1"):
        workflow.create(id="p-1", params={"n": 2})
    assert workflow.create(id="p-2", idempotency_key="k-1").id == "p-1"
    tagged = workflow.create(id="p-3", attributes={"customer": "acme"})
    assert [i.id for i in workflow.list(attributes={"customer": "acme"}).instances] == [tagged.id]
    assert Instance.objects.filter(workflow="plain-create").count() == 2
    testing.run_until_idle()
    assert first.status().output == {"n": 1}
