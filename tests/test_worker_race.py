"""Several workers on one database never run the same instance at once."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import pytest

from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, current_step, register
from workflows_app.engine.worker import Worker, db_threads_default
from workflows_app.live import EngineHooks
from workflows_app.models import Instance, StepRecord

pytestmark = pytest.mark.django_db(transaction=True)

ledger: list[tuple[str, str, int, float, float]] = []
ledger_lock = threading.Lock()


def record_execution():
    def body():
        ctx = current_step()
        started = time.monotonic()
        time.sleep(0.001)
        with ledger_lock:
            ledger.append(
                (ctx.instance_id, ctx.step_name, threading.get_ident(), started, time.monotonic())
            )
        return ctx.step_name

    return body


def run_worker(name: str, errors: list[BaseException]) -> None:
    async def main():
        # Two database threads each (four on PostgreSQL by default): four workers in one
        # process would take the pool's 16 connections, and a thread of the process
        # holding one more (the dashboard hub's reader) made a worker wait 30 s for one.
        worker = Worker(
            worker_id=name,
            concurrency=8,
            db_threads=min(2, db_threads_default()),
            hooks=EngineHooks(),
        )
        await worker.start()
        try:
            await worker.run_until_idle(timeout=60)
        finally:
            await worker.stop(grace_seconds=0)

    try:
        asyncio.run(main())
    except BaseException as exc:  # reported by the test
        errors.append(exc)


@pytest.mark.parametrize("workers", [2, 4])
def test_workers_racing_for_ready_instances_never_run_one_twice(registered, workers):
    ledger.clear()

    @register("raced")
    class Raced(WorkflowEntrypoint):
        async def run(self, event, step):
            for i in range(3):
                await step.do(f"s{i}", record_execution())
            return "done"

    wf = get_workflow("raced")
    for n in range(120):
        wf.create(id=f"r{n}")
    errors: list[BaseException] = []
    threads = [threading.Thread(target=run_worker, args=(f"w{k}", errors)) for k in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    assert errors == []
    assert Instance.objects.filter(workflow="raced").exclude(status="complete").count() == 0
    assert StepRecord.objects.filter(instance__workflow="raced").count() == 360
    executions = [(i, s) for i, s, *_ in ledger]
    assert len(executions) == len(set(executions)) == 360  # each step ran exactly once
    by_instance: dict[str, list[tuple[float, float]]] = {}
    for instance_id, _, _, start, end in ledger:
        by_instance.setdefault(instance_id, []).append((start, end))
    for intervals in by_instance.values():
        intervals.sort()
        for (_, end), (start, _) in itertools.pairwise(intervals):
            assert end <= start  # never two steps of one instance at once
