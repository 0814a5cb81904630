"""The comparison's workloads written for DBOS Transact (imported only by its child process
in bench.versus_dbos): the same shapes as bench.workflows' — no-op steps, a wait for a
message, a 100 ms sleep — as DBOS's documentation writes them (sync workflows and steps,
run by DBOS's own thread pool)."""

from __future__ import annotations

import threading
import time

from dbos import DBOS

# workflow id -> time.perf_counter() / time.time() when its marking step ran
MARKS: dict[str, float] = {}
MARK_WAITERS: dict[str, threading.Event] = {}


@DBOS.step()
def noop() -> None:
    return None


@DBOS.step()
def mark() -> str:
    workflow_id = DBOS.workflow_id
    assert workflow_id is not None
    MARKS[workflow_id] = time.perf_counter()
    MARKS[workflow_id + "@wall"] = time.time()
    waiter = MARK_WAITERS.get(workflow_id)
    if waiter is not None:
        waiter.set()
    return "marked"


@DBOS.workflow()
def ten_steps() -> str:
    for _ in range(10):
        noop()
    return "done"


@DBOS.workflow()
def one_step() -> str:
    noop()
    return "done"


@DBOS.workflow()
def message_then_mark() -> str:
    DBOS.set_event("waiting", True)  # before the measured window: the sender waits for it
    DBOS.recv("go", timeout_seconds=3600)
    mark()
    return "done"


@DBOS.workflow()
def sleep_then_mark(seconds: float) -> str:
    DBOS.sleep(seconds)
    mark()
    return "done"
