"""Tracing: one trace per instance, spans for runs, steps, sleeps and waits, retry events."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tests.otlp import EXPORTED_SPANS, RUN_EXPORTED_WORKFLOW, otlp_receiver
from workflows_app import testing, tracing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, current_step, register, store
from workflows_app.models import ErrorRecord, Span

pytestmark = pytest.mark.django_db(transaction=True)
START = datetime(2026, 3, 1, tzinfo=UTC)
_exporter = InMemorySpanExporter()
tracing.add_processor(SimpleSpanProcessor(_exporter))


@pytest.fixture
def exported():
    _exporter.clear()
    yield _exporter
    _exporter.clear()


def traced_workflow():
    @register("traced")
    class Traced(WorkflowEntrypoint):
        async def run(self, event, step):
            def flaky():
                if current_step().attempt < 3:
                    raise ConnectionError(f"attempt {current_step().attempt} failed")
                with trace.get_tracer("user.code").start_as_current_span("user work"):
                    return "ok"

            await step.do(
                "flaky", flaky, retries={"limit": 4, "delay": "1 second", "backoff": "constant"}
            )
            await step.sleep("nap", "1 minute")
            got = await step.wait_for_event("approval", type="approve", timeout="1 hour")
            return got.payload

    return get_workflow("traced")


def drive_traced_instance():
    with testing.fake_clock(START) as clock:
        inst = traced_workflow().create(id="t1")
        testing.run_until_idle()  # attempt 1 fails
        clock.advance("1 second")
        testing.run_until_idle()  # attempt 2 fails
        clock.advance("1 second")
        testing.run_until_idle()  # attempt 3 succeeds, the sleep parks
        clock.advance("1 minute")
        testing.run_until_idle()  # the sleep ends, the wait parks
        inst.send_event("approve", "yes")
        testing.run_until_idle()  # the event arrives: complete
    assert inst.status().output == "yes"
    return inst


def test_spans_form_one_trace_per_instance_with_steps_sleeps_waits_and_retry_events(
    registered, exported
):
    inst = drive_traced_instance()
    spans = exported.get_finished_spans()
    trace_ids = {format(s.context.trace_id, "032x") for s in spans}
    assert trace_ids == {inst.row().trace_id}

    names = Counter(s.name for s in spans)
    assert names["workflow traced"] == 5  # one per run
    assert names["step flaky"] == 3  # attempts ran in three runs; later replays add none
    assert names["sleep nap"] == 1 and names["waitForEvent approval"] == 1
    assert names["user work"] == 1 and names["create traced"] == 1

    by_id = {s.context.span_id: s for s in spans}
    runs = [s for s in spans if s.name == "workflow traced"]
    assert all(s.kind == trace.SpanKind.SERVER and s.parent is None for s in runs)
    for span in spans:
        if span.name.startswith(("step ", "sleep ", "waitForEvent ")):
            assert by_id[span.parent.span_id].name == "workflow traced"
            assert span.attributes["workflow.step.name"] in {"flaky", "nap", "approval"}
            assert span.attributes["workflow.instance_id"] == "t1"
            assert span.attributes["workflow.version"] == 1
    (user,) = [s for s in spans if s.name == "user work"]
    assert by_id[user.parent.span_id].name == "step flaky"

    retry_events = [e for s in spans for e in s.events if e.name == "step.retry_error"]
    assert len(retry_events) == 2
    assert [e.attributes["step.attempt"] for e in retry_events] == [1, 2]
    assert {e.attributes["step.max_retries"] for e in retry_events} == {4}
    assert {e.attributes["error.name"] for e in retry_events} == {"ConnectionError"}
    assert retry_events[0].attributes["error.message"] == "attempt 1 failed"
    assert "Traceback" in retry_events[0].attributes["error.stack"]

    (sleep_span,) = [s for s in spans if s.name == "sleep nap"]
    assert (sleep_span.end_time - sleep_span.start_time) / 1e9 == 60  # from the stored start


def test_spans_and_errors_are_stored_and_go_with_the_instance(registered, exported):
    inst = drive_traced_instance()
    pk = inst.row().pk
    stored = Span.objects.filter(instance_id=pk)
    assert stored.filter(name="workflow traced").count() == 5
    assert stored.filter(name="step flaky").count() == 3
    errors = ErrorRecord.objects.filter(instance_id=pk).order_by("id")
    assert [(e.source, e.step_name, e.attempt, e.name) for e in errors] == [
        ("workflow.step", "flaky", 1, "ConnectionError"),
        ("workflow.step", "flaky", 2, "ConnectionError"),
    ]
    assert all(e.trace_id == inst.row().trace_id and e.span_id for e in errors)
    span_ids = set(stored.values_list("span_id", flat=True))
    assert {e.span_id for e in errors} <= span_ids

    from workflows_app.models import Instance

    Instance.objects.filter(pk=pk).update(expires_at=START)
    assert store.prune() == 1
    assert not Span.objects.filter(instance_id=pk).exists()
    assert not ErrorRecord.objects.filter(instance_id=pk).exists()


def test_each_stored_span_keeps_what_the_span_said(registered, exported):
    """The stored row of every span of an instance: ids, parent, name, kind, times, status,
    attributes, events with theirs, and links, as OpenTelemetry ended it."""
    inst = drive_traced_instance()
    tracing.flush_spans()
    ended = {
        format(s.context.span_id, "016x"): s
        for s in exported.get_finished_spans()
        if format(s.context.trace_id, "032x") == inst.row().trace_id
    }
    rows = {row.span_id: row for row in Span.objects.filter(trace_id=inst.row().trace_id)}
    assert set(rows) == set(ended) and len(rows) > 10

    def at(ns):  # to the microsecond below, as stored
        return datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=ns // 1000)

    for span_id, span in ended.items():
        row = rows[span_id]
        assert row.instance_id == inst.row().pk
        assert row.parent_span_id == (format(span.parent.span_id, "016x") if span.parent else "")
        assert (row.name, row.kind, row.status_code) == (
            span.name,
            span.kind.name,
            span.status.status_code.name,
        )
        assert (row.start_time, row.end_time) == (at(span.start_time), at(span.end_time))
        assert row.attributes == dict(span.attributes)
        assert [(e["name"], e["attributes"]) for e in row.events] == [
            (e.name, dict(e.attributes)) for e in span.events
        ]
        assert [datetime.fromisoformat(e["time"]) for e in row.events] == [
            at(e.timestamp) for e in span.events
        ]
        assert [(link["trace_id"], link["span_id"]) for link in row.links] == [
            (format(link.context.trace_id, "032x"), format(link.context.span_id, "016x"))
            for link in span.links
        ]


def test_a_failed_instance_records_an_error_and_an_error_span(registered, exported):
    @register("failing")
    class Failing(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do("boom", lambda: 1 / 0, retries={"limit": 0})

    inst = get_workflow("failing").create()
    testing.run_until_idle()
    assert inst.status().error["name"] == "ZeroDivisionError"
    sources = list(
        ErrorRecord.objects.filter(instance_id=inst.row().pk)
        .order_by("id")
        .values_list("source", "name")
    )
    assert sources == [
        ("workflow.step", "ZeroDivisionError"),
        ("workflow.instance", "ZeroDivisionError"),
    ]
    (step_span,) = [s for s in exported.get_finished_spans() if s.name == "step boom"]
    assert step_span.status.status_code == trace.StatusCode.ERROR
    assert any(e.name == "exception" for e in step_span.events)
    (run_span,) = [s for s in exported.get_finished_spans() if s.name == "workflow failing"]
    assert run_span.status.status_code == trace.StatusCode.ERROR


def test_a_request_span_is_linked_from_the_instance_trace(registered, exported):
    @register("linked")
    class Linked(WorkflowEntrypoint):
        async def run(self, event, step):
            return 1

    with trace.get_tracer("web").start_as_current_span("POST /orders") as request_span:
        inst = get_workflow("linked").create()
    (create,) = [s for s in exported.get_finished_spans() if s.name == "create linked"]
    assert format(create.context.trace_id, "032x") == inst.row().trace_id
    assert [link.context.span_id for link in create.links] == [
        request_span.get_span_context().span_id
    ]


EXPORT_SCRIPT = (
    RUN_EXPORTED_WORKFLOW
    + """
