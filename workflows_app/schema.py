"""Whether the database has the code's schema: an engine started before `migrate` fails
every statement, every poll interval, with a traceback that does not say to migrate."""

from __future__ import annotations

from django.db import DatabaseError, connections
from django.db.migrations.executor import MigrationExecutor

CONNECT_SECONDS = 5  # a command run from a shell gives up on the database after this


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
