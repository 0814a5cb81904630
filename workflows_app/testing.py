"""Helpers for testing workflows: run the engine in-process, control its clock, mock steps.

    from workflows_app import testing

    inst = get_workflow("order-fulfilment").create(params={...})
    with testing.fake_clock() as clock:
        testing.run_until_idle()          # runs until the instance parks (sleep / event wait)
        clock.advance("1 hour")           # the sleep is now due
        testing.run_until_idle()

Step timeouts run on real time, not on the fake clock.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from django.db import connections
from django.db.backends.signals import connection_created

from .client import InstanceHandle
from .engine import clock as engine_clock
from .engine import store
from .engine.errors import InstanceNotFound, InvalidInput
from .engine.overrides import overrides
from .engine.worker import Worker
from .live import EngineHooks
from .models import Instance, Status, StepKind, StepRecord, StepStatus

_MISSING = object()


async def arun_until_idle(timeout: float = 10, concurrency: int = 50, queues: Any = None) -> int:
    """Run the engine in this process until no instance is runnable now; returns runs made.
    queues: as a worker started for those Django task queues only (`runworker --queues`)."""
    hooks = _AttemptsSeen()
    worker = Worker(worker_id="testing", concurrency=concurrency, hooks=hooks, queues=queues)
    await worker.start()
    try:
        return await worker.run_until_idle(timeout)
    except TimeoutError:
        raise TimeoutError(
            f"run_until_idle: not idle after {timeout} s; still running: {hooks.going(worker)}"
        ) from None
    finally:
        await worker.stop(grace_seconds=0)


def _refuse_inside_a_transaction(helper: str) -> None:
    """The engine reads and writes on connections of its own threads, which cannot see
    rows the caller has not committed: inside a transaction (pytest-django's plain
    `django_db`, a TestCase) it would find nothing to run and return as if idle, or wait
    on SQLite's lock. Sync code only: in a coroutine `connections` are not this thread's."""
    for connection in connections.all(initialized_only=True):
        if connection.in_atomic_block:
            raise RuntimeError(
                f"testing.{helper} was called inside a transaction on database "
                f"{connection.alias!r}; the engine's own connections cannot see its "
                "uncommitted rows. Mark the test @pytest.mark.django_db(transaction=True) "
                "(or use TransactionTestCase), and call it outside transaction.atomic()."
            )


class _AttemptsSeen(EngineHooks):
    """The app's hooks, also keeping the step attempts begun, so that a timeout can say
    which instances and steps never let the engine idle."""

    def __init__(self) -> None:
        super().__init__()
        self.attempts: dict[int, dict[str, StepRecord]] = {}

    def step_started(self, run: Any, record: Any) -> None:
        self.attempts.setdefault(run.pk, {})[record.name] = record
        super().step_started(run, record)

    def going(self, worker: Worker) -> str:
        going = []
        for run in worker.runs.values():
            records = self.attempts.get(run.pk, {}).values()
            steps = ", ".join(repr(r.name) for r in records if r.status == StepStatus.RUNNING)
            going.append(
                f"{run.definition.name} {run.instance_id!r}"
                + (f" in step {steps}" if steps else "")
            )
        return "; ".join(sorted(going)) or "nothing (its last runs were ending)"


def run_until_idle(timeout: float = 10, concurrency: int = 50, queues: Any = None) -> int:
    """Sync twin of arun_until_idle (for tests without a running event loop)."""
    _refuse_in_a_coroutine("run_until_idle", "await testing.arun_until_idle()")
    _refuse_inside_a_transaction("run_until_idle")
    return asyncio.run(arun_until_idle(timeout, concurrency, queues))


def _refuse_in_a_coroutine(helper: str, instead: str) -> None:
    """A sync helper cannot run the engine's loop inside a running one (asyncio.run and
    async_to_sync both refuse): say what to call from an async test instead."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(f"testing.{helper} is sync and was called from a coroutine; use {instead}")


@contextmanager
def fake_clock(start: datetime | None = None) -> Iterator[engine_clock.ControllableClock]:
    """Make the engine's clock controllable for the duration of the block."""
    clock = engine_clock.ControllableClock(start)
    previous = engine_clock.get_clock()
    engine_clock.set_clock(clock)
    try:
        yield clock
    finally:
        engine_clock.set_clock(previous)


def _instance(instance_id: str) -> InstanceHandle:
    rows = list(
        Instance.objects.filter(instance_id=instance_id).values_list("workflow", flat=True)[:2]
    )
    if not rows:
        raise InstanceNotFound(f"no instance {instance_id!r} in any workflow")
    if len(rows) > 1:
        raise InvalidInput(
            f"instance id {instance_id!r} exists in several workflows; use the InstanceHandle"
        )
    return InstanceHandle(rows[0], instance_id)


def mock_step(
    instance_id: str,
    step_name: str,
    result: Any = _MISSING,
    error: BaseException | None = None,
    times: int = -1,
) -> None:
    """Make a step return `result` or raise `error` instead of calling its callable.

    With error and times=N the step fails N times (through the retry loop), then returns
    `result` (or calls the real callable when no result is given).
    """
    mock: dict[str, Any] = {"error": error, "remaining": times if error is not None else 0}
    if result is not _MISSING:
        mock["result"] = result
    overrides.step_mocks[(instance_id, step_name)] = mock


