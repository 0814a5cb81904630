"""One small function per measurement; each returns a dict of figures (None = not measured)."""

from __future__ import annotations

import functools
import json
import os
import sqlite3
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection, connections, transaction

from workflows_app.client import get_workflow
from workflows_app.engine import clock, spans
from workflows_app.engine.worker import notify_local
from workflows_app.models import Instance, StepKind, StepRecord, StepStatus
from workflows_app.testing import QueryCounter

from . import workflows as wf
from .inproc import ServingWorker, run_until_idle
from .procs import WorkerProcess, rss_mb, stop_all
from .stats import percentile

Figures = dict[str, Any]


# --- helpers ---------------------------------------------------------------------------


def _prefix(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:6]}"


def _create(workflow: str, prefix: str, n: int, params: Any = None, batch: int = 100) -> None:
    binding = get_workflow(workflow)
    for start in range(0, n, batch):
        binding.create_batch(
            [{"id": f"{prefix}-{i}", "params": params} for i in range(start, min(n, start + batch))]
        )


def _count(workflow: str, prefix: str, status: str = "complete") -> int:
    return Instance.objects.filter(
        workflow=workflow, instance_id__startswith=prefix + "-", status=status
    ).count()


def _wait_count(workflow: str, prefix: str, n: int, timeout: float, every: float = 0.05) -> float:
    """Poll until n instances are complete; returns time.perf_counter() when seen."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _count(workflow, prefix) >= n:
            return time.perf_counter()
        time.sleep(every)
    raise TimeoutError(f"{workflow}: {_count(workflow, prefix)}/{n} complete after {timeout} s")


def bulk_park(
    workflow: str,
    prefix: str,
    n: int,
    kind: str,
    step_name: str,
    wake_at: Any,
    params: Any,
    event_type: str = "",
    batch: int = 2000,
) -> None:
    """Insert n instances already parked on one waiting step (the state a run leaves)."""
    import json

    now = clock.now()
    params_json = json.dumps(params)
    for start in range(0, n, batch):
        with transaction.atomic():
            rows = Instance.objects.bulk_create(
                Instance(
                    workflow=workflow,
                    instance_id=f"{prefix}-{i}",
                    version=1,
                    status="waiting",
                    params_json=params_json,
                    created_at=now,
                    updated_at=now,
                    started_at=now,
                    wake_at=wake_at,
                    run_count=1,
                    history_seq=0,
                    trace_id=uuid.uuid4().hex,
                )
                for i in range(start, min(n, start + batch))
            )
            StepRecord.objects.bulk_create(
                StepRecord(
                    instance_id=row.pk,
                    name=step_name,
                    kind=kind,
                    seq=1,
                    status=StepStatus.WAITING,
                    attempts=1,
                    started_at=now,
                    wake_at=wake_at,
                    event_type=event_type,
                )
                for row in rows
            )


# --- 1. baseline -----------------------------------------------------------------------


def baseline(batches: int, per_batch: int) -> Figures:
    """Single-row INSERT + COMMIT per transaction, same driver and settings as the engine."""
    per_commit_ms: list[float] = []
    if connection.vendor == "sqlite":
        conn = sqlite3.connect(
            settings.DATABASES["default"]["NAME"], isolation_level=None, timeout=30
        )
        pragmas = settings.DATABASES["default"].get("OPTIONS", {}).get("init_command", "")
        conn.executescript(pragmas)  # the engine's own connection settings (WAL, ...)
        conn.execute("CREATE TABLE IF NOT EXISTS bench_baseline (id INTEGER PRIMARY KEY, v TEXT)")
        try:
            for _ in range(batches):
                t0 = time.perf_counter()
                for i in range(per_batch):
                    conn.execute("BEGIN IMMEDIATE")
                    conn.execute("INSERT INTO bench_baseline (v) VALUES (?)", (f"row {i}",))
                    conn.execute("COMMIT")
                per_commit_ms.append((time.perf_counter() - t0) * 1000 / per_batch)
        finally:
            conn.close()
    else:
        import psycopg

        with psycopg.connect(
            os.environ["DATABASE_URL"].replace("postgres://", "postgresql://", 1)
        ) as conn:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS bench_baseline (id BIGSERIAL PRIMARY KEY, v TEXT)"
            )
            conn.commit()
            for _ in range(batches):
                t0 = time.perf_counter()
                for i in range(per_batch):
                    conn.execute("INSERT INTO bench_baseline (v) VALUES (%s)", (f"row {i}",))
                    conn.commit()
                per_commit_ms.append((time.perf_counter() - t0) * 1000 / per_batch)
    ms = statistics.median(per_commit_ms)
    return {
        "baseline_commit_ms": ms,
        "baseline_commits_per_s": 1000 / ms,
        "baseline_cpu_unit_us": cpu_unit_us(),
    }


def cpu_unit_us(repeats: int = 15, units: int = 2000) -> float:
    """This machine's Python speed at this moment, in microseconds per unit of a fixed
    slice of the kind of work the engine's process does (a dict, its JSON, a hex id, a
    datetime's text), in this thread's CPU time as the CPU figures are; the median of
    several runs. CPU figures are shown in these units as well: this machine's speed
    moves by a third within an hour, and the ratio says whether a figure moved or the
    machine did."""
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        for i in range(units):
            attributes = {"workflow.name": "bench", "workflow.instance_id": f"i-{i}", "run": i}
            json.dumps(attributes, separators=(",", ":"))
            format(i * 2654435761, "032x")
            datetime.now(UTC).isoformat()
        times.append((time.thread_time() - t0) * 1e6 / units)
    return statistics.median(times)


# --- 2. per-step overhead --------------------------------------------------------------


def per_step(instances: int, steps: int = 10) -> Figures:
    """Wall time of run_until_idle over instances × steps no-op async steps, traced and not."""
    out: Figures = {}
    was = spans._enabled
    try:
        for traced, key in ((True, "per_step_ms"), (False, "per_step_ms_untraced")):
            spans.set_enabled(traced)
            prefix = _prefix("steps")
            _create("bench-steps10", prefix, instances)
            _, seconds = run_until_idle()
            done = _count("bench-steps10", prefix)
            if done != instances:
                raise RuntimeError(f"only {done}/{instances} instances completed")
            out[key] = seconds * 1000 / (instances * steps)
        # Statements per step, on a smaller untimed run (the counting wrapper costs time).
        spans.set_enabled(True)
        small = max(5, instances // 10)
        prefix = _prefix("steps-q")
        _create("bench-steps10", prefix, small)
        with QueryCounter() as counter:
            run_until_idle()
        out["queries_per_step"] = counter.count / (small * steps)
        out["queries_per_step_by_kind"] = {
            k: round(v / (small * steps), 2) for k, v in sorted(counter.kinds.items())
        }
    finally:
        spans.set_enabled(was)
    return out


# --- 3. throughput ---------------------------------------------------------------------


def throughput(n: int, threads: int = 4, batch: int = 100) -> Figures:
    """One-step instances created while a serving in-process worker runs them."""
    out: Figures = {}
    binding = get_workflow("bench-step1")
    with ServingWorker() as w:
        prefix = _prefix("one")
        t0 = time.perf_counter()
        for i in range(n):
            binding.create(id=f"{prefix}-{i}")
        created = time.perf_counter()
        if not w.hooks.wait_for("complete", n, timeout=600):
            raise TimeoutError("sequential throughput: instances did not complete")
        out["one_step_per_s"] = n / (time.perf_counter() - t0)
        out["create_sequential_per_s"] = n / (created - t0)

    with ServingWorker() as w:
        prefix = _prefix("onec")
        errors: list[BaseException] = []

        def creator(k: int) -> None:
            try:
                mine = [i for i in range(n) if (i // batch) % threads == k]
                for start in range(0, len(mine), batch):
                    binding.create_batch(
                        [{"id": f"{prefix}-{i}"} for i in mine[start : start + batch]]
                    )
            except BaseException as exc:
                errors.append(exc)
            finally:
                connections.close_all()

        t0 = time.perf_counter()
        pool = [threading.Thread(target=creator, args=(k,)) for k in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        if errors:
            raise errors[0]
        if not w.hooks.wait_for("complete", n, timeout=600):
            raise TimeoutError("concurrent throughput: instances did not complete")
        out["one_step_per_s_concurrent"] = n / (time.perf_counter() - t0)
    return out


# --- 3b. admission with flow control ---------------------------------------------------


def admission(n: int) -> Figures:
    """create() one at a time, then run them all: flow control off (bench-step1) against on
    (bench-admission: max_concurrent_instances and max_concurrent_per_key, every create
    with a priority and a concurrency key), in the same run. Per instance, in ms."""
    out: Figures = {}
    for workflow, key, extra in (
        ("bench-step1", "off", lambda i: {}),
        (
            "bench-admission",
            "on",
            lambda i: {"priority": i % 10, "concurrency_key": f"customer-{i % 50}"},
        ),
    ):
        binding = get_workflow(workflow)
        prefix = _prefix(f"adm-{key}")
        t0 = time.perf_counter()
        for i in range(n):
            binding.create(id=f"{prefix}-{i}", **extra(i))
        created = time.perf_counter()
        _, seconds = run_until_idle()
        done = _count(workflow, prefix)
        if done != n:
            raise RuntimeError(f"admission {key}: only {done}/{n} instances completed")
        out[f"admission_{key}_create_ms"] = (created - t0) * 1000 / n
        out[f"admission_{key}_total_ms"] = ((created - t0) + seconds) * 1000 / n
    out["admission_overhead_create_ms"] = (
        out["admission_on_create_ms"] - out["admission_off_create_ms"]
    )
    out["admission_overhead_total_ms"] = (
        out["admission_on_total_ms"] - out["admission_off_total_ms"]
    )
    return out


# --- 4. event latency ------------------------------------------------------------------


def _ms_until_marked(iid: str, action: Callable[[], Any]) -> float:
    """Milliseconds from calling action() until instance iid's marking step runs."""
    arrived = threading.Event()
    wf.MARK_WAITERS[iid] = arrived
    try:
        t0 = time.perf_counter()
        action()
        if not arrived.wait(30):
            raise TimeoutError(f"{iid}: its marking step did not run")
        return (wf.MARKS[iid] - t0) * 1000
    finally:
        wf.MARK_WAITERS.pop(iid, None)


