"""Every difference between SQLite and PostgreSQL the engine's store knows about.

SQLite has one writer at a time (a refused BEGIN IMMEDIATE is retried), wants naive UTC
text for datetimes in raw SQL and has no row locks; PostgreSQL takes JSON as jsonb, skips
rows other workers are claiming and may drop idle connections.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import psycopg
from django.conf import settings
from django.core.signals import setting_changed
from django.db import (
    DEFAULT_DB_ALIAS,
    DatabaseError,
    InterfaceError,
    OperationalError,
    connection,
    connections,
)
from django.db.backends.sqlite3.base import SQLiteCursorWrapper
from django.dispatch import receiver
from psycopg._queries import PostgresQuery, _query2pg_nocache
from psycopg.types.datetime import TimestamptzLoader

from .. import clock
from ..spans import instant

LOCKED_RETRIES = 3


def batch_json(value: Any, default: Callable[[Any], Any] | None = None) -> str | None:
    """JSON text of a batch of rows one statement parses (a group's ends, a flush of
    spans), by orjson: a fifth of the standard encoder's time on these many small dicts,
    which took a tenth of a herd of timers' CPU. A datetime is written as isoformat()
    writes it (RFC 3339), without a call back to Python. None where orjson refuses a value
    (an int past 64 bits, a lone surrogate): the caller's standard encoding says what it
    always said of it."""
    try:
        return orjson.dumps(value, default=default).decode()
    except orjson.JSONEncodeError:
        return None


def compact_json_of(value: Any, default: Callable[[Any], Any] | None = None) -> str:
    """batch_json, or the standard encoder's text where orjson refuses a value."""
    text = batch_json(value, default)
    return text if text is not None else json.dumps(value, separators=(",", ":"), default=default)


