"""The step API a workflow sees: do, sleep, sleep_until and wait_for_event.

Every method first looks for the checkpoint of its name: a completed step returns what it
returned the first time (the callable does not run again). Otherwise it does the work and
checkpoints it, or, when the run cannot go on now (sleep, event not here yet, retry
delay), it blocks; the runner then parks the instance in the database and frees the worker.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import hashlib
import inspect
import json
import logging
import re
import threading
import traceback
import types
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, NoReturn

from opentelemetry import trace

from ..codec import seal, unseal
from ..models import Instance, Status, StepKind, StepRecord, StepStatus
from . import clock, faults, meters, spans, store
from .attributes import check_attributes
from .durations import MAX_DURATION_MS, parse_duration, parse_instant
from .errors import (
    ChildWorkflowFailed,
    CodecError,
    EventTimeout,
    InvalidInput,
    InvalidTransition,
    LimitExceeded,
    NonDeterminismError,
    NonRetryableError,
    RunAborted,
    StepOutputError,
    StepRaised,
    StepTimeout,
    WorkflowError,
    safe_str,
    shown,
)
from .limits import (
    BACKOFFS,
    INSTANCE_ID_PATTERN,
    MAX_RETRY_LIMIT,
    Limits,
    check_event_type,
    check_instance_id,
    check_size,
    encode_json,
    encode_step_output,
    error_name,
    payload_for_history,
    shortened_message,
    shortened_stack,
    storable_text,
)
from .schemas import check_event_schema
from .store import History, NewInstance, new_model_object

if TYPE_CHECKING:
    from .runner import Run

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkflowEvent:
    """What run() receives: the params, the instance id, when the instance was created and,
    for an instance a schedule started, the tick it fired for (None otherwise)."""

    payload: Any
    instance_id: str
    timestamp: datetime
    scheduled_at: datetime | None = None


@dataclass(frozen=True)
class Event:
    """What wait_for_event returns."""

    type: str
    payload: Any
    timestamp: datetime


@dataclass(frozen=True)
class StepContext:
    """Passed to a step callable that takes one argument; also current_step() inside it."""

    instance_id: str
    step_name: str
    attempt: int
    _abandoned: threading.Event | None = field(default=None, compare=False, repr=False)

    @property
    def idempotency_key(self) -> str:
        return f"{self.instance_id}:{self.step_name}"

    @property
    def cancelled(self) -> bool:
        """True once this attempt was abandoned (it timed out, or its run was stopped).

        An async step is cancelled outright; a sync one cannot be, so it may check this
        and stop early: whatever it returns now is discarded.
        """
        return self._abandoned is not None and self._abandoned.is_set()

    def wait_cancelled(self, seconds: float) -> bool:
        """Sleep up to `seconds`, waking early if the attempt is abandoned; returns cancelled."""
        return self.abandonment().wait(seconds)

    def abandon(self) -> None:
        self.abandonment().set()

    def abandonment(self) -> threading.Event:
        """The event set when the attempt is abandoned, made when first needed: only a sync
        step's thread waits on it (the runner makes it before the thread starts; an async
        step is cancelled outright), and one per attempt cost 3 µs a step."""
        if self._abandoned is None:
            object.__setattr__(self, "_abandoned", threading.Event())
        return self._abandoned  # type: ignore[return-value]


_current_step: contextvars.ContextVar[StepContext | None] = contextvars.ContextVar(
    "wfdash_step", default=None
)


def current_step() -> StepContext | None:
    """The context of the step whose callable is running, or None outside a step."""
    return _current_step.get()


class StepFailed(WorkflowError):
    """A step failed for good (retries exhausted); carries the last attempt's error."""

    def __init__(self, step_name: str, error_name: str, message: str, stack: str = "") -> None:
        self.step_name = step_name
        self.error_name = error_name
        self.message = message
        self.stack = stack
        super().__init__(message)


@dataclass(frozen=True)
class RetryPolicy:
    limit: int
    delay_ms: int
    backoff: str

    def delay_after(self, failed_attempts: int) -> int:
        """Milliseconds to wait after the n-th failed attempt (n from 1); at most
        MAX_DURATION_MS, so a long exponential backoff stays a date the database stores."""
        n = failed_attempts - 1
        if self.backoff == "constant":
            return self.delay_ms
        if self.backoff == "linear":
            return min(self.delay_ms * (n + 1), MAX_DURATION_MS)
        return min(self.delay_ms * (2**n), MAX_DURATION_MS)


def error_fields(exc: BaseException) -> tuple[str, str, str]:
    """(name, message, stack) of an exception, as stored and shown: text both databases
    store whatever the exception holds (a NUL, a lone surrogate, a str() that raises),
    shortened when long (a message holding a whole response)."""
    if isinstance(exc, (NonRetryableError, StepRaised)):
        # A subclass whose own __init__ skips NonRetryableError's has no error_name (or
        # one set to something else than a name): its class names it.
        name = getattr(exc, "error_name", None)
        if not isinstance(name, str) or not name:
            name = type(exc).__name__
    elif isinstance(exc, StepFailed):
        return error_name(exc.error_name), exc.message, exc.stack
    else:
        name = type(exc).__name__
    return (
        error_name(storable_text(name)),
        storable_text(shortened_message(safe_str(exc))),
        storable_text(shortened_stack("".join(traceback.format_exception(exc)))),
    )


