"""Reliability under crashes, dropped connections, races, zombies, events and deploys.

Real `runworker workflows` processes on the test database; every step body appends a row
to a ledger (tests/fleet_workflows.py), and each test compares those physical executions
with the engine's checkpoints (StepRecord rows and their `step.completed` history).

WFDASH_SOAK=1 scales the tests up (scripts/soak); the soak-only tests skip otherwise.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections import Counter, defaultdict
from datetime import datetime, timezone
from pathlib import Path

import pytest
from django.db import close_old_connections, connection

from tests import fleet_workflows
from tests.polling import wait_until
from tests.workers import WorkerProcess
from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, register, registry
from workflows_app.engine.errors import InvalidTransition, NonDeterminismError
from workflows_app.models import HistoryRecord, InboxEvent, Instance, StepRecord

pytestmark = pytest.mark.django_db(transaction=True)

SOAK = os.environ.get("WFDASH_SOAK") == "1"
SEED = int(os.environ.get("WFDASH_SEED", "8"))
soak_only = pytest.mark.skipif(not SOAK, reason="soak only")


@pytest.fixture
def workers():
    started: list[WorkerProcess] = []

    def start(count: int = 1, **env: str) -> list[WorkerProcess]:
        new = [WorkerProcess(env=env) for _ in range(count)]
        started.extend(new)
        return new

    yield start
    for worker in started:
        worker.stop()


# --- comparing the ledger with the checkpoints -----------------------------------------


def executions(workflow_prefix: str = "") -> Counter:
    """(instance id, step) -> how many times its body physically ran."""
    return Counter(
        (instance_id, step) for instance_id, step, *_ in fleet_workflows.ledger_rows()
        if instance_id.startswith(workflow_prefix)
    )


def checkpoints(workflow: str) -> Counter:
    """(instance id, step) -> how many `step.completed` checkpoints the engine committed."""
    rows = HistoryRecord.objects.filter(instance__workflow=workflow, type="step.completed").values_list(
        "instance__instance_id", "data"
    )
    return Counter((instance_id, data["step"]) for instance_id, data in rows)


def assert_one_checkpoint_per_step(workflow: str, steps_per_instance: int, instances: int) -> None:
    complete = StepRecord.objects.filter(instance__workflow=workflow, status="complete", kind="do")
    assert complete.count() == steps_per_instance * instances
    counted = checkpoints(workflow)
    assert len(counted) == steps_per_instance * instances
    duplicated = {key: n for key, n in counted.items() if n != 1}
    assert not duplicated, f"steps checkpointed more than once: {duplicated}"


def assert_history_gap_free(workflow: str) -> None:
    by_instance: dict[int, list[int]] = defaultdict(list)
    for pk, seq in HistoryRecord.objects.filter(instance__workflow=workflow).values_list("instance_id", "sequence"):
        by_instance[pk].append(seq)
    for pk, seqs in by_instance.items():
        assert sorted(seqs) == list(range(1, len(seqs) + 1)), f"instance #{pk}: history sequences {sorted(seqs)}"


def lease_holders(pid: int) -> set[str]:
    return set(Instance.objects.filter(lease_owner__contains=f":{pid}:").values_list("instance_id", flat=True))


def expire_leases_of(pid: int) -> None:
    """A SIGKILLed worker's leases: expire them now rather than wait for them to run out."""
    Instance.objects.filter(lease_owner__contains=f":{pid}:").update(lease_expires_at=datetime(2000, 1, 1, tzinfo=timezone.utc))


# --- 1. kill -9 at seeded points ---------------------------------------------------------


