"""Review of tracing and metrics: each test failed on the code it was written against,
for the reason its docstring gives (file:line of the fault)."""

# ruff: noqa: F811  (the fixture imported from tests/test_tracing.py is a test parameter)
from __future__ import annotations

import contextlib
from datetime import UTC, datetime

import pytest

from tests.test_tracing import exported  # noqa: F401  (a fixture: the spans exported)
from workflows_app import dashboard, testing, tracing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, register
from workflows_app.engine import clock as engine_clock
from workflows_app.engine.errors import EventTimeout
from workflows_app.engine.step import StepFailed
from workflows_app.models import ErrorRecord, Span

pytestmark = pytest.mark.django_db(transaction=True)
START = datetime(2026, 3, 1, tzinfo=UTC)


def stored(inst) -> list[Span]:
    tracing.flush_spans()
    return list(Span.objects.filter(instance_id=inst.row().pk).order_by("start_time"))


# --- 1. a caught event timeout marks the run's span as failed ---------------------------------


def test_a_caught_event_timeout_leaves_the_run_span_ok_and_errors_point_at_the_wait(
    registered, exported
):
    """wait_for_event's timeout calls run.fail_step (step.py:627) with no span of its own
    current: fail_step (runner.py:961, `span = trace.get_current_span()`) then
    mark_error()s the *workflow* span of the run (records the EventTimeout on it, status
    ERROR) and links the ErrorRecord to it. A workflow that catches the timeout (the
    usual "approve within a day, else escalate") completes, yet its run span is stored
    ERROR with an exception event, and the error row's span is not the waitForEvent span
    that failed."""

    @register("approval-or-escalate")
    class ApprovalOrEscalate(WorkflowEntrypoint):
        async def run(self, event, step):
            try:
                await step.wait_for_event("approval", type="approve", timeout="1 hour")
            except EventTimeout:
                await step.do("escalate", lambda: "escalated")
            return "done"

    with testing.fake_clock(START) as fake:
        inst = get_workflow("approval-or-escalate").create(id="esc-1")
        testing.run_until_idle()
        fake.advance("1 hour")
        testing.run_until_idle()
    assert inst.status().status == "complete"
    rows = stored(inst)
    runs = [s for s in rows if s.name == "workflow approval-or-escalate"]
    assert len(runs) == 2
    final = runs[-1]
    assert final.attributes["workflow.outcome"] == "complete"
    assert (final.status_code, [e["name"] for e in final.events]) == ("UNSET", []), (
        f"the completed run's span is {final.status_code} {final.status_message!r} "
        f"with events {[e['name'] for e in final.events]}"
    )
    (wait,) = [s for s in rows if s.name == "waitForEvent approval"]
    assert wait.status_code == "ERROR"
    (error,) = ErrorRecord.objects.filter(instance_id=inst.row().pk)
    assert error.span_id == wait.span_id, "the error row links the run's span, not the wait's"


# --- 2. retries with no delay: one span for every attempt --------------------------------------


