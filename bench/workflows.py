"""Workflows the bench runs; imported by the bench process and by its worker subprocesses.

In-process measurements record instants in MARKS (time.perf_counter, same process);
worker subprocesses record time.time() in the bench_marks table instead.
"""

from __future__ import annotations

import threading
import time

from django.db import connection

from workflows_app.engine import WorkflowEntrypoint, current_step, register

# instance id -> perf_counter()/time.time() when the marking step ran (in this process)
MARKS: dict[str, float] = {}
MARK_WAITERS: dict[str, threading.Event] = {}

MARKS_DDL = "CREATE TABLE IF NOT EXISTS bench_marks (instance_id VARCHAR(200) PRIMARY KEY, t DOUBLE PRECISION)"


def ensure_marks_table() -> None:
    with connection.cursor() as cursor:
        cursor.execute(MARKS_DDL)


def _mark_here() -> None:
    ctx = current_step()
    assert ctx is not None
    MARKS[ctx.instance_id] = time.perf_counter()
    MARKS[ctx.instance_id + "@wall"] = time.time()
    waiter = MARK_WAITERS.get(ctx.instance_id)
    if waiter is not None:
        waiter.set()


async def mark_async() -> str:
    _mark_here()
    return "marked"


def mark_in_table() -> str:
    """Sync step (runs in a step thread with its own connection): time.time() into bench_marks."""
    ctx = current_step()
    assert ctx is not None
    now = time.time()
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO bench_marks (instance_id, t) VALUES (%s, %s)", [ctx.instance_id, now]
        )
    return "marked"


async def noop() -> None:
    return None


def slow_step() -> str:
    time.sleep(0.05)  # work in flight when the worker is killed
    return "ok"


@register("bench-steps10")
class TenSteps(WorkflowEntrypoint):
    async def run(self, event, step):
        for i in range(10):
            await step.do(f"s{i}", noop)
        return "done"


@register("bench-step1")
class OneStep(WorkflowEntrypoint):
    async def run(self, event, step):
        await step.do("s0", noop)
        return "done"


@register("bench-steps5")
class FiveSteps(WorkflowEntrypoint):
    async def run(self, event, step):
        for i in range(5):
            await step.do(f"s{i}", noop)
        return "done"


@register("bench-event")
class EventThenMark(WorkflowEntrypoint):
    async def run(self, event, step):
        await step.wait_for_event("wait", type="go", timeout="1 hour")
        await step.do("after", mark_async)
        return "done"


@register("bench-event-table")
class EventThenMarkInTable(WorkflowEntrypoint):
    async def run(self, event, step):
        await step.wait_for_event("wait", type="go", timeout="1 hour")
        await step.do("after", mark_in_table)
        return "done"


@register("bench-sleep")
class SleepThenMark(WorkflowEntrypoint):
    async def run(self, event, step):
        await step.sleep("nap", event.payload.get("ms", 100))
        await step.do("after", mark_async)
        return "done"


@register("bench-sched")
class ScheduledMark(WorkflowEntrypoint):
    """Started by a schedule's tick; its first step marks when the instance started."""

    async def run(self, event, step):
        await step.do("mark", mark_async)
        return "done"


@register("bench-herd")
class SleepUntilThenStep(WorkflowEntrypoint):
    """Parked by bulk insert (a waiting sleepUntil step "until"); the replay completes it."""

    async def run(self, event, step):
        await step.sleep_until("until", event.payload["at"])
        await step.do("after", noop)
        return "done"


@register("bench-replay")
class ManyStepsThenWait(WorkflowEntrypoint):
    async def run(self, event, step):
        for i in range(event.payload["steps"]):
            await step.do(f"s{i}", noop)
        await step.wait_for_event("wait", type="go", timeout="1 hour")
        await step.do("after", noop)
        return "done"


@register("bench-parked")
class ParkedForever(WorkflowEntrypoint):
    """Parked by bulk insert (a waiting waitForEvent step "wait")."""

    async def run(self, event, step):
        await step.wait_for_event("wait", type="go", timeout="365 days")
        return "done"


@register("bench-slow")
class SlowSteps(WorkflowEntrypoint):
    async def run(self, event, step):
        for i in range(4):
            await step.do(f"s{i}", slow_step)
        return "done"


# Admission with flow control on: limits high enough that nothing queues, so the figure is
# what deciding costs (the lock, the counts, the queue read), not time spent queued.
@register(
    "bench-admission",
    limits={"max_concurrent_instances": 1_000_000, "max_concurrent_per_key": 1_000_000},
)
class OneStepAdmitted(WorkflowEntrypoint):
    async def run(self, event, step):
        await step.do("s0", noop)
        return "done"
