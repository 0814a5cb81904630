"""Reliability under crashes, dropped connections, races, zombies, events and deploys.

Real `runworker workflows` processes on the test database; every step body appends a row
to a ledger (tests/fleet_workflows.py), and each test compares those physical executions
with the engine's checkpoints (StepRecord rows and their `step.completed` history).

WFDASH_SOAK=1 scales the tests up (scripts/soak); the soak-only tests skip otherwise.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import signal
import threading
import time
from collections import Counter, defaultdict
from datetime import UTC, datetime
from pathlib import Path

import pytest
from django.db import connection, transaction

from tests import fleet_workflows
from tests.polling import wait_until
from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import WorkflowEntrypoint, faults, register
from workflows_app.engine.errors import InvalidTransition, NonDeterminismError
from workflows_app.models import HistoryRecord, InboxEvent, Instance, StepRecord

pytestmark = pytest.mark.django_db(transaction=True)

SOAK = os.environ.get("WFDASH_SOAK") == "1"
SEED = int(os.environ.get("WFDASH_SEED", "8"))
soak_only = pytest.mark.skipif(not SOAK, reason="soak only")
# Scaled up, a test may run for many minutes: scripts/soak bounds the whole run instead.
long_when_soaking = pytest.mark.timeout(1800 if SOAK else 120)


# --- comparing the ledger with the checkpoints -----------------------------------------


def executions(workflow_prefix: str = "") -> Counter:
    """(instance id, step) -> how many times its body physically ran."""
    return Counter(
        (instance_id, step)
        for instance_id, step, *_ in fleet_workflows.ledger_rows()
        if instance_id.startswith(workflow_prefix)
    )


def checkpoints(workflow: str) -> Counter:
    """(instance id, step) -> how many `step.completed` checkpoints the engine committed."""
    rows = HistoryRecord.objects.filter(
        instance__workflow=workflow, type="step.completed"
    ).values_list("instance__instance_id", "data")
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
    for pk, seq in HistoryRecord.objects.filter(instance__workflow=workflow).values_list(
        "instance_id", "sequence"
    ):
        by_instance[pk].append(seq)
    for pk, seqs in by_instance.items():
        assert sorted(seqs) == list(range(1, len(seqs) + 1)), (
            f"instance #{pk}: history sequences {sorted(seqs)}"
        )


def lease_holders(pid: int) -> set[str]:
    return set(
        Instance.objects.filter(lease_owner__contains=f":{pid}:").values_list(
            "instance_id", flat=True
        )
    )


def expire_leases_of(pid: int) -> None:
    """A SIGKILLed worker's leases: expire them now rather than wait for them to run out."""
    Instance.objects.filter(lease_owner__contains=f":{pid}:").update(
        lease_expires_at=datetime(2000, 1, 1, tzinfo=UTC)
    )


# --- 1. kill -9 at seeded points ---------------------------------------------------------


@long_when_soaking
def test_kill_nine_twice_at_seeded_points_every_instance_completes_and_only_in_flight_steps_rerun(
    workers,
):
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
        wait_until(
            lambda threshold=threshold: len(fleet_workflows.ledger_rows()) >= threshold,
            60,
            f"{threshold:.0f} executed steps",
        )
        holding = sorted(
            (w for w in fleet if w.process.poll() is None and lease_holders(w.pid)),
            key=lambda w: w.pid,
        ) or [w for w in fleet if w.process.poll() is None]
        victim = holding[rng.randrange(len(holding))]
        victim.kill()
        killed_at = time.time()
        kill_log.append((victim.pid, killed_at, lease_holders(victim.pid)))
        fleet.remove(victim)
        fleet += workers(1, **env)  # the replacement
    wait_until(
        lambda: Instance.objects.filter(workflow="fleet", status="complete").count() == size,
        120 if SOAK else 60,
        "every instance to complete",
    )
    assert_one_checkpoint_per_step("fleet", 5, size)
    ran = executions("k")
    assert len(ran) == total  # every step ran
    times_held = Counter(i for _, _, held in kill_log for i in held)
    too_many = {key: n for key, n in ran.items() if n - 1 > times_held[key[0]]}
    assert not too_many, (
        f"re-executed more often than their instance was in flight at a kill: {too_many}"
    )
    rows = fleet_workflows.ledger_rows()
    figures = []
    for pid, killed_at, held in kill_log:
        later = [s for i, _, p, s, _ in rows if i in held and p != pid and s > killed_at]
        figures.append(
            f"victim held {len(held)}, takeover {(min(later) - killed_at) if later else 0:.2f} s"
        )
    print(
        f"\nkill -9: {size} instances, {len(kill_log)} kills (seed {SEED}); "
        f"re-executed steps: {sum(n - 1 for n in ran.values())}; " + "; ".join(figures)
    )


