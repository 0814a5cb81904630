"""Pick the bench database and point Django at it (before django.setup())."""

from __future__ import annotations

import os
import secrets
import tempfile
from urllib.parse import urlsplit, urlunsplit

POSTGRES_SCHEMES = ("postgres://", "postgresql://", "pgsql://")


def prepare_database() -> str:
    """Sets DATABASE_URL for this process and its worker subprocesses; returns it.

    No DATABASE_URL: a fresh SQLite file in a temp dir. PostgreSQL: the database
    `<dbname>_bench` on the same server, dropped and created anew. A SQLite URL is used as given.
    """
    url = os.environ.get("DATABASE_URL", "")
    if not url:
        url = f"sqlite:///{tempfile.mkdtemp(prefix='wfdash-bench-')}/bench.sqlite3"
    elif url.startswith(POSTGRES_SCHEMES):
        dbname = urlsplit(url).path.lstrip("/") or "postgres"
        url = fresh_database(url, dbname if dbname.endswith("_bench") else f"{dbname}_bench")
    os.environ["DATABASE_URL"] = url
    return url


def fresh_database(url: str, name: str) -> str:
    """The database `name` on PostgreSQL URL's server, dropped and created anew; its URL.
    Made from URL's own database, or from `postgres` when that is the one remade."""
    import psycopg
    from psycopg import sql

    parts = urlsplit(url)._replace(scheme="postgresql")
    dbname = parts.path.lstrip("/") or "postgres"
    admin = parts if dbname != name else parts._replace(path="/postgres")
    with psycopg.connect(urlunsplit(admin), autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return urlunsplit(parts._replace(path="/" + name))


def setup_django() -> str:
    """The bench process's Django: production-like settings, the bench database fresh
    (prepare_database), the bench workflows registered, migrated. Returns the URL."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "wfdash.settings")
    os.environ["WFDASH_DEMO"] = "0"
    os.environ.setdefault("WFDASH_LOG_LEVEL", "WARNING")
    # Production-like: DEBUG=True wraps every query in CursorDebugWrapper (and, on SQLite,
    # quotes its parameters with an extra round trip). Set DJANGO_DEBUG=1 to measure that.
    os.environ.setdefault("DJANGO_DEBUG", "0")
    # DEBUG off refuses the built-in key and empty hosts (production settings); the bench's
    # processes share this throwaway key through the environment.
    os.environ.setdefault("DJANGO_SECRET_KEY", "bench-" + secrets.token_urlsafe(32))
    os.environ.setdefault("DJANGO_ALLOWED_HOSTS", "localhost,127.0.0.1,testserver")
    url = prepare_database()

    import django

    django.setup()
    from django.core.management import call_command

    from . import workflows  # noqa: F401  (registers the bench workflows)

    call_command("migrate", verbosity=0)
    return url
