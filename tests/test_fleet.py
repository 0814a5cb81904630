"""Many worker processes on one database: crash takeover, fencing, hints across processes,
poison instances and graceful shutdown. Real processes, real signals, real database."""

from __future__ import annotations

import os
import time
from collections import Counter

import pytest
from django.db import connection

from tests import fleet_workflows
from tests.polling import wait_until
from wfdash.settings import redis_channel_layer
from workflows_app.client import get_workflow
from workflows_app.engine import store
from workflows_app.engine.store import History, LeaseLost
from workflows_app.models import ErrorRecord, Instance, StepRecord

pytestmark = pytest.mark.django_db(transaction=True)
FLEET_SIZE = 500 if connection.vendor == "postgresql" else 150


def test_a_killed_worker_s_instances_are_taken_over_and_every_step_checkpoints_once(workers):
    fleet_workflows.ensure_ledger()
    wf = get_workflow("fleet")
    for start in range(0, FLEET_SIZE, 100):
        wf.create_batch([{"id": f"f{n}"} for n in range(start, min(start + 100, FLEET_SIZE))])
    total_steps = FLEET_SIZE * 5
    fleet = workers(3, WFDASH_LEASE_SECONDS="4")
    wait_until(
        lambda: len(fleet_workflows.ledger_rows()) >= total_steps // 4,
        120,
        "a quarter of the steps",
    )
    victim = fleet[0]
    victim.kill()
    killed_at = time.time()
    held = list(
        Instance.objects.filter(lease_owner__contains=f":{victim.pid}:").values_list(
            "instance_id", flat=True
        )
    )
    wait_until(
        lambda: Instance.objects.filter(workflow="fleet", status="complete").count() == FLEET_SIZE,
        180,
        "every fleet instance to complete",
    )
    assert (
        StepRecord.objects.filter(instance__workflow="fleet", status="complete").count()
        == total_steps
    )
    rows = fleet_workflows.ledger_rows()
    executions = Counter((instance_id, step) for instance_id, step, *_ in rows)
    assert len(executions) == total_steps  # every step ran
    reexecuted = {key for key, n in executions.items() if n > 1}
    assert all(n <= 2 for n in executions.values())
    assert {instance_id for instance_id, _ in reexecuted} <= set(
        held
    )  # only steps in flight at the kill
    takeovers = [
        started
        for instance_id, _, pid, started, _ in rows
        if instance_id in held and pid != victim.pid and started > killed_at
    ]
    delay = (min(takeovers) - killed_at) if takeovers else 0.0
    print(
        f"\nfleet: {FLEET_SIZE} instances, 3 workers, 1 SIGKILL; held by the victim: {len(held)}; "
        f"re-executed steps: {len(reexecuted)}; takeover delay: {delay:.2f} s"
    )


def test_a_worker_whose_lease_was_stolen_cannot_write_a_checkpoint_or_status(registered):
    from workflows_app.engine import WorkflowEntrypoint, register
    from workflows_app.engine.limits import Limits
    from workflows_app.models import StepRecord as Step

    @register("fenced")
    class Fenced(WorkflowEntrypoint):
        async def run(self, event, step):
            return 1

    inst = get_workflow("fenced").create()
    ((pk, zombie_token),) = store.claim_runnable("zombie", 1, lease_seconds=0.001)
    Instance.objects.filter(pk=pk).update(
        lease_expires_at=inst.row().created_at
    )  # the zombie's lease ran out
    ((same_pk, owner_token),) = store.claim_runnable("owner", 1, lease_seconds=30)
    assert same_pk == pk and owner_token != zombie_token
    record = Step(
        name="s",
        kind="do",
        seq=1,
        status="complete",
        output_json='"zombie"',
        attempts=1,
        started_at=inst.row().created_at,
    )
    (refused,) = store.write_steps(
        [store.StepWrite(pk, zombie_token, record, [History("step.completed", {})])]
    )
    assert isinstance(refused, LeaseLost)
    assert not store.finish(pk, zombie_token, "complete", Limits(), '"zombie"')
    assert Step.objects.filter(instance_id=pk).count() == 0
    assert inst.status().status == "running" and inst.row().lease_owner == "owner"
    assert store.heartbeat([zombie_token, owner_token], 30) == {zombie_token}