def _takes_context(fn: Callable[..., Any]) -> bool:
    """Whether fn takes exactly one positional argument without a default (the context)."""
    # A plain function or method answers from its code object: inspect.signature cost a
    # tenth of a no-op step's engine time.
    bound = isinstance(fn, types.MethodType)
    target = fn.__func__ if bound else fn
    if (
        isinstance(target, types.FunctionType)
        and not hasattr(target, "__wrapped__")
        and not hasattr(target, "__signature__")
    ):
        required = target.__code__.co_argcount - len(target.__defaults__ or ())
        return required - bound == 1
    try:
        params = [
            p
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
        ]
    except (TypeError, ValueError):
        return False
    return len(params) == 1


def _is_async(fn: Callable[..., Any]) -> bool:
    if type(fn) is types.FunctionType and not fn.__dict__:
        # A plain function (no marker of inspect.markcoroutinefunction, nothing wrapped):
        # its code's flag, which is all inspect reads of it, without inspect's ten calls.
        return bool(fn.__code__.co_flags & inspect.CO_COROUTINE)
    target = fn.func if isinstance(fn, functools.partial) else fn
    # An object whose __call__ is async counts too.
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(type(target).__call__)


async def await_returned(
    result: Awaitable[Any], context: StepContext, seconds: float, timed_out: StepTimeout
) -> Any:
    """Await a step's coroutine in this task (no extra task per step), with current_step()
    set, cancelled when `seconds` run out. An async callable's coroutine comes here, and so
    does what a sync one returned when it only built one (`step.do("x", lambda: fetch())`
    ran the lambda in a thread), under what is left of the attempt's timeout."""
    token = _current_step.set(context)
    try:
        ends_at = asyncio.get_running_loop().time() + max(0.0, seconds)
        if isinstance(result, types.CoroutineType):
            # Run to its first suspension here: a step that never waits (no I/O, or none
            # that blocks) ends with no deadline set up and torn down around it (4% of the
            # event loop's time in a herd of timers); one that waits goes on under it.
            try:
                first = result.send(None)
            except StopIteration as returned:
                return returned.value
            except BaseException as raised:
                _raise_as_attempt_error(raised)
            result = _Resumed(result, first)
        deadline = asyncio.timeout_at(ends_at)
        try:
            async with deadline:
                return await result
        except TimeoutError:
            if deadline.expired():
                raise timed_out from None
            raise
    finally:
        _current_step.reset(token)


def _raise_as_attempt_error(exc: BaseException, thrown: BaseException | None = None) -> NoReturn:
    """Raise what a step coroutine raised as the attempt's error: a BaseException of the
    step's own (GeneratorExit, SystemExit, a library's) becomes StepRaised, a failed attempt
    like any other, not an end of run() that skips the retries and the step's record. Not
    the exception thrown into it (its cancellation, passed on) nor a CancelledError (the
    runner tells the step's own from its run's): those go on as they are."""
    if isinstance(exc, (Exception, asyncio.CancelledError)) or exc is thrown:
        raise exc
    raise StepRaised(exc) from exc


_abandoned: set[asyncio.Task[Any]] = set()  # held: the loop keeps only weak references


def _abandon(rest: _Resumed) -> None:
    """Let a step coroutine that ignored its cancellation run on by itself; its end (a
    result, or an error) is logged, never used."""
    task = asyncio.get_running_loop().create_task(_run_on(rest))
    _abandoned.add(task)
    task.add_done_callback(_abandoned_ended)


async def _run_on(rest: _Resumed) -> Any:
    return await rest


def _abandoned_ended(task: asyncio.Task[Any]) -> None:
    _abandoned.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.info("an abandoned step coroutine ended with an error", exc_info=task.exception())


class _Resumed:
    """A coroutine already run to its first suspension, awaited for the rest: what
    `yield from` does, from the value it yielded first (sends, throws and close pass on)."""

    __slots__ = ("coroutine", "first")

    def __init__(self, coroutine: Any, first: Any) -> None:
        self.coroutine = coroutine
        self.first = first

    def __await__(self) -> Any:
        coroutine, value = self.coroutine, self.first
        while True:
            try:
                sent = yield value
            except GeneratorExit:
                coroutine.close()
                raise
            except BaseException as exc:  # a cancellation, a timeout: the coroutine's to handle
                try:
                    value = coroutine.throw(exc)
                except StopIteration as returned:
                    return returned.value
                except BaseException as raised:
                    _raise_as_attempt_error(raised, thrown=exc)
                if isinstance(exc, asyncio.CancelledError):
                    # It swallowed the cancellation (its timeout's, or the run's) and waits
                    # on: it goes on in a task of its own, abandoned as a timed-out sync
                    # step's thread is, and this attempt ends cancelled all the same.
                    _abandon(_Resumed(coroutine, value))
                    raise
            else:
                try:
                    value = coroutine.send(sent)
                except StopIteration as returned:
                    return returned.value
                except BaseException as raised:
                    _raise_as_attempt_error(raised)


