"""wfdash against DBOS Transact, on the same database server in the same run:
`python -m bench.versus_dbos [--quick] [--rounds N]` (DBOS comes with the `test` extra).

Each engine runs in a child process of its own (DBOS's threads and globals stay out of
wfdash's process), one after the other, `--rounds` times; the table gives each figure's
median over the rounds and how many times wfdash is ahead (above 1: wfdash is faster).
DATABASE_URL picks the server as for `python -m bench`: wfdash gets `<db>_bench`, DBOS
`<db>_dbos_bench`, both made anew; without one, each gets a fresh SQLite file.

The workloads are the same shapes for both, as each engine's documentation writes them
(wfdash: async workflow classes and steps on its worker's event loop, spans stored;
DBOS: sync functions on its thread pool, its tracing off, as by default):

- seq_step_ms: a 10-step no-op workflow started and waited for, one at a time;
- batch_step_ms: as many started one after another, then all waited for;
- one_step_*_per_s: one-step workflows started one after another (seq) or from four
  threads (conc), per second until all have ended;
- event_*_ms: a workflow waiting for a message, sent once it waits, until its next step;
- sleep_late_*_ms: a 100 ms durable sleep, from its stored wake time to its next step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from .dbsetup import POSTGRES_SCHEMES, fresh_database
from .stats import percentile

FULL = {"seq": 100, "batch": 200, "one_step": 2000, "event": 100, "sleep": 50}
THREADS = 4

# (figure, better when higher)
FIGURES = [
    ("seq_step_ms", False),
    ("batch_step_ms", False),
    ("one_step_seq_per_s", True),
    ("one_step_conc_per_s", True),
    ("event_p50_ms", False),
    ("event_p95_ms", False),
    ("sleep_late_p50_ms", False),
    ("sleep_late_p95_ms", False),
]


def sizes(quick: bool, smoke: bool = False) -> dict[str, int]:
    """smoke: every workload at its smallest that still measures each figure (two of each;
    one one-step workflow per thread), for the test that both sides run, not for figures."""
    if smoke:
        return {k: THREADS if k == "one_step" else 2 for k in FULL}
    return {k: max(5, v // 10) for k, v in FULL.items()} if quick else dict(FULL)


def per_second(n: int, start: Callable[[int], Any], wait_all: Callable[[], None]) -> float:
    """n workflows started one after another: per second until all have ended."""
    t0 = time.perf_counter()
    for i in range(n):
        start(i)
    wait_all()
    return n / (time.perf_counter() - t0)


def per_second_threads(
    n: int,
    start: Callable[[int], Any],
    wait_all: Callable[[], None],
    thread_done: Callable[[], None] = lambda: None,
) -> float:
    """n workflows started from THREADS threads: per second until all have ended.
    thread_done: called in each thread once it has started its share."""
    errors: list[BaseException] = []

    def starter(k: int) -> None:
        try:
            for i in range(k, n, THREADS):
                start(i)
        except BaseException as exc:
            errors.append(exc)
        finally:
            thread_done()

    t0 = time.perf_counter()
    pool = [threading.Thread(target=starter, args=(k,)) for k in range(THREADS)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    if errors:
        raise errors[0]
    wait_all()
    return n / (time.perf_counter() - t0)


# --- wfdash's side ---------------------------------------------------------------------


def wfdash_side(size: dict[str, int]) -> dict[str, Any]:
    from .dbsetup import setup_django

    setup_django()
    from django.db import connections

    from workflows_app.client import get_workflow

    from . import measures as m
    from .inproc import ServingWorker

    out: dict[str, Any] = {"baseline_commit_ms": m.baseline(3, 200)["baseline_commit_ms"]}
    ten, one = get_workflow("bench-steps10"), get_workflow("bench-step1")
    run = uuid.uuid4().hex[:6]

    with ServingWorker():
        t0 = time.perf_counter()
        for i in range(size["seq"]):
            ten.create(id=f"seq-{run}-{i}").result(timeout=60)
        out["seq_step_ms"] = (time.perf_counter() - t0) * 1000 / (size["seq"] * 10)

    def counted(w: ServingWorker, n: int) -> Callable[[], None]:
        def wait_all() -> None:
            if not w.hooks.wait_for("complete", n, timeout=600):
                raise TimeoutError(f"{w.hooks.outcomes['complete']}/{n} complete")

        return wait_all

    with ServingWorker() as w:
        n = size["batch"]
        seconds = n / per_second(n, lambda i: ten.create(id=f"batch-{run}-{i}"), counted(w, n))
        out["batch_step_ms"] = seconds * 1000 / (n * 10)

    with ServingWorker() as w:
        n = size["one_step"]
        out["one_step_seq_per_s"] = per_second(
            n, lambda i: one.create(id=f"one-{run}-{i}"), counted(w, n)
        )

    with ServingWorker() as w:
        n = size["one_step"]
        out["one_step_conc_per_s"] = per_second_threads(
            n, lambda i: one.create(id=f"onec-{run}-{i}"), counted(w, n), connections.close_all
        )

    event = m.event_latency(size["event"])
    out["event_p50_ms"] = event["event_latency_p50_ms"]
    out["event_p95_ms"] = event["event_latency_p95_ms"]
    sleep = m.timer_lateness(size["sleep"])
    out["sleep_late_p50_ms"] = sleep["timer_lateness_p50_ms"]
    out["sleep_late_p95_ms"] = sleep["timer_lateness_p95_ms"]
    return out


# --- DBOS's side -----------------------------------------------------------------------


def dbos_database() -> str:
    """DBOS's system database: `<db>_dbos_bench` on DATABASE_URL's server, dropped and made
    anew, or a fresh SQLite file."""
    url = os.environ.get("DATABASE_URL", "")
    if not url.startswith(POSTGRES_SCHEMES):
        return f"sqlite:///{tempfile.mkdtemp(prefix='dbos-bench-')}/dbos.sqlite3"
    dbname = urlsplit(url).path.lstrip("/") or "postgres"
    return fresh_database(url, dbname.removesuffix("_bench") + "_dbos_bench")


def dbos_side(size: dict[str, int], poll_seconds: float | None = None) -> dict[str, Any]:
    """poll_seconds: DBOS's notification_listener_polling_interval_sec (its default, 1 s,
    when None), how often it polls for messages where it has no LISTEN (SQLite)."""
    from dbos import DBOS

    from . import dbos_workflows as flows

    config: dict[str, Any] = {
        "name": "wfdash-versus",
        "system_database_url": dbos_database(),
        "log_level": "WARNING",
    }
    if poll_seconds is not None:
        config["notification_listener_polling_interval_sec"] = poll_seconds
    DBOS(config=config)  # type: ignore[arg-type]
    DBOS.launch()
    out: dict[str, Any] = {}
    try:
        t0 = time.perf_counter()
        for _ in range(size["seq"]):
            DBOS.start_workflow(flows.ten_steps).get_result()
        out["seq_step_ms"] = (time.perf_counter() - t0) * 1000 / (size["seq"] * 10)

        def waiting_for(handles: list[Any]) -> Callable[[], None]:
            def wait_all() -> None:
                for handle in handles:
                    handle.get_result()

            return wait_all

        handles: list[Any] = []
        n = size["batch"]
        seconds = n / per_second(
            n,
            lambda i: handles.append(DBOS.start_workflow(flows.ten_steps)),
            waiting_for(handles),
        )
        out["batch_step_ms"] = seconds * 1000 / (n * 10)

        n = size["one_step"]
        handles = []
        out["one_step_seq_per_s"] = per_second(
            n, lambda i: handles.append(DBOS.start_workflow(flows.one_step)), waiting_for(handles)
        )
        handles = []  # list.append is atomic: the four threads share it
        out["one_step_conc_per_s"] = per_second_threads(
            n, lambda i: handles.append(DBOS.start_workflow(flows.one_step)), waiting_for(handles)
        )

        latencies = []
        for _ in range(size["event"]):
            handle = DBOS.start_workflow(flows.message_then_mark)
            workflow_id = handle.get_workflow_id()
            if DBOS.get_event(workflow_id, "waiting", timeout_seconds=30) is None:
                raise TimeoutError(f"{workflow_id} did not wait")
            arrived = flows.MARK_WAITERS[workflow_id] = threading.Event()
            t0 = time.perf_counter()
            DBOS.send(workflow_id, "go", topic="go")
            if not arrived.wait(30):
                raise TimeoutError(f"{workflow_id}: its marking step did not run")
            latencies.append((flows.MARKS[workflow_id] - t0) * 1000)
            handle.get_result()
        out["event_p50_ms"] = percentile(latencies, 50)
        out["event_p95_ms"] = percentile(latencies, 95)

        lateness = []
        for _ in range(size["sleep"]):
            handle = DBOS.start_workflow(flows.sleep_then_mark, 0.1)
            handle.get_result()
            workflow_id = handle.get_workflow_id()
            (wake_at,) = [
                step["output"]
                for step in DBOS.list_workflow_steps(workflow_id)
                if step["function_name"] == "DBOS.sleep"
            ]
            lateness.append((flows.MARKS[workflow_id + "@wall"] - wake_at) * 1000)
        out["sleep_late_p50_ms"] = percentile(lateness, 50)
        out["sleep_late_p95_ms"] = percentile(lateness, 95)
    finally:
        DBOS.destroy()
    return out


# --- the driver ------------------------------------------------------------------------


def run_child(
    engine: str, quick: bool, dbos_poll: float | None = None, smoke: bool = False
) -> dict[str, Any]:
    command = [sys.executable, "-m", "bench.versus_dbos", "--child", engine]
    if quick:
        command.append("--quick")
    if smoke:
        command.append("--smoke")
    if dbos_poll is not None:
        command += ["--dbos-poll", str(dbos_poll)]
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{engine}'s side failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.versus_dbos", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="a tenth of every size")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each engine, alternated")
    parser.add_argument(
        "--dbos-poll",
        type=float,
        default=None,
        help="DBOS's message polling interval in seconds where it has no LISTEN (SQLite); "
        "its default is 1",
    )
    parser.add_argument("--child", choices=("wfdash", "dbos"), help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)  # the test's
    args = parser.parse_args(argv)
    if args.child == "dbos":
        print(json.dumps(dbos_side(sizes(args.quick, args.smoke), args.dbos_poll)))
        return 0
    if args.child == "wfdash":
        print(json.dumps(wfdash_side(sizes(args.quick, args.smoke))))
        return 0

    runs: dict[str, list[dict[str, Any]]] = {"wfdash": [], "dbos": []}
    started = time.perf_counter()
    for r in range(args.rounds):
        for engine in ("wfdash", "dbos"):
            t0 = time.perf_counter()
            runs[engine].append(run_child(engine, args.quick, args.dbos_poll, args.smoke))
            print(
                f"[{engine} {r + 1}/{args.rounds}] {time.perf_counter() - t0:.1f} s",
                file=sys.stderr,
            )

    def median(engine: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[engine])

    url = os.environ.get("DATABASE_URL", "")
    server = urlsplit(url).hostname if url else "SQLite files"
    base = median("wfdash", "baseline_commit_ms")
    poll = "" if args.dbos_poll is None else f", DBOS polling every {args.dbos_poll} s"
    scale = "smoke" if args.smoke else "quick" if args.quick else "full"
    print(
        f"wfdash against DBOS on {server}, {scale} sizes, "
        f"median of {args.rounds} rounds; baseline commit {base:.3f} ms{poll}"
    )
    print(f"{'figure':<22} {'wfdash':>10} {'DBOS':>10}  wfdash ahead")
    result: dict[str, Any] = {
        "baseline_commit_ms": base,
        "rounds": args.rounds,
        "dbos_poll_s": args.dbos_poll,
    }
    for key, higher_is_better in FIGURES:
        ours, theirs = median("wfdash", key), median("dbos", key)
        ahead = ours / theirs if higher_is_better else theirs / ours
        print(f"{key:<22} {ours:>10.3f} {theirs:>10.3f}  {ahead:>8.1f}×")
        result[key] = {"wfdash": ours, "dbos": theirs, "ahead": ahead}
    result["total_s"] = time.perf_counter() - started
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
