"""`manage.py runworker workflows` says what it does on SIGTERM: the drain, each run's end,
the exit; started before `migrate`, it says to migrate (and the embedded worker waits)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
from django.db import connection

from tests import fleet_workflows
from tests.polling import wait_until
from tests.test_fleet import needs_redis, redis_url
from tests.workers import ROOT, answers_http, database_url
from workflows_app.client import get_workflow

pytestmark = pytest.mark.django_db(transaction=True)


def sigterm_mid_step(workers, instance_id: str, **settings: str):
    """A worker inside the step "work" of a new rel-zombie instance gets SIGTERM; returns
    the instance, its key and the worker's log once it has exited 0."""
    fleet_workflows.ensure_ledger()
    inst = get_workflow("rel-zombie").create(id=instance_id)
    (worker,) = workers(1, **settings)
    wait_until(
        lambda: any(row[1] == "work" and row[4] is None for row in fleet_workflows.ledger_rows()),
        30,
        "the worker to be inside the step",
    )
    assert worker.terminate() == 0
    worker.log.seek(0)
    return inst, inst.row().pk, worker.log.read()


def test_sigterm_logs_the_runs_finishing_how_each_ended_and_the_exit(workers):
    # The step "work" takes 1.5 s: long enough to be mid-step when the signal arrives,
    # well inside the engine's 10 s grace period.
    inst, pk, log = sigterm_mid_step(workers, "drained", FLEET_STEP_SECONDS="1.5")
    assert (
        f"SIGTERM received; claiming nothing new. 1 run(s) finishing their current step (instances #{pk})"
        in log
    )
    assert f"instance #{pk} parked at a step boundary, due at once for another worker" in log
    assert "drained: 1 parked, 0 finished or cut short; leases released; exiting" in log
    # The step finished inside the grace period and its checkpoint is kept; the rest waits.
    assert [s.name for s in inst.steps() if s.status == "complete"] == ["work"]
    assert inst.row().lease_owner == ""


def test_wfdash_drain_seconds_sets_how_long_sigterm_lets_a_step_finish(workers):
    """The drain's grace was fixed at 10 s: a deploy whose orchestrator kills sooner lost
    the lease release, and one that allows longer could not give long steps the time.
    WFDASH_DRAIN_SECONDS sets it; a step outliving it is cut short, its lease given back."""
    inst, pk, log = sigterm_mid_step(
        workers, "cut-short", FLEET_STEP_SECONDS="120", WFDASH_DRAIN_SECONDS="0.5"
    )
    assert f"finishing their current step (instances #{pk}), for up to 0.5 s" in log, log
    assert f"instance #{pk} cut short; its lease is released for another worker" in log, log
    row = inst.row()
    assert (row.lease_token, row.lease_owner) == (None, "")
    assert not [s.name for s in inst.steps() if s.status == "complete"]


def test_a_database_failing_at_the_drains_release_is_tried_again_before_exit(workers):
    """The drain's release met a dropped connection (or a restarting database) at the cut
    short run and once more at the end: the worker exited with the lease still held, left
    to run out, the takeover counted as a crash. The last release now tries again."""
    inst, _, log = sigterm_mid_step(
        workers,
        "release-retried",
        FLEET_STEP_SECONDS="120",
        WFDASH_DRAIN_SECONDS="0.5",
        WFDASH_FAULTS="before_release=raise@1-3",
    )
    assert "could not release 1 leases; will retry" in log, log
    assert "could not give back" not in log, log
    row = inst.row()
    assert (row.lease_token, row.lease_owner) == (None, ""), log


