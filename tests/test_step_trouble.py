"""Steps under everyday trouble: exotic exceptions (CancelledError of a step's own,
SystemExit, StopIteration, a str() that raises), text no database stores (a lone surrogate,
a NUL), one bad write in a group commit, an event that came after its wait's deadline.

Each test failed before the fix its docstring names (found by a review).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
from collections import Counter

import pytest
from django.db import IntegrityError

from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, register, store
from workflows_app.engine.worker import GroupCommit, Worker
from workflows_app.live import EngineHooks
from workflows_app.models import HistoryRecord, Instance, StepRecord

pytestmark = pytest.mark.django_db(transaction=True)

calls: Counter[str] = Counter()


@pytest.fixture(autouse=True)
def _reset_calls():
    calls.clear()


def run_starts(inst) -> int:
    return HistoryRecord.objects.filter(instance=inst.row(), type="run.started").count()


def run_engine(timeout: float) -> str:
    """run_until_idle, reporting (not raising) an engine that did not go idle or blew up."""
    try:
        testing.run_until_idle(timeout=timeout)
    except BaseException as exc:
        return f"{type(exc).__name__}: {exc!r}"
    return "idle"


# --- 1. a step raising CancelledError: endless claim/abort/release loop ---------------------


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
def test_a_step_raising_cancelled_error_fails_instead_of_looping_forever(registered, sync):
    """A step whose callable raises CancelledError (a sync step calling .result() on a
    cancelled concurrent future; an async step awaiting a task someone cancelled) ends the
    workflow task "cancelled"; Run._conclude calls that "aborted" (runner.py:391-395), and
    Worker._execute releases the lease of an aborted run with no database error
    (worker.py:880-893) so it is claimed again at once: a hot loop that writes a
    run.started record per turn for ever and never errors or becomes poison."""
    name = f"raises-cancelled-{sync}"

    @register(name)
    class RaisesCancelled(WorkflowEntrypoint):
        async def run(self, event, step):
            if sync:

                def wait_on_cancelled():
                    calls["f"] += 1
                    future: concurrent.futures.Future[int] = concurrent.futures.Future()
                    future.cancel()
                    return future.result()  # raises concurrent.futures.CancelledError

                fn = wait_on_cancelled
            else:

                async def await_cancelled():
                    calls["f"] += 1
                    task = asyncio.ensure_future(asyncio.sleep(10))
                    await asyncio.sleep(0)
                    task.cancel()
                    return await task  # raises asyncio.CancelledError

                fn = await_cancelled
            return await step.do("s", fn, retries={"limit": 0})

    inst = get_workflow(name).create()
    outcome = run_engine(timeout=3)
    runs = run_starts(inst)
    assert runs <= 2, (
        f"{runs} runs of one instance in 3 s ({calls['f']} calls of its step); engine: {outcome}"
    )
    assert inst.status().status == "errored"


# --- 2. a sync step raising StopIteration hangs until its timeout ---------------------------


def test_a_sync_step_raising_stop_iteration_fails_with_its_error_not_a_timeout(registered):
    """The step thread's concurrent Future holds StopIteration; asyncio.wrap_future cannot
    copy it into an asyncio Future (TypeError in a loop callback), so the attempt's future
    never completes and Run.attempt (runner.py:804-827) waits out the whole timeout (10
    minutes by default), then records StepTimeout instead of the real error."""

    @register("next-of-empty")
    class NextOfEmpty(WorkflowEntrypoint):
        async def run(self, event, step):
            def first_item():
                calls["f"] += 1
                return next(iter([]))  # an everyday bug: StopIteration

            return await step.do("first", first_item, timeout="2 seconds", retries={"limit": 0})

    inst = get_workflow("next-of-empty").create()
    began = time.monotonic()
    run_engine(timeout=10)
    took = time.monotonic() - began
    status = inst.status()
    assert status.status == "errored"
    assert status.error["name"] != "StepTimeout", (status.error, f"{took:.1f} s")


# --- 3. SystemExit / KeyboardInterrupt from a step kills the worker -------------------------


@pytest.mark.parametrize("exc_type", [SystemExit, KeyboardInterrupt])
def test_a_sync_step_raising_system_exit_fails_the_step_not_the_worker(registered, exc_type):
    """A sync step runs in a thread, where SystemExit would only end that thread; the
    engine re-raises it in the event loop (Run.attempt: future.result(), runner.py:812),
    where asyncio re-raises SystemExit/KeyboardInterrupt out of the loop: the worker
    process dies with every run on it, and the instance keeps its lease, unrecorded."""
    name = f"exits-{exc_type.__name__}"

    @register(name)
    class Exits(WorkflowEntrypoint):
        async def run(self, event, step):
            def cli():
                calls["f"] += 1
                raise exc_type(2)  # e.g. argparse/click calling sys.exit on bad arguments

            return await step.do("cli", cli, retries={"limit": 0})

    inst = get_workflow(name).create()
    outcome = run_engine(timeout=10)
    row = Instance.objects.get(pk=inst.row().pk)
    assert outcome == "idle", (outcome, row.status, row.lease_token)
    assert row.status == "errored"


# --- 4. an exception whose str() raises ------------------------------------------------------


def test_an_exception_whose_str_raises_is_retried_and_recorded_under_its_own_name(registered):
    """error_fields (step.py:167) calls str(exc) inside _attempts' except clause: the
    step's own exception is replaced by the one its __str__ raised, the retry policy is
    skipped, no step record or step.failed history is written, and the instance errors
    as "RuntimeError: str is broken"."""

    class BadStr(Exception):
        def __str__(self):
            raise RuntimeError("str is broken")

    @register("bad-str")
    class BadStrFlow(WorkflowEntrypoint):
        async def run(self, event, step):
            def flaky():
                calls["f"] += 1
                raise BadStr("the real problem")

            return await step.do("flaky", flaky, retries={"limit": 1, "delay": 0})

    inst = get_workflow("bad-str").create()
    run_engine(timeout=10)
    status = inst.status()
    assert status.status == "errored"
    assert (calls["f"], status.error["name"]) == (2, "BadStr"), (calls, status.error)


# --- 5. a lone surrogate in a step's output ---------------------------------------------------


def test_an_output_with_a_lone_surrogate_fails_at_once_without_retries(registered):
    """encode_step_output (limits.py:211) measures len(text.encode()) outside any
    try: a str with a lone surrogate (os.listdir of an undecodable file name) raises
    UnicodeEncodeError, not StepOutputError, so the step is retried (its callable runs
    again for nothing; PITFALLS 13)."""

    @register("surrogate-output")
    class SurrogateOutput(WorkflowEntrypoint):
        async def run(self, event, step):
            def list_files():
                calls["f"] += 1
                return ["report-\udcff.csv"]

            return await step.do("list", list_files, retries={"limit": 2, "delay": 0})

    inst = get_workflow("surrogate-output").create()
    run_engine(timeout=10)
    status = inst.status()
    assert (calls["f"], status.error["name"]) == (1, "StepOutputError"), (calls, status.error)


def test_a_run_returning_a_lone_surrogate_errors_instead_of_hanging(registered):
    """Run._conclude catches only StepOutputError around encode_step_output
    (runner.py:415-421): the UnicodeEncodeError escapes the run ("failed inside the
    engine; its lease will run out") and the instance stays running, leased."""

    @register("surrogate-return")
    class SurrogateReturn(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do("one", lambda: 1)
            return "name-\udcff"

    inst = get_workflow("surrogate-return").create()
    run_engine(timeout=10)
    row = Instance.objects.get(pk=inst.row().pk)
    assert row.status == "errored", (row.status, row.lease_token)


# --- 6. a lone surrogate in an error message --------------------------------------------------


def test_an_error_message_with_a_lone_surrogate_is_recorded_and_the_step_not_rerun(registered):
    """The error's message/stack go unsanitised into the step record, history, errors
    table and the instance's error: the checkpoint write raises UnicodeEncodeError (not
    a DatabaseError), the run dies "inside the engine" and the instance stays running
    until its lease runs out; the takeover runs the step again, beyond retries limit 0."""

    @register("surrogate-error")
    class SurrogateError(WorkflowEntrypoint):
        async def run(self, event, step):
            def open_file():
                calls["f"] += 1
                raise ValueError("cannot read report-\udcff.csv")

            return await step.do("open", open_file, retries={"limit": 0})

    inst = get_workflow("surrogate-error").create()
    with testing.fake_clock() as clock:
        run_engine(timeout=10)
        first = Instance.objects.get(pk=inst.row().pk)
        clock.advance("31 seconds")  # the lease of the dead run runs out: taken over
        run_engine(timeout=10)
    row = Instance.objects.get(pk=inst.row().pk)
    assert calls["f"] == 1, (
        f"retries limit 0, yet the step ran {calls['f']} times; after the first run the "
        f"instance was {first.status!r} with lease {first.lease_token!r}; now {row.status!r}"
    )
    assert row.status == "errored"


def group_of_three(monkeypatch, bad_step, refuse=lambda writes, bad_pk: False):
    """Three instances whose 'bad' and 'innocent' checkpoints are queued in one group
    commit behind the 'blocker''s first one (it holds SQLite's one database thread, or
    PostgreSQL's single thread here, until both are queued). bad_step: the bad instance's
    step callable. refuse(writes, bad_pk): a group the database refuses (an
    IntegrityError). Runs them to idle; returns (bad, innocent, refused batches)."""
    gate_entered = threading.Event()
    groups: list[GroupCommit] = []
    real_init = GroupCommit.__init__

    def remember(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        groups.append(self)

    monkeypatch.setattr(GroupCommit, "__init__", remember)

    @register("blocker")
    class Blocker(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do("first", lambda: "first")
            await step.do("second", lambda: "second")
            return "blocker done"

    @register("bad-error")
    class BadError(WorkflowEntrypoint):
        async def run(self, event, step):
            def gated():
                gate_entered.wait(10)
                return bad_step()

            return await step.do("bad", gated, retries={"limit": 0})

    @register("innocent")
    class Innocent(WorkflowEntrypoint):
        async def run(self, event, step):
            def work():
                gate_entered.wait(10)
                calls["innocent"] += 1
                return "ok"

            a = await step.do("a", work)
            b = await step.do("b", lambda: "b")
            return [a, b]

    blocker = get_workflow("blocker").create(id="blocker")
    bad = get_workflow("bad-error").create(id="bad")
    innocent = get_workflow("innocent").create(id="innocent")
    blocker_pk, bad_pk = blocker.row().pk, bad.row().pk
    real_write_steps = store.write_steps
    batches: list[tuple[list[int], str]] = []

    def gated_writes(writes):
        if not gate_entered.is_set() and any(w.pk == blocker_pk for w in writes):
            gate_entered.set()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not (groups and len(groups[0].pending) >= 2):
                time.sleep(0.002)
        try:
            if refuse(writes, bad_pk):
                raise IntegrityError("refused: the bad instance's write in a group")
            return real_write_steps(writes)
        except BaseException as exc:
            batches.append((sorted(w.pk for w in writes), type(exc).__name__))
            raise

    monkeypatch.setattr(store, "write_steps", gated_writes)

    async def drive() -> None:
        worker = Worker(worker_id="review", concurrency=10, db_threads=1, hooks=EngineHooks())
        await worker.start()
        try:
            await worker.run_until_idle(10)
        finally:
            await worker.stop(grace_seconds=0)

    asyncio.run(drive())
    assert gate_entered.is_set()
    return bad, innocent, batches


def assert_innocent_complete(innocent, batches) -> None:
    row = Instance.objects.get(pk=innocent.row().pk)
    assert (row.status, row.error_name) == ("complete", ""), (
        row.status,
        row.error_name,
        row.error_message,
        list(StepRecord.objects.filter(instance=row).values_list("name", "status")),
        f"failed batches (instance pks): {batches}; innocent #{row.pk}",
    )


def test_a_surrogate_error_in_one_instance_does_not_fail_another_instance_s_checkpoint(
    registered, monkeypatch
):
    """Group commit writes several instances' checkpoints in one transaction: the
    UnicodeEncodeError of one instance's error message failed the whole batch, and the
    innocent instance, whose step succeeded, lost its checkpoint."""

    def fail():
        raise ValueError("cannot read report-\udcff.csv")

    _, innocent, batches = group_of_three(monkeypatch, fail)
    assert_innocent_complete(innocent, batches)


def test_a_group_commit_the_database_refuses_is_written_again_one_write_at_a_time(
    registered, monkeypatch
):
    """The same group commit, refused as a whole by the database (here: whenever it holds
    the bad instance's write with another): each write is made again on its own, so the
    innocent instance's checkpoint lands and both complete."""
    bad, innocent, batches = group_of_three(
        monkeypatch,
        lambda: "fine",
        refuse=lambda writes, bad_pk: len(writes) > 1 and bad_pk in {w.pk for w in writes},
    )
    assert any(len(pks) > 1 for pks, _ in batches), batches  # a group was refused
    assert bad.status().status == "complete"
    assert_innocent_complete(innocent, batches)


# --- 7. PostgreSQL: a NUL character in an error message or an event payload -----------------


@pytest.fixture
def postgresql_only():
    from django.db import connection

    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL text and jsonb refuse NUL; SQLite stores it")


def test_pg_an_error_message_with_a_nul_character_is_recorded_and_the_step_not_rerun(
    registered, postgresql_only
):
    """PostgreSQL text columns refuse NUL: the failed step's checkpoint (last_error_message,
    errors table) raises DataError, a non-transient database error, so Run._write_again
    aborts the run silently (runner.py:749-767), the lease is kept until it runs out, and
    the takeover runs the step again (retries limit 0), then again, until PoisonInstance."""

    @register("nul-error")
    class NulError(WorkflowEntrypoint):
        async def run(self, event, step):
            def parse():
                calls["f"] += 1
                raise ValueError("bad record: 'a\x00b'")  # a line of a binary file

            return await step.do("parse", parse, retries={"limit": 0})

    inst = get_workflow("nul-error").create()
    with testing.fake_clock() as clock:
        run_engine(timeout=10)
        first = Instance.objects.get(pk=inst.row().pk)
        clock.advance("31 seconds")
        run_engine(timeout=10)
    row = Instance.objects.get(pk=inst.row().pk)
    assert calls["f"] == 1, (
        f"retries limit 0, yet the step ran {calls['f']} times; after the first run the "
        f"instance was {first.status!r} with lease {first.lease_token!r}; now {row.status!r}"
    )
    assert row.status == "errored"


def test_pg_an_event_payload_with_a_nul_character_is_delivered_or_refused(
    registered, postgresql_only
):
    """send_event stores {"v": "a\\u0000b"} (valid JSON, kept in a text column), but the
    wait's event.received history record is jsonb, which refuses \\u0000: every delivery
    attempt aborts the run (DataError, lease kept until it runs out), the event is never
    delivered and the instance ends as a PoisonInstance after three takeovers."""

    @register("nul-event")
    class NulEvent(WorkflowEntrypoint):
        async def run(self, event, step):
            got = await step.wait_for_event("w", type="go", timeout="1 hour")
            return got.payload

    inst = get_workflow("nul-event").create()
    run_engine(timeout=10)
    try:
        inst.send_event("go", {"v": "a\x00b"})
    except Exception:  # refusing it at the door is fine too
        return
    run_engine(timeout=10)
    row = Instance.objects.get(pk=inst.row().pk)
    assert (row.status, row.output_json) == ("complete", '{"v":"a\\u0000b"}'), (
        row.status,
        row.lease_token,
    )


# --- 9. an event sent after the wait's timeout is delivered to it -----------------------------


def test_an_event_sent_after_the_wait_timed_out_does_not_satisfy_it(registered):
    """wait_for_event takes a buffered event before it looks at the stored deadline
    (step.py:575-576): whether a wait times out depends on when a worker next runs the
    instance, not on its durable timeout_at. An event sent an hour after the deadline
    (all workers busy or down meanwhile) is delivered as if it came in time."""

    @register("late-event")
    class LateEvent(WorkflowEntrypoint):
        async def run(self, event, step):
            try:
                got = await step.wait_for_event("approval", type="approval", timeout="1 hour")
            except Exception as exc:
                return {"error": type(exc).__name__}
            return {"payload": got.payload, "at": got.timestamp.isoformat()}

    inst = get_workflow("late-event").create()
    with testing.fake_clock() as clock:
        run_engine(timeout=10)
        timeout_at = inst.pending_events()[0].timeout_at
        clock.advance("2 hours")  # the deadline passed an hour ago
        inst.send_event("approval", {"ok": True})
        run_engine(timeout=10)
    assert inst.status().output == {"error": "EventTimeout"}, (timeout_at, inst.status().output)


# --- 10. an async step that swallows its cancellation ---------------------------------------


def test_an_async_step_that_swallows_its_cancellation_is_held_to_its_timeout(registered):
    """The attempt's deadline cancels an async step; one that catches the CancelledError
    and goes on waiting ran on past its timeout, its late result taken as the step's (one
    that always swallowed it held the run, and the worker's place, for ever). The attempt
    now times out at its deadline, and the coroutine goes on by itself, abandoned."""

    async def stubborn():
        calls["attempts"] += 1
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            calls["swallowed"] += 1
        await asyncio.sleep(0.5)
        return "finished late"

    @register("swallows-cancel")
    class SwallowsCancel(WorkflowEntrypoint):
        async def run(self, event, step):
            try:
                return await step.do("stubborn", stubborn, retries={"limit": 0}, timeout="200 ms")
            except Exception as exc:
                return {"error": str(exc)}

    inst = get_workflow("swallows-cancel").create()
    assert run_engine(timeout=20) == "idle"
    output = inst.status().output
    assert output == {"error": 'step "stubborn" attempt 1 timed out after 200 ms'}, output
    assert calls == Counter(attempts=1, swallowed=1)


# --- 11. an async step raising a BaseException of its own -------------------------------------


class Interrupted(BaseException):
    """A library's own BaseException (gevent's Timeout, a test runner's Failed…)."""


@pytest.mark.parametrize("exc_type", [GeneratorExit, Interrupted, SystemExit])
def test_an_async_step_raising_a_base_exception_is_a_failed_attempt_recorded_and_retried(
    registered, exc_type
):
    """Only SystemExit and KeyboardInterrupt of an async step were made failed attempts
    (Run.attempt); any other BaseException (GeneratorExit, a library's own) went past
    _attempts' `except Exception` and out of run(): the instance errored at once, its
    retries skipped, with no step record and no step.failed history: the dashboard showed
    an instance that failed with no step that did. A sync step's was retried already."""
    name = f"async-raises-{exc_type.__name__}"

    @register(name)
    class Raises(WorkflowEntrypoint):
        async def run(self, event, step):
            async def fetch():
                calls["f"] += 1
                await asyncio.sleep(0)  # raised after a suspension as well as before
                if calls["f"] == 1:
                    raise exc_type()
                raise exc_type("again")

            return await step.do("fetch", fetch, retries={"limit": 1, "delay": 0})

    inst = get_workflow(name).create()
    assert run_engine(timeout=10) == "idle"
    row = Instance.objects.get(pk=inst.row().pk)
    records = list(
        StepRecord.objects.filter(instance=row).values_list("name", "status", "attempts")
    )
    failed = HistoryRecord.objects.filter(instance=row, type="step.failed").count()
    assert (calls["f"], records, failed) == (2, [("fetch", "failed", 2)], 2), row.error_name
    assert (row.status, row.error_name) == ("errored", exc_type.__name__)


# --- 12. an error with a huge message ----------------------------------------------------------


def stored_text_sizes(row: Instance) -> dict[str, int]:
    """The longest text each place stores of an instance's errors, in characters."""
    from workflows_app.models import ErrorRecord, Span

    def longest(values) -> int:
        return max((len(v if isinstance(v, str) else json.dumps(v)) for v in values), default=0)

    steps = StepRecord.objects.filter(instance=row)
    errors = ErrorRecord.objects.filter(instance=row)
    return {
        "instance.error_message": len(row.error_message),
        "instance.error_stack": len(row.error_stack),
        "step.last_error_message": longest(steps.values_list("last_error_message", flat=True)),
        "step.last_error_stack": longest(steps.values_list("last_error_stack", flat=True)),
        "error.message": longest(errors.values_list("message", flat=True)),
        "error.stack": longest(errors.values_list("stack", flat=True)),
        "history.data": longest(
            HistoryRecord.objects.filter(instance=row).values_list("data", flat=True)
        ),
        "span.status_message": longest(
            Span.objects.filter(instance=row).values_list("status_message", flat=True)
        ),
        "span.events": longest(Span.objects.filter(instance=row).values_list("events", flat=True)),
    }


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
def test_an_error_with_a_huge_message_is_stored_shortened(registered, sync):
    """Error messages and stacks were stored whole: a step raising ValueError(text of a
    whole response) wrote it, and a stack repeating it, into the step record, the
    instance, the errors table, the history and the span of every attempt: 4 MB here
    became tens of MB of rows that every dashboard page and API answer of the instance
    then read. They are shortened to MAX_ERROR_MESSAGE_CHARS, saying by how much."""
    name = f"huge-error-{sync}"
    body = "x" * 4_000_000

    def parse():
        calls["f"] += 1
        raise ValueError(f"cannot parse response: {body}")

    async def parse_async():
        return parse()

    @register(name)
    class HugeError(WorkflowEntrypoint):
        async def run(self, event, step):
            fn = parse if sync else parse_async
            return await step.do("parse", fn, retries={"limit": 1, "delay": 0})

    inst = get_workflow(name).create()
    assert run_engine(timeout=30) == "idle"
    row = Instance.objects.get(pk=inst.row().pk)
    assert (calls["f"], row.status, row.error_name) == (2, "errored", "ValueError")
    sizes = stored_text_sizes(row)
    # A span holds two events (the attempt's error, the exception), each message and stack.
    span_events = sizes.pop("span.events")
    assert max(sizes.values()) <= 17_000 and span_events <= 60_000, (sizes, span_events)
    assert row.error_message.startswith("cannot parse response: xxx"), row.error_message[:80]
    assert "characters more" in row.error_message, row.error_message[-200:]


# --- 13. a retry without delay while a pause is pending ----------------------------------------


def test_a_retry_without_delay_is_not_attempted_once_a_pause_was_asked_for(registered):
    """A step retried with delay 0 went straight on to its next attempt: a pause (or a
    worker's drain at SIGTERM) asked for during an attempt did not stop it, every retry
    ran (each a new execution of the step's side effect) until the step succeeded or
    failed for good; a hung step's retries drew out the drain to its grace period. The
    run now parks at the failed attempt, its retry due at once, as at a step boundary."""

    @register("retry-under-pause")
    class RetryUnderPause(WorkflowEntrypoint):
        async def run(self, event, step):
            def flaky(ctx):
                calls["f"] += 1
                if ctx.attempt == 1:
                    get_workflow("retry-under-pause").get(ctx.instance_id).pause()
                    raise ConnectionError("reset by peer")
                return "ok"

            return await step.do("flaky", flaky, retries={"limit": 3, "delay": 0})

    inst = get_workflow("retry-under-pause").create()
    assert run_engine(timeout=10) == "idle"
    assert (inst.status().status, calls["f"]) == ("paused", 1)
    inst.resume()
    assert run_engine(timeout=10) == "idle"
    status = inst.status()
    assert (status.status, status.output, calls["f"]) == ("complete", "ok", 2)


# --- 14. a sync step that hangs past its timeout -------------------------------------------


def test_a_sync_step_hanging_past_its_timeout_is_reported_with_the_threads_it_leaves(
    registered, caplog
):
    """A timed-out sync attempt keeps its thread (it cannot be killed), and each retry of
    a step that hangs for good leaves one more: nothing said so, so a worker collecting
    hung threads (and their database connections) gave no sign of it. Each timeout now
    logs a warning naming the instance and step and how many are left running."""
    release = threading.Event()

    @register("hangs")
    class Hangs(WorkflowEntrypoint):
        async def run(self, event, step):
            def stuck():
                calls["f"] += 1
                release.wait(30)  # a socket read without a timeout
                return "late"

            return await step.do("read", stuck, timeout="200 ms", retries={"limit": 1, "delay": 0})

    inst = get_workflow("hangs").create()
    try:
        with caplog.at_level("WARNING", logger="workflows_app.engine"):
            assert run_engine(timeout=10) == "idle"
    finally:
        release.set()
    assert (inst.status().error["name"], calls["f"]) == ("StepTimeout", 2)
    reports = [r.getMessage() for r in caplog.records if "thread still runs" in r.getMessage()]
    assert len(reports) == 2, [r.getMessage() for r in caplog.records]
    assert f"hangs/{inst.id}" in reports[0] and 'step "read" attempt 1' in reports[0]
    assert reports[1].endswith("still running in this process: 2"), reports[1]


def test_a_hung_step_s_warning_keeps_a_step_name_with_a_newline_on_its_own_line(registered, caplog):
    """The warning quoted the step's name as it is: a name built from data ("read
    {path}") holding a newline and a log line's own prefix wrote a second log line of
    the attacker's choosing (log injection); ESC sequences drove the terminal tailing
    the log. The name is shown escaped, on the warning's one line."""
    release = threading.Event()
    name = "read\n2026-12-07 ERROR workflows_app forged \x1b[2J\u202e"

    @register("hangs-named")
    class HangsNamed(WorkflowEntrypoint):
        async def run(self, event, step):
            return await step.do(
                name, lambda: release.wait(30), timeout="200 ms", retries={"limit": 0}
            )

    inst = get_workflow("hangs-named").create()
    try:
        with caplog.at_level("WARNING", logger="workflows_app.engine"):
            assert run_engine(timeout=10) == "idle"
    finally:
        release.set()
    assert inst.status().error["name"] == "StepTimeout"
    reports = [r.getMessage() for r in caplog.records if "thread still runs" in r.getMessage()]
    assert len(reports) == 1, [r.getMessage() for r in caplog.records]
    assert "\n" not in reports[0] and "\x1b" not in reports[0] and "\u202e" not in reports[0]
    assert (
        'step "read\\n2026-12-07 ERROR workflows_app forged \\x1b[2J\\u202e" attempt 1'
        in reports[0]
    )