def test_kill_nine_twice_at_seeded_points_every_instance_completes_and_only_in_flight_steps_rerun(workers):
    rng = random.Random(SEED)
    size = 500 if SOAK else 100
    kills = 10 if SOAK else 2
    total = size * 5
    fleet_workflows.ensure_ledger()
    wf = get_workflow("fleet")
    for start in range(0, size, 100):
        wf.create_batch([{"id": f"k{n}"} for n in range(start, min(start + 100, size))])
    # Few slots per worker and slower steps: the run takes seconds, so every kill lands mid-run.
    env = {"FLEET_STEP_SECONDS": "0.03", "WFDASH_WORKER_CONCURRENCY": "5"}
    fleet = workers(3, **env)
    thresholds = sorted(rng.uniform(0.05, 0.8) * total for _ in range(kills))
    kill_log: list[tuple[int, float, set[str]]] = []
    for threshold in thresholds:
        wait_until(lambda: len(fleet_workflows.ledger_rows()) >= threshold, 60, f"{threshold:.0f} executed steps")
        holding = sorted(
            (w for w in fleet if w.process.poll() is None and lease_holders(w.pid)), key=lambda w: w.pid
        ) or [w for w in fleet if w.process.poll() is None]
        victim = holding[rng.randrange(len(holding))]
        victim.kill()
        killed_at = time.time()
        kill_log.append((victim.pid, killed_at, lease_holders(victim.pid)))
        fleet.remove(victim)
        fleet += workers(1, **env)  # the replacement
    wait_until(
        lambda: Instance.objects.filter(workflow="fleet", status="complete").count() == size,
        120 if SOAK else 60, "every instance to complete",
    )
    assert_one_checkpoint_per_step("fleet", 5, size)
    ran = executions("k")
    assert len(ran) == total  # every step ran
    times_held = Counter(i for _, _, held in kill_log for i in held)
    too_many = {key: n for key, n in ran.items() if n - 1 > times_held[key[0]]}
    assert not too_many, f"re-executed more often than their instance was in flight at a kill: {too_many}"
    rows = fleet_workflows.ledger_rows()
    figures = []
    for pid, killed_at, held in kill_log:
        later = [s for i, _, p, s, _ in rows if i in held and p != pid and s > killed_at]
        figures.append(f"victim held {len(held)}, takeover {(min(later) - killed_at) if later else 0:.2f} s")
    print(f"\nkill -9: {size} instances, {len(kill_log)} kills (seed {SEED}); "
          f"re-executed steps: {sum(n - 1 for n in ran.values())}; " + "; ".join(figures))


# --- 2. crash between the side effect and its checkpoint ---------------------------------


@pytest.mark.parametrize("nth", [1, 3, 5])
def test_a_crash_between_side_effect_and_checkpoint_reruns_that_step_exactly_once_more(workers, nth):
    fleet_workflows.ensure_ledger()
    inst = get_workflow("fleet").create(id=f"se{nth}")
    (crashing,) = workers(1, WFDASH_FAULTS=f"after_side_effect=kill@{nth}")
    wait_until(lambda: crashing.process.poll() is not None, 30, "the worker to die at the fault point")
    assert crashing.process.returncode == 137
    crashed_at = time.time()
    crashed_step = f"step {nth - 1}"
    assert executions()[(inst.id, crashed_step)] == 1  # its side effect happened …
    assert not StepRecord.objects.filter(instance__instance_id=inst.id, name=crashed_step).exists()  # … unrecorded
    expire_leases_of(crashing.pid)
    (fresh,) = workers(1)
    wait_until(lambda: inst.status().status == "complete", 30, "the fresh worker to complete the instance")
    ran = executions("se")
    assert ran == {(inst.id, f"step {i}"): 2 if i == nth - 1 else 1 for i in range(5)}
    assert_one_checkpoint_per_step("fleet", 5, 1)
    record = StepRecord.objects.get(instance__instance_id=inst.id, name=crashed_step)
    assert record.output == crashed_step and record.attempts == 1
    pids = [pid for i, step, pid, *_ in fleet_workflows.ledger_rows() if step == crashed_step]
    assert pids == [crashing.pid, fresh.pid] or sorted(pids) == sorted([crashing.pid, fresh.pid])
    again = min(s for _, step, pid, s, _ in fleet_workflows.ledger_rows() if pid == fresh.pid)
    print(f"\nafter_side_effect=kill@{nth}: {crashed_step} ran twice; takeover {again - crashed_at:.2f} s")


# --- 3. the connection drops right after a checkpoint commit -----------------------------


def test_a_connection_dropped_after_every_checkpoint_duplicates_no_checkpoint_history_or_event(workers):
    fleet_workflows.ensure_ledger()
    inst = get_workflow("rel-checkpoint").create(id="drop")
    workers(1, WFDASH_FAULTS="after_checkpoint=drop_connection")
    wait_until(lambda: inst.status().status == "waiting", 30, "the instance to park on its event wait")
    inst.send_event("go", {"n": 1})
    inst.send_event("go", {"n": 2})  # a second one: must stay in the inbox, unconsumed
    wait_until(lambda: inst.status().status == "complete", 30, "the instance to complete")
    assert inst.status().output == {"n": 1}
    assert executions("drop") == {("drop", "before"): 1, ("drop", "after"): 1}
    assert_one_checkpoint_per_step("rel-checkpoint", 2, 1)
    assert StepRecord.objects.filter(instance__instance_id="drop").count() == 3
    events = list(InboxEvent.objects.filter(instance__instance_id="drop").order_by("id"))
    assert [(json.loads(e.payload_json), e.consumed_by) for e in events] == [({"n": 1}, "wait"), ({"n": 2}, "")]
    received = HistoryRecord.objects.filter(instance__instance_id="drop", type="event.received")
    assert received.count() == 1
    assert_history_gap_free("rel-checkpoint")


