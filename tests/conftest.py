from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings

from tests.workers import WorkerProcess
from workflows_app import testing
from workflows_app.engine import clock, registry

# Property tests run the same examples on every run and machine (derandomized, no example
# database), few enough to stay fast on both databases; no deadline: a run through the
# database takes what it takes. Fixtures are set up once per test, not per example: the
# properties are written for that. HYPOTHESIS_PROFILE=wfdash-long searches longer, locally.
hypothesis_settings.register_profile(
    "wfdash",
    derandomize=True,
    database=None,
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
hypothesis_settings.register_profile(
    "wfdash-long", hypothesis_settings.get_profile("wfdash"), max_examples=500
)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "wfdash"))


def pytest_report_header(config: pytest.Config) -> str:
    from django.conf import settings

    return f"wfdash database: {settings.DATABASES['default']['ENGINE']}"


@pytest.fixture(autouse=True)
def _clean_engine() -> Iterator[None]:
    from django.core.cache import cache

    from workflows_app import socket_slots

    testing.reset()
    cache.clear()  # API token throttling counts (each process's own memory)
    socket_slots.forget_connects()  # dashboard sockets' connect rates, by user pk
    yield
    testing.reset()
    clock.set_clock(clock.RealClock())


@pytest.fixture(scope="session", autouse=True)
def _close_every_connection_before_the_test_database_is_dropped(
    django_db_setup: None, django_db_blocker: Any
) -> Iterator[None]:
    """Async tests run sync code in asgiref's one shared thread, also while their event
    loop closes, and the engine's threads borrow from psycopg's pool: connections they
    hold or gave back to the pool at the end stop PostgreSQL from dropping the test
    database ("being accessed by other users"). Runs before that drop."""
    yield
    from asgiref.sync import SyncToAsync
    from django.db import connections

    from workflows_app.engine.store.subscriptions import history_listener

    history_listener.stop()  # its LISTEN connection is on the test database too

    from workflows_app import fanout

    fanout.close_reader_connections()  # the dashboard hub's reader keeps its connection
    if SyncToAsync.single_thread_executor._threads:
        SyncToAsync.single_thread_executor.submit(connections.close_all).result(10)
    connections.close_all()
    for conn in connections.all():
        if getattr(conn, "pool", None) is not None:
            conn.close_pool()
    with django_db_blocker.unblock():
        leaks = _connections_left_open()
    if leaks:
        pytest.fail(
            "connections to the test database were left open at the end of the session "
            "(PostgreSQL refuses to drop a database in use); each is closed now:\n"
            + "\n".join(leaks),
            pytrace=False,
        )