def event_latency(n: int) -> Figures:
    """send_event → the step after wait_for_event starts, with a serving in-process worker."""
    binding = get_workflow("bench-event")
    latencies: list[float] = []
    with ServingWorker() as w:
        prefix = _prefix("ev")
        for i in range(n):
            iid = f"{prefix}-{i}"
            handle = binding.create(id=iid)
            if not w.hooks.wait_for("waiting", i + 1, timeout=30):
                raise TimeoutError(f"{iid} did not park")
            latencies.append(_ms_until_marked(iid, functools.partial(handle.send_event, "go")))
    return {
        "event_latency_p50_ms": percentile(latencies, 50),
        "event_latency_p95_ms": percentile(latencies, 95),
    }


def start_latency(n: int) -> Figures:
    """create() → the instance's first step starts, one at a time, with a serving in-process
    worker (the create's hint, the claim with its look at the queues, the run's start)."""
    binding = get_workflow("bench-sched")
    latencies: list[float] = []
    with ServingWorker() as w:
        prefix = _prefix("start")
        for i in range(n):
            iid = f"{prefix}-{i}"
            latencies.append(_ms_until_marked(iid, functools.partial(binding.create, id=iid)))
            if not w.hooks.wait_for("complete", i + 1, timeout=30):
                raise TimeoutError(f"{iid} did not complete")
    return {
        "start_latency_p50_ms": percentile(latencies, 50),
        "start_latency_p95_ms": percentile(latencies, 95),
    }