# --- 2. crash between the side effect and its checkpoint ---------------------------------


@pytest.mark.parametrize("nth", [1, 3, 5])
def test_a_crash_between_side_effect_and_checkpoint_reruns_that_step_exactly_once_more(
    workers, nth
):
    fleet_workflows.ensure_ledger()
    inst = get_workflow("fleet").create(id=f"se{nth}")
    (crashing,) = workers(1, WFDASH_FAULTS=f"after_side_effect=kill@{nth}")
    wait_until(
        lambda: crashing.process.poll() is not None, 30, "the worker to die at the fault point"
    )
    assert crashing.process.returncode == 137
    crashed_at = time.time()
    crashed_step = f"step {nth - 1}"
    assert executions()[(inst.id, crashed_step)] == 1  # its side effect happened …
    assert not StepRecord.objects.filter(
        instance__instance_id=inst.id, name=crashed_step
    ).exists()  # … unrecorded
    expire_leases_of(crashing.pid)
    (fresh,) = workers(1)
    wait_until(
        lambda: inst.status().status == "complete", 30, "the fresh worker to complete the instance"
    )
    ran = executions("se")
    assert ran == {(inst.id, f"step {i}"): 2 if i == nth - 1 else 1 for i in range(5)}
    assert_one_checkpoint_per_step("fleet", 5, 1)
    record = StepRecord.objects.get(instance__instance_id=inst.id, name=crashed_step)
    assert record.output == crashed_step and record.attempts == 1
    pids = [pid for i, step, pid, *_ in fleet_workflows.ledger_rows() if step == crashed_step]
    assert pids == [crashing.pid, fresh.pid] or sorted(pids) == sorted([crashing.pid, fresh.pid])
    again = min(s for _, step, pid, s, _ in fleet_workflows.ledger_rows() if pid == fresh.pid)
    print(
        f"\nafter_side_effect=kill@{nth}: {crashed_step} ran twice; takeover {again - crashed_at:.2f} s"
    )


# --- 3. the connection drops right after a checkpoint commit -----------------------------


def test_a_connection_dropped_after_every_checkpoint_duplicates_no_checkpoint_history_or_event(
    workers,
):
    fleet_workflows.ensure_ledger()
    inst = get_workflow("rel-checkpoint").create(id="drop")
    workers(1, WFDASH_FAULTS="after_checkpoint=drop_connection")
    wait_until(
        lambda: inst.status().status == "waiting", 30, "the instance to park on its event wait"
    )
    with transaction.atomic():  # both land before the worker can see either (and finish)
        inst.send_event("go", {"n": 1})
        inst.send_event("go", {"n": 2})  # a second one: must stay in the inbox, unconsumed
    wait_until(lambda: inst.status().status == "complete", 30, "the instance to complete")
    assert inst.status().output == {"n": 1}
    assert executions("drop") == {("drop", "before"): 1, ("drop", "after"): 1}
    assert_one_checkpoint_per_step("rel-checkpoint", 2, 1)
    assert StepRecord.objects.filter(instance__instance_id="drop").count() == 3
    events = list(InboxEvent.objects.filter(instance__instance_id="drop").order_by("id"))
    assert [(json.loads(e.payload_json), e.consumed_by) for e in events] == [
        ({"n": 1}, "wait"),
        ({"n": 2}, ""),
    ]
    received = HistoryRecord.objects.filter(instance__instance_id="drop", type="event.received")
    assert received.count() == 1
    assert_history_gap_free("rel-checkpoint")


@pytest.mark.parametrize(
    "plan",
    [
        # The first checkpoint commits, then the database fails before answering: the retry
        # finds it landed and writes nothing twice.
        "after_checkpoint=raise@1",
        # The first checkpoint fails before it writes: the retry writes it; the step does not
        # run again.
        "before_checkpoint=raise@1",
        "before_checkpoint=raise@1-2",
    ],
)
def test_a_checkpoint_write_that_meets_a_passing_database_error_is_retried_not_the_step(plan):
    assert run_to_completion_under_faults("retried", plan) == 1
    assert executions("retried") == {("retried", f"step {i}"): 1 for i in range(3)}
    assert_one_checkpoint_per_step("rel-race", 3, 1)
    assert_history_gap_free("rel-race")


