"""Whether the database has the code's schema: an engine started before `migrate` fails
every statement, every poll interval, with a traceback that does not say to migrate."""

from __future__ import annotations

from django.db import DatabaseError, connections
from django.db.migrations.executor import MigrationExecutor


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