# --- 4. no instance runs in two places at once -------------------------------------------


@pytest.mark.parametrize("fleet_size", [2, 4])
def test_racing_workers_never_run_one_instance_in_two_places_at_once(workers, fleet_size):
    size = 300
    fleet_workflows.ensure_ledger()
    wf = get_workflow("rel-race")
    for start in range(0, size, 100):
        wf.create_batch([{"id": f"r{n}"} for n in range(start, start + 100)])
    # Long leases: no lease can run out under load, so any overlap is a double claim.
    started = time.monotonic()
    fleet = workers(fleet_size, WFDASH_LEASE_SECONDS="60", WFDASH_POLL_SECONDS="0.2")
    wait_until(
        lambda: Instance.objects.filter(workflow="rel-race", status="complete").count() == size,
        60, "every instance to complete",
    )
    elapsed = time.monotonic() - started
    rows = fleet_workflows.ledger_rows()
    by_instance: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    for instance_id, _, pid, begun, ended in rows:
        by_instance[instance_id].append((begun, ended, pid))
    overlaps = []
    for instance_id, intervals in by_instance.items():
        intervals.sort()
        for (b1, e1, p1), (b2, e2, p2) in zip(intervals, intervals[1:]):
            if b2 < e1:
                overlaps.append((instance_id, p1, p2))
    assert not overlaps, f"instances ran in two places at once: {overlaps[:5]}"
    ran = executions("r")
    assert len(ran) == size * 3 and set(ran.values()) == {1}
    assert_one_checkpoint_per_step("rel-race", 3, size)
    share = Counter(pid for _, _, pid, _, _ in rows)
    assert set(share) <= {w.pid for w in fleet}
    print(f"\nrace: {size} instances, {fleet_size} workers, {elapsed:.1f} s; steps per worker {sorted(share.values())}")


# --- 5. a zombie's late writes are refused by the fence ----------------------------------


def process_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_a_zombie_resumed_after_a_takeover_cannot_overwrite_the_new_owner_s_checkpoint(workers):
    fleet_workflows.ensure_ledger()
    inst = get_workflow("rel-zombie").create(id="zombie")
    (zombie,) = workers(1, WFDASH_LEASE_SECONDS="1", FLEET_SELF_STOP="1", FLEET_STEP_SECONDS="0.05")
    try:
        wait_until(lambda: process_state(zombie.pid) == "T", 30, "the worker to freeze itself mid-step")
        stopped_at = time.time()
        assert lease_holders(zombie.pid) == {"zombie"}
        (owner,) = workers(1, WFDASH_LEASE_SECONDS="1")
        wait_until(lambda: inst.status().status == "complete", 30, "the new owner to take over and finish")
        assert inst.status().output == {"work": owner.pid}
        took_over = min(s for _, step, pid, s, _ in fleet_workflows.ledger_rows() if pid == owner.pid)
    finally:
        os.kill(zombie.pid, signal.SIGCONT)

    def zombie_finished_its_step():
        with connection.cursor() as cursor:
            cursor.execute("SELECT ended FROM fleet_ledger WHERE pid = %s AND step = 'work'", [zombie.pid])
            return cursor.fetchone()[0] is not None

    wait_until(zombie_finished_its_step, 30, "the zombie to finish its late side effect")
    assert zombie.terminate(timeout=30) == 0  # whatever it tried to write has been tried now
    work = StepRecord.objects.get(instance__instance_id="zombie", name="work")
    assert work.output == owner.pid and work.output != zombie.pid
    assert inst.status().output == {"work": owner.pid}
    assert_one_checkpoint_per_step("rel-zombie", 2, 1)
    assert executions("zombie") == {("zombie", "work"): 2, ("zombie", "after"): 1}
    assert_history_gap_free("rel-zombie")
    print(f"\nzombie: frozen mid-step, takeover {took_over - stopped_at:.2f} s after SIGSTOP; late write refused")