class _Holders:
    """Who took each PostgreSQL connection last (a connection taken from psycopg's pool or
    opened anew), for the session-end check. The connection is kept referenced here: one
    a thread ended holding, never given back, would otherwise be closed whenever the
    garbage collector reached it, so whether the test database could be dropped depended
    on test order."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holders: dict[Any, tuple[str, str, traceback.StackSummary]] = {}
        self.test = "(no test: collection or a session fixture)"

    def taken(self, sender: Any, connection: Any, **kwargs: Any) -> None:
        if connection.vendor != "postgresql":
            return
        stack = traceback.StackSummary.extract(
            traceback.walk_stack(sys._getframe(1)), lookup_lines=False
        )
        holder = (threading.current_thread().name, self.test, stack)
        with self.lock:
            self.holders[connection.connection] = holder
            if len(self.holders) > 1000:  # forget those closed since (given back ones stay)
                self.holders = {c: h for c, h in self.holders.items() if not c.closed}

    def left_open(self) -> list[tuple[Any, str, str, traceback.StackSummary]]:
        with self.lock:
            return [(c, *h) for c, h in self.holders.items() if not c.closed]


_holders = _Holders()


def _where(stack: traceback.StackSummary) -> str:
    """Where a connection was taken (innermost last): the frames outside site-packages
    (the test's, the project's, a thread's start), then the first three library calls
    the innermost of them made (a test client's request, say)."""
    frames = list(reversed(stack))
    outside = [i for i, f in enumerate(frames) if "/site-packages/" not in f.filename]
    shown = [frames[i] for i in outside[-8:]] + frames[outside[-1] + 1 : outside[-1] + 4]
    return "".join(f"      {f.filename}:{f.lineno} in {f.name}\n" for f in shown)


def _local_tcp_ports() -> set[int]:
    """The local ports of this process's TCP sockets (Linux; none known elsewhere)."""
    try:
        links = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")]
        inodes = {link[len("socket:[") : -1] for link in links if link.startswith("socket:[")}
        ports = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as lines:
                for line in list(lines)[1:]:
                    fields = line.split()
                    if fields[9] in inodes:
                        ports.add(int(fields[1].rsplit(":", 1)[1], 16))
        return ports
    except OSError:
        return set()


def _connections_left_open() -> list[str]:
    """Each connection to the test database still open once every connection the session
    knows of is closed, named by its origin, then closed: this process's by the thread and
    test that took it last (and where), another process's (a worker or server a test did
    not stop) as PostgreSQL sees it."""
    from django.db import connection

    if connection.vendor != "postgresql":
        return []
    leaks, ours = [], set()
    for conn, thread, test, stack in _holders.left_open():
        ours.add(conn.info.backend_pid)
        leaks.append(
            f"  - backend {conn.info.backend_pid}, taken by thread {thread!r} in {test}, at\n"
            f"{_where(stack)}"
        )
        conn.close()
    with connection._nodb_cursor() as cursor:
        # Those of processes just stopped may take a moment to go: DROP DATABASE itself
        # waits up to 5 s for other sessions to end before it refuses.
        for _ in range(50):
            cursor.execute(
                "SELECT pid, application_name, client_port, backend_start, state, query "
                "FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                [connection.settings_dict["NAME"]],
            )
            others = [row for row in cursor.fetchall() if row[0] not in ours]
            if not others:
                break
            time.sleep(0.1)
        mine = _local_tcp_ports()
        for pid, application, port, started, state, query in others:
            whose = (
                "of this process, not opened through Django (a LISTEN connection, a "
                "psycopg.connect?)"
                if port in mine
                else "of another process (a worker, daphne or runserver left running?)"
            )
            leaks.append(
                f"  - backend {pid} {whose}: client port {port}, application "
                f"{application!r}, since {started:%H:%M:%S}, {state}; last query "
                f"{(query or '')[:200]!r}"
            )
            cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
    return leaks


@pytest.fixture
def registered() -> Iterator[list[str]]:
    """Names registered by a test are unregistered after it (the registry is process-wide)."""
    before = {d.name for d in registry.all_definitions()}
    names: list[str] = []
    yield names
    for definition in registry.all_definitions():
        if definition.name not in before:
            registry.unregister(definition.name)


@pytest.fixture
def workers() -> Iterator[Callable[..., list[WorkerProcess]]]:
    """Start real `runworker workflows` processes on the test database; stopped after the test."""
    started: list[WorkerProcess] = []

    def start(count: int = 1, **env: str) -> list[WorkerProcess]:
        new = [WorkerProcess(env=env) for _ in range(count)]
        started.extend(new)
        return new

    yield start
    for worker in started:
        log = worker.stop()
        if log.strip():  # shown by pytest when the test fails
            print(f"--- worker {worker.pid} (exit {worker.process.returncode}) logged:\n{log}")


def pytest_configure(config: pytest.Config) -> None:
    """Tests create users by the hundred: a fast hasher instead of a million PBKDF2
    rounds each (the subprocesses the tests start keep the project's real hashers)."""
    from django.conf import settings
    from django.db.backends.signals import connection_created

    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    connection_created.connect(_holders.taken, dispatch_uid="tests-connection-holders")
    if settings.DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
        from django.db.backends.postgresql.operations import DatabaseOperations

        truncate = DatabaseOperations.sql_flush

        def sql_flush(ops: Any, style: Any, tables: list[str], **kwargs: Any) -> list[str]:
            return _flush_small_tables_by_delete(truncate, ops, style, tables, **kwargs)

        DatabaseOperations.sql_flush = sql_flush


# An engine table of at most this many pages (64 KB) is emptied by DELETE after a test.
SMALL_TABLE_PAGES = 8


def _flush_small_tables_by_delete(
    truncate: Callable[..., list[str]],
    ops: Any,
    style: Any,
    tables: list[str],
    *,
    reset_sequences: bool = False,
    **kwargs: Any,
) -> list[str]:
    """PostgreSQL: how pytest-django's flush empties the tables after each transactional
    test. Django TRUNCATEs every table, and a transaction that truncates must wait for its
    commit to reach the disk: 0.3-1.5 s per test here (1 s and more once other databases
    share the server), over a thousand times on the PostgreSQL leg. When every table is
    small, DELETE empties them in about 10 ms (the foreign keys are deferred, so any order
    holds) and empty ones are left alone. When a test filled one of wfdash's tables beyond
    SMALL_TABLE_PAGES, all are truncated as before, so the next test starts without its
    dead pages (what the plan and table-growth tests look at)."""
    full = truncate(ops, style, tables, reset_sequences=reset_sequences, **kwargs)
    if reset_sequences or not tables:
        return full
    with ops.connection.cursor() as cursor:
        cursor.execute(
            "SELECT relname, pg_relation_size(oid) / current_setting('block_size')::int "
            "FROM pg_class WHERE oid = ANY(CAST(%s AS regclass[]))",
            ["{" + ",".join(ops.quote_name(table) for table in tables) + "}"],
        )
        pages = dict(cursor.fetchall())
    if any(
        size > SMALL_TABLE_PAGES
        for table, size in pages.items()
        if table.startswith("workflows_app_")  # not auth_permission's rows made anew each time
    ):
        return full
    return [f"DELETE FROM {ops.quote_name(table)};" for table in tables if pages.get(table)]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    _holders.test = item.nodeid
    try:
        return (yield)
    finally:
        _holders.test = "(after the last test: session teardown)"
