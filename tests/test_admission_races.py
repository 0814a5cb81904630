"""Admission (flow control) under concurrency: the races found in a review of the create
path on PostgreSQL (READ COMMITTED), and a long queue of one key.

Each race is made deterministic the way tests/test_postgres_fast_path.py does it: one
thread's transaction holds what the other needs, and the test waits for the other's Lock
wait in pg_stat_activity (or for an event the first thread sets), never for time.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from django.db import connection, connections, transaction

from tests.polling import a_backend_waits_for_a_lock, wait_until
from tests.test_flow_control import register_gated
from workflows_app import testing
from workflows_app.client import get_workflow
from workflows_app.engine import clock, store
from workflows_app.models import HistoryRecord, Instance

pytestmark = pytest.mark.django_db(transaction=True)


def postgres_only() -> None:
    if connection.vendor != "postgresql":
        pytest.skip("PostgreSQL only: SQLite's IMMEDIATE transactions serialise these writers")


def create_while_held(wf, instance_id: str, release: threading.Event) -> None:
    """Create instance_id in a thread; release the holder once the create is done or waits
    for a lock (code that serialises the two must not hang the test)."""
    outcome: dict[str, object] = {}

    def create() -> None:
        try:
            outcome["created"] = wf.create(id=instance_id)
        except Exception as exc:
            outcome["error"] = exc
        finally:
            connections.close_all()

    creator = threading.Thread(target=create)
    creator.start()
    try:
        wait_until(
            lambda: not creator.is_alive() or a_backend_waits_for_a_lock(),
            30,
            "the create to end or wait for a lock",
        )
    finally:
        release.set()
        creator.join(30)
    assert "error" not in outcome, outcome


def assert_started_when_no_place_is_held(wf, name: str, instance_id: str) -> None:
    # admit_due only looks at timed queued instances (admit_at set): not this one.
    store.admit_due([(name, wf.definition().limits())])
    row = Instance.objects.get(workflow=name, instance_id=instance_id)
    assert (row.status, row.admit_at) == ("running", None), (
        f"{instance_id} is {row.status!r} ({row.waiting_reason!r}) while no instance holds a place"
    )


def test_a_create_that_queues_while_a_terminate_frees_the_only_place_is_not_left_queued(
    registered,
):
    """max_concurrent_instances 1, A running. A terminate of A has written A's new status
    but not committed; its promote_queued looked for queued instances WITHOUT the
    workflow's admission lock, found none and returned. A create of B meanwhile takes the
    admission lock, still counts A (uncommitted end) and queues B. Both commit: A is
    terminated, the place is free, and B stays queued with no admit_at, so neither
    admit_due nor anything but a worker restart or another end/create starts it."""
    postgres_only()
    register_gated("review-stuck", max_concurrent_instances=1)
    wf = get_workflow("review-stuck")
    a = wf.create(id="a")
    assert a.status().status == "running"
    terminated, release = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def terminate_and_hold() -> None:  # terminate()'s transaction, its commit held back
        try:
            with transaction.atomic():
                outcome["terminated"] = a.terminate()
                terminated.set()
                release.wait(30)
        except Exception as exc:
            outcome["error"] = exc
        finally:
            terminated.set()
            connections.close_all()

    terminator = threading.Thread(target=terminate_and_hold)
    terminator.start()
    try:
        assert terminated.wait(30)
        create_while_held(wf, "b", release)  # A still counts as running
    finally:
        release.set()
        terminator.join(30)
    assert outcome.get("terminated") is True, outcome
    assert a.status().status == "terminated"
    assert_started_when_no_place_is_held(wf, "review-stuck", "b")


def test_a_create_that_queues_while_a_run_finishes_is_not_left_queued(registered):
    """The same race with a run's finish (the long way every end takes under flow
    control: _finish_rows then promote_queued, whose look at the queue is outside the
    admission lock)."""
    postgres_only()
    register_gated("review-stuck-finish", max_concurrent_instances=1)
    wf = get_workflow("review-stuck-finish")
    a = wf.create(id="a")
    pk = a.row().pk
    [(claimed, token, _)] = store.claim_and_load("probe", 5, 30).runs
    assert claimed == pk
    limits = wf.definition().limits()
    finished, release = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def finish_and_hold() -> None:  # as a run's end: its transaction's commit held back
        try:
            with transaction.atomic():
                outcome["finished"] = store.finish(pk, token, "complete", limits, "null")
                finished.set()
                release.wait(30)
        except Exception as exc:
            outcome["error"] = exc
        finally:
            finished.set()
            connections.close_all()

    finisher = threading.Thread(target=finish_and_hold)
    finisher.start()
    try:
        assert finished.wait(30)
        create_while_held(wf, "b", release)
    finally:
        release.set()
        finisher.join(30)
    assert outcome.get("finished") is True, outcome
    assert a.status().status == "complete"
    assert_started_when_no_place_is_held(wf, "review-stuck-finish", "b")


def test_a_debounced_create_and_a_resume_of_its_pending_instance_do_not_deadlock(registered):
    """Lock order. A create with a debounce key takes the workflow's admission lock, then
    row-locks the pending instance of that key (_debounce). resume() row-locks the
    instance, then takes the admission lock (promote_queued). A resume of the pending,
    paused instance racing a create with its key: each holds what the other waits for;
    PostgreSQL aborts one with "deadlock detected", an error the caller never asked for
    (neither is retried)."""
    postgres_only()
    register_gated("review-debounce-deadlock")  # no limits: debounce alone takes the lock
    wf = get_workflow("review-debounce-deadlock")
    pending = wf.create(id="p", debounce_key="k", debounce="1 hour")
    assert pending.status().status == "queued"
    pending.pause()
    assert pending.status().status == "paused"
    pk = pending.row().pk
    locked, go = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def resume() -> None:  # resume(): the row first (held here a moment early), then admission
        try:
            with transaction.atomic():
                list(
                    Instance.objects.select_for_update(no_key=True)
                    .filter(pk=pk)
                    .values_list("id", flat=True)
                )
                locked.set()
                go.wait(30)
                outcome["resumed"] = pending.resume()
        except Exception as exc:
            outcome["resume error"] = exc
        finally:
            locked.set()
            connections.close_all()

    def create() -> None:
        try:
            outcome["created"] = wf.create(id="q", debounce_key="k", debounce="1 hour")
        except Exception as exc:
            outcome["create error"] = exc
        finally:
            connections.close_all()

    resumer = threading.Thread(target=resume)
    resumer.start()
    assert locked.wait(30)
    creator = threading.Thread(target=create)
    creator.start()
    try:
        # The create holds the admission lock and waits for the pending row.
        wait_until(a_backend_waits_for_a_lock, 30, "the create waiting for the pending row")
    finally:
        go.set()
        resumer.join(60)
        creator.join(60)
    errors = {k: v for k, v in outcome.items() if k.endswith("error")}
    assert not errors, errors


def test_an_admission_that_loses_its_instance_to_a_terminate_records_no_start(registered):
    """promote_queued decides from its snapshot, then starts the admitted rows with
    UPDATE ... WHERE status = 'queued'. An instance terminated meanwhile (its row held
    by the terminate until commit) is skipped by that UPDATE, but the admission still
    appends "instance.started" to it after its "instance.terminated", and reports it
    admitted (hinted, on_promoted)."""
    postgres_only()
    register_gated("review-admit-terminated")  # debounce only: the terminate promotes nothing
    wf = get_workflow("review-admit-terminated")
    pending = wf.create(id="p", debounce_key="k", debounce="1 second")
    assert pending.status().status == "queued"
    pk = pending.row().pk
    # The debounce is over: admit_due would start it now.
    Instance.objects.filter(pk=pk).update(admit_at=clock.now() - timedelta(seconds=1))
    terminated, release = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def terminate_and_hold() -> None:
        try:
            with transaction.atomic():
                outcome["terminated"] = pending.terminate()
                terminated.set()
                release.wait(30)
        except Exception as exc:
            outcome["terminate error"] = exc
        finally:
            terminated.set()
            connections.close_all()

    def admit() -> None:
        try:
            outcome["admitted"] = store.admit_due(
                [("review-admit-terminated", wf.definition().limits())]
            )[0]
        except Exception as exc:
            outcome["admit error"] = exc
        finally:
            connections.close_all()

    terminator = threading.Thread(target=terminate_and_hold)
    terminator.start()
    assert terminated.wait(30)
    admitter = threading.Thread(target=admit)
    admitter.start()
    try:
        wait_until(a_backend_waits_for_a_lock, 30, "the admission waiting for the terminated row")
    finally:
        release.set()
        terminator.join(30)
        admitter.join(30)
    assert outcome.get("terminated") is True, outcome
    assert pending.status().status == "terminated"
    types = list(
        HistoryRecord.objects.filter(instance_id=pk)
        .order_by("sequence")
        .values_list("type", flat=True)
    )
    assert types[-1] == "instance.terminated", (types, outcome.get("admitted"), pk)
    assert pk not in outcome.get("admitted", []), outcome


def test_a_new_instance_of_a_free_key_is_not_held_back_by_a_long_queue_of_a_busy_key(
    registered,
):
    """max_concurrent_per_key 1. One customer (key "busy") has one instance running and
    ADMISSION_SCAN (1000) more queued behind it. A create for another customer (key
    "free", nobody active) is queued behind them in (priority, id) order; the admission
    pass stops after ADMISSION_SCAN candidates, all blocked by their key, so the new
    instance is never looked at: it stays queued (with the reason
    "max_concurrent_instances (None) reached") while its key has a free place, until the
    busy customer's backlog falls under 1000. (SPEC §8: an instance blocked by its key
    does not hold back the ones behind it.) Not a race: SQLite too."""
    from workflows_app.engine.store import control

    register_gated("review-key-backlog", max_concurrent_per_key=1)
    wf = get_workflow("review-key-backlog")
    running = wf.create(id="busy-0", concurrency_key="busy")
    assert running.status().status == "running"
    template = wf.create(id="busy-1", concurrency_key="busy").row()
    assert template.status == "queued"
    clones = []
    for n in range(2, control.ADMISSION_SCAN + 2):
        clone = Instance.objects.get(pk=template.pk)
        clone.pk, clone.instance_id = None, f"busy-{n}"
        clones.append(clone)
    Instance.objects.bulk_create(clones)
    assert Instance.objects.filter(workflow="review-key-backlog", status="queued").count() > (
        control.ADMISSION_SCAN
    )
    free = wf.create(id="free-0", concurrency_key="free")
    row = free.row()
    assert row.status == "running", (
        f"the free key's instance is {row.status!r} ({row.waiting_reason!r}); "
        "no instance of its key is active"
    )


def test_a_key_at_its_bound_keeps_no_past_start_time_the_scan_passed_over(registered):
    """One place a key, one start in 10 s. 150 instances of one key wait for the rate
    window (admit_at set). Once the window opens the scan stops reading the full key's
    queue after its first page: the others kept their past admit_at, and admit_due (with
    the workflow's lock) was due again at once, every 20 ms, until a place of the key
    freed. They now wait for the place, with no time."""
    from workflows_app.engine import clock, registry
    from workflows_app.engine.store import control

    register_gated(
        "key-skip", max_concurrent_per_key=1, rate_limit={"limit": 1, "period": "10 seconds"}
    )
    wf = get_workflow("key-skip")
    with testing.fake_clock() as fake:
        wf.create(id="other", concurrency_key="x")  # takes the rate window
        for first in (0, 100):  # two batches: max_batch_size is 100
            wf.create_batch(
                [{"id": f"k{n}", "concurrency_key": "K"} for n in range(first, first + 75)]
            )
        queued = Instance.objects.filter(workflow="key-skip", status="queued")
        assert queued.filter(admit_at__isnull=False).count() == 150
        fake.advance("11 seconds")
        limits = [("key-skip", registry.limits_for("key-skip", 1))]
        started, _ = control.admit_due(limits)
        assert len(started) == 1  # K's one place
        assert not queued.filter(admit_at__lte=clock.now()).exists()
        assert control.admit_due(limits) == ([], None)
