"""scripts/test's look at the services of its PostgreSQL + Redis leg (stdlib, psycopg, redis).

    python scripts/services.py redis-base URL      # URL without its database number
    python scripts/services.py check PG_URL REDIS_URL

`check` exits 0 when both answer within 2 s, else 1 after one line on stdout saying which
is missing, where (never a password) and why: the leg is then skipped locally, and fails
with that line under CI=true instead of failing later in a test's traceback.
"""

from __future__ import annotations

import sys
from urllib.parse import urlsplit, urlunsplit

CONNECT_SECONDS = 2


def redis_base(url: str) -> str:
    """redis://host:6379/3 -> redis://host:6379; one without a database number (or with a
    bare slash) is its own base: the legs add /1 and /2 to it."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise SystemExit(f"WFDASH_TEST_REDIS_URL: not a redis:// or rediss:// URL: {where(url)}")
    path = parts.path.rstrip("/")
    if path and not path.lstrip("/").isdigit():
        raise SystemExit(
            f"WFDASH_TEST_REDIS_URL: the path must be a database number, not {parts.path!r}"
        )
    return urlunsplit((parts.scheme, parts.netloc, "", "", ""))


def where(url: str) -> str:
    """A URL's scheme, host, port and path, without user or password."""
    parts = urlsplit(url)
    host = parts.hostname or "localhost"
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


def missing(pg_url: str, redis_url: str) -> str | None:
    import psycopg
    import redis

    try:
        psycopg.connect(pg_url, connect_timeout=CONNECT_SECONDS).close()
    except Exception as exc:
        return f"no PostgreSQL at {where(pg_url)} ({first_line(exc)})"
    try:
        client = redis.Redis.from_url(
            redis_url, socket_connect_timeout=CONNECT_SECONDS, socket_timeout=CONNECT_SECONDS
        )
        client.ping()
        client.close()
    except Exception as exc:
        return f"no Redis at {where(redis_url)} ({first_line(exc)})"
    return None


def first_line(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0].strip() if lines else type(exc).__name__


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "redis-base":
        print(redis_base(argv[1]))
        return 0
    if len(argv) == 3 and argv[0] == "check":
        reason = missing(argv[1], argv[2])
        if reason:
            print(reason)
            return 1
        return 0
    print(__doc__.strip().splitlines()[2:4], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