def test_sighup_drains_the_worker_as_sigterm_does(workers):
    """The terminal or ssh session that started the worker closed: SIGHUP's default killed
    it mid-step, the lease left to run out and the takeover counted as a crash."""
    fleet_workflows.ensure_ledger()
    inst = get_workflow("rel-zombie").create(id="hung-up")
    (worker,) = workers(1, FLEET_STEP_SECONDS="1.5")
    wait_until(
        lambda: any(row[1] == "work" and row[4] is None for row in fleet_workflows.ledger_rows()),
        30,
        "the worker to be inside the step",
    )
    worker.process.send_signal(signal.SIGHUP)
    assert worker.process.wait(20) == 0, worker.logged()
    pk = inst.row().pk
    assert "SIGHUP received; claiming nothing new. 1 run(s) finishing" in worker.logged()
    assert f"instance #{pk} parked at a step boundary" in worker.logged()
    assert [s.name for s in inst.steps() if s.status == "complete"] == ["work"]
    assert inst.row().lease_owner == ""


def test_a_second_signal_cuts_the_drain_short_and_still_gives_the_lease_back(workers):
    """Ctrl-C twice, or SIGTERM then SIGINT: the second signal was ignored and the worker
    waited out the whole grace period of a long step. It now cuts the runs short at once,
    their leases released, and the worker exits cleanly."""
    fleet_workflows.ensure_ledger()
    inst = get_workflow("rel-zombie").create(id="hurried")
    (worker,) = workers(1, FLEET_STEP_SECONDS="120", WFDASH_DRAIN_SECONDS="120")
    wait_until(
        lambda: any(row[1] == "work" and row[4] is None for row in fleet_workflows.ledger_rows()),
        30,
        "the worker to be inside the step",
    )
    worker.process.send_signal(signal.SIGTERM)
    wait_until(lambda: "SIGTERM received" in worker.logged(), 10, "the drain to begin")
    worker.process.send_signal(signal.SIGINT)
    assert worker.process.wait(15) == 0, worker.logged()
    log = worker.logged()
    pk = inst.row().pk
    assert f"SIGINT received again; cutting short the runs still going (instances #{pk})" in log
    assert f"instance #{pk} cut short; its lease is released for another worker" in log, log
    row = inst.row()
    assert (row.lease_token, row.lease_owner) == (None, "")