def event_latency_worker(n: int, via: str = "redis") -> Figures:
    """The same through a separate `runworker workflows` process, hinted through Redis
    (needs REDIS_URL) or, via="notify", through PostgreSQL's NOTIFY (the worker has no Redis)."""
    key = "event_latency_worker" if via == "redis" else "event_latency_notify"
    usable = os.environ.get("REDIS_URL") if via == "redis" else connection.vendor == "postgresql"
    if not usable:
        return {f"{key}_p50_ms": None, f"{key}_p95_ms": None}
    wf.ensure_marks_table()
    binding = get_workflow("bench-event-table")
    latencies: list[float] = []
    env = {"WFDASH_POLL_SECONDS": "5", **({"REDIS_URL": ""} if via == "notify" else {})}
    with WorkerProcess(**env) as proc:
        proc.wait_ready()
        prefix = _prefix("evw")
        for i in range(n):
            iid = f"{prefix}-{i}"
            handle = binding.create(id=iid)
            deadline = time.monotonic() + 30
            while handle.status().status != "waiting":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{iid} did not park in the worker process")
                time.sleep(0.005)
            t0 = time.time()
            handle.send_event("go")
            with connection.cursor() as cursor:
                while True:
                    cursor.execute("SELECT t FROM bench_marks WHERE instance_id = %s", [iid])
                    row = cursor.fetchone()
                    if row is not None:
                        break
                    if time.time() - t0 > 30:
                        raise TimeoutError(f"{iid}: no mark from the worker process")
                    time.sleep(0.001)
            latencies.append((row[0] - t0) * 1000)
    return {f"{key}_p50_ms": percentile(latencies, 50), f"{key}_p95_ms": percentile(latencies, 95)}


