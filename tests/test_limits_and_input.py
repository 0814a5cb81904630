"""Every limit and bad input raises the named error, naming the value; nothing is written."""

from __future__ import annotations

import contextlib
from datetime import datetime, timedelta, timezone

import pytest

from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, register
from workflows_app.engine.durations import LATEST_INSTANT
from workflows_app.engine.errors import (
    InstanceAlreadyExists,
    InstanceNotFound,
    InvalidDuration,
    InvalidEventType,
    InvalidInput,
    LimitExceeded,
    ResultTimeout,
    UnknownWorkflow,
    WorkflowError,
)
from workflows_app.engine.limits import Limits
from workflows_app.engine.step import StepFailed
from workflows_app.models import HistoryRecord, InboxEvent, Instance

pytestmark = pytest.mark.django_db(transaction=True)


def snapshot():
    return (
        list(Instance.objects.order_by("id").values_list("id", "status", "history_seq")),
        InboxEvent.objects.count(),
        HistoryRecord.objects.count(),
    )


@pytest.fixture
def waiter(registered):
    @register(
        "waiter",
        limits={
            "max_batch_size": 3,
            "max_instance_id_length": 40,
            "max_event_payload_bytes": 100,
            "max_params_bytes": 50,
        },
    )
    class Waiter(WorkflowEntrypoint):
        async def run(self, event, step):
            got = await step.wait_for_event(
                "wait",
                type="ping",
                schema={
                    "type": "object",
                    "required": ["n"],
                    "properties": {"n": {"type": "integer"}},
                },
            )
            return got.payload

    return get_workflow("waiter")


def test_unknown_workflow_and_instance_raise_named_errors(waiter):
    with pytest.raises(UnknownWorkflow, match="nope"):
        get_workflow("nope")
    with pytest.raises(InstanceNotFound, match="ghost"):
        waiter.get("ghost")
    with pytest.raises(UnknownWorkflow, match="version 9"):
        waiter.create(version=9)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"id": "x" * 41}, LimitExceeded, "max_instance_id_length is 40, got 41"),
        ({"id": "has space"}, InvalidInput, "has space"),
        ({"id": ""}, InvalidInput, None),
        ({"params": {"big": "y" * 60}}, LimitExceeded, "max_params_bytes"),
        ({"params": {"bad": object()}}, InvalidInput, "not JSON-serialisable"),
        ({"params": float("nan")}, InvalidInput, "not JSON-serialisable"),
        ({"retention": "forever"}, InvalidDuration, "forever"),
        ({"retention": "8000 years"}, InvalidDuration, "'8000 years': longer than the longest"),
        ({"retention": 9e18}, InvalidDuration, "1000 years (31536000000000 ms)"),
    ],
)
def test_create_refuses_bad_input_and_writes_nothing(waiter, kwargs, error, message):
    before = snapshot()
    with pytest.raises(error) as caught:
        waiter.create(**kwargs)
    assert isinstance(caught.value, WorkflowError)
    if message:
        assert message in str(caught.value)
    assert snapshot() == before


@pytest.mark.parametrize(
    ("actor", "message"),
    [
        ("ops\x00bot", "actor contains a NUL character at position 3"),
        ("ops\udcffbot", "actor is not valid Unicode text: surrogates not allowed at position 3"),
    ],
    ids=["nul", "surrogate"],
)
def test_an_actor_no_database_stores_is_refused_by_name_and_writes_nothing(waiter, actor, message):
    """actor= is recorded in history: a NUL was a DataError from PostgreSQL's driver (and
    stored on SQLite: the databases disagreed), a lone surrogate a UnicodeEncodeError
    from either, neither naming what was wrong. Both are InvalidInput naming the actor."""
    inst = waiter.create(id="acted")
    before = snapshot()
    for act in (
        lambda: waiter.create(id="other", actor=actor),
        lambda: inst.pause(actor=actor),
        lambda: inst.send_event("ping", {"n": 1}, actor=actor),
        lambda: inst.terminate(actor=actor),
    ):
        with pytest.raises(InvalidInput) as caught:
            act()
        assert str(caught.value) == message
        assert snapshot() == before