@pytest.fixture
def unmigrated_database_url(tmp_path):
    """An empty database of the test run's kind: what a worker meets when started before
    `manage.py migrate`. On PostgreSQL an empty schema first on the search path: a database
    of its own cost a checkpoint to drop (29 s at the end of a loaded suite)."""
    if connection.vendor == "sqlite":
        yield f"sqlite:///{tmp_path / 'unmigrated.sqlite3'}"
        return
    schema = "wfdash_unmigrated"
    with connection.cursor() as cursor:
        cursor.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        cursor.execute(f'CREATE SCHEMA "{schema}"')
    try:
        yield f"{database_url()}?options=-c%20search_path%3D{schema}"
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def test_a_worker_started_before_migrate_refuses_with_what_to_run(unmigrated_database_url):
    """Not a traceback every poll interval for ever: one line saying to migrate, exit 1."""
    env = {**os.environ, "DATABASE_URL": unmigrated_database_url, "REDIS_URL": ""}
    result = subprocess.run(
        [sys.executable, "manage.py", "runworker", "workflows"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    assert "unapplied migration" in result.stderr, result.stderr
    assert "python manage.py migrate" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_wf_on_a_database_it_cannot_use_says_why_in_one_line(unmigrated_database_url, tmp_path):
    """`wf list` before `migrate`, or on a database it cannot open, ended in a traceback."""

    def wf_list(url: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "DATABASE_URL": url, "REDIS_URL": ""}
        return subprocess.run(
            [sys.executable, "manage.py", "wf", "list"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    for url, said in [
        (unmigrated_database_url, "run `python manage.py migrate` before using wf"),
        (f"sqlite:///{tmp_path / 'no-such-dir' / 'db.sqlite3'}", "the database refused: "),
    ]:
        result = wf_list(url)
        assert result.returncode == 1, result.stderr
        assert said in result.stderr and "Traceback" not in result.stderr, result.stderr
        assert result.stderr.strip().count("\n") == 0, result.stderr


def test_the_embedded_worker_waits_for_migrate_saying_so_once(unmigrated_database_url):
    """runserver (or daphne) on a database not migrated yet: the pages serve, the engine
    says once what to run and starts when it has been run, with no traceback loop."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "DATABASE_URL": unmigrated_database_url,
        "REDIS_URL": "",
        "WFDASH_EMBEDDED_WORKER": "1",
        "WFDASH_POLL_SECONDS": "0.5",
        "PYTHONUNBUFFERED": "1",
    }
    log = tempfile.TemporaryFile(mode="w+")
    server = subprocess.Popen(
        [sys.executable, "manage.py", "runserver", "--noreload", f"127.0.0.1:{port}"],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def logged() -> str:
        log.seek(0)
        return log.read()

    try:
        wait_until(lambda: "waits: the database has" in logged(), 60, "the worker to say it waits")
        migrate = subprocess.run(
            [sys.executable, "manage.py", "migrate", "-v0"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert migrate.returncode == 0, migrate.stderr
        wait_until(lambda: "the database is migrated" in logged(), 30, "the worker to start")
        server.send_signal(signal.SIGTERM)
        server.wait(30)
        text = logged()
        assert text.count("waits: the database has") == 1, text
        assert "python manage.py migrate" in text, text
        assert "Traceback" not in text, text
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
        log.close()


def test_a_worker_that_cannot_reach_redis_at_start_says_so_without_the_password():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]  # nothing listens once the socket is closed
    env = {
        **os.environ,
        "DATABASE_URL": database_url(),  # migrated: only Redis is missing
        "REDIS_URL": f"redis://:s3cret-pw@127.0.0.1:{closed_port}/0",
    }
    result = subprocess.run(
        [sys.executable, "manage.py", "runworker", "workflows"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    assert f"cannot reach Redis (REDIS_URL) at 127.0.0.1:{closed_port}" in result.stderr, (
        result.stderr
    )
    assert "Traceback" not in result.stderr, result.stderr
    assert "s3cret-pw" not in result.stderr, result.stderr


def manage(
    *args: str, timeout: float = 60, **env: str
) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env={**os.environ, "REDIS_URL": "", **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return result, time.monotonic() - started


def unreachable_postgresql() -> tuple[str, str]:
    """A DATABASE_URL nothing answers (with a password that must not be shown), and where."""
    port = free_port()
    return f"postgres://wf:db-s3cret@127.0.0.1:{port}/nowhere", f"127.0.0.1:{port}/nowhere"


@pytest.mark.parametrize(
    "command",
    [["migrate"], ["createsuperuser", "--noinput", "--username", "x", "--email", "x@x.x"]],
)
def test_shell_commands_on_an_unreachable_postgresql_fail_in_seconds_in_one_line(command):
    """migrate and createsuperuser waited the connection pool's 30 s, then printed a
    traceback that named neither the host nor the database; `wf` said where in seconds."""
    url, where = unreachable_postgresql()
    result, took = manage(*command, timeout=120, DATABASE_URL=url)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip() == (
        f"CommandError: cannot connect to the database (DATABASE_URL) at {where}: "
        f'connection failed: connection to server at "127.0.0.1", port {where.split(":")[1].split("/")[0]} failed: '
        "Connection refused"
    ), result.stderr
    assert took < 20, took


@pytest.mark.parametrize("reload", [["--noreload"], []], ids=["noreload", "autoreloader"])
def test_runserver_on_an_unreachable_postgresql_fails_in_seconds_in_one_line(reload):
    """runserver waited the connection pool's 30 s in Django's migration check, then
    ended with a traceback naming neither the host nor the database."""
    url, where = unreachable_postgresql()
    result, took = manage(
        "runserver", *reload, "127.0.0.1:0", timeout=120, DATABASE_URL=url, WFDASH_DEMO="0"
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().startswith(
        f"CommandError: cannot connect to the database (DATABASE_URL) at {where}: "
    ), result.stderr
    assert "Traceback" not in result.stderr and "db-s3cret" not in result.stderr
    assert took < 20, took


def store_other_release_of_order_approval() -> None:
    """The demo's order-approval version 1 as another release stored it (other code)."""
    from workflows_app.engine import clock
    from workflows_app.models import WorkflowVersion

    now = clock.now()
    WorkflowVersion.objects.create(
        name="order-approval",  # a demo workflow (WFDASH_DEMO=1) registers version 1
        version=1,
        source_hash="0" * 64,  # another release's code
        class_path="workflows_app.demo.workflows.OrderApproval",
        registered_at=now,
        last_seen_at=now,
    )


def test_a_worker_whose_code_changed_under_a_stored_version_exits_in_one_line():
    """A deploy that changed a workflow's code without bumping its version: runworker
    printed 'running', then 'stopped; exiting' and a 25-frame traceback of the engine's
    start-up, the refusal in its last line. runserver already said it as a CommandError."""
    store_other_release_of_order_approval()
    result, took = manage(
        "runworker", "workflows", DATABASE_URL=database_url(), WFDASH_DEMO="1", timeout=120
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().startswith(
        "CommandError: workflow 'order-approval' version 1 is already registered with "
        "different source code (stored hash 000000000000"
    ), result.stderr
    assert "Traceback" not in result.stderr and "running (concurrency" not in result.stderr
    assert took < 30, took


def test_daphne_whose_workflow_code_changed_under_a_stored_version_exits_in_one_line():
    """The README's production command, `daphne … wfdash.asgi:application`, with the
    embedded worker and a workflow whose code changed under a stored version: it served
    without the engine, saying so only at the first request, as a CRITICAL line and the
    engine's 25-frame traceback. runworker and runserver refuse it in one line, exit 1;
    daphne now does too, before it listens."""
    store_other_release_of_order_approval()
    port = free_port()
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "wfdash.settings",
        "DATABASE_URL": database_url(),
        "REDIS_URL": "",
        "WFDASH_EMBEDDED_WORKER": "1",
        "WFDASH_DEMO": "1",
    }
    daphne = [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port)]
    process = subprocess.Popen(
        [*daphne, "wfdash.asgi:application"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _, stderr = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        _, stderr = process.communicate(timeout=10)
        pytest.fail(f"daphne still serving after 60 s: {stderr[-2000:]}")
    assert process.returncode == 1, stderr
    assert stderr.strip().startswith(
        "wfdash: workflow 'order-approval' version 1 is already registered with "
        "different source code (stored hash 000000000000"
    ), stderr
    assert "Traceback" not in stderr and "Listening on" not in stderr, stderr


def test_the_embedded_worker_of_another_asgi_server_says_its_refusal_in_one_line(
    registered, caplog
):
    """Under an ASGI server other than daphne's command line (which now exits on it), the
    embedded worker refused by changed code logged its refusal as the engine's 25-frame
    traceback: one line now, the refusal's, as runworker and runserver say it."""
    import asyncio
    import logging

    from workflows_app import embedded
    from workflows_app.engine import WorkflowEntrypoint, register
    from workflows_app.engine import clock as engine_clock
    from workflows_app.engine.worker import Worker
    from workflows_app.models import WorkflowVersion

    @register("changed-under-asgi")
    class Changed(WorkflowEntrypoint):
        async def run(self, event, step):
            return 1

    now = engine_clock.now()
    WorkflowVersion.objects.create(
        name="changed-under-asgi",
        version=1,
        source_hash="0" * 64,
        class_path="elsewhere.Changed",
        registered_at=now,
        last_seen_at=now,
    )

    async def serve() -> None:
        await asyncio.wait_for(embedded._serve(Worker(), asyncio.Event()), 60)

    with caplog.at_level(logging.CRITICAL, logger="workflows_app.engine"):
        asyncio.run(serve())
    [said] = [r for r in caplog.records if r.levelno == logging.CRITICAL]
    assert said.getMessage().startswith(
        "embedded wfdash worker refused: workflow 'changed-under-asgi' version 1 is already "
        "registered with different source code"
    ), said.getMessage()
    assert said.exc_info is None


def test_a_worker_that_cannot_reach_postgresql_at_start_retries_then_exits_saying_where():
    """runworker's start-up tries each waited the pool's 30 s: a quarter of an hour of
    tracebacks and pool errors before it exited, SIGTERM unanswered meanwhile. It now
    tries again with backoff, one line each time, for WFDASH_START_WAIT_SECONDS, then
    exits 1 in one line (for systemd or Kubernetes to restart it)."""
    url, where = unreachable_postgresql()
    result, took = manage("runworker", "workflows", DATABASE_URL=url, WFDASH_START_WAIT_SECONDS="3")
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    *tries, last = lines
    assert tries and all(line.startswith("wfdash worker: ") for line in tries), lines
    assert tries[0].endswith("; trying again in 1 s"), lines
    assert last.startswith(
        f"CommandError: cannot connect to the database (DATABASE_URL) at {where}: "
    ), lines
    assert last.endswith("WFDASH_START_WAIT_SECONDS=3)"), lines
    assert "db-s3cret" not in result.stderr
    assert took < 30, took


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    ("server", "started"),
    [
        # The README's production command: daphne sets up the root logger's handler first.
        ("daphne", "embedded wfdash worker"),
        ("runserver", "embedded wfdash worker"),
        ("runworker", "running (concurrency"),
    ],
)
def test_each_engine_log_line_is_written_once(server, started):
    """Under daphne every engine line was written twice: by the wfdash logger's handler
    and by the handler daphne's command line gives the root logger, which it reached
    too. runserver and runworker wrote it once; so must each of the three."""
    port = free_port()
    command = {
        "daphne": ["-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "wfdash.asgi:application"],
        "runserver": ["manage.py", "runserver", "--noreload", f"127.0.0.1:{port}"],
        "runworker": ["manage.py", "runworker", "workflows"],
    }[server]
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "wfdash.settings",
        "DATABASE_URL": database_url(),
        "REDIS_URL": "",
        "WFDASH_EMBEDDED_WORKER": "1",
        "WFDASH_DEMO": "0",
        "PYTHONUNBUFFERED": "1",
    }
    log = tempfile.TemporaryFile(mode="w+")
    process = subprocess.Popen(
        [sys.executable, *command], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
    )

    def logged() -> str:
        log.seek(0)
        return log.read()

    try:
        if server != "runworker":  # daphne starts the embedded worker at the first request
            wait_until(lambda: answers_http(port), 60, f"{server} to answer")
        wait_until(lambda: started in logged(), 60, f"{server}'s engine to start")
        process.send_signal(signal.SIGTERM)
        process.wait(30)
        lines = [line for line in logged().splitlines() if started in line]
        assert len(lines) == 1, logged()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        log.close()


@needs_redis  # the worker reaches its metrics port once it has joined the workers' group
def test_a_worker_whose_metrics_port_is_taken_says_so_in_one_line():
    """Two workers on one host with the same WFDASH_METRICS_PORT: the second died with
    http.server's traceback ending in "OSError: [Errno 98] Address already in use", which
    named neither the setting nor the fix. Now one line says which port and what to do."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result, _ = manage(
            "runworker",
            "workflows",
            DATABASE_URL=database_url(),
            REDIS_URL=redis_url,
            WFDASH_METRICS_PORT=str(port),
        )
    assert result.returncode == 1, result.stderr
    assert f"cannot serve this worker's metrics at 127.0.0.1:{port}" in result.stderr
    assert "WFDASH_METRICS_PORT" in result.stderr
    assert "Traceback" not in result.stderr, result.stderr