redis_url = os.environ.get("WFDASH_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def redis_available() -> bool:
    try:
        import redis

        redis.Redis.from_url(redis_url, socket_connect_timeout=1).ping()
        return True
    except Exception:
        return False


needs_redis = pytest.mark.skipif(
    os.environ.get("CI") != "true" and not redis_available(),
    reason=f"no Redis at {redis_url} (CI=true makes this test run and fail instead)",
)


@needs_redis
def test_an_event_sent_from_one_process_wakes_an_instance_parked_by_another(workers, settings):
    from channels.layers import channel_layers, get_channel_layer

    settings.CHANNEL_LAYERS = {"default": redis_channel_layer(redis_url)}
    channel_layers.backends.clear()
    try:
        (worker,) = workers(
            1, REDIS_URL=redis_url, WFDASH_POLL_SECONDS="60"
        )  # only a hint can wake it in time
        inst = get_workflow("fleet-waiter").create()
        wait_until(lambda: inst.status().status == "waiting", 30, "the worker to park the instance")
        # Stay idle past the channel layer's blocking pop (5 s): the worker's listener must
        # still be receiving then (with redis-py 8's default read timeout it had died).
        time.sleep(get_channel_layer().brpop_timeout + 1)
        sent = time.monotonic()
        inst.send_event("go", {"from": os.getpid()})
        wait_until(
            lambda: inst.status().status == "complete",
            10,
            "the hinted worker to finish the instance",
        )
        latency = time.monotonic() - sent
        assert inst.status().output == {"payload": {"from": os.getpid()}, "pid": worker.pid}
        assert latency < 5  # far below the 60 s poll: the hint travelled through Redis
        print(f"\ncross-process event latency: {latency * 1000:.0f} ms")
    finally:
        channel_layers.backends.clear()


def test_a_poison_instance_errors_after_bounded_takeovers_and_resumes_after_a_fix(workers):
    inst = get_workflow("fleet-poison").create()
    crashes = 0
    for _ in range(6):
        (worker,) = workers(1)
        wait_until(
            lambda worker=worker: (
                worker.process.poll() is not None or inst.status().status == "errored"
            ),
            60,
            "the worker to crash on the poison step or to error the instance",
        )
        if worker.process.poll() is None:
            break  # it errored the instance and keeps running, healthy
        assert worker.process.returncode == 137
        crashes += 1
        # The dead worker's lease: expire it now rather than wait for it.
        Instance.objects.filter(pk=inst.row().pk).update(lease_expires_at=inst.row().created_at)
    status = inst.status()
    assert status.status == "errored" and status.error["name"] == "PoisonInstance"
    assert "taken over 3 times" in status.error["message"]
    assert crashes == 3  # the first claim plus two takeovers crashed; the third takeover errored it
    recorded = ErrorRecord.objects.get(instance=inst.row())
    assert (recorded.source, recorded.name) == ("workflow.instance", "PoisonInstance")
    assert recorded.trace_id == inst.row().trace_id
    inst.restart()
    workers(1, FLEET_POISON_FIXED="1")
    wait_until(lambda: inst.status().status == "complete", 30, "the fixed instance to complete")
    assert inst.status().output == "fixed"


def test_sigterm_lets_running_steps_finish_starts_no_new_ones_and_releases_leases(workers):
    fleet_workflows.ensure_ledger()
    wf = get_workflow("fleet")
    wf.create_batch([{"id": f"g{n}"} for n in range(20)])
    (worker,) = workers(1, FLEET_STEP_SECONDS="0.2")
    wait_until(lambda: len(fleet_workflows.ledger_rows()) >= 5, 30, "steps to start")
    signalled = time.time()
    assert worker.terminate(timeout=30) == 0
    assert not Instance.objects.filter(workflow="fleet", lease_token__isnull=False).exists()
    running_steps = StepRecord.objects.filter(instance__workflow="fleet", status="running").count()
    assert running_steps == 0  # every step that started finished and was checkpointed
    # Draining: no instance went on to further steps after the signal (one may have been
    # starting as it arrived); the rest are parked due at once for the next worker.
    after = Counter(
        i for i, _, _, started, _ in fleet_workflows.ledger_rows() if started > signalled
    )
    assert max(after.values(), default=0) <= 1, after
    unfinished = Instance.objects.filter(workflow="fleet").exclude(status="complete")
    assert unfinished.exists() and set(unfinished.values_list("status", flat=True)) == {"waiting"}
    (_other,) = workers(1)
    wait_until(
        lambda: Instance.objects.filter(workflow="fleet", status="complete").count() == 20,
        60,
        "all to complete",
    )


def test_a_timer_that_came_due_while_no_worker_ran_fires_as_soon_as_a_worker_starts(workers):
    from datetime import timedelta

    from workflows_app import testing

    inst = get_workflow("fleet-sleeper").create()
    testing.run_until_idle()  # parks on the one-hour sleep; then no worker runs
    assert inst.status().status == "waiting"
    past = inst.row().created_at - timedelta(minutes=1)
    StepRecord.objects.filter(instance=inst.row(), name="nap").update(
        wake_at=past
    )  # the hour went by
    Instance.objects.filter(pk=inst.row().pk).update(wake_at=past)
    started = time.monotonic()
    (worker,) = workers(1, WFDASH_POLL_SECONDS="30")
    wait_until(lambda: inst.status().status == "complete", 25, "the due timer to fire")
    elapsed = time.monotonic() - started
    assert inst.status().output == worker.pid
    assert elapsed < 30  # within one poll interval of the worker starting (boot included)
    print(f"\ndue timer fired {elapsed:.2f} s after the worker process was started")