@pytest.mark.parametrize(
    "plan", ["before_checkpoint=terminate_backend@4", "after_checkpoint=raise@4"]
)
def test_a_group_commit_that_loses_its_connection_writes_its_checkpoints_again_not_the_steps(
    plan, settings
):
    """Group commit on: a group of concurrent runs' checkpoints fails as one (the connection
    drops inside its transaction, or the answer is lost after the commit); every run writes
    its checkpoint again, and no step runs twice."""
    settings.WFDASH = {**settings.WFDASH, "GROUP_COMMIT": True}
    fleet_workflows.ensure_ledger()
    wf = get_workflow("rel-race")
    insts = [wf.create(id=f"group-{n}") for n in range(12)]
    faults.configure(plan)
    try:
        testing.run_until_idle(timeout=60)
    finally:
        faults.configure("")
    assert {inst.status().status for inst in insts} == {"complete"}
    assert executions("group-") == {
        (f"group-{n}", f"step {i}"): 1 for n in range(12) for i in range(3)
    }
    assert_one_checkpoint_per_step("rel-race", 3, 12)
    assert_history_gap_free("rel-race")


def run_to_completion_under_faults(instance_id: str, plan: str) -> int:
    """Run a rel-race instance in this process under a fault plan; how many runs it took."""
    fleet_workflows.ensure_ledger()
    inst = get_workflow("rel-race").create(id=instance_id)
    faults.configure(plan)
    try:
        testing.run_until_idle()
    finally:
        faults.configure("")
    status = inst.status()
    assert status.status == "complete", status
    return HistoryRecord.objects.filter(
        instance__instance_id=instance_id, type="run.started"
    ).count()


@pytest.mark.parametrize(
    "plan",
    [
        # Every try of the first checkpoint fails: the run is cut short, and no lease is left
        # to wait out: the same pass claims the instance again.
        "before_checkpoint=raise@1-3",
        # And the release fails too (the database is out of connections): the lease is given
        # back at the worker's next turn, not left to run out with no run behind it.
        "before_checkpoint=raise@1-3,before_release=raise@1",
    ],
)
def test_a_run_cut_short_by_a_database_error_is_released_at_once_and_resumes_from_its_checkpoint(
    plan, monkeypatch
):
    from workflows_app.engine import runner

    monkeypatch.setattr(runner, "WRITE_RETRY_DELAYS", (0.01, 0.01))  # two retries, then give up
    assert run_to_completion_under_faults("cut", plan) == 2
    # The first step's work was done, but its checkpoint never landed: it runs again.
    assert executions("cut") == {("cut", "step 0"): 2, ("cut", "step 1"): 1, ("cut", "step 2"): 1}
    assert_one_checkpoint_per_step("rel-race", 3, 1)
    assert_history_gap_free("rel-race")


def test_claims_whose_load_failed_are_handed_back_at_once():
    fleet_workflows.ensure_ledger()
    inst = get_workflow("rel-race").create(id="unloaded")
    faults.configure("after_claim=raise@1")  # claimed and committed, then the load fails
    try:
        with pytest.raises(faults.InjectedFault):
            testing.run_until_idle()
        row = inst.row()
        assert (row.lease_token, row.lease_owner) == (None, "")  # not left leased to nobody
        testing.run_until_idle()
    finally:
        faults.configure("")
    assert inst.status().status == "complete"
    assert executions("unloaded") == {("unloaded", f"step {i}"): 1 for i in range(3)}


def test_a_step_thread_gives_its_connection_back_after_each_step():
    """One thread per concurrent run: were each to keep its connection, a few workers
    would exhaust PostgreSQL's max_connections. Like a request, a step closes it."""
    from django.db import connection as thread_connection

    from workflows_app.engine.worker import ConnectionThreads, StepThreads

    def query_then_report() -> bool:
        with thread_connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        return thread_connection.connection is not None

    def still_connected() -> bool:
        return thread_connection.connection is not None

    # Step threads give it back; the engine's few database threads keep theirs.
    for threads, kept in (
        (StepThreads("test-step"), False),
        (ConnectionThreads(1, "test-db"), True),
    ):
        try:
            assert threads.submit(query_then_report).result() is True  # open while the step runs
            assert threads.submit(still_connected).result() is kept
        finally:
            threads.close()


def test_on_postgresql_fifty_concurrent_steps_share_the_process_s_bounded_pool():
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL only: the pool is psycopg's")
    from django.conf import settings
    from django.db import connection as thread_connection

    from workflows_app.engine.worker import StepThreads

    pool_size = settings.DATABASES["default"]["OPTIONS"]["pool"]["max_size"]

    def step_using_the_database() -> int:
        with thread_connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid() FROM pg_sleep(0.02)")
            return cursor.fetchone()[0]

    threads = StepThreads("test-step")
    try:
        backends = {
            f.result() for f in [threads.submit(step_using_the_database) for _ in range(200)]
        }
    finally:
        threads.close()
    # 50 threads, yet no more server connections than the pool holds (this test's own
    # connection comes from the same pool).
    assert 1 < len(backends) <= pool_size


