"""Pick the bench database and point Django at it (before django.setup())."""

from __future__ import annotations

import os
import tempfile
from urllib.parse import urlsplit, urlunsplit


def prepare_database() -> str:
    """Sets DATABASE_URL for this process and its worker subprocesses; returns it.

    No DATABASE_URL: a fresh SQLite file in a temp dir. PostgreSQL: the database
    `<dbname>_bench` on the same server, dropped and created anew. A SQLite URL is used as given.
    """
    url = os.environ.get("DATABASE_URL", "")
    if not url:
        url = f"sqlite:///{tempfile.mkdtemp(prefix='wfdash-bench-')}/bench.sqlite3"
    elif url.startswith(("postgres://", "postgresql://", "pgsql://")):
        import psycopg
        from psycopg import sql

        parts = urlsplit(url)
        dbname = parts.path.lstrip("/") or "postgres"
        bench_db = dbname if dbname.endswith("_bench") else f"{dbname}_bench"
        admin_url = urlunsplit(parts._replace(scheme="postgresql"))
        with psycopg.connect(
            admin_url
            if dbname != bench_db
            else urlunsplit(parts._replace(scheme="postgresql", path="/postgres")),
            autocommit=True,
        ) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(bench_db))
            )
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(bench_db)))
        url = urlunsplit(parts._replace(path="/" + bench_db))
    os.environ["DATABASE_URL"] = url
    return url