def test_durations_past_the_calendar_are_refused_in_limits_sleeps_and_timeouts(registered):
    with pytest.raises(InvalidDuration, match="'8000 years': longer than the longest duration"):
        register("eternal", limits={"max_sleep": "8000 years"})

    @register("far-future", limits={"max_sleep": "1000 years"})
    class FarFuture(WorkflowEntrypoint):
        async def run(self, event, step):
            kind = event.payload
            if kind == "sleep_until":
                utc_minus_5 = timezone(timedelta(hours=-5))
                await step.sleep_until("end", datetime(9999, 12, 31, 23, tzinfo=utc_minus_5))
            if kind == "sleep_until_ms":
                await step.sleep_until("end", 9e18)
            if kind == "timeout":
                await step.do("t", lambda: 1, timeout=1e20)
            if kind == "wait":
                await step.wait_for_event("w", type="t", timeout="9000 years")
            if kind == "retry_delay":
                await step.do("r", lambda: 1, retries={"delay": "2000 years"})

    wf = get_workflow("far-future")
    kinds = ("sleep_until", "sleep_until_ms", "timeout", "wait", "retry_delay")
    insts = {kind: wf.create(params=kind) for kind in kinds}
    testing.run_until_idle()
    for kind, inst in insts.items():
        status = inst.status()
        assert status.status == "errored", kind
        assert status.error["name"] == "InvalidDuration", (kind, status.error)
        message = status.error["message"]
        assert "1000 years" in message or "9999-12-31" in message, status.error


def test_an_instance_stored_with_a_retention_past_the_calendar_finishes_and_terminates(waiter):
    finished, live = waiter.create(id="finished"), waiter.create(id="live")
    # Rows stored before durations were bounded (a plain retention covers every outcome):
    Instance.objects.filter(instance_id__in=["finished", "live"]).update(
        retention_ms=9 * 10**18, retention_error_ms=9 * 10**18
    )
    testing.run_until_idle()
    finished.send_event("ping", {"n": 1})
    testing.run_until_idle()
    assert finished.status().status == "complete"
    assert live.terminate() is True
    assert live.status().status == "terminated"
    for inst in (finished, live):
        assert inst.row().expires_at == LATEST_INSTANT


def test_a_finished_instance_expires_its_retention_after_it_finished(waiter):
    kept = waiter.create(id="kept", retention="7 days")
    forever, zero = waiter.create(id="forever"), waiter.create(id="zero", retention=0)
    testing.run_until_idle()
    for inst in (kept, forever, zero):
        inst.send_event("ping", {"n": 1})
    testing.run_until_idle()
    assert {i.status().status for i in (kept, forever, zero)} == {"complete"}
    row = kept.row()
    assert row.expires_at == row.finished_at + timedelta(days=7)
    assert forever.row().expires_at is None and zero.row().expires_at is None


def test_a_duplicate_id_is_refused_and_ids_are_scoped_by_workflow(waiter, registered):
    waiter.create(id="same")
    with pytest.raises(InstanceAlreadyExists, match="same"):
        waiter.create(id="same")

    @register("other")
    class Other(WorkflowEntrypoint):
        async def run(self, event, step):
            return "other"

    other = get_workflow("other").create(id="same")
    assert other.row().workflow == "other"
    assert waiter.get("same").row().workflow == "waiter"
    waiter.create(id="only-in-w")
    with pytest.raises(InstanceNotFound):
        get_workflow("other").get("only-in-w")


def test_batches_are_all_or_nothing_and_bounded(waiter):
    before = snapshot()
    with pytest.raises(LimitExceeded, match="max_batch_size is 3, got 4"):
        waiter.create_batch([{"id": f"b{n}"} for n in range(4)])
    with pytest.raises(InvalidInput, match="same instance id twice"):
        waiter.create_batch([{"id": "b1"}, {"id": "b1"}])
    waiter.create(id="b2")
    before = snapshot()
    with pytest.raises(InstanceAlreadyExists, match="b2"):
        waiter.create_batch([{"id": "b1"}, {"id": "b2"}])
    assert snapshot() == before
    created = waiter.create_batch([{"id": "b1", "params": 1}, {"id": "b3", "params": 3}])
    assert [c.id for c in created] == ["b1", "b3"]