def retry_while_locked(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Retry a one-transaction write that SQLite refused with "database is locked", or
    that PostgreSQL rolled back to break a deadlock.

    Either refusal is definite (SQLite's BEGIN IMMEDIATE did not get the lock; PostgreSQL
    rolled the whole transaction back), so trying again is safe; each SQLite try already
    waited the busy timeout. A deadlock comes from two writers taking the same locks in
    opposite orders (a debounced create takes the workflow's admission lock, then the
    pending instance's row; a resume of that instance, the other way round). Inside a
    caller's transaction the error is the caller's to handle, as is any other error.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        for attempt in range(LOCKED_RETRIES + 1):
            try:
                return fn(*args, **kwargs)
            except OperationalError as exc:
                retry = (
                    _refused_whole(exc)
                    and not connection.in_atomic_block
                    and attempt < LOCKED_RETRIES
                )
                if not retry:
                    raise
        raise AssertionError("unreachable")

    return wrapper


DEADLOCK_DETECTED = "40P01"  # PostgreSQL's SQLSTATE


def _refused_whole(exc: OperationalError) -> bool:
    if connection.vendor == "sqlite":
        return "locked" in str(exc)
    return getattr(exc.__cause__, "sqlstate", None) == DEADLOCK_DETECTED


def db_time(value: datetime | None, db: Any = None) -> Any:
    """A datetime as this database's driver wants it in raw SQL (SQLite: naive UTC text).
    An aware UTC one on SQLite in UTC (the engine's clock and loads give those) is written
    as Django writes it, without the look-ups of the connection and settings on the way
    (4.6 against 1.7 µs; a checkpoint writes three). db: the connection (default: the
    engine's, through Django's proxy)."""
    if value is None:
        return None  # NULL on every backend
    if value.tzinfo is UTC and writes_utc_text():
        return value.isoformat(" ")[:-6]  # str() of the naive UTC datetime, "+00:00" cut
    if db is None and passes_datetimes():
        return value  # PostgreSQL's driver takes the datetime (Django's adapt returns it)
    return (connection if db is None else db).ops.adapt_datetimefield_value(value)


@functools.cache
def writes_utc_text() -> bool:
    """utc_text_times of the engine's database (made once; see _settings_changed)."""
    return utc_text_times(connections[DEFAULT_DB_ALIAS])


@functools.cache
def passes_datetimes() -> bool:
    """The engine's database takes datetimes as they are (PostgreSQL): db_time skips the
    connection proxy's look-up, three a checkpoint (made once; see _settings_changed)."""
    return connections[DEFAULT_DB_ALIAS].vendor == "postgresql"


@receiver(setting_changed)
def _settings_changed(setting: str, **_: Any) -> None:
    if setting in ("DATABASES", "TIME_ZONE", "USE_TZ"):
        writes_utc_text.cache_clear()
        passes_datetimes.cache_clear()


NAIVE_EPOCH = datetime(1970, 1, 1)


def ns_time_adapter(db: Any) -> Callable[[int], Any]:
    """An OpenTelemetry time (integer nanoseconds since the epoch) as this connection's
    raw SQL wants a datetime, to the microsecond below, for many values at once (span
    storage). SQLite in UTC (the default, which from_db_time assumes too): the naive UTC
    text Django would store, with no aware datetime made and converted (those were a
    quarter of a span row's cost in a herd of timers)."""
    if utc_text_times(db):
        return utc_text_maker()
    adapt = db.ops.adapt_datetimefield_value
    return lambda ns: adapt(instant(ns))


def utc_text_maker() -> Callable[[int], str]:
    """ns_time_adapter's SQLite text: a flush's spans share few seconds, so each second's
    text is made once (a span row's two times were a fifth of its cost in a herd)."""
    seconds_text: dict[int, str] = {}

    def utc_text(ns: int) -> str:
        seconds, micro = divmod(ns // 1000, 1_000_000)
        head = seconds_text.get(seconds)
        if head is None:
            head = seconds_text[seconds] = str(NAIVE_EPOCH + timedelta(seconds=seconds))
        return f"{head}.{micro:06d}" if micro else head

    return utc_text


def utc_text_times(db: Any) -> bool:
    """SQLite in UTC (the default): datetime columns hold naive UTC text, which
    from_db_time reads and ns_time_adapter writes without Django's conversions."""
    return db.vendor == "sqlite" and str(db.timezone) == "UTC"


def from_db_time(value: Any) -> datetime | None:
    """A datetime column read by raw SQL, aware as the ORM gives it (SQLite's driver
    returns naive UTC; PostgreSQL's an aware one)."""
    if isinstance(value, str):
        if value[-6:-5] not in ("+", "-"):
            # Naive UTC text: parsed with its offset in one call (replace() costs as much).
            return datetime.fromisoformat(value + "+00:00")
        value = datetime.fromisoformat(value)
    if value is not None and value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value


def array_literal(values: Iterable[int | str]) -> str:
    """A PostgreSQL array literal ('{1,2,3}'), bound as one text parameter and cast in the
    SQL: psycopg dumps a list parameter element by element in Python. Only for values
    that need no quoting (ids, hex tokens)."""
    return "{" + ",".join(map(str, values)) + "}"


def json_placeholder() -> str:
    return "CAST(%s AS jsonb)" if connection.vendor == "postgresql" else "%s"


def statement_cursor() -> Any:
    """A cursor for the engine's hot statements (checkpoint, finish, claim and its reads,
    next timer, create, send_event, span storage).

    PostgreSQL: the parameters are bound on the server and each statement is prepared on
    its connection at first use, so it is parsed and planned once per connection rather
    than on every call. Every such statement touches the instance table, whose planning
    costs 0.4-2 ms with its indexes: prepared, 10,000 timers took 36.9 s instead of 45.5 s
    (docs/performance.md, fourth round). Django's own cursors keep client-side binding
    (some ORM queries need it). Off with WFDASH_PG_PREPARE=0, for a pooler that cannot
    keep prepared statements (PgBouncer before 1.21 in transaction mode). SQLite: Django's
    cursor (its statements are cached by the driver already).
    """
    # With queries logged (DEBUG, CaptureQueriesContext) Django's cursor, whose log shows
    # the SQL: a prepared statement's text is not kept by psycopg once it is prepared.
    db = connections[DEFAULT_DB_ALIAS]  # once: each `connection.x` is a look-up of its own
    if db.vendor != "postgresql" or not prepares_statements() or db.queries_logged:
        return sql_cursor(db)
    db.ensure_connection()
    conn = db.connection
    if conn.prepare_threshold is None:  # Django turns preparing off; on, by request only
        conn.prepare_threshold = ONLY_WHEN_ASKED
    if conn not in _GENERIC_PLANS and conn.autocommit and conn.info.transaction_status == IDLE:
        # The plan made once is kept: without this the server may plan a statement anew on
        # every call whenever its generic plan looks dearer than the plans made for the
        # values at hand. Once the tables had statistics the claim was planned on every
        # call (0.49 ms, a tenth of an event's latency). Only prepared statements (the
        # engine's) are concerned; Django's are not prepared.
        conn.execute("SET plan_cache_mode = force_generic_plan")
        _GENERIC_PLANS.add(conn)
    return db.make_cursor(PreparingCursor(conn))


# Connections whose session keeps generic plans (statement_cursor).
_GENERIC_PLANS: weakref.WeakSet[Any] = weakref.WeakSet()
IDLE = psycopg.pq.TransactionStatus.IDLE


def sql_cursor(db: Any = None) -> Any:
    """Django's cursor, for the store's raw SQL. SQLite: its `%s` to `?` conversion is
    cached per statement text; Django runs a regular expression over the whole statement
    on every execute, a sixth of the engine's database thread per step (the checkpoint's
    upsert alone is 600 characters). With queries logged, Django's own debug cursor.
    db: the default connection, when the caller has it already."""
    db = db or connections[DEFAULT_DB_ALIAS]
    if db.vendor != "sqlite" or db.queries_logged:
        return db.cursor()
    db.ensure_connection()
    return db.make_cursor(db.connection.cursor(factory=QmarkCachingCursor))


class QmarkCachingCursor(SQLiteCursorWrapper):
    """Django's SQLite cursor with its format-to-qmark conversion cached (sql_cursor)."""

    def convert_query(self, query: str, *, param_names: Any = None) -> str:
        if param_names is not None:
            return super().convert_query(query, param_names=param_names)
        return cached(
            _QMARK_QUERIES, query, lambda: super(QmarkCachingCursor, self).convert_query(query)
        )


# Statement text -> its qmark form.
_QMARK_QUERIES: dict[str, str] = {}
MAX_CACHED_STATEMENTS = 1000


def cached(cache: dict[Any, Any], key: Any, convert: Callable[[], Any]) -> Any:
    """A statement's conversion from a bounded cache (a dict read and write are atomic
    under the GIL); statements of many shapes only start it over."""
    converted = cache.get(key)
    if converted is None:
        if len(cache) >= MAX_CACHED_STATEMENTS:
            cache.clear()
        converted = cache[key] = convert()
    return converted


# A count of executions psycopg would never reach: only statement_cursor's statements,
# which ask, are prepared (Django's client-side cursors cannot be).
ONLY_WHEN_ASKED = 2**62


class ConvertOnceQuery(PostgresQuery):
    """psycopg's query conversion (`%s` to `$1`, by a regular expression over the whole
    text) cached per statement text for the engine's statements, whatever their length
    and parameter count: psycopg caches only those under 4,096 bytes and 50 parameters,
    and the finish, the claim and span storage are over (a fifth of the database
    thread's time in a herd of timers). The statements come in a few shapes each."""

    def convert(self, query: Any, vars: Any) -> None:
        if vars is None or not isinstance(query, str):
            return super().convert(query, vars)
        encoding = self._tx.encoding
        self.query, self._want_formats, self._order, self._parts = cached(
            _PG_QUERIES,
            (query, encoding),
            lambda: _query2pg_nocache(query.encode(encoding), encoding),
        )
        self.dump(vars)


# (statement text, encoding) -> psycopg's conversion of it (ConvertOnceQuery).
_PG_QUERIES: dict[tuple[str, str], Any] = {}


class PreparingCursor(psycopg.Cursor):
    """Server-side binding, every statement prepared on its connection (statement_cursor),
    its conversion cached (ConvertOnceQuery)."""

    _query_cls = ConvertOnceQuery

    def __init__(self, connection: Any) -> None:
        super().__init__(connection)
        # psycopg's own loader, which it swaps for its C one: Django's (a Python subclass,
        # for the time zone) parsed each timestamp in Python, 4 us against 0.3 (a claim
        # loads a dozen per instance). The session's zone is UTC: the same datetimes.
        self.adapters.register_loader("timestamptz", TimestamptzLoader)

    def execute(self, query: Any, params: Any = None, **options: Any) -> Any:
        return super().execute(query, params, **{**options, "prepare": True})


@contextlib.contextmanager
def pipeline() -> Iterator[None]:
    """psycopg's pipeline mode on Django's connection, its errors raised as Django's: the
    pipeline's exit sends and reads the statements outside any cursor's error wrapper, and
    a driver error is neither a DatabaseError the runs retry nor one the worker releases
    the lease for (a terminated backend then left instances leased until their leases ran
    out)."""
    connection.ensure_connection()
    with connection.wrap_database_errors, connection.connection.pipeline():
        yield


def prepares_statements() -> bool:
    return bool(getattr(settings, "WFDASH", {}).get("PG_PREPARE", True))


def writes_in_one_statement() -> bool:
    """PostgreSQL runs data-modifying CTEs: a checkpoint's fence, step upsert, history and
    error rows go as one autocommit statement, one round trip instead of five (BEGIN,
    three statements, COMMIT). SQLite has no such CTEs, and its round trips cost nothing."""
    return connection.vendor == "postgresql"


def column_types(model: Any, columns: Sequence[str]) -> list[tuple[str, str]]:
    """(column, its database type) for these columns of a model's table."""
    fields = {f.column: f for f in model._meta.concrete_fields}
    return [(c, fields[c].db_type(connection)) for c in columns]


def typed_placeholders(model: Any, columns: Sequence[str]) -> list[str]:
    """`CAST(%s AS <column type>)` per column: a value selected (not VALUES-inserted) into
    a table has no type of its own, and a NULL or a text literal must not stay text."""
    return [f"CAST(%s AS {kind})" for _, kind in column_types(model, columns)]


def recordset_columns(model: Any, columns: Sequence[str]) -> str:
    """The column definition list of json_to_recordset for these columns of a model's
    table: each as its column's type."""
    return ", ".join(f"{c} {kind}" for c, kind in column_types(model, columns))


def transient(error: BaseException | None) -> bool:
    """No error, or one a new connection may not meet again (restart, dropped connection)."""
    return error is None or isinstance(error, (OperationalError, InterfaceError))


def skip_rows_being_claimed(query: Any) -> Any:
    """PostgreSQL: lock the rows a claim takes and skip those another worker is claiming.
    SQLite needs nothing: its IMMEDIATE transaction already serialises claimers."""
    if connection.features.has_select_for_update_skip_locked:
        return query.select_for_update(skip_locked=True, of=("self",), no_key=True)
    return query


# Namespace of the advisory locks admission takes (PostgreSQL), beside hashtext(workflow).
ADMISSION_LOCK_SPACE = 0x7F10


def lock_admission(workflow: str) -> None:
    """Serialise the admission decisions of one workflow until the transaction ends.

    PostgreSQL: an advisory transaction lock on the workflow's name, so two processes can
    never both see the same free place (it needs no catalog row, unlike a row lock).
    SQLite needs nothing: its IMMEDIATE transactions already run one at a time.
    """
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_advisory_xact_lock(%s, hashtext(%s))", [ADMISSION_LOCK_SPACE, workflow]
            )


def lock_rows(query: Any) -> Any:
    """Row locks where the database has them (SQLite locks the whole database instead).

    FOR NO KEY UPDATE, like every row lock of the store: the engine never changes an
    instance's key, and the stronger FOR UPDATE would block (and deadlock with) the
    FOR KEY SHARE locks that foreign-key checks of concurrent inserts take at commit
    (a history or span row of the same instance)."""
    return (
        query.select_for_update(no_key=True) if connection.features.has_select_for_update else query
    )


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


CLOCK_OFFSET_MAX_AGE = 60.0  # seconds between measurements of the clock offset
# The most a host's clock may gain on the database's per second between measurements: the
# kernel lets NTP slew a clock's rate by at most 500 ppm.
CLOCK_MAX_DRIFT = 500e-6


def measure_clock_offset(force: bool = False) -> None:
    """PostgreSQL: set the real clock's offset from the database's clock (see RealClock).

    One round trip, at most once a minute unless forced. The database read its clock at
    some moment of the round trip, so the true offset lies between its time less the
    host's time after the answer (the lower bound) and its time less the host's time
    before the request. The offset is the largest lower bound known: the clock never runs
    ahead of the database's (a timer due by it is due by the database's clock; a midpoint
    guess ran ahead by half a lopsided round trip). A kept bound is aged by the most the
    host's clock can have gained since, and dropped when the new measurement shows it
    ahead (the host's clock was stepped), so a noisy measurement's looser bound never
    moves the clock back by its round trip (an instance made due a moment ago stays due).
    """
    real = clock.get_clock()
    if connection.vendor != "postgresql" or not isinstance(real, clock.RealClock):
        return
    fresh = (
        real.measured_at is not None and time.monotonic() - real.measured_at < CLOCK_OFFSET_MAX_AGE
    )
    if fresh and not force:
        return
    real.measured_at = time.monotonic()  # first: a failure does not retry on every connect
    before = real.host_now()
    with connection.cursor() as cursor:
        cursor.execute("SELECT clock_timestamp()")
        (database_now,) = cursor.fetchone()
    after = real.host_now()
    lower, upper = database_now - after, database_now - before
    bound = lower
    if real.offset_at is not None:
        drift = timedelta(seconds=CLOCK_MAX_DRIFT * (time.monotonic() - real.offset_at))
        aged = real.offset - drift
        if lower < aged <= upper:
            bound = aged
    real.offset = bound
    real.offset_at = time.monotonic()


def measure_clock_offset_on_connect(sender: Any, connection: Any, **kwargs: Any) -> None:
    """connection_created receiver: keeps every process's clock offset under a minute old
    (web processes write wake times too: an event sent makes its instance due "now")."""
    if connection.alias == "default" and connection.vendor == "postgresql":
        try:
            measure_clock_offset()
        except DatabaseError:
            logging.getLogger("workflows_app.engine").warning(
                "could not read the database's clock", exc_info=True
            )


def merge_json_sql(column: str) -> str:
    """SQL of `column` with the keys of a JSON object parameter set (an upsert of keys)."""
    if connection.vendor == "postgresql":
        return f"{column} || CAST(%s AS jsonb)"
    return f"json_patch({column}, %s)"


def notifies_history() -> bool:
    """PostgreSQL: history inserts of watched instances NOTIFY (a trigger; migration 0007).
    SQLite has no cross-process notification: subscribers poll."""
    return connection.vendor == "postgresql"