# --- 5. timers -------------------------------------------------------------------------


def timer_lateness(n: int, sleep_ms: int = 100) -> Figures:
    """n sequential instances sleeping sleep_ms: step-after-sleep start minus stored wake time."""
    binding = get_workflow("bench-sleep")
    lateness: list[float] = []
    with ServingWorker():
        prefix = _prefix("sleep")
        for i in range(n):
            iid = f"{prefix}-{i}"
            arrived = threading.Event()
            wf.MARK_WAITERS[iid] = arrived
            handle = binding.create(id=iid, params={"ms": sleep_ms})
            if not arrived.wait(30):
                raise TimeoutError(f"{iid}: the step after the sleep did not run")
            wake_at = StepRecord.objects.get(instance_id=handle.row().pk, name="nap").wake_at
            lateness.append((wf.MARKS[iid + "@wall"] - wake_at.timestamp()) * 1000)
            wf.MARK_WAITERS.pop(iid, None)
    return {
        "timer_lateness_p50_ms": percentile(lateness, 50),
        "timer_lateness_p95_ms": percentile(lateness, 95),
    }


def schedule_latency(ticks: int) -> Figures:
    """A schedule firing every second, serving in-process worker: from each tick (the
    instance's scheduled_at) to the start of its instance's first step, `ticks` ticks."""
    from workflows_app.client import schedules

    name = _prefix("tick")
    with ServingWorker():
        schedules.create(name, workflow="bench-sched", cron="* * * * * *")
        deadline = time.monotonic() + ticks * 2 + 30
        while True:
            started = list(
                Instance.objects.filter(schedule=name).values_list("instance_id", "scheduled_at")
            )
            marked = [(iid, at) for iid, at in started if iid + "@wall" in wf.MARKS]
            if len(marked) >= ticks:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(marked)}/{ticks} scheduled instances started")
            time.sleep(0.1)
        schedules.get(name).pause()
    latencies = [(wf.MARKS[iid + "@wall"] - at.timestamp()) * 1000 for iid, at in marked]
    return {
        "schedule_tick_to_start_p50_ms": percentile(latencies, 50),
        "schedule_tick_to_start_p95_ms": percentile(latencies, 95),
        "schedule_ticks": len(latencies),
    }


def herd(n: int, lead_seconds: float = 3.0) -> Figures:
    """n instances parked on sleep_until the same instant: seconds from it until all complete."""
    prefix = _prefix("herd")
    far = clock.now() + timedelta(days=300)
    bulk_park(
        "bench-herd",
        prefix,
        n,
        StepKind.SLEEP_UNTIL,
        "until",
        far,
        {"at": int(far.timestamp() * 1000)},
    )
    at = clock.now() + timedelta(seconds=lead_seconds)
    params = f'{{"at": {int(at.timestamp() * 1000)}}}'
    with transaction.atomic():
        pks = Instance.objects.filter(workflow="bench-herd", instance_id__startswith=prefix + "-")
        pks.update(wake_at=at, params_json=params)
        StepRecord.objects.filter(instance__in=pks, name="until").update(wake_at=at)
    with ServingWorker() as w:
        cpu_before = time.process_time()
        notify_local("wake")
        if not w.hooks.wait_for("complete", n, timeout=max(600, n * 0.1)):
            raise TimeoutError(f"herd: {w.hooks.outcomes['complete']}/{n} complete")
        done = time.time()
        cpu = time.process_time() - cpu_before
    seconds = done - at.timestamp()
    return {
        "herd_10k_wake_s": seconds,
        "herd_instances": n,
        "herd_wake_per_s": n / seconds,
        # This process's CPU (every thread) per instance: what a loaded machine changes least.
        "herd_cpu_ms_per_instance": cpu * 1000 / n,
    }


# --- 6. replay -------------------------------------------------------------------------


