"""Where the per-step time goes: `python -m bench.profile [--instances N] [--untraced]`.

Runs the per-step scenario (N instances of a 10-step no-op workflow, run_until_idle) once
and prints, per step: wall time, the engine database thread's busy time by store function,
SQL statements by kind, and a cProfile of the database thread grouped by layer (ORM query
building, driver execute, transaction handling, span storage, engine code).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import threading
import time
from typing import Any


def layer(filename: str, function: str) -> str:
    if "sqlite3.Cursor" in function or "sqlite3.Connection" in function or "psycopg" in filename:
        return "driver (SQL execute/commit)"
    if (
        "opentelemetry" in filename
        or "workflows_app/tracing.py" in filename
        or "engine/spans.py" in filename
    ):
        return "spans (OpenTelemetry + storage)"
    if "django/db/models" in filename:
        return "ORM (query build/compile, model rows)"
    if "django/db" in filename:
        return "Django db backend/transaction"
    if "workflows_app" in filename:
        return "engine (store.py etc.)"
    if "concurrent/futures" in filename or "threading.py" in filename or "asyncio" in filename:
        return "thread hop / asyncio"
    return "other (json, datetime, uuid, ...)"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.profile")
    parser.add_argument("--instances", type=int, default=100)
    parser.add_argument("--untraced", action="store_true")
    args = parser.parse_args()
    from .dbsetup import setup_django

    setup_django()

    from workflows_app.engine import spans
    from workflows_app.engine import worker as engine_worker
    from workflows_app.testing import QueryCounter

    from .inproc import run_until_idle
    from .measures import _create

    spans.set_enabled(not args.untraced)
    n, steps = args.instances, args.instances * 10

    busy: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    profiles: dict[int, cProfile.Profile] = {}
    lock = threading.Lock()
    original = engine_worker.ConnectionThreads._call

    def timed_call(self: Any, fn: Any, *a: Any) -> Any:
        prof = profiles.setdefault(threading.get_ident(), cProfile.Profile())
        t0 = time.perf_counter()
        prof.enable()
        try:
            return original(self, fn, *a)
        finally:
            prof.disable()
            with lock:
                entry = busy[getattr(fn, "__name__", repr(fn))]
                entry[0] += 1
                entry[1] += time.perf_counter() - t0

    # A pass without the profiler first: the wall time per step to compare with.
    _create("bench-steps10", "plain", n)
    cpu0 = time.process_time()
    _, plain_s = run_until_idle()
    cpu_plain = time.process_time() - cpu0
    _create("bench-steps10", "prof", n)
    engine_worker.ConnectionThreads._call = timed_call
    try:
        with QueryCounter() as counter:
            _, prof_s = run_until_idle()
    finally:
        engine_worker.ConnectionThreads._call = original

    print(f"{n} instances x 10 steps, tracing {'off' if args.untraced else 'on'}")
    print(
        f"wall per step (no profiler): {plain_s * 1000 / steps:.2f} ms; process CPU per step {cpu_plain * 1000 / steps:.2f} ms"
    )
    print(f"wall per step (profiled run): {prof_s * 1000 / steps:.2f} ms")
    print(
        f"SQL statements per step: {counter.count / steps:.2f}  "
        + " ".join(f"{k}={v / steps:.2f}" for k, v in sorted(counter.kinds.items()))
    )
    total_busy = sum(s for _, s in busy.values())
    print(
        f"\ndatabase threads busy per step: {total_busy * 1000 / steps:.2f} ms (profiler inflates this)"
    )
    for name, (calls, secs) in sorted(busy.items(), key=lambda kv: -kv[1][1]):
        print(
            f"  {name:26} calls/step={calls / steps:5.2f}  ms/step={secs * 1000 / steps:6.2f}  ms/call={secs * 1000 / calls:6.2f}"
        )
    stats = (
        pstats.Stats(*profiles.values())
        if len(profiles) > 1
        else pstats.Stats(next(iter(profiles.values())))
    )
    layers: dict[str, float] = collections.Counter()
    for (filename, _line, function), (_cc, _nc, tottime, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        layers[layer(filename, function)] += tottime
    total = sum(layers.values())
    print("\ndatabase thread self time by layer:")
    for name, secs in sorted(layers.items(), key=lambda kv: -kv[1]):
        print(f"  {name:40} {100 * secs / total:5.1f}%  {secs * 1000 / steps:6.2f} ms/step")
    print("\ntop functions by self time (database thread):")
    stats.sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
