"""Wake hints between processes through PostgreSQL's LISTEN/NOTIFY.

A change that may make an instance runnable, or that a running instance must hear
(terminate, pause, ...), notifies the channel in the transaction that makes it: the
notification is delivered at commit, to every listening worker, with no Redis on the
path. SQLite runs one process's workers only; they hear each other in memory.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from django.conf import settings
from django.db import connection

log = logging.getLogger("workflows_app.engine")

WAKE_CHANNEL = "wfdash_wake"
RECONNECT_SECONDS = 1.0
STOP_CHECK_SECONDS = 0.5


def hint_workers(kind: str, pks: Iterable[int | None]) -> None:
    """NOTIFY "kind pk" for each instance, in the caller's transaction (PostgreSQL only)."""
    if connection.vendor != "postgresql":
        return
    payloads = [f"{kind} {'' if pk is None else pk}" for pk in pks]
    if payloads:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_notify(%s, p) FROM unnest(CAST(%s AS text[])) AS p",
                [WAKE_CHANNEL, payloads],
            )


def workers_listen() -> bool:
    """Whether hint_workers reaches every worker: PostgreSQL, whose workers LISTEN unless
    WFDASH["WAKE_NOTIFY"] is off. Then the same hint through Redis would only wake them
    a second time (and fill the engine channel when no `runworker` reads it)."""
    return connection.vendor == "postgresql" and bool(
        getattr(settings, "WFDASH", {}).get("WAKE_NOTIFY", True)
    )


def parse_hint(payload: str) -> tuple[str, int | None]:
    kind, _, pk = payload.partition(" ")
    return kind, int(pk) if pk.isdigit() else None


class WakeListener:
    """A thread with its own connection that LISTENs and hands each hint to `on_hint`.

    After every (re)connection it hands over one plain wake: notifications sent while it
    was not listening are gone, and the worker then looks at the database itself.
    """

    def __init__(self, on_hint: Callable[[str, int | None], None]) -> None:
        self.on_hint = on_hint
        params = connection.get_connection_params()
        self.params: dict[str, Any] = {
            k: v for k, v in params.items() if k not in ("cursor_factory", "context")
        }
        self.listening = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wfdash-wake-listener", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=STOP_CHECK_SECONDS * 4)

    def _run(self) -> None:
        import psycopg

        while not self._stop.is_set():
            try:
                with psycopg.connect(**self.params, autocommit=True) as conn:
                    conn.execute(f"LISTEN {WAKE_CHANNEL}")
                    self.listening.set()
                    self.on_hint("wake", None)
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=STOP_CHECK_SECONDS):
                            self.on_hint(*parse_hint(note.payload))
            except Exception:
                self.listening.clear()
                log.warning("wake listener: connection lost; reconnecting", exc_info=True)
                self._stop.wait(RECONNECT_SECONDS)
