"""python -m bench [--quick] [--only NAME,...]

Runs every measurement in one process on the database named by DATABASE_URL (default: a
fresh SQLite file in a temp dir; PostgreSQL: `<dbname>_bench`, recreated), prints a table
and, as the last line, one JSON object with every figure (null where not measured).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

# Full sizes; --quick divides each by 10.
FULL = {
    "baseline": (5, 200),
    "per_step": 200,
    "throughput": 2000,
    "admission": 1000,
    "event": 100,
    "start": 100,
    "timers": 50,
    "schedule": 20,
    "herd": 10_000,
    "replay": 1000,
    "recovery": 500,
    "fleet": 300,
    "parked_memory": 100_000,
    "attributes": 100_000,
    "attr_create": 1000,
    "bulk": 10_000,
    "sse": 200,
    "metrics": 10_000,
    # Dashboard fan-out: sockets, changes at 0.5 s, burst creates, creates timed with none
    # and with rate_sockets open.
    "fanout": {"sockets": 500, "changes": 20, "burst": 500, "rate_n": 500, "rate_sockets": 200},
}
QUICK_FANOUT = {"sockets": 50, "changes": 6, "burst": 50, "rate_n": 100, "rate_sockets": 20}

# The JSON keys every run prints (null when the measurement was skipped or failed).
REQUIRED_KEYS = [
    "db",
    "baseline_commit_ms",
    "baseline_cpu_unit_us",
    "per_step_ms",
    "per_step_ms_untraced",
    "per_step_ratio",
    "one_step_per_s",
    "one_step_per_s_concurrent",
    "event_latency_p50_ms",
    "event_latency_p95_ms",
    "event_latency_worker_p50_ms",
    "event_latency_notify_p50_ms",
    "start_latency_p50_ms",
    "timer_lateness_p50_ms",
    "timer_lateness_p95_ms",
    "schedule_tick_to_start_p50_ms",
    "herd_10k_wake_s",
    "replay_1000_ratio",
    "parked_100k_rss_delta_mb",
    "recovery_500_s",
    "fleet_1_worker_per_s",
    "fleet_3_workers_per_s",
    "sse_latency_p50_ms",
    "sse_latency_p95_ms",
    "metrics_scrape_p50_ms",
    "fanout_sockets",
    "fanout_p50_ms",
    "fanout_p95_ms",
    "fanout_missed",
    "fanout_stale_sockets",
    "fanout_create_rate_ratio",
]

# Figures in milliseconds per operation: shown against the baseline commit as well.
PER_COMMIT_MS = {
    "per_step_ms",
    "per_step_ms_untraced",
    "event_latency_p50_ms",
    "event_latency_p95_ms",
    "event_latency_worker_p50_ms",
    "event_latency_worker_p95_ms",
    "event_latency_notify_p50_ms",
    "event_latency_notify_p95_ms",
    "start_latency_p50_ms",
    "start_latency_p95_ms",
    "replay_run_ms",
    "replay_load_rows_ms",
    "admission_off_create_ms",
    "admission_on_create_ms",
    "admission_off_total_ms",
    "admission_on_total_ms",
    "admission_overhead_create_ms",
    "admission_overhead_total_ms",
    "schedule_tick_to_start_p50_ms",
    "schedule_tick_to_start_p95_ms",
    "attr_list_baseline_ms",
    "attr_list_rare_ms",
    "attr_list_common_ms",
    "attr_list_rare_status_ms",
    "attr_list_none_ms",
}
# Figures in operations per second: shown as commits of the baseline per operation.
# Milliseconds of CPU: shown in CPU units as well (baseline_cpu_unit_us, the same run).
PER_CPU_UNIT = {"herd_cpu_ms_per_instance"}

PER_SECOND = {
    "one_step_per_s",
    "one_step_per_s_concurrent",
    "fleet_1_worker_per_s",
    "fleet_3_workers_per_s",
    "herd_wake_per_s",
    "create_sequential_per_s",
    "bulk_terminate_per_s",
}


def scaled(quick: bool) -> dict[str, Any]:
    if not quick:
        return {**FULL, "herd_lead_s": 3.0, "settle_s": 3.0}
    out: dict[str, Any] = {k: max(1, v // 10) for k, v in FULL.items() if isinstance(v, int)}
    out["baseline"] = (5, 50)
    # The herd and the parked rows cost engine time per instance (~20-30 ms on SQLite on a
    # 2-core box): a tenth of them alone would take most of the minute --quick is allowed.
    out["herd"] = FULL["herd"] // 40
    out["parked_memory"] = FULL["parked_memory"] // 20
    out["fanout"] = QUICK_FANOUT
    out["herd_lead_s"] = 1.5
    out["settle_s"] = 1.5
    return out


def plan(size: dict[str, Any]) -> list[tuple[str, Callable[[], dict[str, Any]]]]:
    """The measurements in the order they run. Their modules are imported when one runs
    (they need Django set up), so `--help` lists these very names."""

    def run(module: str, function: str, *args: Any, **kwargs: Any) -> Callable[[], Any]:
        def measure() -> Any:
            return getattr(importlib.import_module(f"bench.{module}"), function)(*args, **kwargs)

        return measure

    m, ops, streams = "measures", "operating", "streams"
    # Parked memory last: its 100k rows would otherwise sit under every later measurement.
    return [
        ("baseline", run(m, "baseline", *size["baseline"])),
        ("per_step", run(m, "per_step", size["per_step"])),
        ("throughput", run(m, "throughput", size["throughput"])),
        ("admission", run(m, "admission", size["admission"])),
        ("event", run(m, "event_latency", size["event"])),
        ("event_worker", run(m, "event_latency_worker", size["event"])),
        ("event_notify", run(m, "event_latency_worker", size["event"], via="notify")),
        ("start", run(m, "start_latency", size["start"])),
        ("timers", run(m, "timer_lateness", size["timers"])),
        ("schedule", run(m, "schedule_latency", size["schedule"])),
        ("herd", run(m, "herd", size["herd"], size["herd_lead_s"])),
        ("replay", run(m, "replay", size["replay"])),
        ("recovery", run(m, "recovery", size["recovery"])),
        ("fleet", run(m, "fleet", size["fleet"])),
        ("attributes", run(ops, "attribute_filter", size["attributes"])),
        ("attr_create", run(ops, "attribute_create", size["attr_create"])),
        ("bulk", run(ops, "bulk_terminate", size["bulk"])),
        ("sse", run(streams, "sse_latency", size["sse"])),
        ("metrics", run(streams, "metrics_scrape", size["metrics"], 50)),
        ("fanout", run("fanout", "fanout", **size["fanout"])),
        ("parked_memory", run(m, "parked_memory", size["parked_memory"], size["settle_s"])),
    ]


def settle_tables(vendor: str) -> None:
    """PostgreSQL: VACUUM ANALYZE between measurements, as autovacuum would. The CI
    server runs with autovacuum off, so its tables were never analyzed and their dead
    rows never cleared: the engine's prepared statements kept the plans made while the
    tables were nearly empty (a load of a claim's steps read the whole table, 2 ms
    instead of 0.1), and each measurement ran slower for the ones before it. Not while
    no instance exists: autovacuum leaves an empty table alone, and one analyzed empty
    is planned as empty until it is analyzed again."""
    if vendor != "postgresql":
        return
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT EXISTS (SELECT 1 FROM workflows_app_instance)")
        if cursor.fetchone()[0]:
            cursor.execute("VACUUM ANALYZE")


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
    if isinstance(value, dict):
        return " ".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def vs_baseline(key: str, value: Any, base_ms: float | None, cpu_us: float | None) -> str:
    if not isinstance(value, (int, float)):
        return ""
    if key in PER_CPU_UNIT:
        return f"{value * 1000 / cpu_us:,.1f} CPU units" if cpu_us else ""
    if not base_ms:
        return ""
    if key in PER_COMMIT_MS:
        return f"{value / base_ms:,.1f} commits"
    if key in PER_SECOND and value:
        return f"{1000 / value / base_ms:,.1f} commits/instance"
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="a tenth of every size (under a minute on SQLite)"
    )
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated measurements: "
        + ",".join(name for name, _ in plan(scaled(quick=False))),
    )
    args = parser.parse_args(argv)

    from .dbsetup import setup_django

    url = setup_django()
    from django.db import connection

    vendor = connection.vendor
    size = scaled(args.quick)
    for module in ("measures", "operating", "streams", "fanout"):  # registers bench workflows
        importlib.import_module(f"bench.{module}")
    steps = plan(size)
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    unknown = only - {name for name, _ in steps}
    if unknown:
        parser.error(f"unknown measurement(s): {', '.join(sorted(unknown))}")

    results: dict[str, Any] = {key: None for key in REQUIRED_KEYS}
    results["db"] = vendor
    rows: list[tuple[str, str, Any]] = []
    failures: list[str] = []
    started = time.perf_counter()
    print(
        f"wfdash bench on {vendor} ({url.split('@')[-1]}), {'quick' if args.quick else 'full'} sizes, "
        f"python {platform.python_version()}, {os.cpu_count()} cpus, redis={'yes' if os.environ.get('REDIS_URL') else 'no'}",
        file=sys.stderr,
    )
    for name, measure in steps:
        if only and name not in only:
            continue
        settle_tables(vendor)
        t0 = time.perf_counter()
        try:
            figures = measure()
        except Exception:
            failures.append(name)
            print(f"[{name}] FAILED:\n{traceback.format_exc()}", file=sys.stderr)
            continue
        print(f"[{name}] {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        results.update(figures)
        rows.extend((name, key, value) for key, value in figures.items())

    base = results.get("baseline_commit_ms")
    if base and results.get("per_step_ms") is not None:
        results["per_step_ratio"] = results["per_step_ms"] / base
        rows.append(("per_step", "per_step_ratio", results["per_step_ratio"]))
    results["failed"] = failures
    results["quick"] = args.quick
    results["total_s"] = time.perf_counter() - started

    width = max([len(k) for _, k, _ in rows] + [10])
    print(f"{'measurement':<14} {'figure':<{width}} {'value':>14}  vs baseline")
    print("-" * (width + 45))
    cpu = results.get("baseline_cpu_unit_us")
    for name, key, value in rows:
        print(f"{name:<14} {key:<{width}} {fmt(value):>14}  {vs_baseline(key, value, base, cpu)}")
    print("-" * (width + 45))
    print(json.dumps(results, default=str))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
