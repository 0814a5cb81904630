"""PostgreSQL: the engine's kept plans follow its tables' growth.

The engine's statements are prepared once per connection and keep their generic plan
(dialect.statement_cursor). The server re-plans them only when a table is analyzed again,
and a plan made while a table was nearly empty (a new database, a quiet one before a
burst) reads it whole: the claim scanned the instance table instead of its runnable
index until autovacuum's next analysis, a minute or more later. A worker started on a new
database then woke a herd of 10,000 timers in 57-65 s instead of 6-7 s
(docs/performance.md, thirteenth round). Workers look every PLAN_CHECK_SECONDS and
analyze a hot table that grew fourfold since its last analysis; the analysis makes every
connection re-plan what touches that table.
"""

from __future__ import annotations

import logging

from django.db import DatabaseError, connection, transaction

from .records import HISTORY_TABLE, INBOX_TABLE, INSTANCE_TABLE, STEP_TABLE

log = logging.getLogger("workflows_app.engine")

HOT_TABLES = (INSTANCE_TABLE, STEP_TABLE, HISTORY_TABLE, INBOX_TABLE)
GROWN_PAGES = 16  # 128 KB: below it a whole-table read costs little
GROWTH = 4  # analyzed again once this many times the pages of the last analysis
PLAN_CHECK_SECONDS = 2.0
LOCK_TIMEOUT = "1s"  # an analysis already running (autovacuum's) is not waited for long

# table -> its pages when this process last asked to analyze it: an analysis the server
# skipped (the role does not own the table) is not asked for again until it grows further.
_asked_at_pages: dict[str, int] = {}


def analyze_grown_tables() -> list[str]:
    """ANALYZE each hot table past GROWN_PAGES that has GROWTH times the pages it had when
    last analyzed (or was never analyzed). One catalog read when none has; returns the
    tables analyzed. SQLite plans each statement as it comes: nothing to do."""
    if connection.vendor != "postgresql":
        return []
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT relname, GREATEST(relpages, 0), "
            "pg_relation_size(oid) / current_setting('block_size')::int "
            "FROM pg_class WHERE oid = ANY(CAST(%s AS regclass[]))",
            ["{" + ",".join(HOT_TABLES) + "}"],
        )
        sizes = cursor.fetchall()
    grown = []
    for name, analyzed_pages, pages in sizes:
        asked = _asked_at_pages.get(name, 0)
        if asked > pages:  # emptied since (a TRUNCATE): start over
            asked = 0
        if pages >= max(GROWN_PAGES, GROWTH * max(analyzed_pages, asked)):
            _asked_at_pages[name] = pages
            grown.append(name)
    analyzed = []
    for name in grown:
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
                cursor.execute(f"ANALYZE {connection.ops.quote_name(name)}")
            analyzed.append(name)
        except DatabaseError:
            log.info("could not analyze %s; autovacuum will", name, exc_info=True)
    return analyzed