def test_an_empty_batch_creates_nothing_and_returns_an_empty_list(waiter):
    before = snapshot()
    assert waiter.create_batch([]) == []
    assert snapshot() == before
    with pytest.raises(UnknownWorkflow, match="version 9"):
        waiter.create_batch([], version=9)


def test_send_event_refuses_bad_types_payloads_and_finished_instances(waiter):
    inst = waiter.create(id="w1")
    testing.run_until_idle()
    before = snapshot()
    for bad_type in ["", "-starts-with-dash", "has space", "x" * 101, "ünïcode", None, 5]:
        with pytest.raises(InvalidEventType):
            inst.send_event(bad_type, {"n": 1})
    with pytest.raises(LimitExceeded, match="max_event_payload_bytes is 100 bytes"):
        inst.send_event("ping", {"n": 1, "pad": "z" * 100})
    with pytest.raises(InvalidInput, match="not JSON-serialisable"):
        inst.send_event("ping", {1, 2})
    with pytest.raises(InvalidInput) as caught:
        inst.send_event("ping", {"n": "not a number"})
    assert "n: 'not a number' is not of type 'integer'" in str(caught.value)
    assert snapshot() == before
    assert inst.status().status == "waiting"  # a schema violation leaves the instance waiting
    with pytest.raises(InstanceNotFound):
        waiter.get("nobody").send_event("ping", {"n": 1})
    inst.send_event("ping", {"n": 1})
    testing.run_until_idle()
    assert inst.status().output == {"n": 1}


@pytest.fixture
def notes(registered):
    """Takes two `note` events, then waits for `go`: notes sent before it runs are buffered."""

    @register("notes", limits={"max_buffered_events": 3})
    class Notes(WorkflowEntrypoint):
        async def run(self, event, step):
            first = await step.wait_for_event("first", type="note")
            second = await step.wait_for_event("second", type="note")
            await step.wait_for_event("go", type="go")
            return [first.payload, second.payload]

    return get_workflow("notes")


def test_an_instance_buffers_at_most_max_buffered_events_and_refuses_more_storing_nothing(notes):
    assert Limits().max_buffered_events == 1000  # the default
    inst = notes.create(id="n1")  # not run yet: every event waits to be taken
    for n in range(3):
        inst.send_event("note", n)
    before = snapshot()
    with pytest.raises(LimitExceeded) as refused:
        inst.send_event("note", 3)
    assert refused.value.limit == "max_buffered_events"
    assert str(refused.value) == (
        "event 'note' for instance 'n1' (events sent to it that no wait_for_event has taken "
        "yet): max_buffered_events is 3, got 4"
    )
    with pytest.raises(LimitExceeded):
        inst.send_event("go")  # whatever its type: the bound is on what the instance holds
    assert snapshot() == before
    testing.run_until_idle()  # its waits take two of the three: room for two more
    assert inst.status().status == "waiting"
    inst.send_event("go")
    testing.run_until_idle()
    assert inst.status().output == [0, 1]
    assert list(InboxEvent.objects.order_by("id").values_list("type", "payload_json")) == [
        ("note", "0"),
        ("note", "1"),
        ("note", "2"),
        ("go", "null"),
    ]


def test_a_full_instance_still_takes_the_event_a_wait_of_it_is_there_for(notes):
    """Full of events no wait takes yet, an instance refused the one its pending wait was
    for as well: a flood of another type kept it from ever going on."""
    inst = notes.create(id="n3")
    testing.run_until_idle()  # waits for a note at "first"
    for _ in range(3):
        inst.send_event("go")  # not waited for yet: fills the buffer
    inst.send_event("note", "taken")  # the waiting "first" takes it
    before = snapshot()
    with pytest.raises(LimitExceeded):
        inst.send_event("note", "more")  # "first" has its note: no wait left for this one
    assert snapshot() == before
    testing.run_until_idle()
    assert [s.name for s in inst.steps() if s.status == "complete"] == ["first"]