def replay(steps: int, loads: int = 5) -> Figures:
    """The run that replays `steps` checkpoints vs loading their rows once."""
    handle = get_workflow("bench-replay").create(params={"steps": steps})
    run_until_idle()
    if handle.status().status != "waiting":
        raise RuntimeError(f"replay instance is {handle.status().status}, not waiting")
    pk = handle.row().pk
    handle.send_event("go")
    _, replay_s = run_until_idle()
    if handle.status().status != "complete":
        raise RuntimeError(f"replay instance is {handle.status().status} after the event")
    load_times = []
    for _ in range(loads):
        t0 = time.perf_counter()
        rows = list(StepRecord.objects.filter(instance_id=pk))
        load_times.append(time.perf_counter() - t0)
    load_s = statistics.median(load_times)
    return {
        "replay_1000_ratio": replay_s / load_s,
        "replay_run_ms": replay_s * 1000,
        "replay_load_rows_ms": load_s * 1000,
        "replay_rows": len(rows),
    }


# --- 7. parked memory ------------------------------------------------------------------


def _idle_rss(settle: float = 3.0) -> float:
    with WorkerProcess(WFDASH_POLL_SECONDS="1") as proc:
        proc.wait_ready()
        samples = []
        deadline = time.monotonic() + settle
        while time.monotonic() < deadline:
            samples.append(rss_mb(proc.pid))
            time.sleep(0.1)
        return max(samples)


def parked_memory(n: int, settle: float = 3.0) -> Figures:
    """RSS of an idle worker process with 0, then with n parked instances in the database."""
    empty = _idle_rss(settle)
    far = clock.now() + timedelta(days=300)
    t0 = time.perf_counter()
    bulk_park(
        "bench-parked",
        _prefix("parked"),
        n,
        StepKind.WAIT_FOR_EVENT,
        "wait",
        far,
        None,
        event_type="go",
    )
    insert_s = time.perf_counter() - t0
    full = _idle_rss(settle)
    return {
        "parked_100k_rss_delta_mb": full - empty,
        "parked_rss_empty_mb": empty,
        "parked_rss_full_mb": full,
        "parked_instances": n,
        "parked_insert_s": insert_s,
    }


# --- 8. crash recovery -----------------------------------------------------------------


def recovery(n: int, kill_fraction: float = 0.3) -> Figures:
    """SIGKILL a worker process mid-run (lease 2 s); seconds from the kill until all complete."""
    prefix = _prefix("crash")
    env = {"WFDASH_LEASE_SECONDS": "2", "WFDASH_POLL_SECONDS": "1"}
    _create("bench-slow", prefix, n)
    done_steps = StepRecord.objects.filter(
        instance__workflow="bench-slow",
        instance__instance_id__startswith=prefix + "-",
        status="complete",
    )
    first = WorkerProcess(**env)
    try:
        first.wait_ready()
        deadline = time.monotonic() + 120
        while done_steps.count() < n * 4 * kill_fraction:
            if time.monotonic() > deadline:
                raise TimeoutError("recovery: the first worker made no progress")
            time.sleep(0.02)
        first.kill()
        killed = time.perf_counter()
        in_flight = Instance.objects.filter(
            workflow="bench-slow", instance_id__startswith=prefix + "-", lease_token__isnull=False
        ).count()
    finally:
        first.stop()
    with WorkerProcess(**env) as second:
        second.wait_ready()
        ready = time.perf_counter()
        finished = _wait_count("bench-slow", prefix, n, timeout=600)
    return {
        "recovery_500_s": finished - killed,
        "recovery_instances": n,
        "recovery_leased_at_kill": in_flight,
        "recovery_new_worker_boot_s": ready - killed,
    }


# --- 9. fleet --------------------------------------------------------------------------


def fleet(n: int, sizes: tuple[int, ...] = (1, 3)) -> Figures:
    """Instances/s of a 5-step no-op workflow with 1 and 3 worker processes."""
    out: Figures = {}
    for k in sizes:
        procs = [WorkerProcess(WFDASH_POLL_SECONDS="0.1") for _ in range(k)]
        try:
            for proc in procs:
                proc.wait_ready()
            prefix = _prefix(f"fleet{k}")
            t0 = time.perf_counter()
            _create("bench-steps5", prefix, n)
            finished = _wait_count("bench-steps5", prefix, n, timeout=600, every=0.02)
            out[f"fleet_{k}_worker{'s' if k > 1 else ''}_per_s"] = n / (finished - t0)
        finally:
            stop_all(procs)
    return out
