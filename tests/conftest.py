from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.workers import WorkerProcess
from workflows_app import testing
from workflows_app.engine import clock, registry


def pytest_report_header(config: pytest.Config) -> str:
    from django.conf import settings

    return f"wfdash database: {settings.DATABASES['default']['ENGINE']}"


@pytest.fixture(autouse=True)
def _clean_engine() -> Iterator[None]:
    from django.core.cache import cache

    testing.reset()
    cache.clear()  # API token throttling counts (each process's own memory)
    yield
    testing.reset()
    clock.set_clock(clock.RealClock())


@pytest.fixture(scope="session", autouse=True)
def _close_every_connection_before_the_test_database_is_dropped(
    django_db_setup: None,
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

    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