def test_concurrent_sends_to_one_instance_never_buffer_more_than_the_limit(notes):
    import threading

    from django.db import connections

    inst = notes.create(id="n2")
    start = threading.Barrier(6)
    outcomes: list[str] = []

    def sender(n: int) -> None:
        try:
            start.wait(10)
            for i in range(4):
                try:
                    get_workflow("notes").get("n2").send_event("note", [n, i])
                    outcomes.append("sent")
                except LimitExceeded:
                    outcomes.append("refused")
        except BaseException as exc:  # reported by the test
            outcomes.append(repr(exc))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=sender, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(outcomes) == ["refused"] * 21 + ["sent"] * 3
    row = inst.row()
    assert InboxEvent.objects.filter(instance=row).count() == 3
    sent = HistoryRecord.objects.filter(instance=row, type="event.sent").count()
    assert sent == 3 and row.history_seq == HistoryRecord.objects.filter(instance=row).count()


def test_max_buffered_events_is_a_positive_integer_or_none(registered):
    assert Limits.build({"max_buffered_events": None}).max_buffered_events is None  # no bound
    for bad in (0, -1, 2.5, True, "10"):
        with pytest.raises(InvalidInput, match="max_buffered_events must be a positive integer"):
            Limits.build({"max_buffered_events": bad})


def test_step_limits_name_the_limit_and_the_value(registered):
    @register(
        "limits",
        limits={
            "max_steps_per_workflow": 3,
            "max_step_name_length": 5,
            "max_step_output_bytes": 20,
            "max_sleep": "1 day",
        },
    )
    class Limits(WorkflowEntrypoint):
        async def run(self, event, step):
            kind = event.payload
            if kind == "steps":
                for i in range(4):
                    await step.do(f"s{i}", lambda i=i: i)
            if kind == "name":
                await step.do("too-long-name", lambda: 1)
            if kind == "output":
                await step.do("big", lambda: "x" * 50)
            if kind == "sleep":
                await step.sleep("long", "2 days")
            if kind == "timeout":
                await step.do("t", lambda: 1, timeout="31 minutes")
            if kind == "wait":
                await step.wait_for_event("w", type="t", timeout="500 ms")
            if kind == "duration":
                await step.sleep("bad", "a while")
            if kind == "retries":
                await step.do("r", lambda: 1, retries={"limit": -1})

    expectations = {
        "steps": ("LimitExceeded", "max_steps_per_workflow is 3, got 4"),
        "name": ("LimitExceeded", "max_step_name_length is 5, got 13"),
        "output": ("StepOutputError", "max_step_output_bytes is 20"),
        "sleep": ("LimitExceeded", "max_sleep is 86400000 ms, got 172800000 ms"),
        "timeout": ("LimitExceeded", "max_step_timeout is 1800000 ms, got 1860000 ms"),
        "wait": ("LimitExceeded", "got 500 ms"),
        "duration": ("InvalidDuration", "a while"),
        "retries": ("InvalidInput", "-1"),
    }
    wf = get_workflow("limits")
    insts = {kind: wf.create(params=kind) for kind in expectations}
    testing.run_until_idle()
    for kind, (name, message) in expectations.items():
        error = insts[kind].status().error
        assert error is not None, kind
        assert error["name"] == name, (kind, error)
        assert message in error["message"], (kind, error)


