"""Whether the database has the code's schema: an engine started before `migrate` fails
every statement, every poll interval, with a traceback that does not say to migrate. And
the start-up checks of runworker, runserver and daphne, tried again when the server drops
their connection (begin_again_on_dropped_connection)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from django.db import DatabaseError, InterfaceError, OperationalError, connections
from django.db.migrations.executor import MigrationExecutor

log = logging.getLogger("workflows_app.engine")
CONNECT_SECONDS = 5  # a command run from a shell gives up on the database after this
START_CHECK_TRIES = 5  # start-up checks begun again after a dropped connection, at most
T = TypeVar("T")


def unreachable_database(using: str = "default", seconds: int = CONNECT_SECONDS) -> str | None:
    """For a command run from a shell: None if PostgreSQL takes a new connection within
    `seconds`, else one line saying where the database is (host, port and name, never the
    password) and why no connection could be made. The process's own connections come
    from psycopg's pool, whose wait for one (30 s, for a busy pool) is spent in full when
    the server is down, the address wrong or blackholed: a user at a prompt waited a
    minute for the error. Workers and servers keep the pool's patience."""
    connection = connections[using]
    if connection.vendor != "postgresql":
        return None
    params = {**connection.get_connection_params(), "connect_timeout": seconds}
    try:
        connection.Database.connect(**params).close()
    except connection.Database.Error as exc:
        where = connection.settings_dict
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        return (
            f"cannot connect to the database (DATABASE_URL) at {where['HOST'] or 'localhost'}:"
            f"{where['PORT'] or 5432}/{where['NAME']}: {lines[0].strip()}"
        )
    return None


# Django's commands an operator runs from a shell or a deploy job that open the database at
# once: refused in seconds by refuse_unreachable_database (manage.py) when it cannot be
# reached, instead of after the pool's 30 s wait and a traceback. Servers and workers have
# their own answer (runworker waits with backoff, then exits; daphne serves and retries).
SHELL_DATABASE_COMMANDS = frozenset(
    {
        "changepassword",
        "clearsessions",
        "createcachetable",
        "createsuperuser",
        "dumpdata",
        "flush",
        "inspectdb",
        "loaddata",
        "migrate",
        "remove_stale_contenttypes",
        "showmigrations",
        "sqlflush",
        "sqlmigrate",
        "sqlsequencereset",
    }
)


def refuse_unreachable_database(argv: list[str]) -> None:
    """manage.py's look before one of SHELL_DATABASE_COMMANDS: an unreachable PostgreSQL
    ends the process with the one line `wf` gives (where it looked and why), exit 1."""
    import sys

    import django
    from django.core.management.base import CommandError

    if len(argv) < 2 or argv[1] not in SHELL_DATABASE_COMMANDS:
        return
    if any(arg in ("-h", "--help") for arg in argv[2:]):
        return
    django.setup()
    problem = unreachable_database(_database_option(argv[2:]))
    if problem:
        sys.stderr.write(f"{CommandError.__name__}: {problem}\n")
        sys.exit(1)


def _database_option(args: list[str]) -> str:
    """The alias a command's --database names (default: "default")."""
    for i, arg in enumerate(args):
        if arg.startswith("--database="):
            return arg.split("=", 1)[1]
        if arg == "--database" and i + 1 < len(args):
            return args[i + 1]
    return "default"


def unapplied_migrations(using: str = "default") -> list[str] | None:
    """The migrations `manage.py migrate` would apply; None if the database cannot be
    asked (down, restarting: the engine's own start-up retries outlive that)."""
    try:
        executor = MigrationExecutor(connections[using])
        plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
    except DatabaseError:
        return None
    finally:
        connections[using].close()  # this thread's connection: the engine uses its own
    return [f"{migration.app_label}.{migration.name}" for migration, _ in plan]


def not_migrated_message(pending: list[str], before: str = "starting the wfdash engine") -> str:
    shown = ", ".join(pending[:3]) + (", …" if len(pending) > 3 else "")
    return (
        f"the database has {len(pending)} unapplied migration(s) ({shown}): run "
        f"`python manage.py migrate` before {before}"
    )


def begin_again_on_dropped_connection(checks: Callable[[], T], who: str) -> T:
    """checks(), a server's or worker's start-up checks (the database reachable, migrated,
    no workflow's code changed under a stored version), begun again on a new connection
    when the server drops theirs (a restart, a failover, pg_terminate_backend): one warning
    line a time, up to START_CHECK_TRIES, then a CommandError saying so. runworker exited
    1 on the traceback when a fleet's backends were ended as it started; daphne and
    runserver took the dropped connection for a database that could not say yet and
    served a workflow whose code had changed under a stored version, without its engine.
    `who` names the process in those lines ("wfdash worker")."""
    from django.core.management.base import CommandError

    from workflows_app.engine import faults
    from workflows_app.text import first_line

    attempt = 0
    while True:
        attempt += 1
        try:
            faults.hit("start_checks")
            return checks()
        except (OperationalError, InterfaceError) as exc:
            close_dropped_connection()
            problem = first_line(exc)
            if attempt == START_CHECK_TRIES:
                raise CommandError(
                    f"the database dropped the connection {attempt} times during the "
                    f"{who}'s start-up checks: {problem}"
                ) from None
            log.warning(
                "%s: the database dropped the connection during the start-up checks (%s); "
                "trying again",
                who,
                problem,
            )
            time.sleep(0.5 * attempt)


class _ThisThreadsDiscard(logging.Filter):
    """psycopg's pool line for a broken connection given back by this thread."""

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.thread == self.thread
            and str(record.msg).startswith("discarding closed connection")
        )


def close_dropped_connection() -> None:
    """Close this thread's connection the server ended, without psycopg's pool line for
    it ("discarding closed connection: <psycopg.Connection [BAD] at 0x…>", on stderr
    beside the start-up checks' own line, which says what happened)."""
    pool_log = logging.getLogger("psycopg.pool")
    quiet = _ThisThreadsDiscard()
    pool_log.addFilter(quiet)
    try:
        connections["default"].close()
    finally:
        pool_log.removeFilter(quiet)