def test_a_write_refused_by_sqlite_s_writer_lock_is_retried_and_lands_once():
    if connection.vendor != "sqlite":
        pytest.skip("SQLite only: its writer lock refuses a BEGIN IMMEDIATE definitely")
    import sqlite3

    inst = get_workflow("rel-checkpoint").create(id="locked")
    before = HistoryRecord.objects.filter(instance__instance_id="locked").count()
    connection.ensure_connection()
    raw = connection.connection
    outsider = sqlite3.connect(connection.settings_dict["NAME"], isolation_level=None)
    outsider.execute("BEGIN EXCLUSIVE")
    begins: list[str] = []

    def lift_the_lock_on_the_retry(sql: str) -> None:
        if sql.startswith("BEGIN"):
            begins.append(sql)
            if len(begins) == 2:
                outsider.execute("COMMIT")

    raw.execute("PRAGMA busy_timeout = 0")  # refused at once instead of after 30 s
    raw.set_trace_callback(lift_the_lock_on_the_retry)
    try:
        assert inst.pause() == "paused"
    finally:
        raw.set_trace_callback(None)
        raw.execute("PRAGMA busy_timeout = 30000")
        outsider.close()
    assert len(begins) == 2  # refused once, then retried
    assert inst.status().status == "paused"
    paused = HistoryRecord.objects.filter(instance__instance_id="locked", type="instance.paused")
    assert paused.count() == 1
    assert HistoryRecord.objects.filter(instance__instance_id="locked").count() == before + 1


WORKER_APP = "wfdash-reliability-worker"


