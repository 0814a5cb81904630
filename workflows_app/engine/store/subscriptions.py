"""Following an instance's history as it is written (inst.subscribe, the SSE stream).

A follower reads the records after its cursor, then waits to be woken: in this process
by the engine's hooks and operator actions (live.result_waiters), and on PostgreSQL by
a NOTIFY on channel wfdash_history that a trigger on the history table sends for the
instances that have a subscriber row (migration 0007). One LISTEN connection per process
turns those notifications into the same in-process wake-ups. Waits also end after a
poll interval, so a wake-up lost anywhere (another SQLite process, a listener
reconnecting) only delays a record, never loses it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from ...models import HistoryRecord, HistorySubscriber, Instance
from .. import lifecycle
from .dialect import notifies_history

log = logging.getLogger(__name__)

HISTORY_CHANNEL = "wfdash_history"
READ_BATCH = 500  # records per read: a long history streams in pages
SUBSCRIBER_TTL = timedelta(seconds=120)  # a crashed subscriber's row stops NOTIFYs after this
REFRESH_SECONDS = 30.0  # a live subscriber pushes its expiry forward this often
NOTIFIED_POLL_SECONDS = 2.0  # PostgreSQL: a re-read in case a notification was missed
POLL_MIN_SECONDS = 0.05  # SQLite: another process's writes are seen by polling, backing off
POLL_MAX_SECONDS = 1.0
LISTEN_RETRY_SECONDS = 1.0


@dataclass
class HistoryFollower:
    """The state of one subscription; sync and async drivers share it and differ only in
    how they wait."""

    pk: int
    cursor: int
    notified: bool = field(default_factory=notifies_history)
    poll_seconds: float = POLL_MIN_SECONDS
    subscriber: int | None = None
    refreshed_at: float = 0.0

    def read(self) -> tuple[list[HistoryRecord], bool]:
        """The next records after the cursor (advancing it) and whether the subscription is
        over: the instance finished (or is gone) and every record it wrote has been read.

        The status is read before the records, so the records a finish wrote together
        with its status are among those read.
        """
        status = Instance.objects.filter(pk=self.pk).values_list("status", flat=True).first()
        records = list(
            HistoryRecord.objects.filter(instance_id=self.pk, sequence__gt=self.cursor).order_by(
                "sequence"
            )[:READ_BATCH]
        )
        if records:
            self.cursor = records[-1].sequence
            self.poll_seconds = POLL_MIN_SECONDS
        else:
            self.poll_seconds = min(self.poll_seconds * 2, POLL_MAX_SECONDS)
        finished = not records and (status is None or status in lifecycle.FINISHED)
        return records, finished

    @property
    def wait_seconds(self) -> float:
        return NOTIFIED_POLL_SECONDS if self.notified else self.poll_seconds

    def open(self) -> None:
        """PostgreSQL: register as a subscriber, so the trigger notifies this instance."""
        if not self.notified:
            return
        now = timezone.now()  # the trigger compares with the database's now(): one clock
        HistorySubscriber.objects.filter(expires_at__lt=now).delete()
        self.subscriber = HistorySubscriber.objects.create(
            instance_id=self.pk, expires_at=now + SUBSCRIBER_TTL
        ).pk
        self.refreshed_at = now.timestamp()

    def keep_alive_due(self) -> bool:
        return (
            self.subscriber is not None
            and timezone.now().timestamp() - self.refreshed_at > REFRESH_SECONDS
        )

    def keep_alive(self) -> None:
        """Push the subscriber row's expiry forward (at most every REFRESH_SECONDS). A row
        that expired meanwhile (a caller slow to take the next record, a stream busy past
        SUBSCRIBER_TTL) may have been deleted by another subscriber's open(): it is made
        again, or the trigger would stop notifying and every record wait for a poll."""
        if not self.keep_alive_due():
            return
        now = timezone.now()
        expires_at = now + SUBSCRIBER_TTL
        if not HistorySubscriber.objects.filter(pk=self.subscriber).update(expires_at=expires_at):
            try:
                with transaction.atomic():
                    self.subscriber = HistorySubscriber.objects.create(
                        instance_id=self.pk, expires_at=expires_at
                    ).pk
            except IntegrityError:  # the instance is gone: read() ends the subscription
                self.subscriber = None
        self.refreshed_at = now.timestamp()

    def close(self) -> None:
        if self.subscriber is not None:
            HistorySubscriber.objects.filter(pk=self.subscriber).delete()
            self.subscriber = None


class HistoryListener:
    """This process's one LISTEN connection (PostgreSQL), in a daemon thread: calls wake(pk)
    for every notification; reconnects after an error."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._wake: Callable[[int], None] = lambda pk: None

    def ensure_started(self, wake: Callable[[int], None], timeout: float = 5.0) -> bool:
        """Start listening (once per process); True once LISTEN is in effect."""
        with self._lock:
            self._wake = wake
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._ready.clear()
                params = dict(connection.settings_dict)
                self._thread = threading.Thread(
                    target=self._listen, args=(params,), name="wfdash-history-listener", daemon=True
                )
                self._thread.start()
        return self._ready.wait(timeout)

    def stop(self) -> None:
        """Close the connection (tests: before the test database is dropped)."""
        with self._lock:
            thread, self._thread = self._thread, None
        self._stop.set()
        if thread is not None:
            thread.join(10)

    def _listen(self, settings: dict[str, object]) -> None:
        import psycopg

        while not self._stop.is_set():
            try:
                with psycopg.connect(
                    dbname=settings["NAME"],
                    user=settings.get("USER") or None,
                    password=settings.get("PASSWORD") or None,
                    host=settings.get("HOST") or None,
                    port=settings.get("PORT") or None,
                    autocommit=True,
                ) as conn:
                    conn.execute(f"LISTEN {HISTORY_CHANNEL}")
                    self._ready.set()
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=1.0):
                            self._wake(int(note.payload))
            except Exception:
                self._ready.clear()
                log.warning("history listener lost its connection; reconnecting", exc_info=True)
                self._stop.wait(LISTEN_RETRY_SECONDS)


history_listener = HistoryListener()
