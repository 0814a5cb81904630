"""Every difference between SQLite and PostgreSQL the engine's store knows about.

SQLite has one writer at a time (a refused BEGIN IMMEDIATE is retried), wants naive UTC
text for datetimes in raw SQL and has no row locks; PostgreSQL takes JSON as jsonb, skips
rows other workers are claiming and may drop idle connections.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import datetime
from typing import Any

from django.db import InterfaceError, OperationalError, connection

LOCKED_RETRIES = 3


def retry_while_locked(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Retry a one-transaction write that SQLite refused with "database is locked".

    The refusal is definite (BEGIN IMMEDIATE did not get the lock, nothing was written),
    so trying again is safe; each try already waited the busy timeout. Inside a caller's
    transaction the error is the caller's to handle, as is any other database error.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        for attempt in range(LOCKED_RETRIES + 1):
            try:
                return fn(*args, **kwargs)
            except OperationalError as exc:
                retry = (
                    connection.vendor == "sqlite"
                    and "locked" in str(exc)
                    and not connection.in_atomic_block
                    and attempt < LOCKED_RETRIES
                )
                if not retry:
                    raise
        raise AssertionError("unreachable")

    return wrapper


def db_time(value: datetime | None) -> Any:
    """A datetime as this database's driver wants it in raw SQL (SQLite: naive UTC text)."""
    return connection.ops.adapt_datetimefield_value(value)


def json_placeholder() -> str:
    return "CAST(%s AS jsonb)" if connection.vendor == "postgresql" else "%s"


def transient(error: BaseException | None) -> bool:
    """No error, or one a new connection may not meet again (restart, dropped connection)."""
    return error is None or isinstance(error, (OperationalError, InterfaceError))


def skip_rows_being_claimed(query: Any) -> Any:
    """PostgreSQL: lock the rows a claim takes and skip those another worker is claiming.
    SQLite needs nothing: its IMMEDIATE transaction already serialises claimers."""
    if connection.features.has_select_for_update_skip_locked:
        return query.select_for_update(skip_locked=True, of=("self",))
    return query


def lock_rows(query: Any) -> Any:
    """Row locks where the database has them (SQLite locks the whole database instead)."""
    return query.select_for_update() if connection.features.has_select_for_update else query


def close_if_dropped() -> None:
    """PostgreSQL: a connection the server dropped while idle (a restart,
    pg_terminate_backend) would fail every write of a group commit; one round trip per
    group finds out first and the next statement reconnects."""
    if (
        connection.vendor == "postgresql"
        and connection.connection is not None
        and not connection.is_usable()
    ):
        connection.close()


def notifies_history() -> bool:
    """PostgreSQL: history inserts of watched instances NOTIFY (a trigger; migration 0007).
    SQLite has no cross-process notification: subscribers poll."""
    return connection.vendor == "postgresql"