def test_an_oversized_or_unserialisable_output_fails_at_once_without_retries(registered):
    calls = []

    @register("bad-output")
    class BadOutput(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.do(
                "obj", lambda: calls.append(1) or object(), retries={"limit": 5, "delay": 0}
            )

    inst = get_workflow("bad-output").create()
    testing.run_until_idle()
    assert inst.status().error["name"] == "StepOutputError"
    assert "not JSON-serialisable" in inst.status().error["message"]
    assert calls == [1]


def test_register_refuses_bad_definitions(registered):
    with pytest.raises(InvalidInput, match="version"):
        register("v0", version=0)
    # Past the version columns (PostgreSQL's integer): every create of it was an
    # IntegrityError on PostgreSQL (and stored on SQLite).
    for past, shown in ((2**31, "2147483648"), (HUGE, "<an integer of about 5001 digits>")):
        with pytest.raises(InvalidInput) as refused:
            register("v-past", version=past)
        assert str(refused.value) == (
            f"workflow version must be an integer from 1 to 2147483647, got {shown}"
        )
    with pytest.raises(InvalidInput, match="unknown limit 'max_bananas'"):
        register("bananas", limits={"max_bananas": 1})
    with pytest.raises(InvalidInput, match="async def run"):

        @register("sync-run")
        class SyncRun(WorkflowEntrypoint):
            def run(self, event, step):
                return 1


def test_list_pages_with_a_cursor_and_filters(waiter):
    for n in range(5):
        waiter.create(id=f"p{n}")
    first = waiter.list(limit=2)
    assert [i.id for i in first.instances] == ["p4", "p3"]
    waiter.create(id="p5")  # created between pages: the next page neither repeats nor skips
    second = waiter.list(limit=2, cursor=first.cursor)
    assert [i.id for i in second.instances] == ["p2", "p1"]
    third = waiter.list(limit=2, cursor=second.cursor)
    assert [i.id for i in third.instances] == ["p0"] and third.cursor is None
    assert waiter.list(status="complete").instances == []
    assert len(waiter.list(version=1).instances) == 6 and waiter.list(version=2).instances == []
    with pytest.raises(InvalidInput, match="unknown status"):
        waiter.list(status="bogus")
    with pytest.raises(InvalidInput, match="invalid cursor"):
        waiter.list(cursor="!!!")


def test_steps_without_options_take_the_workflows_defaults_and_others_their_own(registered):
    """The defaults are read once a run; a step's own retries never leak into them."""
    attempts: dict[str, int] = {}

    def failing(name):
        def fail():
            attempts[name] = attempts.get(name, 0) + 1
            raise RuntimeError(name)

        return fail

    @register("default-config", limits={"default_retry_limit": 1, "default_retry_delay": 0})
    class DefaultConfig(WorkflowEntrypoint):
        async def run(self, event, step):
            for name, retries in (("a", None), ("b", {"limit": 3, "delay": 0}), ("c", None)):
                with contextlib.suppress(StepFailed):
                    await step.do(name, failing(name), retries=retries)
            return "done"

    inst = get_workflow("default-config").create()
    testing.run_until_idle()
    assert inst.status().output == "done"
    assert attempts == {"a": 2, "b": 4, "c": 2}


@pytest.mark.parametrize(
    ("limits", "named"),
    [
        ({"max_concurrent": 5}, "unknown limit 'max_concurrent'"),
        ({"default_step_timeout": "thirty seconds"}, "thirty seconds"),
        ({"max_batch_size": "many"}, "max_batch_size"),
        (["max_batch_size", 5], "must be a dict of limits"),
    ],
)
def test_bad_limits_settings_are_refused_at_start_up(limits, named):
    """A typo in WFDASH["LIMITS"] passed every check, then refused every create and
    stopped every run with the settings' error. manage.py check now refuses it."""
    from django.core.management import call_command
    from django.core.management.base import SystemCheckError
    from django.test import override_settings

    call_command("check")
    with override_settings(WFDASH={"LIMITS": limits}), pytest.raises(SystemCheckError) as refused:
        call_command("check")
    assert "workflows_app.E004" in str(refused.value) and named in str(refused.value)
    with override_settings(WFDASH={"LIMITS": {"max_concurrent_instances": 5}}):
        call_command("check")


def test_reads_of_rows_refuse_counts_past_what_a_database_limit_takes(registered):
    """history(limit=), steps(last= or limit=), children_rows(limit=), recent_steps() and
    newest_children_rows() sent their count to the database as a LIMIT: one past a bigint
    was "datatype mismatch" (SQLite) or "bigint out of range" (PostgreSQL), naming neither
    the argument nor its range. recent_steps(0) raised IndexError."""
    from workflows_app.converters import MAX_PK

    @register("reader")
    class Reader(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do("first", lambda: 1)
            await step.wait_for_event("open", type="go")

    inst = get_workflow("reader").create(id="read")
    testing.run_until_idle()
    reads = {
        "history limit": lambda n: inst.history(limit=n),
        "steps limit": lambda n: inst.steps(limit=n),
        "steps last": lambda n: inst.steps(last=n),
        "children limit": lambda n: inst.children_rows(limit=n),
        "recent steps": lambda n: inst.recent_steps(n),
        "newest children": lambda n: inst.newest_children_rows(n),
    }
    for what, read in reads.items():
        for count, shown in (
            (MAX_PK + 1, str(MAX_PK + 1)),
            (10**5000, "<an integer of about 5001 digits>"),
        ):
            with pytest.raises(InvalidInput) as refused:
                read(count)
            message = str(refused.value)
            assert message.endswith(f"got {shown}"), (what, message)
            assert f" to {MAX_PK}" in message or f" to {MAX_PK - 1}" in message, (what, message)
    # The largest each takes still reads every row.
    assert len(inst.history(limit=MAX_PK)) == len(inst.history())
    assert [s.name for s in inst.steps(last=MAX_PK)] == ["first", "open"]
    assert [s.name for s in inst.recent_steps(MAX_PK - 1)[0]] == ["first", "open"]
    assert inst.newest_children_rows(MAX_PK - 1) == ([], 0)
    # None of the newest, and the open wait older than them.
    assert [s.name for s in inst.recent_steps(0)[0]] == ["open"]
    with pytest.raises(InvalidInput, match=r"newest must be an integer from 0 to \d+, got -1"):
        inst.recent_steps(-1)


def test_a_batch_size_of_zero_is_refused_at_register_and_one_still_starts_many(registered):
    """max_batch_size 0 was taken: every create_batch was refused, and `wf start --count`
    failed with "range() arg 3 must not be zero", naming no limit."""
    from io import StringIO

    from django.core.management import call_command

    for bad in (0, -1):
        with pytest.raises(
            InvalidInput, match=f"max_batch_size must be a positive integer, got {bad}"
        ):
            register("no-batch", limits={"max_batch_size": bad})

    @register("one-batch", limits={"max_batch_size": 1})
    class OneBatch(WorkflowEntrypoint):
        async def run(self, event, step):
            return 1

    call_command("wf", "start", "one-batch", "--count", "3", stdout=StringIO(), stderr=StringIO())
    assert Instance.objects.filter(workflow="one-batch").count() == 3


HUGE = 10**5000  # repr() of it raises ValueError: past 4,300 digits


def huge_inputs():
    """(what, call, error, named): each call takes an integer of 5,001 digits somewhere a
    number is checked; its refusal must name the argument, not fail to print the value."""
    from workflows_app.client import BulkJobHandle, schedules
    from workflows_app.engine.durations import parse_duration
    from workflows_app.tasks import options_problems

    def wf():
        return get_workflow("waiter")

    def inst():
        return wf().create(id="huge")

    def schedule():
        return schedules.create("huge-s", workflow="waiter", cron="0 3 * * *")

    return [
        ("retry limit", lambda: Limits.build({"default_retry_limit": HUGE}), "default_retry_limit"),
        (
            "max steps",
            lambda: Limits.build({"max_steps_per_workflow": -HUGE}),
            "max_steps_per_workflow",
        ),
        (
            "id length",
            lambda: Limits.build({"max_instance_id_length": HUGE}),
            "max_instance_id_length",
        ),
        ("rate", lambda: Limits.build({"rate_limit": {"limit": HUGE}}), "rate_limit must be"),
        (
            "backoff",
            lambda: Limits.build({"default_retry_backoff": [HUGE]}),
            "default_retry_backoff",
        ),
        ("duration", lambda: parse_duration([HUGE]), "invalid duration"),
        ("get", lambda: wf().get(HUGE), "instance id must be a string"),
        ("list", lambda: wf().list(limit=HUGE), "limit must be an integer from 1 to 1000"),
        ("list version", lambda: wf().list(version=HUGE), "version must be an integer"),
        ("priority", lambda: wf().create(priority=HUGE), "priority must be an integer"),
        ("attribute", lambda: wf().create(attributes={"n": HUGE}), "attribute 'n': integer"),
        ("history", lambda: inst().history(after=HUGE), "after must be a history sequence"),
        ("steps", lambda: inst().steps(after=HUGE), "after must be a cursor"),
        ("subscribe", lambda: next(inst().subscribe(cursor=HUGE)), "cursor must be"),
        (
            "bulk job",
            lambda: BulkJobHandle.find(HUGE),
            "no bulk job #<an integer of about 5001 digits>",
        ),
        ("next runs", lambda: schedule().next_runs(HUGE), "count must be an integer"),
        ("schedule instances", lambda: schedule().instances(HUGE), "limit must be an integer"),
        (
            "task retries",
            lambda: (_ for _ in ()).throw(
                InvalidInput(options_problems({"retries": {"limit": HUGE}})[0])
            ),
            '"retries" limit must be an integer',
        ),
    ]


@pytest.mark.parametrize("index", range(len(huge_inputs())), ids=[h[0] for h in huge_inputs()])
def test_an_integer_too_long_to_print_is_refused_naming_the_argument(waiter, index):
    """repr() of an integer past 4,300 digits raises ValueError: each of these refusals
    raised "Exceeds the limit (4300 digits) for integer string conversion" instead,
    naming neither the argument nor its range (manage.py check, which catches only
    wfdash's errors, failed with a traceback)."""
    what, call, named = huge_inputs()[index]
    before = snapshot()
    with pytest.raises(WorkflowError) as refused:
        call()
    message = str(refused.value)
    assert named in message, (what, message)
    assert "digits>" in message or "to 9223372036854775807" in message, (what, message)
    if what not in ("history", "steps", "subscribe"):
        assert snapshot() == before


def test_a_step_given_a_retry_limit_too_long_to_print_fails_naming_it(registered):
    @register("huge-retries")
    class HugeRetries(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do("r", lambda: 1, retries={"limit": HUGE})

    inst = get_workflow("huge-retries").create()
    testing.run_until_idle()
    error = inst.status().error
    assert error["name"] == "InvalidInput", error
    assert 'step "r": retries limit must be an integer from 0 to 2147483646' in error["message"]
    assert "<an integer of about 5001 digits>" in error["message"]


def test_waits_for_a_result_refuse_a_timeout_that_is_not_a_number_of_seconds(waiter):
    """result(timeout=nan) waited for ever (no comparison with NaN is true); "5" raised
    TypeError, 10**400 OverflowError; a bulk job's wait(poll=-1) raised ValueError from
    time.sleep. Each is InvalidInput naming the argument."""
    inst = waiter.create(id="waits")
    job = waiter.bulk("pause", status="complete")  # matches nothing: done at once
    for bad in (float("nan"), "5", -1, True, [1]):
        with pytest.raises(InvalidInput, match="timeout must be a number of seconds, 0 or more"):
            inst.result(timeout=bad)
        with pytest.raises(InvalidInput, match="timeout must be a number of seconds, 0 or more"):
            job.wait(timeout=bad)
    for bad in (0, -1, float("nan"), 10**400, "0.2"):
        with pytest.raises(InvalidInput, match="poll must be a number of seconds, more than 0"):
            job.wait(poll=bad)
    with pytest.raises(ResultTimeout, match="after 0 s"):
        inst.result(timeout=0)
    with pytest.raises(ResultTimeout, match=r"after 0\.0 s"):
        inst.result(timeout=0.0)
    assert job.wait(timeout=10**400, poll=0.01).done
