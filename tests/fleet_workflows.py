"""Workflows for the multi-process tests; imported by the worker subprocesses too.

Each step body appends a row to a ledger table: the physical executions, to compare with
the engine's checkpoints.
"""

from __future__ import annotations

import os
import time

from django.db import connection, transaction

from workflows_app.engine import WorkflowEntrypoint, current_step, register

LEDGER_DDL = (
    "CREATE TABLE IF NOT EXISTS fleet_ledger ("
    " instance_id VARCHAR(200), step VARCHAR(300), pid INTEGER, started DOUBLE PRECISION, ended DOUBLE PRECISION)"
)


def ensure_ledger() -> None:
    with connection.cursor() as cursor:
        cursor.execute(LEDGER_DDL)
        cursor.execute("DELETE FROM fleet_ledger")


def ledger_rows() -> list[tuple[str, str, int, float, float]]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT instance_id, step, pid, started, ended FROM fleet_ledger")
        return list(cursor.fetchall())


def record_execution() -> str:
    ctx = current_step()
    started = time.time()
    time.sleep(float(os.environ.get("FLEET_STEP_SECONDS", "0.002")))
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO fleet_ledger (instance_id, step, pid, started, ended) VALUES (%s, %s, %s, %s, %s)",
            [ctx.instance_id, ctx.step_name, os.getpid(), started, time.time()],
        )
    return ctx.step_name


@register("fleet")
class Fleet(WorkflowEntrypoint):
    async def run(self, event, step):
        for i in range(5):
            await step.do(f"step {i}", record_execution)
        return "done"


@register("fleet-waiter")
class FleetWaiter(WorkflowEntrypoint):
    async def run(self, event, step):
        got = await step.wait_for_event("wait", type="go", timeout="1 hour")
        return await step.do("after", lambda: {"payload": got.payload, "pid": os.getpid()})


@register("fleet-poison")
class FleetPoison(WorkflowEntrypoint):
    async def run(self, event, step):
        def kill_the_process():
            if os.environ.get("FLEET_POISON_FIXED") != "1":
                os._exit(137)  # the process dies mid-step, every time
            return "fixed"

        return await step.do("poison", kill_the_process)


# --- workflows of tests/test_reliability.py -----------------------------------------------


def record_two_phase() -> int:
    """A ledger row written when the step starts (ended NULL), completed when it ends.

    With FLEET_SELF_STOP=1 the process stops itself (SIGSTOP) right after the start row
    is committed: a zombie frozen mid-step at an exact point. Returns this process's pid.
    """
    import signal

    ctx = current_step()
    started = time.time()
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO fleet_ledger (instance_id, step, pid, started, ended) VALUES (%s, %s, %s, %s, NULL)",
            [ctx.instance_id, ctx.step_name, os.getpid(), started],
        )
    if os.environ.get("FLEET_SELF_STOP") == "1":
        if connection.vendor == "sqlite":
            # Not while the engine's database thread is in a write transaction: frozen,
            # it would hold SQLite's one write lock and no other process could write. A
            # transaction of our own (IMMEDIATE) waits for it to end; the stop follows at
            # once, before a waiting writer's busy handler looks again (a millisecond).
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute("SELECT 1")
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(float(os.environ.get("FLEET_STEP_SECONDS", "0.002")))
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE fleet_ledger SET ended = %s WHERE instance_id = %s AND step = %s AND pid = %s",
            [time.time(), ctx.instance_id, ctx.step_name, os.getpid()],
        )
    return os.getpid()


@register("rel-race")
class RelRace(WorkflowEntrypoint):
    async def run(self, event, step):
        for i in range(3):
            await step.do(f"step {i}", record_execution)
        return "done"


@register("rel-zombie")
class RelZombie(WorkflowEntrypoint):
    async def run(self, event, step):
        pid = await step.do("work", record_two_phase)
        await step.do("after", record_execution)
        return {"work": pid}


@register("rel-checkpoint")
class RelCheckpoint(WorkflowEntrypoint):
    async def run(self, event, step):
        await step.do("before", record_execution)
        got = await step.wait_for_event("wait", type="go", timeout="1 hour")
        await step.do("after", record_execution)
        return got.payload


def reserve_step() -> dict:
    ctx = current_step()
    return {"instance": ctx.instance_id, "step": ctx.step_name}


def undo_in_ledger(output: dict) -> str:
    """A compensation; with FLEET_DIE_IN_COMPENSATION=1 the process dies as it begins
    undoing step "a" (after "b" was undone: compensations run newest first)."""
    if output["step"] == "a" and os.environ.get("FLEET_DIE_IN_COMPENSATION") == "1":
        os._exit(137)
    now = time.time()
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO fleet_ledger (instance_id, step, pid, started, ended) VALUES (%s, %s, %s, %s, %s)",
            [output["instance"], f"undo {output['step']}", os.getpid(), now, now],
        )
    return f"undid {output['step']}"


@register("rel-compensate")
class RelCompensate(WorkflowEntrypoint):
    async def run(self, event, step):
        await step.do("a", reserve_step, compensate=undo_in_ledger)
        await step.do("b", reserve_step, compensate=undo_in_ledger)
        await step.wait_for_event("wait", type="go", timeout="1 hour")
        return "done"