def test_attempts_retried_without_delay_each_show_in_the_dashboard(registered, exported):
    """A retry with delay 0 loops inside the one `step` span (step.py:390-417: the
    `while True` runs inside `with spans.child_span(...)` of _do, step.py:378), while the
    dashboard reads one span per attempt (dashboard.py:676 step_attempts: "each attempt
    runs in a span of its own"). A step that failed twice and then succeeded is listed as
    ONE attempt, and that attempt is shown failed (the span's last retry_error event),
    so the page says the step's only attempt failed although it completed."""
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError(f"try {len(calls)}")
        return "ok"

    @register("no-delay-retries")
    class NoDelayRetries(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.do("flaky", flaky, retries={"limit": 3, "delay": 0})

    inst = get_workflow("no-delay-retries").create(id="nd-1")
    testing.run_until_idle()
    assert inst.status().output == "ok" and len(calls) == 3
    attempts = dashboard.step_attempts(stored(inst))["flaky"]
    shown = [(a.number, a.failed) for a in attempts]
    assert shown == [(1, True), (2, True), (3, False)], shown


# --- 3. an error message no database stores loses the spans flushed with it -------------------


def test_a_step_error_with_a_lone_surrogate_does_not_lose_the_spans_stored_with_it(
    registered, exported
):
    """mark_error (spans.py:196) records the raw exception (exception.message) and sets
    the status description to safe_str(exc): a lone surrogate (an undecodable file name)
    stays in the span. The error, history and step rows are cleaned (storable_text), but
    DatabaseSpanProcessor._row via _text (tracing.py:180) only replaces NUL: SQLite's driver raises
    UnicodeEncodeError on the status message (no DatabaseError: flush, tracing.py:228,
    neither re-queues nor counts it, the batch taken from the queue is gone), PostgreSQL
    refuses the \\udcff escape in the JSON batch (DataError: the whole batch is dropped).
    Every span flushed with it, of every instance, is lost; the dashboard shows no trace."""

    def open_file():
        raise ValueError("cannot read report-\udcff.csv")

    @register("surrogate-span")
    class SurrogateSpan(WorkflowEntrypoint):
        async def run(self, event, step):
            with contextlib.suppress(StepFailed):
                await step.do("open", open_file, retries={"limit": 0})
            return await step.do("after", lambda: "after")

    inst = get_workflow("surrogate-span").create(id="sur-1")
    testing.run_until_idle()
    assert inst.status().output == "after"
    names = {s.name for s in stored(inst)}
    assert {"workflow surrogate-span", "step open", "step after"} <= names, names


# --- 4-6. the instances counters miss some starts and ends --------------------------------------


def _counters(workflow: str) -> tuple[float, dict[str, float]]:
    """(started, finished by status) of a workflow, from /metrics."""
    from tests.test_metrics import sample, scrape

    samples = scrape()
    started = sample(samples, "wfdash_instances_started_total", workflow=workflow)
    finished = {
        status: sample(samples, "wfdash_instances_finished_total", workflow=workflow, status=status)
        for status in ("complete", "errored", "terminated")
    }
    return started, finished


def test_children_a_terminate_takes_with_their_parent_are_counted_as_finished(registered):
    """client.terminate counts the instance it was asked for (client.py:729,
    count_ended_on_commit), but store.control._terminate_children (control.py:1027)
    terminates the parent's unfinished children in the same transaction and nobody
    counts them: wfdash_instances_finished_total{status="terminated"} of the child's
    workflow stays 0 while the child was started (counted) and is now terminated."""

    @register("rv-child")
    class Child(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.wait_for_event("go", type="go")

    @register("rv-parent")
    class Parent(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.invoke("child", "rv-child")

    started0, finished0 = _counters("rv-child")
    parent = get_workflow("rv-parent").create(id="rv-p")
    testing.run_until_idle()
    child = get_workflow("rv-child").get("rv-p:child")
    assert child.status().status == "waiting"
    assert parent.terminate()
    assert child.status().status == "terminated"
    started, finished = _counters("rv-child")
    assert started - started0 == 1
    assert finished["terminated"] - finished0["terminated"] == 1, (started, finished)


def test_a_poison_instance_errored_by_the_worker_is_counted_as_finished(registered):
    """Worker._execute ends a poison instance (worker.py:877-900, store.finish with
    PoisonInstance) without meters.instance_finished: only Run.execute counts ends
    (runner.py:314). The instance is errored in the database and in
    wfdash_instances_finished_last_hour, but not in wfdash_instances_finished_total."""
    from workflows_app.models import Instance

    @register("rv-poison")
    class Poison(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.do("x", lambda: 1)

    _, finished0 = _counters("rv-poison")
    inst = get_workflow("rv-poison").create(id="rv-poison-1")
    Instance.objects.filter(pk=inst.row().pk).update(unproductive_claims=3)  # three takeovers
    testing.run_until_idle()
    assert inst.status().status == "errored"
    assert inst.status().error["name"] == "PoisonInstance"
    _, finished = _counters("rv-poison")
    assert finished["errored"] - finished0["errored"] == 1, finished


def test_an_instance_first_parked_for_its_version_is_counted_as_started(registered):
    """Run.execute counts a start only when inst.run_count == 1 (runner.py:279). In a
    rolling deploy a worker without the instance's version claims it first (run_count
    becomes 1) and parks it (worker.py:871, park_unrunnable); the worker with the
    version runs it with run_count 2: wfdash_instances_started_total and the queue-wait
    histogram never see it, while it is counted as finished."""
    from workflows_app.engine import registry

    def define() -> None:
        @register("rv-deploy", version=2)
        class V2(WorkflowEntrypoint):
            async def run(self, event, step):
                return await step.do("x", lambda: "v2")

    @register("rv-deploy", version=1)
    class V1(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.do("x", lambda: "v1")

    define()
    started0, finished0 = _counters("rv-deploy")
    with testing.fake_clock(START) as fake:
        inst = get_workflow("rv-deploy").create(id="rv-dep-1", version=2)
        registry.unregister("rv-deploy", 2)  # an old worker, without version 2
        fake.advance("11 seconds")  # past the grace for another version's instances
        testing.run_until_idle()
        assert "version" in inst.row().waiting_reason
        define()  # the new worker, with version 2
        fake.advance("61 seconds")
        testing.run_until_idle()
    assert inst.status().output == "v2"
    started, finished = _counters("rv-deploy")
    assert finished["complete"] - finished0["complete"] == 1
    assert started - started0 == 1, "finished once, never started"


# --- 7. two clocks in one trace ------------------------------------------------------------------


def test_spans_of_one_trace_are_timed_by_one_clock_when_the_host_clock_is_off(registered):
    """The engine's clock is the host's corrected by its offset from the database's
    (clock.py:16 RealClock; measured on PostgreSQL at connect, worker start and
    heartbeats). Sleep, waitForEvent, invoke and start spans take their times from it
    (step.py _sleep_span / finished_span with record.started_at, completed_at), while
    `workflow` and `step` spans take the SDK's host time (
    start_workflow_span, spans.py:98; child_span, spans.py:141 and 155: no start_time/end_time). On a host 5 s
    behind its database the waterfall draws an event wait that ends 5 s after the step
    that ran because of it started (and a wait that starts 5 s after the step before it
    ended). The offset is set here as the measurement would set it (SQLite measures none)."""
    from datetime import timedelta

    @register("rv-skew")
    class Skew(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do("before", lambda: 1)
            await step.wait_for_event("wait", type="go", timeout="1 hour")
            return await step.do("after", lambda: 2)

    real = engine_clock.get_clock()
    assert isinstance(real, engine_clock.RealClock)
    real.offset = timedelta(seconds=5)  # the database's clock runs 5 s ahead of this host's
    try:
        inst = get_workflow("rv-skew").create(id="rv-skew-1")
        testing.run_until_idle()
        inst.send_event("go", {})
        testing.run_until_idle()
    finally:
        real.offset = timedelta(0)
    assert inst.status().status == "complete"
    by_name = {s.name: s for s in stored(inst)}
    before, wait, after = (
        by_name["step before"],
        by_name["waitForEvent wait"],
        by_name["step after"],
    )
    assert before.end_time <= wait.start_time, (before.end_time, wait.start_time)
    assert wait.end_time <= after.start_time, (
        f"the wait ends {wait.end_time - after.start_time} after the step it let run started"
    )


# --- 8. step names as a metric label -------------------------------------------------------------


def test_step_names_made_in_a_loop_do_not_push_other_workflows_out_of_the_step_histogram(
    registered,
):
    """wfdash.step.duration is labelled with the raw step name (meters.py:124,
    step_attempted; step.py:401). Step names must be unique in a run, so a loop names
    them `item 0`, `item 1`, … (or after an order id): every name is a new series, kept
    for the process's life. Past the SDK's 2,000 series per instrument everything new is
    folded into one `otel.metric.overflow` series: after a couple of long loops (here
    two instances of 1,010 steps) the step durations of any other workflow vanish from
    /metrics and OTLP, and each scrape carries 2,000 x 20 bucket lines meanwhile."""
    from tests.test_metrics import sample, scrape

    async def item() -> int:
        return 1

    @register("rv-loop", limits={"max_steps_per_workflow": 1024})
    class Loop(WorkflowEntrypoint):
        async def run(self, event, step):
            for i in range(1010):
                await step.do(f"{event.instance_id} item {i}", item)
            return "looped"

    @register("rv-steady")
    class Steady(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.do("pay", item)

    loops = [get_workflow("rv-loop").create(id=f"loop-{n}") for n in range(2)]
    testing.run_until_idle(timeout=120)
    assert all(inst.status().output == "looped" for inst in loops)
    steady = get_workflow("rv-steady").create(id="steady")
    testing.run_until_idle()
    assert steady.status().status == "complete"
    samples = scrape()
    count = sample(samples, "wfdash_step_duration_seconds_count", workflow="rv-steady", step="pay")
    overflow = sample(samples, "wfdash_step_duration_seconds_count", otel_metric_overflow="true")
    assert count == 1, (
        f"the steady workflow's step is not in the step-duration histogram; "
        f"{overflow:.0f} attempts were folded into the overflow series"
    )


def test_a_step_error_with_a_lone_surrogate_leaves_its_spans_exportable_over_otlp(
    registered, exported
):
    """mark_error put the raw message (exception.message, the status description, the
    stack) on the span: the OTLP exporter's protobuf encoding of a batch holding a lone
    surrogate raises UnicodeEncodeError, and the BatchSpanProcessor drops the whole
    batch: every span exported with it, of every instance, never reached the collector.
    The spans carry the text as stored now (U+FFFD in the surrogate's place)."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    def open_file():
        raise ValueError("cannot read report-\udcff.csv")

    @register("surrogate-export")
    class SurrogateExport(WorkflowEntrypoint):
        async def run(self, event, step):
            with contextlib.suppress(StepFailed):
                await step.do("open", open_file, retries={"limit": 0})
            return await step.do("after", lambda: "after")

    inst = get_workflow("surrogate-export").create(id="sur-x")
    testing.run_until_idle()
    assert inst.status().output == "after"
    spans = exported.get_finished_spans()
    assert {"step open", "step after"} <= {s.name for s in spans}
    assert encode_spans(spans).SerializeToString()  # the request body the exporter sends
    failed = next(s for s in spans if s.name == "step open")
    assert failed.status.description == "cannot read report-\ufffd.csv"
