"""Run one instance once: replay from its checkpoints until it completes, fails or parks.

A run never waits for time to pass or for an event to arrive. When every branch of the
workflow is blocked (sleeping, waiting for an event, waiting for a retry) or a pause was
asked for, the run is quiescent: the runner cancels the workflow coroutine and parks the
instance in the database. Parked instances cost a row, not a coroutine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import functools
import inspect
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import DatabaseError
from opentelemetry import context as otel_context
from opentelemetry import trace

from ..codec import is_sensitive, seal
from ..models import InboxEvent, Status, StepKind, StepRecord, StepStatus
from ..text import one_line
from . import clock, lifecycle, meters, spans, store
from .errors import (
    ChildWorkflowFailed,
    CodecError,
    DuplicateStepName,
    EventTimeout,
    LimitExceeded,
    NonDeterminismError,
    NonRetryableError,
    RunAborted,
    StepOutputError,
    StepRaised,
    StepTimeout,
)
from .limits import check_step_name, encode_step_output
from .overrides import overrides
from .registry import Definition
from .schemas import event_validator
from .step import (
    Step,
    StepContext,
    StepFailed,
    WorkflowEvent,
    _current_step,
    _is_async,
    _takes_context,
    await_returned,
    error_fields,
    new_step_record,
)
from .store import History, LeaseLost

log = logging.getLogger("workflows_app.engine")
# The threads of timed-out sync attempts still running: each is a thread, and maybe a
# database connection, held until its callable returns (reported at every timeout).
_hung_threads: set[concurrent.futures.Future[Any]] = set()

DbCall = Callable[..., Awaitable[Any]]
QUIESCENCE_TICKS = 10  # loop iterations to let sibling branches start before calling a run blocked
# The latest step asked for in this branch of the workflow: asyncio tasks copy the context,
# so each gathered branch carries its own from the step before the fork.
_previous_step: contextvars.ContextVar[str] = contextvars.ContextVar(
    "wfdash_previous_step", default=""
)
# Waits before each new try of a checkpoint after a passing database error: about 10 s in all.
WRITE_RETRY_DELAYS = (
    0.05,
    0.1,
    0.2,
    0.4,
    0.8,
    1.6,
    2.0,
    2.0,
    2.0,
)
# How long a run's end waits for the gathered branches it cancelled to stop.
BRANCH_STOP_SECONDS = 10.0

EVENT_BATCH = 100  # buffered events read at a time by a wait


@dataclass
class Inbox:
    """The buffered events of one type this run has read and not yet taken."""

    events: list[InboxEvent] = field(default_factory=list)
    last_id: int = 0
    exhausted: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class Activity:
    """A branch of the run at work (a step, a sleep, a wait), for `async with run.activity()`:
    work cannot start while a pause is pending. A class, not an async generator context
    manager: every step enters one, and an async generator costs its creation, the loop's
    first-iteration hook (a weak set) and its closing."""

    __slots__ = ("blocked", "run")

    def __init__(self, run: Run) -> None:
        self.run = run
        self.blocked = False

    async def __aenter__(self) -> Activity:
        run = self.run
        if run.abort_reason is not None:
            raise RunAborted(run.abort_reason)
        if run.unconfirmed:  # a new step that may be a sibling branch's: see _check_determinism
            await run.confirmed()
            if run.abort_reason is not None:
                raise RunAborted(run.abort_reason)
        run.in_flight += 1
        try:
            if run.held is not None or run.landing is not None:
                await run.land()  # before the pause check: the last checkpoint may carry one
            if run.holding or ((run.compensating or run.rolling_back) and not run.unwinding):
                await self.block()
        except BaseException:
            self._leave()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._leave()

    def _leave(self) -> None:
        if not self.blocked:
            run = self.run
            run.in_flight -= 1
            if run._quiescent():  # the last branch at work stopped: the run may park
                run.changed.set()

    async def block(
        self, *, wake_at: datetime | None = None, event_type: str | None = None
    ) -> None:
        """Declare this branch unable to go on in this run; never returns."""
        self.blocked = True
        self.run.in_flight -= 1
        if event_type:
            self.run.awaited_types.append(event_type)
        self.run.blocked += 1
        self.run.changed.set()
        await asyncio.get_running_loop().create_future()


class Run:
    def __init__(
        self,
        definition: Definition,
        loaded: store.LoadedRun,
        token: str,
        db: DbCall,
        step_threads: Any,
        hooks: Any = None,
        checkpoint: Callable[[store.StepWrite], Awaitable[str]] | None = None,
        sleep_in_process: float = 0.0,
    ) -> None:
        self.definition = definition
        # Sleeps ending within this many seconds are waited for here (see sleep_here).
        self.sleep_in_process = sleep_in_process
        self.instance = loaded.instance
        self.pk = loaded.instance.pk
        self.instance_id = loaded.instance.instance_id
        self.token = token
        self.db = db
        # Where checkpoints go: the worker's group commit, or one transaction each.
        self.checkpoint = checkpoint or self._checkpoint_alone
        self.step_threads = step_threads
        self.hooks = hooks
        self.limits = definition.limits()
        self.default_step_config: tuple[Any, int] | None = None  # see Step._step_config
        # When a run that parked made the instance due next (None: when told): its
        # worker need not look for work because of it until then.
        self.parked_until: datetime | None = None
        # An end joins the group commit unless it has a parent to lock and wake or a queue
        # to promote (flow control).
        self.end_in_group = (
            checkpoint is not None
            and loaded.instance.parent_id is None
            and not self.limits.flow_controlled
        )
        self.checkpoints = loaded.steps
        # A step.invoke of this run began creating its child: from then on the child may
        # exist before its waiting checkpoint does (a branch stopped in between).
        self.invoke_began = False
        self.sleeps_ended = loaded.sleeps_ended  # see Step._sleep
        self.compensation_checkpoints = loaded.compensations
        # Checkpoints by the step before them in their branch: where replay must go next.
        self.successors: dict[str, list[StepRecord]] = {}
        for checkpoint in self.checkpoints.values():
            if checkpoint.after is not None:
                self.successors.setdefault(checkpoint.after, []).append(checkpoint)
        # Buffered events by type: those of waiting steps came with the load, others are
        # read as waits ask for them.
        self.inboxes: dict[str, Inbox] = {
            event_type: Inbox(list(events), events[-1].pk if events else 0, complete)
            for event_type, (events, complete) in loaded.events.items()
        }
        self.seen: set[str] = set()
        # New steps asked after a step another checkpoint followed, by the branch (task)
        # asking: they start once every checkpoint after that step is asked for (a sibling
        # branch's), or fail with a NonDeterminismError when the run can go no further.
        self.unconfirmed: dict[asyncio.Task[Any] | None, Unconfirmed] = {}
        # Why this run stopped on a stored value the payload codec cannot decode (None: it did not).
        self.undecodable: str | None = None
        self._after: dict[str, str] = {}  # step name -> the step before it in its branch, this run
        self.op_count = 0
        self.next_seq = max([loaded.instance.step_seq, *(s.seq for s in loaded.steps.values())])
        self.in_flight = 0
        self.blocked = 0
        self.awaited_types: list[str] = []
        self.pause_requested = loaded.instance.status == Status.WAITING_FOR_PAUSE
        self.draining = False  # its worker is shutting down: stop at the next step boundary
        # The contexts of step callables still running in threads, told when the run stops.
        self.sync_attempts: set[StepContext] = set()
        self.abandoned: dict[
            str, Any
        ] = {}  # step name -> the thread future of its timed-out attempt
        self.abort_reason: str | None = None
        self.abort_error: BaseException | None = None  # the database error that cut the run short
        self.fatal: BaseException | None = None
        self.changed = asyncio.Event()
        self.compensations: dict[str, Callable[..., Any]] = {}
        self.task: asyncio.Task[Any] | None = None
        self.span: Any = None
        # cancel(compensate=True): replay only to collect compensations, then unwind.
        self.error_message = ""
        self.failure: BaseException | None = None  # compensate_on_failure: the error being unwound
        self.compensating = loaded.instance.compensate_on_cancel
        # compensate_on_failure, resumed: the instance failed and unwinds; this replay only
        # fails again the same way, it starts no new work (a sibling branch's next step).
        self.rolling_back = loaded.instance.status == Status.COMPENSATING and not self.compensating
        self.unwinding = False
        self.cancelled_before_end = False  # an end refused for a cancel that compensates
        self.main_context: contextvars.Context | None = None  # run()'s task's, once started
        # The tasks that asked for steps (gathered branches): stopped before the run
        # unwinds or ends, so none goes on (and completes uncompensated) meanwhile.
        self.branches: set[asyncio.Task[Any]] = set()
        self.branches_stopped = False
        self.behind: asyncio.Future[None] | None = None  # see write(behind=True)
        self.held: store.StepWrite | None = None  # see write(hold=True)
        self.landing: asyncio.Future[None] | None = None  # a held checkpoint, sent behind

    # --- signals from outside -------------------------------------------------------

    def request_pause(self) -> None:
        self.pause_requested = True
        self.changed.set()

    def drain(self) -> None:
        """Start no more work: park at the next step boundary, due at once for another worker."""
        self.draining = True
        self.changed.set()

    @property
    def holding(self) -> bool:
        """Work may not start (a pause is pending or the worker is draining)."""
        return self.pause_requested or self.draining

    def start_compensating(self) -> None:
        """cancel(compensate=True) came while this run holds the lease: no more work starts,
        the steps in flight finish and are checkpointed, then the run unwinds (their
        compensations with the others'). Not for a run unwinding a failure already."""
        if self.compensating or self.unwinding or self.rolling_back or self.failure is not None:
            return
        self.compensating = True
        self.changed.set()

    @contextlib.contextmanager
    def decoding(self, what: str) -> Iterator[None]:
        """Reading a stored value: the run stops when the payload codec cannot decode it
        (see cannot_decode)."""
        try:
            yield
        except CodecError as exc:
            raise self.cannot_decode(what, exc) from None

    def cannot_decode(self, what: str, exc: CodecError) -> RunAborted:
        """Stop the run on a stored value the payload codec cannot decode (a key missing
        after a rotation, a damaged envelope). Not an error raised into run(): a workflow
        catching ValueError went on with another value. The worker parks the instance,
        saying which value, until the codec can decode it."""
        self.undecodable = (
            f"cannot decode {what} of {self.definition.name}/{self.instance_id}: {exc}"
        )
        self.abort(self.undecodable)
        return RunAborted(self.undecodable)

    def abort(self, reason: str) -> None:
        """Stop this run now (terminate, restart, lost lease): it writes nothing more."""
        if self.abort_reason is None:
            self.abort_reason = reason
        for context in self.sync_attempts:
            context.abandon()  # a sync step that checks ctx.cancelled stops early
        self.changed.set()

    # --- the run ----------------------------------------------------------------------

    async def execute(self) -> str:
        """Returns what became of the instance: complete, errored, waiting, paused or aborted."""
        inst = self.instance
        if inst.status == Status.WAITING_FOR_PAUSE:
            return await self._park()  # a pause asked for while a crashed run held the lease
        try:
            params = inst.params
        except CodecError as exc:
            self.cannot_decode("the params", exc)
            return "aborted"
        event = WorkflowEvent(
            payload=params,
            instance_id=inst.instance_id,
            timestamp=inst.created_at,
            scheduled_at=inst.scheduled_at,
        )
        self.span = spans.start_workflow_span(
            inst.trace_id,
            inst.pk,
            self.definition.name,
            {
                "workflow.name": self.definition.name,
                "workflow.instance_id": inst.instance_id,
                "workflow.version": self.definition.version,
                "workflow.run": inst.run_count,
            },
            inst.parent_span,
        )
        # The workflow coroutine runs with the run's span current: user spans nest under it.
        ctx = contextvars.copy_context()
        ctx.run(otel_context.attach, trace.set_span_in_context(self.span))
        ctx.run(_previous_step.set, "")
        self.main_context = ctx  # its _previous_step: the main branch's last step
        self.task = asyncio.get_running_loop().create_task(
            self.definition.start(inst.instance_id, event, Step(self)), context=ctx
        )
        outcome = "aborted"
        try:
            outcome = await self._supervise(self.task)
            return outcome
        finally:
            with contextlib.suppress(RunAborted, DatabaseError):
                await self.settle()  # an aborted run's write behind lands before its lease goes
            if outcome in lifecycle.FINISHED:
                meters.instance_finished(self.definition.name, outcome)
            self.span.set_attribute("workflow.outcome", outcome)
            if outcome == Status.ERRORED:
                spans.mark_error(self.span, None, self.error_message)
            self.span.end(end_time=spans.now_ns())

    async def _supervise(self, task: asyncio.Task[Any]) -> str:
        # The workflow's end wakes the supervisor as any other change does: one Event to
        # wait on, not a waiter task and an asyncio.wait per turn.
        task.add_done_callback(self._workflow_ended)
        while True:
            await self.changed.wait()
            if task.done():
                break
            self.changed.clear()
            if self.abort_reason is not None:
                await self._cancel(task)
                return "aborted"
            if self._quiescent():
                for _ in range(QUIESCENCE_TICKS):
                    await asyncio.sleep(0)
                if task.done():
                    break
                if self._quiescent() and self.unconfirmed and not self.holding:
                    self._refuse_unconfirmed()  # no sibling asked for what followed: changed code
                    continue
                if self._quiescent():
                    await self._cancel(task)
                    if self.abort_reason is not None:
                        return "aborted"
                    if self.compensating and not self.unwinding and not self.holding:
                        return await self._unwind()
                    return await self._park()
        if self.compensating and not self.unwinding and self.abort_reason is None:
            return await self._unwind()
        return await self._conclude(task)

    def _workflow_ended(self, _: asyncio.Task[Any]) -> None:
        self.changed.set()

    async def _stop_branches(self) -> None:
        """Cancel the branches still at work once run() has ended (a gathered sibling of a
        branch that failed) and wait for them (at most BRANCH_STOP_SECONDS: a branch whose
        own code swallows the cancellation may go on, but any step it asks for raises
        RunAborted): the compensations undo what was checkpointed, and nothing completes
        behind them. A sync step's thread is told (ctx.cancelled); its result is discarded,
        as at a terminate."""
        self.branches_stopped = True
        for context in self.sync_attempts:
            context.abandon()
        current = asyncio.current_task()
        left = [t for t in self.branches if t is not current and not t.done()]
        self.branches.clear()
        for task in left:
            task.cancel()
        if left:
            await asyncio.wait(left, timeout=BRANCH_STOP_SECONDS)
        self.unconfirmed.clear()  # the stopped branches' new steps: nothing waits on them now

    async def _unwind(self) -> str:
        """Run the compensations of completed steps, newest first, each as a durable step."""
        await self._stop_branches()
        self.unwinding = True
        self.blocked = 0
        self.awaited_types.clear()
        self.task = asyncio.ensure_future(self._run_compensations())
        return await self._supervise(self.task)

    async def _run_compensations(self) -> None:
        step = Step(self)
        completed = sorted(
            (
                r
                for r in self.checkpoints.values()
                if r.kind == StepKind.DO and r.status == StepStatus.COMPLETE and r.has_compensation
            ),
            key=lambda r: r.seq,
            reverse=True,
        )
        for record in completed:
            fn = self.compensations.get(record.name)
            if fn is None:
                raise NonRetryableError(
                    f'step "{record.name}" has a compensation but the replay did not reach it',
                    "CompensationMissing",
                )
            with self.decoding(f'the output of step "{record.name}"'):
                output = record.output
            await step._do(
                record.name,
                functools.partial(fn, output),
                None,
                None,
                None,
                kind=StepKind.COMPENSATE,
                # What undoes a sensitive step is given its secret: its result is as secret.
                sensitive=is_sensitive(record.output_json),
            )

    def _quiescent(self) -> bool:
        return self.in_flight == 0 and (self.blocked > 0 or self.holding or bool(self.unconfirmed))

    async def _cancel(self, task: asyncio.Task[Any]) -> None:
        task.cancel()
        with contextlib.suppress(BaseException):  # the workflow's own unwinding is not our result
            await task

    async def _park(self) -> str:
        try:
            await self.settle()
            status, self.parked_until = await self.db(
                store.park,
                self.pk,
                self.token,
                self.holding,
                list(self.awaited_types),
                "",
                # Per type, the newest event read: newer ones arrived during the run.
                {
                    t: self.inboxes[t].last_id if t in self.inboxes else 0
                    for t in self.awaited_types
                },
                self.unwinding,
            )
        except (LeaseLost, RunAborted):
            return "aborted"
        return str(status)

    async def _conclude(self, task: asyncio.Task[Any]) -> str:
        # Retrieve the outcome first, always: an unretrieved task exception is logged at
        # garbage collection, at an arbitrary point of some other code.
        exc = task.exception() if not task.cancelled() else RunAborted("cancelled")
        if self.abort_reason is not None:
            return "aborted"
        if isinstance(exc, (RunAborted, asyncio.CancelledError)):
            return "aborted"
        if self.fatal is not None:
            exc = self.fatal
        if not self.unwinding:
            await self._stop_branches()
        if exc is None and self.unwinding and self.failure is not None:
            exc = self.failure
            history_first = [History("compensation.completed", {"reason": "failure"})]
        else:
            history_first = []
        if exc is None and self.unwinding:
            ok = await self.end(
                Status.TERMINATED,
                history=[
                    History("compensation.completed", {}),
                    History("instance.cancelled", {"compensated": True}),
                ],
            )
            return Status.TERMINATED if ok else "aborted"
        if exc is None and not self.unwinding:
            exc = self._skipped_at_the_end()
        if exc is None:
            try:
                output_json = seal(
                    encode_step_output(task.result(), "run() return value", self.limits)
                )
            except StepOutputError as error:
                exc = error
            else:
                ok = await self.end(
                    Status.COMPLETE, output_json, history=[History("instance.completed", {})]
                )
                if not ok and self.cancelled_before_end:
                    return await self._unwind()
                return Status.COMPLETE if ok else "aborted"
        if (
            self.definition.cls.compensate_on_failure
            and not self.unwinding
            and any(
                r.has_compensation and r.status == StepStatus.COMPLETE
                for r in self.checkpoints.values()
            )
        ):
            # Unwind first; replays fail the same way, so a parked unwinding resumes.
            self.failure = exc
            name, message, _ = error_fields(exc)
            data = {"reason": "failure", "error": {"name": name, "message": message}}
            try:
                await self.settle()
                await self.db(store.begin_compensation, self.pk, self.token, data)
            except (LeaseLost, RunAborted):
                return "aborted"
            return await self._unwind()
        name, message, stack = error_fields(exc)
        self.error_message = f"{name}: {message}"
        spans.mark_error(
            self.span, exc if not isinstance(exc, StepFailed) else None, self.error_message
        )
        ok = await self.end(
            Status.ERRORED,
            error=(name, message, stack),
            history=[
                *history_first,
                History("instance.errored", {"error": {"name": name, "message": message}}),
            ],
            error_record=self.error_record("workflow.instance", name, message, stack, self.span),
        )
        if not ok and self.cancelled_before_end:
            return await self._unwind()
        return Status.ERRORED if ok else "aborted"

    async def end(
        self,
        status: str,
        output_json: str | None = None,
        *,
        error: tuple[str, str, str] | None = None,
        history: list[History],
        error_record: dict[str, Any] | None = None,
    ) -> bool:
        """Finish the instance; False when the lease was lost. A plain end shares the
        group commit with other runs' checkpoints (SQLite), one commit fewer per run. The
        checkpoint of a step the workflow ended right after is written with the end."""
        held, self.held = self.held, None
        try:
            await self.settle()
        except RunAborted:
            return False
        end = store.FinishWrite(
            self.pk,
            self.token,
            status,
            self.limits,
            output_json,
            error,
            history,
            error_record,
            held,
        )
        try:
            ended = await self._finish(end)
        except DatabaseError as exc:
            if held is None:
                raise
            # The step ran: its checkpoint is retried on its own (never the step), then the end.
            try:
                self._written(held, await self._write_again(held, exc))
            except RunAborted:
                return False
            end.step = None
            return await self._finish(end)
        if ended and held is not None:
            self._written(held, status)
        if not ended and status != Status.TERMINATED and not self.unwinding:
            await self._compensate_instead(held)
        return ended

    async def _compensate_instead(self, held: store.StepWrite | None) -> None:
        """An end refused for a cancel(compensate=True) that came meanwhile (the lease is
        still this run's, not lost): the step it held is checkpointed after all, and the
        run is to unwind (_conclude), that step's compensation with the others'."""
        try:
            if not await self.db(store.cancel_pending, self.pk, self.token):
                return
            if held is not None:
                await self._write_now(held)
        except (RunAborted, DatabaseError):
            return
        self.compensating = self.cancelled_before_end = True

    async def _finish(self, end: store.FinishWrite) -> bool:
        # A run that ends on its own while a step.invoke waits ends that child with it.
        end_children = end.status != Status.TERMINATED and self.awaits_child()
        # The end of a cancel's unwinding (errored: a compensation failed for good) is that
        # cancel's own: the fence that refuses other ends while it is pending lets it pass.
        unwound = self.unwinding and self.compensating and end.status != Status.TERMINATED
        if self.end_in_group and not end_children and not unwound:
            return bool(await self.checkpoint(end))
        return bool(
            await self.db(
                store.finish,
                end.pk,
                end.token,
                end.status,
                end.limits,
                end.output_json,
                end.error,
                end.history,
                end.error_record,
                self.instance.parent_id,  # a child's finish locks its parent first and wakes it
                end.step,
                end_children,
                unwound,
            )
        )

    def awaits_child(self) -> bool:
        """Whether a step.invoke of this run may still wait for its child: a waiting
        checkpoint, or an invoke this run began (its branch stopped while the child was
        being created leaves a child and no checkpoint; the end's look then finds it)."""
        return self.invoke_began or awaits_child(self.checkpoints.values())

    def error_record(
        self,
        source: str,
        name: str,
        message: str,
        stack: str,
        span: Any,
        step: str = "",
        attempt: int | None = None,
    ) -> dict[str, Any]:
        trace_id, span_id = spans.span_ids(span)
        return {
            "workflow": self.definition.name,
            "source": source,
            "step_name": step,
            "attempt": attempt,
            "name": name,
            "message": message,
            "stack": stack,
            "trace_id": trace_id or self.instance.trace_id,
            "span_id": span_id,
        }

    def notify(self, hook: str, *args: Any) -> None:
        """Tell the app's hooks (live updates); their failure never affects the run."""
        if self.hooks is None:
            return
        try:
            getattr(self.hooks, hook)(*args)
        except Exception:
            log.exception("hook %s failed for instance #%s", hook, self.pk)

    # --- what the step API uses -------------------------------------------------------

    def begin_op(self, name: str, kind: str) -> StepRecord | None:
        """Validate a step call and return its checkpoint, if any."""
        if self.abort_reason is not None:
            raise RunAborted(self.abort_reason)
        check_step_name(name, self.limits)
        if kind == StepKind.COMPENSATE:  # the engine's own: undoes the step of that name
            return self.compensation_checkpoints.get(name)
        if self.branches_stopped:  # a branch that went on after its cancellation
            raise RunAborted("the run has ended")
        task = asyncio.current_task()
        if task is not None:
            self.branches.add(task)
        if name in self.seen:
            raise DuplicateStepName(
                f'step name "{name}" is used twice in one execution; step names must be unique'
            )
        self.op_count += 1
        if self.op_count > self.limits.max_steps_per_workflow:
            raise LimitExceeded(
                "max_steps_per_workflow", self.op_count, self.limits.max_steps_per_workflow
            )
        previous = _previous_step.get()
        record = self.checkpoints.get(name)
        self._check_determinism(name, kind, previous, record)
        self.seen.add(name)
        if self.unconfirmed and record is not None:
            self._confirm_siblings(name)
        self._after[name] = previous
        _previous_step.set(name)  # in this branch's context: a gathered branch has its own
        return record

    def _check_determinism(
        self, name: str, kind: str, previous: str, record: StepRecord | None
    ) -> None:
        """Replay must ask for the steps the instance checkpointed, in each branch's order.

        Every checkpoint remembers the step before it in its branch; a step asked for
        after another one than it followed, or a new step where a checkpointed one followed
        the same step, means the code changed under the instance (register a new version).
        """
        changed = None
        if record is not None and record.kind != kind:
            changed = f'step "{name}" was checkpointed as {record.kind} but the workflow now asks for it as {kind}'
        elif record is not None and record.after is not None and record.after != previous:
            changed = (
                f'{kind} step "{name}" was checkpointed after {_step_label(record.after)} but the workflow now '
                f"asks for it after {_step_label(previous)}"
            )
        elif record is None:
            skipped = next(
                (r for r in self.successors.get(previous, ()) if r.name not in self.seen), None
            )
            if skipped is not None:
                # Changed code, or a gathered sibling's checkpoint the replay has not reached
                # yet: this branch's step was asked for and never checkpointed (stopped at
                # the run's end, lost with a crashed worker) while the sibling's was. Which
                # one is known when the run can go no further: the step waits until then.
                self.unconfirmed[asyncio.current_task()] = Unconfirmed(
                    previous,
                    _changed(
                        f'the workflow now asks for {kind} step "{name}" after {_step_label(previous)}, '
                        f'where it checkpointed {skipped.kind} step "{skipped.name}"'
                    ),
                )
                self.changed.set()
        if changed is not None:
            self.fatal = _changed(changed)
            raise self.fatal

    def _confirm_siblings(self, name: str) -> None:
        """A checkpointed step was asked for: the new steps waiting on the step before it
        go on once every checkpoint after that step is asked for (siblings' branches)."""
        record = self.checkpoints.get(name)
        if record is None or record.after is None:
            return
        if any(r.name not in self.seen for r in self.successors.get(record.after, ())):
            return
        for task, waiting in list(self.unconfirmed.items()):
            if waiting.after == record.after:
                del self.unconfirmed[task]
                if not waiting.future.done():
                    waiting.future.set_result(None)

    async def confirmed(self) -> None:
        """Wait until this branch's new step is known not to replace a checkpointed one."""
        waiting = self.unconfirmed.get(asyncio.current_task())
        if waiting is None:
            return
        try:
            await waiting.future
        finally:
            if self.unconfirmed.get(asyncio.current_task()) is waiting:
                del self.unconfirmed[asyncio.current_task()]

    def _refuse_unconfirmed(self) -> None:
        """The run can go no further and a checkpoint after the step before a new one was
        never asked for: the code changed under the instance."""
        for waiting in self.unconfirmed.values():
            if self.fatal is None:
                self.fatal = waiting.error
            if not waiting.future.done():
                waiting.future.set_exception(waiting.error)
                # Retrieved here too: its branch may have been stopped before it woke.
                waiting.future.add_done_callback(lambda done: done.cancelled() or done.exception())
        self.unconfirmed.clear()

    def _skipped_at_the_end(self) -> NonDeterminismError | None:
        """A workflow that returns after its last step where a checkpoint followed that
        step: the steps it was at were removed under the instance (not a new version)."""
        context = self.main_context
        last = context.get(_previous_step, "") if context is not None else ""
        skipped = next((r for r in self.successors.get(last, ()) if r.name not in self.seen), None)
        if skipped is None:
            return None
        return NonDeterminismError(
            f"the workflow now returns after {_step_label(last)}, where it checkpointed "
            f'{skipped.kind} step "{skipped.name}": steps were renamed, added, removed or '
            "reordered under a running instance (register a new version instead)"
        )

    def span_attributes(self, name: str, kind: str) -> dict[str, Any]:
        return {
            "workflow.name": self.definition.name,
            "workflow.instance_id": self.instance_id,
            "workflow.version": self.definition.version,
            "workflow.step.name": name,
            "workflow.step.type": kind,
        }

    def register_compensation(self, name: str, fn: Callable[..., Any]) -> None:
        self.compensations[name] = fn

    def new_record(self, name: str, kind: str, status: str) -> StepRecord:
        self.next_seq += 1
        record = new_step_record(name, kind, status, self.next_seq)
        if kind != StepKind.COMPENSATE:
            # begin_op made this step the branch's latest: the one before it was saved there.
            record.after = self._after.get(name, "")
        return record

    def activity(self) -> Activity:
        """Mark a branch as doing work (async with); see Activity."""
        return Activity(self)

    async def write(
        self,
        record: StepRecord,
        history: list[History],
        consume_event: int | None = None,
        progress: bool = False,
        error: dict[str, Any] | None = None,
        behind: bool = False,
        hold: bool = False,
    ) -> None:
        """Checkpoint a step. `behind`: the run goes on while the checkpoint is written (the
        end of a sleep or a wait, which ran no user code: a crash before it lands replays
        to the same point); every later write of the run, its park and its end wait for it.

        `hold` (a step that ran user code): the workflow goes on until it next suspends.
        If it has ended by then, the checkpoint is written with the instance's end (Run.end:
        one statement instead of two); if it starts a step, a sleep or a wait first, that
        writes the checkpoint and waits for it (land); else (it awaits something of its
        own) the checkpoint is written behind, at the loop's next turn. Either way no more
        work of the run starts before the checkpoint has landed."""
        if self.abort_reason is not None:
            raise RunAborted(self.abort_reason)
        write = store.StepWrite(
            self.pk, self.token, record, history, consume_event, progress, error
        )
        (self.compensation_checkpoints if record.kind == StepKind.COMPENSATE else self.checkpoints)[
            record.name
        ] = record
        if hold:
            self._send_held(for_end=False)  # a branch's earlier one
            self.held = write
            asyncio.get_running_loop().call_soon(self._send_held)
            return
        if behind:
            self._send_behind(write)
            return
        await self._write_now(write)

    async def _write_now(self, write: store.StepWrite) -> None:
        await self.settle()  # the run's checkpoints land in the order they were made
        self._written(write, await self._checkpoint_or_abort(write))

    def _send_behind(self, write: store.StepWrite) -> asyncio.Future[None]:
        self.behind = asyncio.ensure_future(self._write_behind(self.behind, write))
        # Retrieved here too: a refused write aborts the run, which may never settle it.
        self.behind.add_done_callback(lambda done: done.cancelled() or done.exception())
        return self.behind

    def _send_held(self, for_end: bool = True) -> None:
        """Write the held checkpoint behind the run, unless the workflow has ended and its
        end may take it (for_end)."""
        write = self.held
        if write is None or (for_end and self.task is not None and self.task.done()):
            return
        self.held = None
        self.landing = self._send_behind(write)

    async def land(self) -> None:
        """Wait for the held checkpoint (written here if still held); RunAborted if refused.
        Not for the writes behind sleeps and waits: work may start before those land."""
        write = self.held
        if write is not None:
            self.held = None
            await self._write_now(write)
            return
        landing = self.landing
        if landing is None:
            return
        try:
            await asyncio.shield(landing)
        finally:
            if landing.done() and self.landing is landing:
                self.landing = None

    async def _checkpoint_or_abort(self, write: store.StepWrite) -> str:
        try:
            return await self.checkpoint(write)
        except LeaseLost as exc:
            self.abort(str(exc))
            raise RunAborted(str(exc)) from None
        except DatabaseError as exc:
            return await self._write_again(write, exc)

    def _written(self, write: store.StepWrite, status: str) -> None:
        if status == Status.WAITING_FOR_PAUSE and not self.pause_requested:
            self.request_pause()
        elif status == Status.COMPENSATING:
            self.start_compensating()  # a cancel whose hint has not come (yet)
        elif status == Status.RUNNING and self.pause_requested:
            self.pause_requested = False  # resumed before this boundary: the pause is off
        self.notify("step_written", self, write.step, write.history)

    async def _write_behind(
        self, before: asyncio.Future[None] | None, write: store.StepWrite
    ) -> None:
        if before is not None:
            await before  # the instance's checkpoints land in the order they were made
        if self.abort_reason is not None:
            raise RunAborted(self.abort_reason)
        self._written(write, await self._checkpoint_or_abort(write))

    async def settle(self) -> None:
        """Wait for the checkpoints written behind the run; RunAborted if one was refused."""
        self._send_held(for_end=False)
        behind = self.behind
        if behind is None:
            return
        try:
            await asyncio.shield(behind)  # a cancelled waiter leaves the write going
        finally:
            if behind.done() and self.behind is behind:
                self.behind = None

    async def _write_again(self, write: store.StepWrite, error: DatabaseError) -> str:
        """Retry a checkpoint the database refused for a passing reason (a restart, a dropped
        connection), with backoff: the write is fenced and idempotent, while re-running the
        step would repeat its side effects. Anything else stops this run (it is not the
        workflow's business, and it must not catch it); it runs again from its checkpoint."""
        for delay in WRITE_RETRY_DELAYS:
            if not store.transient(error) or self.abort_reason is not None:
                break
            await asyncio.sleep(delay)
            try:
                return str(await self.db(store.rewrite_step, write))
            except LeaseLost as exc:
                self.abort(str(exc))
                raise RunAborted(str(exc)) from None
            except DatabaseError as exc:
                error = exc
        self.abort_error = error
        self.abort(f"database error: {error}")
        raise RunAborted(f"database error: {error}") from error

    async def _checkpoint_alone(self, write: store.StepWrite) -> str:
        (result,) = await self.db(store.write_steps, [write])
        if isinstance(result, LeaseLost):
            raise result
        return result

    async def attempt(self, record: StepRecord, fn: Callable[..., Any], timeout_ms: int) -> Any:
        """One attempt of a step callable, cancelled (async) or abandoned (sync) at its timeout."""
        context = StepContext(self.instance_id, record.name, record.attempts)
        call = functools.partial(fn, context) if _takes_context(fn) else fn
        mocked = (  # a mock of a step stands for the step, not for its compensation
            call
            if record.kind == StepKind.COMPENSATE
            else overrides.step_callable(self.instance_id, record.name, call)
        )
        if mocked is not call:
            fn = call = mocked
        timed_out = StepTimeout(
            f'step "{record.label}" attempt {record.attempts} timed out after {timeout_ms} ms'
        )
        if _is_async(fn):
            # In this task, under a deadline: no extra task per step; cancelled at the timeout.
            try:
                return await await_returned(call(), context, timeout_ms / 1000, timed_out)
            except (SystemExit, KeyboardInterrupt) as exc:
                raise StepRaised(exc) from exc
            except asyncio.CancelledError as exc:
                task = asyncio.current_task()
                if self.abort_reason is not None or task is None or task.cancelling():
                    raise  # this run is being cancelled
                raise StepRaised(exc) from exc  # the step's own: a failed attempt
        previous = self.abandoned.pop(record.name, None)
        if previous is not None and not previous.done():
            # The last attempt timed out but its thread still runs (it was told through
            # ctx.cancelled): give it up to one more timeout to stop before the next
            # attempt starts, so attempts overlap only when a step ignores cancellation.
            await asyncio.wait({asyncio.wrap_future(previous)}, timeout=timeout_ms / 1000)
        context.abandonment()  # before its thread may wait on it
        ctx = contextvars.copy_context()
        ctx.run(_current_step.set, context)
        self.loop = asyncio.get_running_loop()
        began: list[float] = []

        def in_thread() -> Any:
            began.append(time.monotonic())
            try:
                return ctx.run(call)
            except (StopIteration, concurrent.futures.CancelledError) as exc:
                # A future cannot carry the one (the attempt would hang), and the other
                # would reach the loop as a cancel of this run.
                raise StepRaised(exc) from exc
            except Exception:
                raise
            except BaseException as exc:  # SystemExit, KeyboardInterrupt, CancelledError
                raise StepRaised(exc) from exc

        thread_future = self.step_threads.submit(in_thread)
        self.sync_attempts.add(context)
        thread_future.add_done_callback(functools.partial(self._sync_attempt_ended, context))
        future = asyncio.wrap_future(thread_future)
        remaining = timeout_ms / 1000
        while True:
            done, _ = await asyncio.wait({future}, timeout=remaining)
            if done:
                result = future.result()
                if inspect.isawaitable(result):  # step.do("x", lambda: fetch()) built a coroutine
                    left = began[0] + timeout_ms / 1000 - time.monotonic()
                    return await await_returned(result, context, left, timed_out)
                return result
            # The timeout counts running time only: not the wait for a thread to start it.
            remaining = (
                timeout_ms / 1000 if not began else began[0] + timeout_ms / 1000 - time.monotonic()
            )
            if remaining <= 0:
                break
        # Abandoned: its late result is discarded, so attempts never overlap in effect.
        context.abandon()
        self.abandoned[record.name] = thread_future
        future.cancel()
        if not thread_future.done():
            _hung_threads.add(thread_future)
            thread_future.add_done_callback(_hung_threads.discard)
            log.warning(
                "%s/%s: %s; its thread still runs (a thread cannot be killed) and its "
                "result will be discarded. Timed-out step threads still running in this "
                "process: %d",
                self.definition.name,
                self.instance_id,
                one_line(str(timed_out)),  # it quotes the step's name, the user's text
                len(_hung_threads),
            )
        raise timed_out

    def _sync_attempt_ended(self, context: StepContext, _: Any) -> None:
        # Called in the step's thread: the set changes on the loop, where it is read.
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody reads it any more
            self.loop.call_soon_threadsafe(self.sync_attempts.discard, context)

    async def schedule_retry(
        self,
        record: StepRecord,
        exc: BaseException,
        delay_ms: int,
        history: list[History] | None = None,
    ) -> None:
        name, message, stack = error_fields(exc)
        record.last_error_name, record.last_error_message, record.last_error_stack = (
            name,
            message,
            stack,
        )
        record.status = StepStatus.RETRYING
        record.wake_at = clock.now() + timedelta(milliseconds=delay_ms)
        span = trace.get_current_span()
        spans.record_failed_attempt(
            span, record.attempts, record.max_attempts - 1, name, message, stack
        )
        await self.write(
            record,
            [
                *(history or []),
                History(
                    "step.failed",
                    {
                        "step": record.label,
                        "attempt": record.attempts,
                        "error": {"name": name, "message": message},
                        "final": False,
                    },
                ),
                History(
                    "step.retry_scheduled",
                    {"step": record.label, "delay_ms": delay_ms, "at": record.wake_at.isoformat()},
                ),
            ],
            error=self.error_record(
                "workflow.step", name, message, stack, span, record.label, record.attempts
            ),
        )
        self.notify("attempt_failed", self, record, exc)

    async def fail_step(
        self,
        record: StepRecord,
        exc: BaseException | None,
        nonretryable: bool,
        history: list[History] | None = None,
        span: Any = None,
    ) -> BaseException:
        """Record the step as failed for good; returns the exception to raise into run().
        span: the failed step's span (default: the current one, a `step` span)."""
        if exc is not None:
            name, message, stack = error_fields(exc)
            record.last_error_name, record.last_error_message, record.last_error_stack = (
                name,
                message,
                stack,
            )
        elif not record.last_error_name:
            record.last_error_name = "StepFailed"
            record.last_error_message = f'step "{record.label}" used all {record.attempts} attempts'
        record.status = StepStatus.FAILED
        record.completed_at = clock.now()
        record.wake_at = None
        record.output_json = json.dumps({"nonretryable": nonretryable})
        if span is None:
            span = trace.get_current_span()
        error = None
        if exc is not None:
            name, message, stack = error_fields(exc)
            if record.kind in (StepKind.DO, StepKind.COMPENSATE):
                spans.record_failed_attempt(
                    span, record.attempts, record.max_attempts - 1, name, message, stack
                )
            spans.mark_error(span, exc)
            error = self.error_record(
                "workflow.step", name, message, stack, span, record.label, record.attempts
            )
        await self.write(
            record,
            [
                *(history or []),
                History(
                    "step.failed",
                    {
                        "step": record.label,
                        "attempt": record.attempts,
                        "final": True,
                        "error": {
                            "name": record.last_error_name,
                            "message": record.last_error_message,
                        },
                    },
                ),
            ],
            progress=True,
            error=error,
        )
        if exc is not None:
            self.notify("attempt_failed", self, record, exc)
        return self.stored_failure(record)

    def stored_failure(self, record: StepRecord) -> BaseException:
        """The exception a failed step raises, the same on its first run and on every replay."""
        info = json.loads(record.output_json or "{}")
        if record.kind == StepKind.INVOKE and "child" in info:  # else its child never started
            child = info["child"]
            return ChildWorkflowFailed(
                child.get("workflow", ""),
                child.get("id", ""),
                child.get("error_name", record.last_error_name),
                child.get("message", record.last_error_message),
            )
        if record.last_error_name == "EventTimeout":
            return EventTimeout(record.last_error_message)
        if info.get("nonretryable"):
            return NonRetryableError(record.last_error_message, record.last_error_name)
        return StepFailed(
            record.name, record.last_error_name, record.last_error_message, record.last_error_stack
        )

    async def sleep_here(self, wake_at: datetime | None) -> bool:
        """Wait for a sleep that ends soon in this run, keeping the lease, instead of
        parking: a park, a claim, a load and a replay cost more than a short wait, and a
        wait wakes on time. The sleep's checkpoint is already written, so a crash meanwhile
        loses nothing. Not under a test's controllable clock, nor while work is held."""
        if wake_at is None or self.holding or not isinstance(clock.get_clock(), clock.RealClock):
            return False
        delay = (wake_at - clock.now()).total_seconds()
        if delay > self.sleep_in_process:
            return False
        await asyncio.sleep(max(0.0, delay))
        return True

    def sleep_is_due(self, record: StepRecord) -> bool:
        if overrides.sleep_disabled(self.instance_id):
            return True
        return record.wake_at is not None and record.wake_at <= clock.now()

    async def take_event(
        self, event_type: str, schema: dict[str, Any] | None = None, sent_by: Any = None
    ) -> InboxEvent | None:
        """The oldest undelivered event of a type, reserved for the caller (program order).

        With a schema (a typed wait), events buffered before the wait whose payload does
        not match it are passed over: they stay in the inbox, never delivered to this wait.
        So are events sent after `sent_by` (the wait's deadline: one that came later did
        not come in time, however late the run woke to see it). Events are read
        EVENT_BATCH at a time and only as far as a wait needs them.
        """
        validator = event_validator(schema) if schema is not None else None
        inbox = self.inboxes.setdefault(event_type, Inbox())
        async with inbox.lock:  # parallel waits on one type read the inbox once
            checked = 0
            while True:
                for index in range(checked, len(inbox.events)):
                    event = inbox.events[index]
                    if sent_by is not None and event.created_at > sent_by:
                        continue
                    if validator is None:
                        return inbox.events.pop(index)
                    with self.decoding(f"the payload of event #{event.pk}"):
                        payload = event.payload
                    try:
                        matches = validator.is_valid(payload)
                    except RecursionError:  # schemas.CHECK_RECURSED: send_event refuses it
                        matches = False  # as a payload that does not match, not fatal
                    if matches:
                        return inbox.events.pop(index)
                checked = len(inbox.events)
                if inbox.exhausted:
                    return None
                batch = await self.db(
                    store.unconsumed_events, self.pk, event_type, inbox.last_id, EVENT_BATCH
                )
                inbox.events.extend(batch)
                inbox.exhausted = len(batch) < EVENT_BATCH
                if batch:
                    inbox.last_id = batch[-1].pk

    def event_timed_out(self, record: StepRecord) -> bool:
        if overrides.take_forced_timeout(self.instance_id, record.event_type):
            return True
        return record.wake_at is not None and record.wake_at <= clock.now()


def awaits_child(steps: Iterable[StepRecord]) -> bool:
    """Whether any of these checkpoints is a step.invoke still waiting for its child."""
    return any(r.kind == StepKind.INVOKE and r.status == StepStatus.WAITING for r in steps)


def _step_label(name: str) -> str:
    return f'step "{name}"' if name else "the start of its branch"


@dataclass
class Unconfirmed:
    """A new step waiting to know whether a checkpoint after the same step is a sibling
    branch's (see Run._check_determinism)."""

    after: str
    error: NonDeterminismError
    future: asyncio.Future[None] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


def _changed(what: str) -> NonDeterminismError:
    return NonDeterminismError(
        f"{what}: steps were renamed, added, removed or reordered under a running instance "
        "(register a new version instead)"
    )