@register("rel-collector")
class RelCollector(WorkflowEntrypoint):
    """Ten waits of one type in program order, collecting the payloads."""

    async def run(self, event, step):
        payloads = []
        for i in range(10):
            got = await step.wait_for_event(f"item {i}", type="item", timeout="1 hour")
            payloads.append(got.payload)
        await step.do("after", record_execution)
        return payloads


@register("rel-timer")
class RelTimer(WorkflowEntrypoint):
    """Sleeps until the instant params["at"] (epoch ms); the ledger shows when it woke."""

    async def run(self, event, step):
        await step.sleep_until("timer", event.payload["at"])
        return await step.do("after", record_execution)


@register("fleet-sleeper")
class FleetSleeper(WorkflowEntrypoint):
    async def run(self, event, step):
        await step.sleep("nap", "1 hour")
        return await step.do("after", lambda: os.getpid())


@register("rel-outage")
class RelOutage(WorkflowEntrypoint):
    """Five ledger steps; a step whose own query meets a dropped connection retries soon."""

    async def run(self, event, step):
        for i in range(5):
            await step.do(
                f"step {i}",
                record_execution,
                retries={"limit": 10, "delay": "50 ms", "backoff": "constant"},
            )
        return "done"


# Flow control across processes: each step reads how many instances hold a place, overall
# and under its own concurrency key, as committed now; admission must never let it pass
# the limits, whichever worker admitted whom.
ADMISSION_LIMITS = {"max_concurrent_instances": 6, "max_concurrent_per_key": 2}
ADMISSION_DDL = (
    "CREATE TABLE IF NOT EXISTS fleet_admission ("
    " instance_id VARCHAR(200), concurrency_key VARCHAR(200), active INTEGER, active_per_key INTEGER)"
)


def ensure_admission_ledger() -> None:
    with connection.cursor() as cursor:
        cursor.execute(ADMISSION_DDL)
        cursor.execute("DELETE FROM fleet_admission")


def admission_samples() -> list[tuple[str, str, int, int]]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT instance_id, concurrency_key, active, active_per_key FROM fleet_admission"
        )
        return list(cursor.fetchall())


def sample_admission() -> int:
    from workflows_app.engine.store import holding_places
    from workflows_app.models import Instance

    ctx = current_step()
    mine = Instance.objects.filter(workflow="fleet-admission")
    key = mine.filter(instance_id=ctx.instance_id).values_list("concurrency_key", flat=True).get()
    active = holding_places(mine).count()
    per_key = holding_places(mine.filter(concurrency_key=key)).count()
    time.sleep(float(os.environ.get("FLEET_STEP_SECONDS", "0.01")))
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO fleet_admission (instance_id, concurrency_key, active, active_per_key) "
            "VALUES (%s, %s, %s, %s)",
            [ctx.instance_id, key, active, per_key],
        )
    return active


@register("fleet-admission", limits=ADMISSION_LIMITS)
class FleetAdmission(WorkflowEntrypoint):
    async def run(self, event, step):
        for i in range(3):
            await step.do(f"sample {i}", sample_admission)
        return "done"


# Children across processes: a parent invokes a child; whichever worker finishes the
# child wakes the parent through the database, whichever worker then runs it.
@register("fleet-parent")
class FleetParent(WorkflowEntrypoint):
    async def run(self, event, step):
        out = await step.invoke("child", "fleet")
        started = await step.start("side", "fleet")
        return {"child": out, "side": started, "pid": os.getpid()}


# --- workflows of tests/test_tracing_export.py ---------------------------------------------


def project_work() -> str:
    """A step body that makes a span of its own, as a project's instrumented code does."""
    from opentelemetry import trace

    with trace.get_tracer("project.code").start_as_current_span("project work"):
        return "ok"


@register("traced-fleet")
class TracedFleet(WorkflowEntrypoint):
    async def run(self, event, step):
        await step.do("first", project_work)
        return await step.do("second", project_work)


# --- workflows of tests/test_step_trouble_fleet.py (steps that hang or block the loop) -----


def _ledger_row(instance_id: str, step: str) -> None:
    now = time.time()
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO fleet_ledger (instance_id, step, pid, started, ended) VALUES (%s, %s, %s, %s, %s)",
            [instance_id, step, os.getpid(), now, now],
        )
    connection.close()


def hang_forever() -> str:
    """A sync step stuck for good (a socket read with no timeout): it never returns."""
    record_execution()
    import threading

    threading.Event().wait()
    return "never"


@register("trouble-hung-sync")
class TroubleHungSync(WorkflowEntrypoint):
    async def run(self, event, step):
        return await step.do(
            "hang", hang_forever, timeout="1 second", retries={"limit": 2, "delay": 0}
        )


@register("trouble-blocks-loop")
class TroubleBlocksLoop(WorkflowEntrypoint):
    """An async step that blocks the event loop (time.sleep, requests.get in async def)."""

    async def run(self, event, step):
        async def blocking():
            import threading

            ctx = current_step()
            writer = threading.Thread(target=lambda: _ledger_row(ctx.instance_id, ctx.step_name))
            writer.start()
            writer.join()
            time.sleep(float(os.environ.get("FLEET_BLOCK_SECONDS", "6")))
            return os.getpid()

        return await step.do("block", blocking, timeout="1 minute", retries={"limit": 0})


@register("trouble-spins")
class TroubleSpins(WorkflowEntrypoint):
    """A run() that loops without awaiting anything."""

    async def run(self, event, step):
        await step.do("before", record_execution)
        while True:
            pass