class Step:
    """The `step` argument of run(): one per run of an instance."""

    def __init__(self, run: Run) -> None:
        self._run = run

    # --- do ---------------------------------------------------------------------------

    def do(
        self,
        name: str,
        fn: Callable[..., Any] | None = None,
        *,
        retries: dict[str, Any] | None = None,
        timeout: Any = None,
        compensate: Callable[..., Any] | None = None,
        sensitive: bool = False,
    ) -> Any:
        """Run fn as a durable step; or, without fn, decorate a function (Cloudflare's Python form).

        sensitive: the output is checkpointed for replay but every surface (dashboard,
        admin, API, CLI, history, spans) shows REDACTED instead of it.
        """
        if fn is None:

            def decorate(func: Callable[..., Any]) -> Callable[[], Awaitable[Any]]:
                async def call() -> Any:
                    return await self._do(
                        name, func, retries, timeout, compensate, sensitive=sensitive
                    )

                return call

            return decorate
        return self._do(name, fn, retries, timeout, compensate, sensitive=sensitive)

    async def _do(
        self,
        name: str,
        fn: Callable[..., Any],
        retries: dict[str, Any] | None,
        timeout: Any,
        compensate: Callable[..., Any] | None,
        kind: str = StepKind.DO,
        sensitive: bool = False,
    ) -> Any:
        run = self._run
        if not callable(fn):
            raise InvalidInput(f'step "{name}": expected a callable, got {fn!r}')
        policy, timeout_ms = self._step_config(name, retries, timeout)
        record = run.begin_op(name, kind)
        if compensate is not None:
            run.register_compensation(name, compensate)
        if record is not None:
            if record.status == StepStatus.COMPLETE:
                try:  # every replayed step: no context manager made on the way
                    return record.output
                except CodecError as exc:
                    raise run.cannot_decode(f'the output of step "{name}"', exc) from None
            if record.status == StepStatus.FAILED:
                raise run.stored_failure(record)
        async with run.activity() as activity:
            if (
                record is not None
                and record.status == StepStatus.RETRYING
                and record.wake_at > clock.now()
            ):
                await activity.block(wake_at=record.wake_at)
            if record is None:
                record = run.new_record(name, kind, StepStatus.RUNNING)
            record.max_attempts = policy.limit + 1
            record.has_compensation = compensate is not None
            attributes = run.span_attributes(record.label, kind)
            if sensitive:
                attributes["workflow.step.sensitive"] = True
            return await self._attempts(
                record, fn, policy, timeout_ms, activity, sensitive, attributes
            )

    async def _attempts(
        self,
        record: StepRecord,
        fn: Callable[..., Any],
        policy: RetryPolicy,
        timeout_ms: int,
        activity: Any,
        sensitive: bool,
        attributes: dict[str, Any],
    ) -> Any:
        """Attempt the step until it succeeds, fails for good, or must wait for a retry;
        each attempt in a span of its own (the dashboard lists attempts by their spans)."""
        run, name = self._run, record.label
        while True:
            with spans.child_span(run.span, f"step {name}", attributes):
                if record.attempts >= policy.limit + 1:
                    # The limit may have been lowered after a crash: fail with the real last error.
                    raise await run.fail_step(record, None, nonretryable=False)
                record.attempts += 1
                record.status = StepStatus.RUNNING
                # No write before the attempt: its start is recorded with its outcome, in the
                # one transaction a checkpoint costs. A crash mid-attempt re-runs it
                # (at-least-once).
                started = [
                    History(
                        "step.started",
                        {"step": name, "attempt": record.attempts, "at": clock.now().isoformat()},
                    )
                ]
                run.notify("step_started", run, record)
                try:
                    # A result that cannot be stored fails the step: an attempt in error.
                    with meters.timed_attempt(run.definition.name, name):
                        result = await run.attempt(record, fn, timeout_ms)
                        output_json = encode_step_output(result, name, run.limits)
                    faults.hit("after_side_effect")
                except (NonRetryableError, StepOutputError) as exc:
                    raise await run.fail_step(
                        record, exc, nonretryable=True, history=started
                    ) from exc
                except Exception as exc:  # a failed attempt: retry or give up
                    if record.attempts >= policy.limit + 1:
                        raise await run.fail_step(
                            record, exc, nonretryable=False, history=started
                        ) from exc
                    delay = policy.delay_after(record.attempts)
                    await run.schedule_retry(record, exc, delay, history=started)
                    if delay > 0 or run.holding:
                        # A pause or a drain asked for meanwhile: no new attempt here; the
                        # run parks, its retry due at once (for another worker, at a drain).
                        await activity.block(wake_at=record.wake_at)
                    continue
                record.status = StepStatus.COMPLETE
                record.output_json = seal(output_json, sensitive)
                record.completed_at = clock.now()
                record.wake_at = None
                await run.write(
                    record,
                    [
                        *started,
                        History("step.completed", {"step": name, "attempt": record.attempts}),
                    ],
                    progress=True,
                    hold=True,
                )
                return json.loads(output_json)

    def _step_config(
        self, name: str, retries: dict[str, Any] | None, timeout: Any
    ) -> tuple[RetryPolicy, int]:
        if retries is None and timeout is None:  # the workflow's defaults: read once a run
            run = self._run
            if run.default_step_config is None:
                if self._settled(name):  # not checked: not to be kept for the steps to come
                    return self._read_step_config(name, None, None, settled=True)
                run.default_step_config = self._read_step_config(name, None, None)
            return run.default_step_config
        return self._read_step_config(name, retries, timeout, self._settled(name))

    def _read_step_config(
        self, name: str, retries: dict[str, Any] | None, timeout: Any, settled: bool = False
    ) -> tuple[RetryPolicy, int]:
        """settled: the step has its result already (its timeout is not checked against
        the limits, which may have been lowered since)."""
        limits = self._run.limits
        retries = dict(retries or {})
        unknown = set(retries) - {"limit", "delay", "backoff"}
        if unknown:
            raise InvalidInput(
                f'step "{name}": unknown retries option(s) {sorted(unknown)}; use limit, delay, backoff'
            )
        limit = retries.get("limit")
        if limit is None:
            limit = limits.default_retry_limit
        if (
            not isinstance(limit, int)
            or isinstance(limit, bool)
            or not 0 <= limit <= MAX_RETRY_LIMIT
        ):
            raise InvalidInput(
                f'step "{name}": retries limit must be an integer from 0 to {MAX_RETRY_LIMIT}, '
                f"got {shown(limit)}"
            )
        delay = retries.get("delay")
        delay_ms = limits.default_retry_delay if delay is None else parse_duration(delay)
        backoff = retries.get("backoff")
        backoff = limits.default_retry_backoff if backoff is None else backoff
        if backoff not in BACKOFFS:
            raise InvalidInput(f'step "{name}": backoff must be one of {BACKOFFS}, got {backoff!r}')
        timeout_ms = limits.default_step_timeout if timeout is None else parse_duration(timeout)
        if timeout_ms > limits.max_step_timeout and not settled:
            raise LimitExceeded(
                "max_step_timeout",
                f"{timeout_ms} ms",
                f"{limits.max_step_timeout} ms",
                f'step "{name}" timeout',
            )
        return RetryPolicy(limit, delay_ms, backoff), timeout_ms

    # --- search attributes --------------------------------------------------------------

    async def set_attributes(self, name: str, attributes: dict[str, Any]) -> dict[str, Any]:
        """A durable step that upserts the instance's search attributes; returns them.

        Replay returns the checkpoint without writing again; a crash between the write and
        the checkpoint writes the same values again (an upsert is idempotent).
        """
        checked = check_attributes(attributes, f'attributes of step "{name}"')
        run = self._run

        async def upsert() -> dict[str, Any]:
            try:
                await run.db(store.merge_attributes, run.pk, run.token, checked)
            except LimitExceeded as exc:  # too many keys with those kept: no retry helps
                raise NonRetryableError(str(exc), "LimitExceeded") from None
            return checked

        return await self._do(name, upsert, {"limit": 3, "delay": 1000}, None, None)

    # The limits an operator may change (max_sleep, timeouts) judge a step when it starts:
    # one started (a sleep's wake time, a wait's timeout are stored) or settled under the
    # limits of its day replays as it was, not as an error after they were lowered.

    def _started(self, name: str) -> bool:
        return name in self._run.checkpoints

    def _settled(self, name: str) -> bool:
        record = self._run.checkpoints.get(name)
        return record is not None and record.status in (StepStatus.COMPLETE, StepStatus.FAILED)

    # --- sleeps -----------------------------------------------------------------------

    async def sleep(self, name: str, duration: Any) -> None:
        """Park the instance for a duration (str, timedelta or milliseconds)."""
        ms = parse_duration(duration)
        limits = self._run.limits
        if ms > limits.max_sleep and not self._started(name):
            raise LimitExceeded(
                "max_sleep", f"{ms} ms", f"{limits.max_sleep} ms", f'sleep "{name}"'
            )
        await self._sleep(name, StepKind.SLEEP, lambda now: now + timedelta(milliseconds=ms))

    async def sleep_until(self, name: str, until: Any) -> None:
        """Park the instance until an instant (aware datetime or epoch milliseconds)."""
        instant = parse_instant(until)
        limits = self._run.limits
        delay_ms = (instant - clock.now()) / timedelta(milliseconds=1)
        if delay_ms > limits.max_sleep and not self._started(name):
            raise LimitExceeded(
                "max_sleep",
                f"{int(delay_ms)} ms",
                f"{limits.max_sleep} ms",
                f'sleep_until "{name}"',
            )
        await self._sleep(name, StepKind.SLEEP_UNTIL, lambda now: instant)

    async def _sleep(
        self, name: str, kind: str, wake_at_from: Callable[[datetime], datetime]
    ) -> None:
        run = self._run
        record = run.begin_op(name, kind)
        if record is not None and record.status == StepStatus.COMPLETE:
            if name in run.sleeps_ended:  # by this run's claim: reported here, not written
                run.sleeps_ended.discard(name)
                run.notify(
                    "step_written", run, record, [History("sleep.completed", {"step": name})]
                )
                self._sleep_span(name, kind, record)
            return
        async with run.activity() as activity:
            if record is None:
                # The wake time is computed once and stored: replays use the stored one.
                record = run.new_record(name, kind, StepStatus.WAITING)
                record.wake_at = wake_at_from(clock.now())
                record.attempts = 1
                history = [
                    History("sleep.started", {"step": name, "until": record.wake_at.isoformat()})
                ]
                if not run.sleep_is_due(record):
                    await run.write(record, history)
                    if not await run.sleep_here(record.wake_at):
                        await activity.block(wake_at=record.wake_at)
            else:
                history = []
                if not run.sleep_is_due(record) and not await run.sleep_here(record.wake_at):
                    await activity.block(wake_at=record.wake_at)
            record.status = StepStatus.COMPLETE
            record.completed_at = clock.now()
            record.output_json = "null"
            history.append(History("sleep.completed", {"step": name}))
            await run.write(record, history, progress=True, behind=True)
            self._sleep_span(name, kind, record)

    def _sleep_span(self, name: str, kind: str, record: StepRecord) -> None:
        run = self._run
        spans.finished_span(
            run.span,
            f"{kind} {name}",
            record.started_at,
            record.completed_at,
            run.span_attributes(name, kind),
        )

    # --- events -----------------------------------------------------------------------

    async def wait_for_event(
        self, name: str, *, type: str, timeout: Any = None, schema: dict[str, Any] | None = None
    ) -> Event:
        """Wait until an event of `type` is sent to this instance (or one sent earlier is here)."""
        run = self._run
        limits = run.limits
        check_event_type(type)
        timeout_ms = (
            limits.default_wait_for_event_timeout if timeout is None else parse_duration(timeout)
        )
        if (
            timeout_ms < limits.min_wait_for_event_timeout
            or timeout_ms > limits.max_wait_for_event_timeout
        ) and not self._started(name):
            raise LimitExceeded(
                "wait_for_event timeout",
                f"{timeout_ms} ms",
                f"{limits.min_wait_for_event_timeout} ms … {limits.max_wait_for_event_timeout} ms",
                f'wait_for_event "{name}"',
            )
        schema_json = None
        if schema is not None:
            check_event_schema(name, schema)
            schema_json = encode_json(schema, f'schema of wait_for_event "{name}"')
        record = run.begin_op(name, StepKind.WAIT_FOR_EVENT)
        if record is not None:
            if record.status == StepStatus.COMPLETE:
                with run.decoding(f'the event received by step "{name}"'):
                    return _event_from_json(record.output_json)
            if record.status == StepStatus.FAILED:
                raise run.stored_failure(record)
        async with run.activity() as activity:
            history: list[History] = []
            if record is None:
                record = run.new_record(name, StepKind.WAIT_FOR_EVENT, StepStatus.WAITING)
                record.event_type = type
                record.event_schema_json = schema_json
                record.attempts = 1
                record.wake_at = clock.now() + timedelta(milliseconds=timeout_ms)
                history.append(
                    History(
                        "event.waiting",
                        {"step": name, "type": type, "timeout_at": record.wake_at.isoformat()},
                    )
                )
            delivered = await run.take_event(type, schema, sent_by=record.wake_at)
            if delivered is None and not run.event_timed_out(record):
                if history:
                    await run.write(record, history)
                await activity.block(event_type=type, wake_at=record.wake_at)
            attributes = {
                **run.span_attributes(name, StepKind.WAIT_FOR_EVENT),
                "workflow.event.type": type,
            }
            if delivered is None:
                error = EventTimeout(
                    f'wait_for_event "{name}" timed out waiting for an event of type {type!r}'
                )
                history.append(History("event.timeout", {"step": name, "type": type}))
                # The wait's own span carries the error (and the error row links it), not
                # the run's: a workflow may catch the timeout and complete.
                span = spans.open_span(
                    run.span, f"waitForEvent {name}", record.started_at, attributes
                )
                try:
                    failure = await run.fail_step(
                        record, error, nonretryable=False, history=history, span=span
                    )
                finally:
                    spans.end_span(span, record.started_at, clock.now())
                raise failure
            with run.decoding(f"the payload of event #{delivered.pk}"):
                payload = delivered.payload
            event = Event(type=type, payload=payload, timestamp=delivered.created_at)
            meters.event_received(run.definition.name, type, delivered.created_at, clock.now())
            record.status = StepStatus.COMPLETE
            record.completed_at = clock.now()
            record.output_json = seal(
                encode_json(
                    {
                        "type": type,
                        "payload": payload,
                        "timestamp": delivered.created_at.isoformat(),
                    },
                    f'event received by "{name}"',
                )
            )
            record.wake_at = None
            shown = payload_for_history(payload, unseal(delivered.payload_json) or "null")
            data = {"step": name, "type": type, "event_id": delivered.pk, **shown}
            history.append(History("event.received", data))
            await run.write(record, history, consume_event=delivered.pk, progress=True, behind=True)
            spans.finished_span(
                run.span, f"waitForEvent {name}", record.started_at, record.completed_at, attributes
            )
            return event

    # --- children -----------------------------------------------------------------------

    async def invoke(
        self,
        name: str,
        workflow: str,
        params: Any = None,
        *,
        id: str | None = None,
        version: int | None = None,
    ) -> Any:
        """Start a child workflow once and return its output when it completes.

        The parent parks meanwhile (it holds no worker slot); the child's finish makes it
        due. A child that errors or is terminated raises ChildWorkflowFailed (not retried).
        """
        run = self._run
        record = run.begin_op(name, StepKind.INVOKE)
        if record is not None:
            if record.status == StepStatus.COMPLETE:
                with run.decoding(f'the output of step "{name}"'):
                    return record.output
            if record.status == StepStatus.FAILED:
                raise run.stored_failure(record)
        async with run.activity() as activity:
            if record is None:
                # A run that ends from now on terminates the child (Run.awaits_child), even
                # if this branch is stopped before its waiting checkpoint is written.
                run.invoke_began = True
                try:
                    child = await self._start_child(
                        name, workflow, params, id, version, detached=False
                    )
                except WorkflowError as exc:
                    failure = await self._start_failed(None, name, StepKind.INVOKE, workflow, exc)
                    if failure is exc:
                        raise
                    raise failure from exc
                record = run.new_record(name, StepKind.INVOKE, StepStatus.WAITING)
                record.attempts = 1
                await run.write(record, [_child_history("child.started", name, child, wait=True)])
            # Read after the waiting checkpoint is stored: a child finishing later finds
            # that step and wakes this instance; one that finished before is seen here.
            child = await run.db(store.child_of, run.pk, name)
            if (
                child is not None
                and child.status not in FINISHED_STATUSES
                and record.wake_at is not None
            ):
                # A child's end woke this step, and the child runs again since (restarted):
                # clear the wake time park reads, then look again (it may have ended since).
                record.wake_at = None
                await run.write(record, [])
                child = await run.db(store.child_of, run.pk, name)
            if child is not None and child.status not in FINISHED_STATUSES:
                await activity.block()
            return await self._child_finished(record, child, workflow)

    async def start(
        self,
        name: str,
        workflow: str,
        params: Any = None,
        *,
        id: str | None = None,
        version: int | None = None,
    ) -> str:
        """Start a child workflow once and return its instance id at once (no waiting)."""
        run = self._run
        record = run.begin_op(name, StepKind.START_CHILD)
        if record is not None and record.status == StepStatus.COMPLETE:
            return str(record.output)
        if record is not None and record.status == StepStatus.FAILED:
            raise run.stored_failure(record)  # its child could not be started (_start_failed)
        async with run.activity():
            try:
                child = await self._start_child(name, workflow, params, id, version, detached=True)
            except WorkflowError as exc:
                failure = await self._start_failed(
                    record, name, StepKind.START_CHILD, workflow, exc
                )
                if failure is exc:
                    raise
                raise failure from exc
            record = record or run.new_record(name, StepKind.START_CHILD, StepStatus.RUNNING)
            record.status = StepStatus.COMPLETE
            record.attempts = 1
            record.output_json = json.dumps(child.instance_id)
            record.completed_at = clock.now()
            history = [_child_history("child.started", name, child, wait=False)]
            await run.write(record, history, progress=True)
            attributes = {
                **run.span_attributes(name, StepKind.START_CHILD),
                "workflow.child": workflow,
                **_child_attributes(child),
            }
            spans.finished_span(
                run.span, f"start {name}", record.started_at, record.completed_at, attributes
            )
            return child.instance_id

    async def _start_child(
        self,
        name: str,
        workflow: str,
        params: Any,
        id: str | None,
        version: int | None,
        detached: bool,
    ) -> Instance:
        from .registry import get_definition  # the registry imports this module

        run = self._run
        if not isinstance(workflow, str) or not workflow:
            raise InvalidInput(
                f'step "{name}": the child\'s workflow must be a registered workflow name, '
                f"got {workflow!r}"
            )
        if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
            raise InvalidInput(
                f'step "{name}": the child\'s version must be an integer or None, got {shown(version)}'
            )
        definition = get_definition(workflow, version)
        limits = definition.limits()
        what = f'params of the child of step "{name}"'
        params_json = encode_json(params, what)
        check_size(params_json, "max_params_bytes", limits.max_params_bytes, what)
        if id is None:
            readable, fallback = child_ids(run.pk, run.instance_id, name, limits)
        else:
            readable = fallback = check_instance_id(id, limits)
        trace_id, span_id = spans.span_ids(run.span)
        item = NewInstance(
            readable,
            seal(params_json),
            parent_pk=run.pk,
            parent_step=name,
            parent_span=f"{trace_id}:{span_id}" if span_id else "",
            detached=detached,  # step.start's: it outlives the parent's end (Instance.detached)
            parent_token=run.token,
        )
        actor = f"{run.definition.name}/{run.instance_id}"
        await run.settle()  # the parent's history keeps its order
        try:
            child, created = await run.db(
                store.start_child,
                definition.name,
                definition.version,
                limits,
                item,
                fallback,
                actor,
            )
        except store.LeaseLost as exc:
            run.abort(str(exc))
            raise RunAborted(str(exc)) from None
        if not created:
            # A replay finds the child by the step's name: after a restart (on another
            # version, or after a deploy), that step may now ask for another workflow, a
            # pinned version or an id the old child does not have, and would take the old
            # child's output as that one's. Without id=: the ids derived from the parent
            # and step (the readable one whatever the child's id length limit is now).
            ids = {readable, fallback}
            if id is None:
                ids.add(f"{run.instance_id}:{_ID_UNSAFE.sub('-', name)}")
            asked = _other_child_asked(child, definition, version, id, ids)
            if asked is not None:
                run.fatal = NonDeterminismError(
                    f'step "{name}" started {child.instance_id}, a child of workflow '
                    f'"{child.workflow}" version {child.version}, but the workflow now asks '
                    f"it for {asked}: a step that starts another child needs another name "
                    "(or restart the instance on the version it started the child with)"
                )
                raise run.fatal
        if created:  # in the parent's context: the creation span links to the parent's span
            created_span = spans.creation_span(
                child.trace_id, child.pk, definition.name, child.instance_id, actor
            )
            spans.link_child(run.span, created_span, child.instance_id)
        return child

    async def _start_failed(
        self,
        record: StepRecord | None,
        name: str,
        kind: str,
        workflow: Any,
        exc: WorkflowError,
    ) -> BaseException:
        """A child that could not be started (an unknown workflow or version, an invalid
        id or params, an id taken) fails the step that asked for it, as any step error does:
        its record, step.failed history, error row and span name the step, and every replay
        raises the same NonRetryableError (under the original error's name) instead of
        trying again (a workflow registered meanwhile would start a child the first run
        did not). Returns what to raise: `exc` itself for a non-determinism or an ended
        parent (nothing recorded)."""
        run = self._run
        if run.fatal is exc or isinstance(exc, (NonDeterminismError, InvalidTransition)):
            return exc
        if record is None:
            record = run.new_record(name, kind, StepStatus.RUNNING)
        record.attempts = record.max_attempts = 1
        attributes = run.span_attributes(name, kind)
        if isinstance(workflow, str):
            attributes["workflow.child"] = workflow
        label = "invoke" if kind == StepKind.INVOKE else "start"
        span = spans.open_span(run.span, f"{label} {name}", record.started_at, attributes)
        try:
            return await run.fail_step(record, exc, nonretryable=True, span=span)
        finally:
            spans.end_span(span, record.started_at, clock.now())

    async def _child_finished(
        self, record: StepRecord, child: Instance | None, workflow: str
    ) -> Any:
        """Checkpoint what became of the child: its output, or ChildWorkflowFailed."""
        run, name = self._run, record.name
        attributes = {
            **run.span_attributes(name, StepKind.INVOKE),
            "workflow.child": workflow,
            **_child_attributes(child),
        }
        record.completed_at = clock.now()
        record.wake_at = None
        complete = child is not None and child.status == Status.COMPLETE
        oversized = None
        if child is not None and complete:
            with run.decoding(f'the output of the child of step "{name}"'):
                oversized = self._too_big(child)
        if complete and oversized is None:
            record.status = StepStatus.COMPLETE
            record.output_json = child.output_json or "null"
            await run.write(record, [_child_history("child.completed", name, child)], progress=True)
            spans.finished_span(
                run.span, f"invoke {name}", record.started_at, record.completed_at, attributes
            )
            return json.loads(unseal(record.output_json) or "null")  # sealed by a payload codec
        if child is None:
            error = ChildWorkflowFailed(
                workflow, "", "InstanceNotFound", "the child instance no longer exists"
            )
        elif oversized:
            error = ChildWorkflowFailed(child.workflow, child.instance_id, *oversized)
        else:
            terminated = child.status == Status.TERMINATED
            error = ChildWorkflowFailed(
                child.workflow,
                child.instance_id,
                child.error_name or ("WorkflowTerminated" if terminated else "WorkflowFailed"),
                child.error_message or ("the child was terminated" if terminated else ""),
            )
        record.status = StepStatus.FAILED
        record.last_error_name = "ChildWorkflowFailed"
        record.last_error_message = str(error)
        record.output_json = json.dumps(
            {
                "nonretryable": True,
                "child": {
                    "workflow": error.workflow,
                    "id": error.instance_id,
                    "error_name": error.error_name,
                    "message": error.message,
                },
            }
        )
        failed = {"name": error.error_name, "message": error.message}
        history = [
            History("child.failed", {"step": name, "id": error.instance_id, "error": failed}),
            History(
                "step.failed",
                {
                    "step": name,
                    "attempt": 1,
                    "final": True,
                    "error": {"name": "ChildWorkflowFailed", "message": str(error)},
                },
            ),
        ]
        span = trace.get_current_span()
        await run.write(
            record,
            history,
            progress=True,
            error=run.error_record(
                "workflow.step", "ChildWorkflowFailed", str(error), "", span, name, 1
            ),
        )
        spans.finished_span(
            run.span, f"invoke {name}", record.started_at, record.completed_at, attributes, error
        )
        raise error

    def _too_big(self, child: Instance) -> tuple[str, str] | None:
        """The error of a child's output larger than this workflow's max_step_output_bytes
        (the child's own limit may be higher): the invoke is a step, and its checkpoint
        holds no more than step.do's may. None when it fits."""
        run, limit = self._run, self._run.limits.max_step_output_bytes
        size = len((unseal(child.output_json) or "null").encode())
        if size <= limit:
            return None
        return (
            "StepOutputError",
            f"the output of {child.workflow}/{child.instance_id} is {size} bytes of JSON; "
            f"max_step_output_bytes of {run.definition.name} is {limit}",
        )


