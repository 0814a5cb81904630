"""Steps that hang or block, run by real worker processes (tests/workers.py): a sync step
that never returns, an async step that blocks the event loop past the lease, a run() that
spins without awaiting. Real processes, real signals, real database."""

from __future__ import annotations

import signal
import time
from collections import Counter

import pytest

from tests import fleet_workflows
from tests.polling import wait_until
from workflows_app.client import get_workflow
from workflows_app.engine import clock
from workflows_app.engine.worker import ABORT_WAIT_SECONDS, STUCK_EXIT_CODE
from workflows_app.models import Instance, StepRecord

pytestmark = pytest.mark.django_db(transaction=True)


def executions() -> Counter[tuple[str, int]]:
    """(step, pid) of every physical execution of a step body."""
    return Counter((step, pid) for _, step, pid, _, _ in fleet_workflows.ledger_rows())


def logged_by(worker) -> str:
    worker.log.seek(0)
    return worker.log.read()


def test_an_async_step_blocking_the_event_loop_past_the_lease_runs_once_and_is_reported(
    workers,
):
    """Heartbeats run on the worker's event loop: an async step that blocked it (here
    time.sleep for 8 s, as a blocking HTTP client in an `async def` does) let the lease
    (2 s) run out under the running step. The other worker claimed the instance and ran
    the step again beside it, then a third time, and the instance ended PoisonInstance
    although the step would have succeeded. The worker's LoopWatch thread now renews the
    leases while its loop does not answer, and logs where the loop is stuck."""
    fleet_workflows.ensure_ledger()
    inst = get_workflow("trouble-blocks-loop").create()
    first, second = workers(2, FLEET_BLOCK_SECONDS="8")
    wait_until(
        lambda: inst.status().status in ("complete", "errored"),
        60,
        "the instance to end",
    )
    ran = executions()
    status = inst.status()
    assert (status.status, list(ran.values())) == ("complete", [1]), (status.error, ran)
    ((_, pid),) = ran
    assert status.output == pid
    owner = first if first.pid == pid else second
    logged = logged_by(owner)
    assert "its event loop has not answered" in logged, logged[-2000:]
    assert "time.sleep(" in logged, logged[-2000:]  # the line that blocks it


def test_a_run_spinning_without_await_has_its_leases_given_up_after_the_stall_limit(workers):
    """The renewal is bounded: a run() that loops for good without an await keeps its
    worker's loop blocked, and after WFDASH_LOOP_STALL_RENEW_SECONDS the leases are
    left to run out, so other workers can take its instances over (and the poison
    count ends a run that hangs every worker it lands on)."""
    fleet_workflows.ensure_ledger()
    inst = get_workflow("trouble-spins").create()
    (worker,) = workers(1, WFDASH_LOOP_STALL_RENEW_SECONDS="2")
    wait_until(lambda: executions(), 30, "the step before the spin")
    row = lambda: Instance.objects.get(pk=inst.row().pk)  # noqa: E731
    wait_until(
        lambda: row().lease_expires_at is not None and row().lease_expires_at < clock.now(),
        20,
        "the spinning worker's lease to run out",
    )
    assert worker.process.poll() is None  # still spinning: the lease was given up, not freed
    logged = logged_by(worker)
    assert "its leases are no longer renewed" in logged, logged[-2000:]


def test_hung_sync_steps_time_out_are_retried_and_sigterm_still_drains_at_once(workers):
    """A sync step that never returns cannot be killed: each attempt times out (1 s),
    leaves its thread behind and the next attempt starts in a new thread; the instance
    errors StepTimeout after its retries, other instances go on, and SIGTERM exits at
    once (the hung threads are daemons) with no lease left behind."""
    fleet_workflows.ensure_ledger()
    hung = get_workflow("trouble-hung-sync").create()
    (worker,) = workers(1)
    wait_until(lambda: hung.status().status == "errored", 30, "errored")
    other = get_workflow("fleet").create()
    wait_until(lambda: other.status().status == "complete", 30, "complete")
    assert hung.status().error["name"] == "StepTimeout"
    assert list(
        StepRecord.objects.filter(instance=hung.row()).values_list("status", "attempts")
    ) == [("failed", 3)]
    assert executions()[("hang", worker.pid)] == 3
    began = time.monotonic()
    assert worker.terminate(timeout=20) == 0
    assert time.monotonic() - began < 10
    assert not Instance.objects.filter(lease_token__isnull=False).exists()