def disable_sleeps(instance_id: str | None = None) -> None:
    """Sleeps of that instance (or of every instance) end at once; makes a parked sleep due."""
    overrides.sleeps_disabled.add(instance_id)
    sleeping = StepRecord.objects.filter(
        kind__in=(StepKind.SLEEP, StepKind.SLEEP_UNTIL), status=StepStatus.WAITING
    )
    if instance_id is not None:
        sleeping = sleeping.filter(instance__instance_id=instance_id)
    parked = Instance.objects.filter(pk__in=sleeping.values("instance_id"), status="waiting")
    parked.update(wake_at=engine_clock.now())


def mock_event(instance_id: str, type: str, payload: Any = None) -> None:
    """Send an event to the instance (it is buffered until its wait consumes it)."""
    _instance(instance_id).send_event(type, payload, actor="testing")


def force_event_timeout(instance_id: str, type: str) -> None:
    """The instance's next wait for `type` times out at once; makes a parked wait due."""
    handle = _instance(instance_id)  # an unknown id raises before anything is forced
    overrides.forced_event_timeouts.add((instance_id, type))
    Instance.objects.filter(pk=handle.row().pk, status="waiting").update(wake_at=engine_clock.now())


def reset() -> None:
    """Forget every mock and override."""
    overrides.clear()


def wait_for_status(instance: InstanceHandle, *statuses: str, timeout: float = 10) -> str:
    """Run the engine until the instance reaches one of the statuses (any status, not only
    final ones); waits for real timers that fall due within the timeout."""
    _refuse_in_a_coroutine(
        "wait_for_status", "await testing.arun_until_idle() and `await instance.astatus()`"
    )
    unknown = [status for status in statuses if status not in Status.values]
    if unknown or not statuses:
        # A typo ("completed") would otherwise wait out the timeout, or for other timers.
        raise ValueError(
            f"wait_for_status: unknown status(es) {unknown}; statuses are {Status.values}"
        )
    deadline = time.monotonic() + timeout
    while True:
        current = instance.status().status
        if current in statuses:
            return current
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(
                f"instance {instance.id!r} is {current!r}, not {statuses} after {timeout} s"
            )
        try:
            runs = run_until_idle(timeout=remaining)
        except TimeoutError:  # a run was still going at the deadline
            raise AssertionError(
                f"instance {instance.id!r} is {instance.status().status!r}, not {statuses} after {timeout} s"
            ) from None
        if runs == 0:
            due = store.next_wake_at()
            if due is None:
                raise AssertionError(
                    f"instance {instance.id!r} is {current!r}, not {statuses}, and nothing is due to change it"
                )
            fake = isinstance(engine_clock.get_clock(), engine_clock.ControllableClock)
            if fake and due > engine_clock.now():
                # A fake clock stands still: sleeping in real time would not bring it due.
                raise AssertionError(
                    f"instance {instance.id!r} is {current!r}, not {statuses}; the next timer "
                    f"is due at {due.isoformat()} on the fake clock, which moves only with "
                    "clock.advance()"
                )
            time.sleep(min(remaining, max(0.0, (due - engine_clock.now()).total_seconds())))


def step_result(instance: InstanceHandle, step_name: str) -> Any:
    """The checkpointed output of a completed step; otherwise an AssertionError saying
    where the step is (failed with what, retrying, waiting) or which steps there are."""
    records = [r for r in instance.steps() if r.kind != StepKind.COMPENSATE]
    missing = f"instance {instance.id!r} has no completed step {step_name!r}"
    for record in records:
        if record.name != step_name:
            continue
        if record.status == StepStatus.COMPLETE:
            return record.output
        error = (
            f", last error {record.last_error_name}: {record.last_error_message}"
            if record.last_error_name
            else ""
        )
        raise AssertionError(
            f"{missing}: it is {record.status!r} after {record.attempts} attempt(s){error}"
        )
    raise AssertionError(
        f"{missing}: no step has that name; its steps: {[r.name for r in records]}"
    )


class QueryCounter:
    """Counts SQL statements on every connection opened while installed, in every thread
    (the engine's database threads open their own): `with QueryCounter() as q: ...`;
    `q.count`, `q.kinds` (by first word), `q.statements` (the SQL, in order)."""

    def __init__(self) -> None:
        self.count = 0
        self.kinds: dict[str, int] = {}
        self.statements: list[str] = []
        self.active = False
        self.lock = threading.Lock()

    def __call__(
        self, execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any
    ) -> Any:
        if not self.active:  # installed on a connection that outlived the block
            return execute(sql, params, many, context)
        word = sql.lstrip().split(None, 1)[0].upper() if sql.strip() else "?"
        with self.lock:
            self.count += 1
            self.kinds[word] = self.kinds.get(word, 0) + 1
            self.statements.append(sql)
        return execute(sql, params, many, context)

    def _install(self, sender: Any, connection: Any, **kwargs: Any) -> None:
        connection.execute_wrappers.append(self)

    def __enter__(self) -> QueryCounter:
        self.active = True
        connection_created.connect(self._install)
        return self

    def __exit__(self, *exc: object) -> None:
        self.active = False
        connection_created.disconnect(self._install)