def terminate_worker_backends() -> int:
    """pg_terminate_backend every connection of the test's workers; returns how many."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name = %s AND pid <> pg_backend_pid()",
            [WORKER_APP],
        )
        return cursor.fetchone()[0]


@long_when_soaking
def test_postgres_backends_terminated_under_load_lose_nothing_and_no_worker_exits(workers):
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL only: the fault is pg_terminate_backend")
    size, rounds = (500, 20) if SOAK else (60, 4)
    fleet_workflows.ensure_ledger()
    wf = get_workflow("rel-outage")
    for start in range(0, size, 100):
        wf.create_batch([{"id": f"o{n}"} for n in range(start, min(size, start + 100))])
    fleet = workers(2, PGAPPNAME=WORKER_APP, FLEET_STEP_SECONDS="0.005", WFDASH_LEASE_SECONDS="5")
    terminated = 0
    for done in range(1, rounds + 1):
        # Terminate at fixed points of the work, not of time: mid-load every time.
        wait_until(
            lambda done=done: len(fleet_workflows.ledger_rows()) >= size * 5 * done // (rounds + 1),
            120,
            f"the fleet to reach {done}/{rounds + 1} of the work",
        )
        terminated += terminate_worker_backends()
    wait_until(
        lambda: Instance.objects.filter(workflow="rel-outage", status="complete").count() == size,
        180,
        "every instance to complete after the terminations",
    )
    assert [w.process.poll() for w in fleet] == [None] * len(fleet), "a worker exited"
    assert terminated >= rounds  # every round cut at least one live backend
    assert_one_checkpoint_per_step("rel-outage", 5, size)
    ran = executions("o")
    assert len(ran) == size * 5
    # A step re-runs only when a termination cut its run between side effect and checkpoint
    # (or cut the group commit its checkpoint was in): at most once per round.
    reruns = sum(n - 1 for n in ran.values())
    assert max(ran.values()) <= 1 + rounds
    assert_history_gap_free("rel-outage")
    assert not Instance.objects.filter(workflow="rel-outage").exclude(status="complete").exists()
    print(
        f"\npg_terminate_backend: {size} instances, {rounds} rounds, {terminated} backends cut, {reruns} steps re-ran"
    )


# --- a worker killed while it compensates ------------------------------------------------


def test_a_worker_killed_mid_compensation_is_taken_over_and_each_undo_runs_once(workers):
    fleet_workflows.ensure_ledger()
    inst = get_workflow("rel-compensate").create(id="comp")
    (doomed,) = workers(1, FLEET_DIE_IN_COMPENSATION="1", WFDASH_POLL_SECONDS="0.2")
    wait_until(
        lambda: inst.status().status == "waiting", 30, "the worker to run both steps and park"
    )
    assert inst.cancel(compensate=True) == "compensating"
    wait_until(lambda: doomed.process.poll() is not None, 30, "the worker to die undoing step a")
    assert doomed.process.returncode == 137
    assert inst.status().status == "compensating"  # b undone and checkpointed, a not yet
    expire_leases_of(doomed.pid)
    (heir,) = workers(1, WFDASH_POLL_SECONDS="0.2")
    wait_until(
        lambda: inst.status().status == "terminated", 30, "the new worker to finish compensating"
    )
    undone = {
        step: pid
        for instance_id, step, pid, *_ in fleet_workflows.ledger_rows()
        if instance_id == "comp"
    }
    assert undone == {"undo b": doomed.pid, "undo a": heir.pid}  # each once: b was not undone again
    assert executions("comp") == {("comp", "undo b"): 1, ("comp", "undo a"): 1}
    types = [h.type for h in inst.history()]
    assert types.count("compensation.started") == 1
    assert types[-2:] == ["compensation.completed", "instance.cancelled"]
    assert_history_gap_free("rel-compensate")


# --- 4. no instance runs in two places at once -------------------------------------------


@pytest.mark.parametrize("fleet_size", [2, 4])
def test_racing_workers_never_run_one_instance_in_two_places_at_once(workers, fleet_size):
    size = 300
    fleet_workflows.ensure_ledger()
    wf = get_workflow("rel-race")
    # Long leases: no lease can run out under load, so any overlap is a double claim.
    fleet = workers(
        fleet_size,
        WFDASH_LEASE_SECONDS="60",
        WFDASH_POLL_SECONDS="0.2",
        WFDASH_WORKER_CONCURRENCY="25",
    )
    # Every worker up before the first instance exists: with the instances made first, the
    # first two workers to boot ran all 300 before the others started (steps per worker
    # [300, 600] with four), and four never raced.
    wait_until(lambda: all(w.serving() for w in fleet), 60, "every worker to start serving")
    started = time.monotonic()
    for start in range(0, size, 100):
        wf.create_batch([{"id": f"r{n}"} for n in range(start, start + 100)])
    wait_until(
        lambda: Instance.objects.filter(workflow="rel-race", status="complete").count() == size,
        60,
        "every instance to complete",
    )
    elapsed = time.monotonic() - started
    rows = fleet_workflows.ledger_rows()
    by_instance: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    for instance_id, _, pid, begun, ended in rows:
        by_instance[instance_id].append((begun, ended, pid))
    overlaps = []
    for instance_id, intervals in by_instance.items():
        intervals.sort()
        for (_b1, e1, p1), (b2, _e2, p2) in itertools.pairwise(intervals):
            if b2 < e1:
                overlaps.append((instance_id, p1, p2))
    assert not overlaps, f"instances ran in two places at once: {overlaps[:5]}"
    ran = executions("r")
    assert len(ran) == size * 3 and set(ran.values()) == {1}
    assert_one_checkpoint_per_step("rel-race", 3, size)
    share = Counter(pid for _, _, pid, _, _ in rows)
    assert set(share) == {w.pid for w in fleet}  # each worker took part in the race
    print(
        f"\nrace: {size} instances, {fleet_size} workers, {elapsed:.1f} s; steps per worker {sorted(share.values())}"
    )


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
        wait_until(
            lambda: process_state(zombie.pid) == "T", 30, "the worker to freeze itself mid-step"
        )
        stopped_at = time.time()
        assert lease_holders(zombie.pid) == {"zombie"}
        (owner,) = workers(1, WFDASH_LEASE_SECONDS="1")
        wait_until(
            lambda: inst.status().status == "complete", 30, "the new owner to take over and finish"
        )
        assert inst.status().output == {"work": owner.pid}
        took_over = min(
            s for _, step, pid, s, _ in fleet_workflows.ledger_rows() if pid == owner.pid
        )
    finally:
        os.kill(zombie.pid, signal.SIGCONT)

    def zombie_finished_its_step():
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT ended FROM fleet_ledger WHERE pid = %s AND step = 'work'", [zombie.pid]
            )
            return cursor.fetchone()[0] is not None

    wait_until(zombie_finished_its_step, 30, "the zombie to finish its late side effect")
    assert zombie.terminate(timeout=30) == 0  # whatever it tried to write has been tried now
    work = StepRecord.objects.get(instance__instance_id="zombie", name="work")
    assert work.output == owner.pid and work.output != zombie.pid
    assert inst.status().output == {"work": owner.pid}
    assert_one_checkpoint_per_step("rel-zombie", 2, 1)
    assert executions("zombie") == {("zombie", "work"): 2, ("zombie", "after"): 1}
    assert_history_gap_free("rel-zombie")
    print(
        f"\nzombie: frozen mid-step, takeover {took_over - stopped_at:.2f} s after SIGSTOP; late write refused"
    )


# --- 11. events: each delivered exactly once in send order, or refused definitely --------


def consumed(instance_id: str) -> list[tuple[object, str]]:
    return [
        (json.loads(e.payload_json), e.consumed_by)
        for e in InboxEvent.objects.filter(instance__instance_id=instance_id).order_by("id")
    ]


def test_an_event_sent_before_the_wait_while_no_worker_runs_is_delivered_exactly_once():
    fleet_workflows.ensure_ledger()
    early = get_workflow("rel-checkpoint").create(id="early")
    early.send_event("go", {"sent": "before the first run"})  # no worker anywhere yet
    testing.run_until_idle()
    assert early.status().status == "complete" and early.status().output == {
        "sent": "before the first run"
    }
    parked = get_workflow("rel-checkpoint").create(id="parked")
    testing.run_until_idle()
    assert parked.status().status == "waiting"
    parked.send_event("go", {"sent": "while parked, no worker running"})
    testing.run_until_idle()
    assert parked.status().output == {"sent": "while parked, no worker running"}
    assert consumed("early") == [({"sent": "before the first run"}, "wait")]
    assert consumed("parked") == [({"sent": "while parked, no worker running"}, "wait")]
    assert executions() == {(i, s): 1 for i in ("early", "parked") for s in ("before", "after")}
    assert_one_checkpoint_per_step("rel-checkpoint", 2, 2)
    assert_history_gap_free("rel-checkpoint")


def send_concurrently(handle, per_thread: list[int], event_type: str) -> list[BaseException]:
    """Four threads send their events together; returns unexpected errors."""
    barrier = threading.Barrier(len(per_thread))
    failures: list[BaseException] = []

    def sender(thread: int, count: int) -> None:
        try:
            barrier.wait(10)
            for n in range(count):
                handle.send_event(event_type, {"thread": thread, "n": n})
        except BaseException as exc:
            failures.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=sender, args=(t, c)) for t, c in enumerate(per_thread)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a sender thread hung"
    return failures


def test_ten_events_from_four_threads_reach_ten_waits_in_send_order_exactly_once(workers):
    fleet_workflows.ensure_ledger()
    inst = get_workflow("rel-collector").create(id="collector")
    workers(1, WFDASH_POLL_SECONDS="0.2")
    wait_until(
        lambda: inst.status().status == "waiting", 30, "the collector to park on its first wait"
    )
    assert send_concurrently(inst, [3, 3, 2, 2], "item") == []
    wait_until(lambda: inst.status().status == "complete", 30, "the collector to receive all ten")
    sent = list(InboxEvent.objects.filter(instance__instance_id="collector").order_by("id"))
    assert len(sent) == 10
    assert inst.status().output == [json.loads(e.payload_json) for e in sent]  # send (commit) order
    assert [e.consumed_by for e in sent] == [f"item {i}" for i in range(10)]
    for thread in range(4):
        mine = [p["n"] for p in inst.status().output if p["thread"] == thread]
        assert mine == sorted(mine)
    received = Counter(
        d["event_id"]
        for d in HistoryRecord.objects.filter(
            instance__instance_id="collector", type="event.received"
        ).values_list("data", flat=True)
    )
    assert received == {e.pk: 1 for e in sent}
    assert executions("collector") == {("collector", "after"): 1}
    assert_history_gap_free("rel-collector")


def test_events_racing_with_completion_are_stored_before_it_or_refused_definitely_after(workers):
    fleet_workflows.ensure_ledger()
    inst = get_workflow("rel-checkpoint").create(id="racing")
    workers(1, WFDASH_POLL_SECONDS="0.2")
    wait_until(lambda: inst.status().status == "waiting", 30, "the instance to park on its wait")
    outcomes: list[str] = []
    stop = threading.Event()

    # SQLite's write lock is not fair: a sender that takes it again at once after each
    # commit kept the worker's three writes waiting for 4,000-12,000 sends (8-29 s, once
    # past the 30 s below). Pacing it by a millisecond still races every send with the
    # completion, which is what this test is about.
    pace = 0.001 if connection.vendor == "sqlite" else 0.0

    def hammer() -> None:
        try:
            n = 0
            while not stop.is_set():
                try:
                    inst.send_event("extra", {"n": n})
                    outcomes.append("stored")
                except InvalidTransition as exc:
                    assert "complete" in str(exc)
                    outcomes.append("refused")
                    if outcomes.count("refused") >= 3:
                        return
                n += 1
                time.sleep(pace)
        finally:
            connection.close()

    sender = threading.Thread(target=hammer)
    sender.start()
    wait_until(lambda: "stored" in outcomes, 10, "an extra event to be stored")
    inst.send_event("go", {"n": "go"})
    wait_until(
        lambda: outcomes.count("refused") >= 3 or not sender.is_alive(), 30, "sends to be refused"
    )
    stop.set()
    sender.join(10)
    assert outcomes.count("refused") >= 3, outcomes[-5:]
    first_refusal = outcomes.index("refused")
    assert set(outcomes[first_refusal:]) == {"refused"}  # once refused, never stored again
    extras = InboxEvent.objects.filter(instance__instance_id="racing", type="extra")
    assert (
        extras.count() == outcomes.count("stored") and not extras.exclude(consumed_by="").exists()
    )
    before = list(InboxEvent.objects.order_by("id").values_list("id", flat=True))
    with pytest.raises(InvalidTransition, match="it is complete"):
        inst.send_event("go", {"late": True})
    assert list(InboxEvent.objects.order_by("id").values_list("id", flat=True)) == before
    assert inst.status().output == {"n": "go"}
    print(f"\nevents racing completion: {outcomes.count('stored')} stored before, then refused")


# --- 12. a deploy that renames or reorders the steps of a running instance ----------------


@pytest.fixture
def lax_versions(settings, registered):
    settings.WFDASH = {**settings.WFDASH, "STRICT_VERSIONS": False}


def deploy_v1() -> None:
    @register("rel-deploy")
    class Deploy(WorkflowEntrypoint):
        async def run(self, event, step):
            a = await step.do("a", lambda: "from a")
            await step.sleep("pause", "1 hour")
            b = await step.do("b", lambda: "from b")
            return {"a": a, "b": b}


def test_a_deploy_that_reorders_the_steps_of_a_running_instance_fails_it_with_non_determinism(
    lax_versions,
):
    deploy_v1()
    inst = get_workflow("rel-deploy").create(id="reordered")
    testing.run_until_idle()
    assert inst.status().status == "waiting"

    @register("rel-deploy")
    class Reordered(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.sleep("a", "1 hour")  # "a" was checkpointed as a do step
            return await step.do("pause", lambda: "never")

    inst.skip_sleep()
    testing.run_until_idle()
    status = inst.status()
    assert status.status == "errored" and status.error["name"] == NonDeterminismError.__name__
    assert 'step "a" was checkpointed as do' in status.error["message"]
    assert StepRecord.objects.get(instance__instance_id="reordered", name="a").output == "from a"
    assert not StepRecord.objects.filter(instance__instance_id="reordered", name="b").exists()


def redeploy_and_replay(inst, run) -> None:
    """Register other code under the same version (lax), then replay the parked instance."""
    register("rel-deploy")(type("Changed", (WorkflowEntrypoint,), {"run": run}))
    inst.skip_sleep()
    testing.run_until_idle()


def assert_non_determinism(inst, *fragments: str) -> None:
    status = inst.status()
    assert status.status == "errored" and status.error["name"] == NonDeterminismError.__name__, (
        status
    )
    for fragment in fragments:
        assert fragment in status.error["message"], status.error["message"]


def test_a_renamed_step_fails_naming_both_before_the_new_step_runs(lax_versions):
    deploy_v1()
    inst = get_workflow("rel-deploy").create(id="renamed")
    testing.run_until_idle()
    calls: list[str] = []

    async def run(self, event, step):
        a = await step.do("a renamed", lambda: calls.append("a renamed") or "from a renamed")
        await step.sleep("pause", "1 hour")
        return a

    redeploy_and_replay(inst, run)
    assert_non_determinism(inst, 'asks for do step "a renamed"', 'checkpointed do step "a"')
    assert calls == []  # it never ran
    assert StepRecord.objects.get(instance__instance_id="renamed", name="a").output == "from a"


def test_a_removed_step_fails_naming_the_step_that_now_follows(lax_versions):
    deploy_v1()
    inst = get_workflow("rel-deploy").create(id="removed")
    testing.run_until_idle()

    async def run(self, event, step):
        await step.sleep("pause", "1 hour")  # "a" is gone
        return await step.do("b", lambda: "from b")

    redeploy_and_replay(inst, run)
    assert_non_determinism(
        inst, 'sleep step "pause" was checkpointed after step "a"', "the start of its branch"
    )


def test_reordered_steps_of_the_same_kind_fail_with_non_determinism(lax_versions):
    @register("rel-deploy")
    class Two(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do("first", lambda: 1)
            await step.do("second", lambda: 2)
            await step.sleep("pause", "1 hour")

    inst = get_workflow("rel-deploy").create(id="swapped")
    testing.run_until_idle()

    async def run(self, event, step):
        await step.do("second", lambda: 2)
        await step.do("first", lambda: 1)
        await step.sleep("pause", "1 hour")

    redeploy_and_replay(inst, run)
    assert_non_determinism(inst, 'do step "second" was checkpointed after step "first"')


def test_gathered_branches_replay_whatever_order_their_steps_finished_in(registered):
    order: list[str] = []

    @register("rel-branches")
    class Branches(WorkflowEntrypoint):
        async def run(self, event, step):
            async def branch(tag: str, delay: float) -> str:
                async def slow() -> str:
                    await asyncio.sleep(delay)
                    order.append(tag)
                    return tag

                await step.do(f"{tag} 1", slow)
                return await step.do(f"{tag} 2", slow)

            await step.do("before", lambda: "before")
            result = await asyncio.gather(branch("slow", 0.05), branch("fast", 0))
            await step.sleep("pause", "1 hour")
            return result

    inst = get_workflow("rel-branches").create()
    testing.run_until_idle()
    assert order == ["fast", "fast", "slow", "slow"]  # the fast branch's second step started first
    inst.skip_sleep()
    testing.run_until_idle()
    assert inst.status().output == ["slow", "fast"]


def test_a_compensation_cannot_collide_with_a_step_named_like_it(registered):
    undone: list[str] = []

    @register("rel-collide")
    class Collide(WorkflowEntrypoint):
        async def run(self, event, step):
            await step.do("charge", lambda: "charged", compensate=lambda out: undone.append(out))
            await step.do("compensate:charge", lambda: "a step of the user's")
            await step.wait_for_event("w", type="go")

    inst = get_workflow("rel-collide").create()
    testing.run_until_idle()
    inst.cancel(compensate=True)
    testing.run_until_idle()
    assert inst.status().status == "terminated"
    assert undone == ["charged"]
    rows = set(
        StepRecord.objects.filter(instance__instance_id=inst.id).values_list(
            "kind", "name", "output_json"
        )
    )
    assert ("do", "compensate:charge", '"a step of the user\'s"') in rows
    assert ("compensate", "charge", "null") in rows


# --- soak only (scripts/soak) ---------------------------------------------------------------


@soak_only
@long_when_soaking
def test_ten_thousand_simultaneous_timers_all_fire_and_checkpoint_once(workers):
    size = 10_000
    fleet_workflows.ensure_ledger()
    wf = get_workflow("rel-timer")
    # One instant for all, late enough that every instance is parked on it beforehand.
    instant = time.time() + 150
    for start in range(0, size, 100):
        wf.create_batch(
            [
                {"id": f"t{n}", "params": {"at": int(instant * 1000)}}
                for n in range(start, start + 100)
            ]
        )
    workers(2, WFDASH_LEASE_SECONDS="30")
    wait_until(
        lambda: Instance.objects.filter(workflow="rel-timer", status="waiting").count() == size,
        150,
        "every instance to park on its timer",
        interval=1,
    )
    parked_at = time.time()
    assert parked_at < instant, "the instances parked too late for their instant to be simultaneous"
    wait_until(
        lambda: Instance.objects.filter(workflow="rel-timer", status="complete").count() == size,
        900,
        "every timer to fire and its instance to complete",
        interval=1,
    )
    assert_one_checkpoint_per_step("rel-timer", 1, size)
    assert (
        StepRecord.objects.filter(
            instance__workflow="rel-timer", kind="sleepUntil", status="complete"
        ).count()
        == size
    )
    assert set(executions("t").values()) == {1}
    woke = sorted(
        started - instant
        for _, step, _, started, _ in fleet_workflows.ledger_rows()
        if step == "after"
    )
    assert len(woke) == size
    assert woke[0] >= 0, f"a timer fired {-woke[0]:.3f} s early"
    p50, p95 = woke[size // 2], woke[size * 95 // 100]
    print(
        f"\n10k timers: parked {instant - parked_at:.1f} s before the instant; lateness "
        f"p50 {p50:.2f} s, p95 {p95:.2f} s, max {woke[-1]:.2f} s (all woken {woke[-1]:.2f} s after it)"
    )


@soak_only
@long_when_soaking
def test_sqlite_held_by_an_external_exclusive_lock_delays_but_loses_and_duplicates_nothing(workers):
    if connection.vendor != "sqlite":
        pytest.skip("SQLite only: the external lock is a SQLite BEGIN EXCLUSIVE")
    import sqlite3

    size = 200
    fleet_workflows.ensure_ledger()
    wf = get_workflow("fleet")
    for start in range(0, size, 100):
        wf.create_batch([{"id": f"x{n}"} for n in range(start, start + 100)])
    # Leases outlast the lock: nothing may be taken over, so nothing may run twice.
    workers(2, FLEET_STEP_SECONDS="0.01", WFDASH_LEASE_SECONDS="30")
    wait_until(lambda: len(fleet_workflows.ledger_rows()) >= size, 60, "the fleet to be busy")
    outsider = sqlite3.connect(connection.settings_dict["NAME"], timeout=30, isolation_level=None)
    outsider.execute("BEGIN EXCLUSIVE")
    time.sleep(5)  # the injected fault itself: the database is unavailable for five seconds
    outsider.execute("COMMIT")
    outsider.close()
    wait_until(
        lambda: Instance.objects.filter(workflow="fleet", status="complete").count() == size,
        300,
        "every instance to complete after the lock",
    )
    assert_one_checkpoint_per_step("fleet", 5, size)
    assert set(executions("x").values()) == {1}