def test_sigterm_during_a_hung_step_parks_it_at_its_timeout_without_running_its_retries(
    workers,
):
    """At SIGTERM a drain lets the running attempt end (here: its 1 s timeout) but
    starts no new one: the retries (delay 0) of a hung step ran in the draining worker,
    each another execution, until the step failed for good. Now the run parks after the
    attempt, its retry due at once for the next worker."""
    fleet_workflows.ensure_ledger()
    hung = get_workflow("trouble-hung-sync").create()
    (worker,) = workers(1)
    wait_until(lambda: executions(), 30, "the first attempt")
    assert worker.terminate(timeout=20) == 0
    row = Instance.objects.get(pk=hung.row().pk)
    steps = list(StepRecord.objects.filter(instance=row).values_list("status", "attempts"))
    assert (row.status, row.lease_token, steps) == ("waiting", None, [("retrying", 1)])
    assert sum(executions().values()) == 1


def spinning_worker(workers, **settings: str):
    """A worker whose event loop a run() spinning without an await holds; returns it and
    the instance once LoopWatch has reported the stall."""
    fleet_workflows.ensure_ledger()
    inst = get_workflow("trouble-spins").create()
    (worker,) = workers(1, **settings)
    wait_until(lambda: executions(), 30, "the step before the spin")
    wait_until(
        lambda: "its event loop has not answered" in logged_by(worker), 30, "the stall report"
    )
    return worker, inst


def assert_given_back(inst) -> None:
    row = Instance.objects.get(pk=inst.row().pk)
    assert (row.lease_token, row.lease_owner) == (None, "")
    assert row.wake_at is not None and row.wake_at <= clock.now()  # due for another worker


def test_sigterm_to_a_worker_whose_run_spins_gives_its_lease_back_and_exits_in_bounds(workers):
    """The SIGTERM handler ran on the event loop the spinning run() held: the worker went
    on spinning, and only the orchestrator's SIGKILL ended it, the instance leased to a
    dead process until the lease ran out (the stall limit aside). The signal now reaches
    LoopWatch, which, once the drain's bound (WFDASH_DRAIN_SECONDS and the unwinding
    wait) is over, releases the leases and ends the process, naming the instance."""
    worker, inst = spinning_worker(workers, WFDASH_DRAIN_SECONDS="0.5")
    started = time.monotonic()
    code = worker.terminate(timeout=30)
    took = time.monotonic() - started
    logged = logged_by(worker)
    assert code == STUCK_EXIT_CODE, logged[-2000:]
    assert took < 0.5 + ABORT_WAIT_SECONDS + 5, took
    pk = inst.row().pk
    assert "SIGTERM received" in logged and f"by the run of instance #{pk}" in logged, logged
    assert f"instances held: #{pk}, their leases are released for other workers" in logged
    assert "fleet_workflows.py" in logged  # where the loop is stuck
    assert_given_back(inst)


def test_a_second_signal_to_a_worker_whose_run_spins_ends_it_at_once(workers):
    """Ctrl-C twice (or SIGTERM then SIGINT) does not wait out the drain's bound."""
    worker, inst = spinning_worker(workers, WFDASH_DRAIN_SECONDS="120")
    started = time.monotonic()
    worker.process.send_signal(signal.SIGTERM)
    worker.process.send_signal(signal.SIGINT)
    code = worker.process.wait(30)
    assert code == STUCK_EXIT_CODE, logged_by(worker)[-2000:]
    assert time.monotonic() - started < 10
    assert_given_back(inst)
