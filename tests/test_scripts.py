"""scripts/services.py: what scripts/test asks before its PostgreSQL + Redis leg."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from django.db import connection

from tests.workers import ROOT, database_url


def services(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "scripts/services.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("url", "base"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379"),
        ("redis://:s3cret@cache.internal:6380/12", "redis://:s3cret@cache.internal:6380"),
        # No database number: the base was "redis:/" and every leg's Redis URL was broken.
        ("redis://127.0.0.1:6379", "redis://127.0.0.1:6379"),
        ("redis://127.0.0.1:6379/", "redis://127.0.0.1:6379"),
    ],
)
def test_the_legs_redis_base_with_or_without_a_database_number(url, base):
    result = services("redis-base", url)
    assert (result.returncode, result.stdout.strip()) == (0, base), result.stderr


def test_a_redis_url_whose_path_is_no_database_number_is_refused_saying_so():
    result = services("redis-base", "redis://127.0.0.1:6379/cache")
    assert result.returncode == 1
    assert "the path must be a database number, not '/cache'" in result.stderr


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_check_names_the_missing_service_without_its_password():
    """The leg was started (CI) or skipped (locally) on PostgreSQL alone: without Redis it
    failed test by test. Now one line says which service is missing, and where."""
    port = closed_port()
    result = services("check", f"postgres://u:pg-secret@127.0.0.1:{port}/db", "redis://x")
    assert result.returncode == 1
    assert f"no PostgreSQL at postgres://127.0.0.1:{port}/db" in result.stdout
    assert "pg-secret" not in result.stdout + result.stderr


@pytest.mark.django_db
@pytest.mark.skipif(connection.vendor != "postgresql", reason="the PostgreSQL leg's check")
def test_check_says_redis_is_missing_when_postgresql_answers():
    port = closed_port()
    result = services("check", database_url(), f"redis://:r-secret@127.0.0.1:{port}/3")
    assert result.returncode == 1, result.stdout
    assert result.stdout.startswith(f"no Redis at redis://127.0.0.1:{port}/3 ("), result.stdout
    assert "r-secret" not in result.stdout


@pytest.fixture
def script_copy(tmp_path):
    """scripts/test in a copy of its directory whose .venv's pip and ruff do nothing and
    whose python runs everything but pytest, which it only reports (leg and Redis URL)."""
    (tmp_path / "scripts").mkdir()
    for name in ("test", "services.py"):
        target = tmp_path / "scripts" / name
        target.write_text((ROOT / "scripts" / name).read_text())
        target.chmod(0o755)
    for venv in (".venv", ".venv312"):
        bin_dir = tmp_path / venv / "bin"
        bin_dir.mkdir(parents=True)
        for tool in ("pip", "ruff"):
            (bin_dir / tool).write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / "python").write_text(
            "#!/bin/sh\n"
            'if [ "$1" = "-m" ] && [ "$2" = "pytest" ]; then\n'
            '  echo "PYTEST redis=$WFDASH_TEST_REDIS_URL database=${DATABASE_URL:-sqlite}'
            ' sqlite=${WFDASH_TEST_SQLITE:-} python=$0 args=$*"\n'
            "  exit 0\n"
            "fi\n"
            f'exec {sys.executable} "$@"\n'
        )
        for tool in bin_dir.iterdir():
            tool.chmod(0o755)
    return tmp_path / "scripts" / "test"


def run_script(script, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("CI", "DATABASE_URL", "REDIS_URL")}
    return subprocess.run(
        [str(script), *args],
        env={**base, "PYTHON312": "", **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_scripts_test_under_ci_fails_at_once_naming_the_missing_service(script_copy):
    """CI=true ran the leg without looking: PostgreSQL missing was a traceback per test,
    Redis missing was not looked for at all."""
    port = closed_port()
    result = run_script(
        script_copy,
        CI="true",
        WFDASH_TEST_POSTGRES_URL=f"postgres://postgres@127.0.0.1:{port}/test",
    )
    assert result.returncode == 1, result.stdout
    assert (
        f"CI=true needs PostgreSQL and Redis for the PostgreSQL + Redis leg: no PostgreSQL at "
        f"postgres://127.0.0.1:{port}/test" in result.stderr
    ), result.stderr
    assert "PYTEST" not in result.stdout


@pytest.mark.django_db
@pytest.mark.skipif(connection.vendor != "postgresql", reason="needs PostgreSQL to answer")
def test_scripts_test_without_redis_skips_the_leg_locally_and_fails_under_ci(script_copy):
    port = closed_port()
    env = {"WFDASH_TEST_POSTGRES_URL": database_url()}
    redis_url = f"redis://127.0.0.1:{port}"  # no database number
    local = run_script(script_copy, WFDASH_TEST_REDIS_URL=redis_url, **env)
    assert local.returncode == 0, local.stderr
    assert (
        f"== skipped the PostgreSQL + Redis leg: no Redis at redis://127.0.0.1:{port} ("
        in local.stdout
    ), local.stdout
    # The SQLite leg's Redis database is /1 of that server (it was "redis:/1").
    assert f"PYTEST redis=redis://127.0.0.1:{port}/1 database=sqlite" in local.stdout
    ci = run_script(script_copy, CI="true", WFDASH_TEST_REDIS_URL=redis_url, **env)
    assert ci.returncode == 1
    assert f"no Redis at redis://127.0.0.1:{port} (" in ci.stderr, ci.stderr


def test_the_python_312_leg_is_cut_into_parts_that_run_each_of_its_files_once(script_copy):
    """The Python 3.12 leg followed the SQLite leg alone, the critical path, while the
    PostgreSQL line was done minutes earlier: it is cut into parts, taken by whichever
    line is free, each with its own SQLite file and Redis database."""
    tests = script_copy.parent.parent / "tests"
    on_312 = ["tests/dashboard/test_views.py"] + [f"tests/test_{n}.py" for n in "abcdefghij"]
    left_out = ["tests/test_fleet.py", "tests/test_browser_reading.py", "tests/test_worker_race.py"]
    for name in [*on_312, *left_out, "tests/helpers.py"]:
        (tests.parent / name).parent.mkdir(parents=True, exist_ok=True)
        (tests.parent / name).write_text("")
    # A "Python 3.12" that passes the script's version check, on any machine.
    python312 = tests.parent / "python3.12"
    python312.write_text("#!/bin/sh\nexit 0\n")
    python312.chmod(0o755)
    port = closed_port()
    services = {
        "WFDASH_TEST_POSTGRES_URL": f"postgres://postgres@127.0.0.1:{port}/test",
        "WFDASH_TEST_REDIS_URL": f"redis://127.0.0.1:{port}/0",
        "PYTHON312": str(python312),
    }
    result = run_script(script_copy, **services)
    assert result.returncode == 0, result.stdout + result.stderr
    parts = [line for line in result.stdout.splitlines() if "PYTEST" in line and ".venv312" in line]
    assert len(parts) == 4, result.stdout
    ran = [
        arg for line in parts for arg in line.split("args=")[1].split() if arg.startswith("tests/")
    ]
    assert sorted(ran) == sorted(on_312)  # each file once; the multi-process ones not at all
    assert {line.split()[1] for line in parts} == {
        f"redis=redis://127.0.0.1:{port}/{n}" for n in (2, 3, 4, 5)
    }
    assert len({line.split()[3] for line in parts}) == 4  # a SQLite file each
    for n in (1, 2, 3, 4):
        assert result.stdout.count(f"(part {n} of 4)") == 1, result.stdout
    # An argument (a file, -k ...) runs the leg as one part with it, as before.
    one = run_script(script_copy, "-k", "x", **services)
    assert one.returncode == 0, one.stdout + one.stderr
    (whole,) = [line for line in one.stdout.splitlines() if "PYTEST" in line and ".venv312" in line]
    assert whole.endswith(
        "args=-m pytest -q -p no:cacheprovider --ignore=tests/test_reliability.py "
        "--ignore=tests/test_fleet.py --ignore=tests/test_fleet_live.py "
        "--ignore=tests/test_admission_fleet.py --ignore=tests/test_step_trouble_fleet.py "
        "--ignore=tests/test_worker_race.py --ignore=tests/test_browser.py "
        "--ignore=tests/test_browser_metrics.py --ignore=tests/test_browser_reading.py "
        "--ignore=tests/test_bench_smoke.py -k x"
    ), whole


def test_scripts_test_writes_the_projects_bytecode_before_the_legs(script_copy):
    """With PYTHONDONTWRITEBYTECODE set (as on CI's machine), every worker, daphne and
    manage.py process a test started compiled the project's modules anew (pip compiles
    site-packages, not an editable install's sources): 0.13 s of CPU each. The script
    writes them once before any leg."""
    module = script_copy.parent.parent / "workflows_app" / "compiled.py"
    module.parent.mkdir()
    module.write_text("X = 1\n")
    port = closed_port()
    result = run_script(
        script_copy,
        PYTHONDONTWRITEBYTECODE="1",
        WFDASH_TEST_POSTGRES_URL=f"postgres://postgres@127.0.0.1:{port}/test",
        WFDASH_TEST_REDIS_URL=f"redis://127.0.0.1:{port}/0",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    tag = sys.implementation.cache_tag
    assert (module.parent / "__pycache__" / f"compiled.{tag}.pyc").exists()
