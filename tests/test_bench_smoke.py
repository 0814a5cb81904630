"""`python -m bench --quick` runs and ends with its JSON line (no speed assertions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import connection

# Both tests run the bench on SQLite files of their own whatever the leg's database (the
# comparison drops DATABASE_URL, the quick run sets a SQLite one), so on the PostgreSQL leg
# they would repeat the SQLite leg's runs exactly, on CI's longest leg.
pytestmark = pytest.mark.skipif(
    connection.vendor != "sqlite", reason="runs on SQLite files; the SQLite leg runs it"
)
ROOT = Path(__file__).resolve().parent.parent
KEYS = [
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
    "timer_lateness_p50_ms",
    "timer_lateness_p95_ms",
    "herd_10k_wake_s",
    "replay_1000_ratio",
    "parked_100k_rss_delta_mb",
    "recovery_500_s",
    "fleet_1_worker_per_s",
    "fleet_3_workers_per_s",
]
MEASURED = [
    "baseline_commit_ms",
    "baseline_cpu_unit_us",
    "per_step_ms",
    "per_step_ms_untraced",
    "per_step_ratio",
    "replay_1000_ratio",
]


def run_bench(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`python -m <args>` from the repository's root without Redis; it must succeed."""
    env = {k: v for k, v in env.items() if k != "REDIS_URL"}
    done = subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done


@pytest.mark.timeout(600)
def test_quick_bench_prints_json_last(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "DATABASE_URL": f"sqlite:///{tmp_path / 'bench.sqlite3'}",
        "DJANGO_SETTINGS_MODULE": "wfdash.settings",
    }
    done = run_bench(["bench", "--quick", "--only", "baseline,per_step,replay"], env)
    lines = done.stdout.strip().splitlines()
    figures = json.loads(lines[-1])
    assert isinstance(figures, dict)
    for key in KEYS:
        assert key in figures, key
        assert figures[key] is None or isinstance(figures[key], (int, float, str)), (
            key,
            figures[key],
        )
    assert figures["db"] == "sqlite"
    for key in MEASURED:
        assert isinstance(figures[key], (int, float)) and figures[key] > 0, (key, figures[key])
    assert figures["one_step_per_s"] is None  # not selected by --only
    assert "per_step_ms" in done.stdout  # the table is printed before the JSON line


@pytest.mark.timeout(600)
def test_the_comparison_with_dbos_runs_both_engines_and_ends_with_its_json(tmp_path: Path) -> None:
    """`python -m bench.versus_dbos --rounds 1` at its smoke sizes (two of each workload):
    each figure measured for wfdash and for DBOS (a fresh SQLite file each), and wfdash's
    lead computed (no speed assertions). DBOS polls for messages every 50 ms instead of its
    1 s, so its event figures take no second each."""
    from bench.versus_dbos import FIGURES

    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "wfdash.settings"}
    env.pop("DATABASE_URL", None)  # each engine gets a SQLite file of its own
    done = run_bench(["bench.versus_dbos", "--smoke", "--rounds", "1", "--dbos-poll", "0.05"], env)
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["rounds"] == 1 and figures["baseline_commit_ms"] > 0
    assert figures["dbos_poll_s"] == 0.05
    for key, _ in FIGURES:
        both = figures[key]
        assert both["wfdash"] > 0 and both["dbos"] > 0, (key, both)
        assert both["ahead"] > 0, (key, both)
    assert "seq_step_ms" in done.stdout  # the table is printed before the JSON line