from opentelemetry import trace
trace.get_tracer_provider().shutdown()  # flushes the batch exporter
"""
)


def test_spans_are_exported_over_otlp_http_when_the_endpoint_is_set(tmp_path: Path):
    with otlp_receiver() as (url, received):
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "wfdash.settings",
            "DATABASE_URL": f"sqlite:///{tmp_path / 'otlp.sqlite3'}",
            "OTEL_EXPORTER_OTLP_ENDPOINT": url,
            "WFDASH_DEMO": "0",
        }
        env.pop("REDIS_URL", None)
        result = subprocess.run(
            [sys.executable, "-c", EXPORT_SCRIPT],
            env=env,
            cwd=Path(__file__).parent.parent,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
    names = {name for _, name in received}
    assert names >= EXPORTED_SPANS


def test_create_spans_are_stored_where_no_engine_runs_and_the_project_s_own_spans_are_not(
    registered,
):
    @register("traced-create")
    class TracedCreate(WorkflowEntrypoint):
        async def run(self, event, step):
            return "ok"

    with trace.get_tracer("project").start_as_current_span("project request"):
        inst = get_workflow("traced-create").create(id="tc")  # no worker in this process now
    stored = list(
        Span.objects.filter(trace_id=inst.row().trace_id).values_list("name", "instance_id")
    )
    assert stored == [("create traced-create", inst.row().pk)]
    tracing.flush_spans()
    assert not Span.objects.filter(name="project request").exists()  # not an instance's span


def test_a_span_whose_attributes_json_cannot_say_as_they_are_is_stored_with_its_batch(registered):
    """bytes, a NaN and a NUL character (PostgreSQL's jsonb and text take none) in a user
    span's attributes, name and event: stored as text, and the engine's own spans flushed
    in the same batch are stored too."""

    @register("odd-attributes")
    class OddAttributes(WorkflowEntrypoint):
        async def run(self, event, step):
            def work():
                with trace.get_tracer("user.code").start_as_current_span("odd\x00name") as span:
                    span.set_attributes(
                        {"raw": b"\xffok", "ratio": float("nan"), "nul": "a\x00b", "n": 7}
                    )
                    span.add_event("seen", {"far": float("inf")})
                return "ok"

            return await step.do("work", work)

    inst = get_workflow("odd-attributes").create(id="odd")
    testing.run_until_idle()
    assert inst.status().output == "ok"
    tracing.flush_spans()
    rows = {row.name: row for row in Span.objects.filter(trace_id=inst.row().trace_id)}
    assert {"workflow odd-attributes", "step work", "odd\ufffdname"} <= set(rows)
    odd = rows["odd\ufffdname"]
    assert odd.attributes == {"raw": "\ufffdok", "ratio": "nan", "nul": "a\ufffdb", "n": 7}
    assert [(e["name"], e["attributes"]) for e in odd.events] == [("seen", {"far": "inf"})]
    assert odd.instance_id == inst.row().pk


def test_one_flush_stores_each_span_with_its_own_instance_or_none(registered, monkeypatch):
    """Spans of several instances in one flush, their look-up split in chunks of two keys,
    and the span of an instance deleted meanwhile: each row names its instance (or none),
    and what flush returns says the same."""
    from workflows_app.engine import spans as engine_spans

    @register("many-traces")
    class ManyTraces(WorkflowEntrypoint):
        async def run(self, event, step):
            return "ok"

    monkeypatch.setattr(tracing, "LOOKUP_INSTANCES", 2)
    tracing.flush_spans()  # the creates' spans: this flush holds only the spans below
    rows = [get_workflow("many-traces").create(id=f"mt{i}").row() for i in range(5)]
    traces = [(row.trace_id, row.pk) for row in rows]
    gone = rows.pop()
    gone.delete()  # its key stays in the list: its spans come as a run's would
    for trace_id, pk in [*traces, traces[0]]:
        engine_spans.start_workflow_span(trace_id, pk, "many-traces", {}).end()
    stored = tracing.flush_spans()
    expected = [row.pk for row in rows] + [None, rows[0].pk]
    assert [s.instance_id for s in stored] == expected
    assert [s.trace_id for s in stored] == [row.trace_id for row in [*rows, gone, rows[0]]]
    in_db = dict(
        Span.objects.filter(name="workflow many-traces").values_list("span_id", "instance")
    )
    assert [in_db[s.span_id] for s in stored] == expected


def test_span_times_are_written_as_the_text_sqlite_stores():
    """A span time as SQLite's naive UTC text, second by second from a cache: the same text
    a datetime makes, with or without microseconds, before 1970 too."""
    from workflows_app.engine.store.dialect import NAIVE_EPOCH, utc_text_maker

    text = utc_text_maker()
    base = 1_764_990_000 * 10**9
    for ns in [base, base + 1_000, base + 999_999_999, base + 10**9, 0, -1_500_000_000, base]:
        assert text(ns) == str(NAIVE_EPOCH + timedelta(microseconds=ns // 1000)), ns


def test_instance_trace_ids_begin_with_their_creation_time_and_end_random(registered):
    """Ordered by creation, the index of instances' trace ids grows at its end; the low 80
    bits (what samplers and the W3C random flag read) are random."""
    workflow = traced_workflow()
    with testing.fake_clock(datetime(2026, 3, 1, tzinfo=UTC)) as clock:
        first = workflow.create(id="t-1").row()
        clock.advance("1 second")
        later = [workflow.create(id=f"t-{n}").row() for n in range(2, 6)]
    for row in (first, *later):
        assert int(row.trace_id[:12], 16) == int(row.created_at.timestamp() * 1000), row.trace_id
        assert len(row.trace_id) == 32 and int(row.trace_id, 16)
    assert all(first.trace_id < row.trace_id for row in later)
    assert len({row.trace_id[12:] for row in (first, *later)}) == 5  # same instant, not same id


def test_span_times_are_stored_to_the_microsecond_from_1970_to_the_year_9999(registered):
    """A span's start and end as stored, at the bounds of what a datetime holds and between
    (PostgreSQL is sent integer microseconds: through a double, the year 9999 lost some)."""
    from workflows_app.engine import spans as engine_spans

    @register("far-times")
    class FarTimes(WorkflowEntrypoint):
        async def run(self, event, step):
            return "ok"

    row = get_workflow("far-times").create(id="far").row()
    tracing.flush_spans()
    times = [
        datetime(1970, 1, 1, 0, 0, 0, 1, tzinfo=UTC),
        datetime(2026, 5, 28, 20, 26, 40, 123457, tzinfo=UTC),
        datetime(2255, 6, 5, 23, 47, 34, 740993, tzinfo=UTC),  # 2**53 µs after the epoch
        datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
    ]
    root = engine_spans.start_workflow_span(row.trace_id, row.pk, "far-times", {})
    for n, at in enumerate(times):
        engine_spans.finished_span(root, f"at {n}", at, at, {})
    root.end()
    tracing.flush_spans()
    stored = dict(
        Span.objects.filter(trace_id=row.trace_id, name__startswith="at ").values_list(
            "name", "start_time"
        )
    )
    assert stored == {f"at {n}": at for n, at in enumerate(times)}
    assert set(
        Span.objects.filter(name__startswith="at ").values_list("start_time", "end_time")
    ) == {(at, at) for at in times}


def test_a_rolled_back_create_s_span_is_not_stored_with_the_instance_that_took_its_key(
    registered, monkeypatch
):
    """A create's span is queued for an engine running here to store; if the create's
    transaction rolls back, the next instance may get the same key (SQLite hands the id
    out again). The span is stored with no instance, not with that other instance."""
    from django.db import connection, transaction

    from workflows_app import client

    @register("rolled-back")
    class RolledBack(WorkflowEntrypoint):
        async def run(self, event, step):
            return "ok"

    monkeypatch.setattr(client, "running_in_this_process", lambda: True)  # it flushes later
    tracing.flush_spans()
    with pytest.raises(RuntimeError, match="roll back"), transaction.atomic():
        gone = get_workflow("rolled-back").create(id="gone").row()
        raise RuntimeError("roll back")
    kept = get_workflow("rolled-back").create(id="kept").row()
    if connection.vendor == "sqlite":
        assert kept.pk == gone.pk  # the key the span was queued with now names another
    stored = {span.trace_id: span.instance_id for span in tracing.flush_spans()}
    assert stored == {gone.trace_id: None, kept.trace_id: kept.pk}
    assert Span.objects.get(trace_id=gone.trace_id).instance_id is None


def test_a_trace_id_of_zeros_is_no_trace_id_and_the_run_s_span_gets_a_valid_one(registered):
    from workflows_app.engine import spans as engine_spans

    span = engine_spans.start_workflow_span("0" * 32, 1, "zeros", {})
    span.end()
    assert span.get_span_context().is_valid and span.get_span_context().trace_id != 0


def test_a_trace_whose_spans_keep_ending_stays_known_while_newer_traces_come(monkeypatch):
    """The instance traces known are bounded (MAX_KNOWN_TRACES), the least recent forgotten
    first: a span of a trace ending makes it recent, so a long run's later spans are still
    stored with its instance while newer instances' traces come and go."""
    from workflows_app.engine import spans as engine_spans

    monkeypatch.setattr(tracing, "MAX_KNOWN_TRACES", 2)
    trace_ids = tracing.InstanceTraceIds()

    def begin(trace_id: int, instance_pk: int) -> None:
        token = engine_spans.forced_trace.set((trace_id, instance_pk))
        try:
            assert trace_ids.generate_trace_id() == trace_id
        finally:
            engine_spans.forced_trace.reset(token)

    begin(1, 10)
    begin(2, 20)
    assert trace_ids.instance_of(1) == 10  # a span of the first run ended
    begin(3, 30)
    assert trace_ids.instance_of(2) is None  # the least recent was forgotten, not the first
    assert (trace_ids.instance_of(1), trace_ids.instance_of(3)) == (10, 30)


def _sampler_cases() -> list[tuple[object, int]]:
    """(parent context, trace id) pairs: no parent, an invalid one, local and remote
    parents sampled and not, one with a trace state; trace ids of an instance and not."""
    from opentelemetry.context import Context
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

    contexts: list[object] = [None, Context(), trace.set_span_in_context(trace.INVALID_SPAN)]
    for remote in (False, True):
        for flags in (TraceFlags.DEFAULT, TraceFlags.SAMPLED):
            for state in (None, TraceState([("vendor", "x")])):
                parent = SpanContext(
                    0xA1, 0xB2, is_remote=remote, trace_flags=TraceFlags(flags), trace_state=state
                )
                contexts.append(trace.set_span_in_context(NonRecordingSpan(parent)))
    return [(context, trace_id) for context in contexts for trace_id in (0xA1, 0xC3)]


def test_the_default_sampler_s_shortcut_decides_as_the_sdk_s_parent_based_sampler():
    """RecordInstanceTraces takes the SDK's default sampler's decision (parentbased_always_on)
    from the parent's span context itself, not through the SDK's three samplers (17
    Python calls a span, three spans an instance in a herd of timers). The same wrapper
    around an equal ParentBased that is not the SDK's own DEFAULT_ON object goes the long
    way: both must decide alike, keep the same attributes and trace state, and record an
    instance's dropped spans."""
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON, DEFAULT_ON, ParentBased

    trace_ids = tracing.InstanceTraceIds()
    trace_ids.known[0xA1] = 7  # 0xA1 is an instance's trace; 0xC3 is not
    short = tracing.RecordInstanceTraces(DEFAULT_ON, trace_ids)
    long = tracing.RecordInstanceTraces(ParentBased(ALWAYS_ON), trace_ids)
    assert short._parent_based_on and not long._parent_based_on
    attributes = {"workflow.name": "w", "workflow.run": 1}
    decisions = Counter()
    for context, trace_id in _sampler_cases():
        got = short.should_sample(context, trace_id, "step s", None, attributes, ())
        want = long.should_sample(context, trace_id, "step s", None, attributes, ())
        assert got.decision is want.decision, (context, trace_id)
        assert dict(got.attributes) == dict(want.attributes)
        assert got.trace_state == want.trace_state
        decisions[got.decision.name] += 1
    assert decisions == {"RECORD_AND_SAMPLE": 14, "RECORD_ONLY": 4, "DROP": 4}


def test_span_ids_come_from_the_fallback_generator_set_last():
    """InstanceTraceIds hands the tracer its fallback's own span id method (no call of its
    own a span); a fallback set later (configure() puts a project's generator behind
    ours) must give the span ids from then on, and the trace ids of no instance."""
    from opentelemetry.sdk.trace.id_generator import IdGenerator

    class Fixed(IdGenerator):
        def __init__(self, base: int) -> None:
            self.base = base

        def generate_span_id(self) -> int:
            return self.base + 1

        def generate_trace_id(self) -> int:
            return self.base + 2

    ids = tracing.InstanceTraceIds(Fixed(100))
    assert (ids.generate_span_id(), ids.generate_trace_id()) == (101, 102)
    ids.fallback = Fixed(200)
    assert (ids.generate_span_id(), ids.generate_trace_id()) == (201, 202)
    assert isinstance(ids.fallback, Fixed) and ids.fallback.base == 200
    assert 0 < tracing.InstanceTraceIds().generate_span_id() < 2**64