FINISHED_STATUSES = frozenset({Status.COMPLETE, Status.ERRORED, Status.TERMINATED})
_ID_UNSAFE = re.compile(r"[^a-zA-Z0-9_.:-]+")


def child_ids(parent_pk: int, parent_id: str, step_name: str, limits: Limits) -> tuple[str, str]:
    """The id a child gets (readable: "<parent id>:<step name>") and the one it falls back
    to (when that is not a valid id, too long, or taken): both depend only on the parent
    and the step, so every replay names the same child."""
    digest = hashlib.sha256(f"{parent_pk}/{step_name}".encode()).hexdigest()
    fallback = f"child-{digest[:32]}"
    # Two step names may make one slug ("a b", "a-b"): the second child finds the id taken
    # and falls back (store.start_child); replays find children by step, not by id.
    readable = f"{parent_id}:{_ID_UNSAFE.sub('-', step_name)}"
    if len(readable) > limits.max_instance_id_length or not INSTANCE_ID_PATTERN.match(readable):
        return fallback, fallback
    return readable, fallback


def _other_child_asked(
    child: Instance,
    definition: Any,
    version: int | None,
    given_id: str | None,
    ids: Collection[str],
) -> str | None:
    """What a step now asks for that the child it started is not (None: it is that child):
    another workflow, another pinned version (`version=`; an unpinned step takes the child
    on whatever version it started), or another id (`id=`, else the ids derived from the
    parent and step)."""
    if child.workflow != definition.name:
        return f'workflow "{definition.name}"'
    if version is not None and child.version != definition.version:
        return f"version {definition.version}"
    if child.instance_id not in ids:
        return f"id {given_id!r}" if given_id is not None else "the id it derives (no id=)"
    return None


def _child_attributes(child: Instance | None) -> dict[str, str]:
    """What a parent's invoke or start span says of its child, to find the child's trace."""
    if child is None:
        return {}
    return {
        "workflow.child.instance_id": child.instance_id,
        "workflow.child.trace_id": child.trace_id,
    }


def _child_history(kind: str, step_name: str, child: Instance, wait: bool | None = None) -> History:
    data: dict[str, Any] = {"step": step_name, "workflow": child.workflow, "id": child.instance_id}
    if wait is not None:
        data["wait"] = wait
    return History(kind, data)


def _event_from_json(text: str | None) -> Event:
    data = json.loads(unseal(text) or "{}")
    return Event(
        type=data["type"],
        payload=data["payload"],
        timestamp=datetime.fromisoformat(data["timestamp"]),
    )


def new_step_record(name: str, kind: str, status: str, seq: int) -> StepRecord:
    """A new, unsaved StepRecord (new_model_object: Model.__init__ with keywords looked up
    every field's default one by one, 10 µs a step, a twelfth of the engine's time per
    step on SQLite)."""
    given = {"name": name, "kind": kind, "status": status, "seq": seq, "started_at": clock.now()}
    return new_model_object(StepRecord, given)
