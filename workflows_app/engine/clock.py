"""The one clock of the engine: timers, wake times, timestamps, history and events.

Tests swap in a ControllableClock (workflows_app.testing.fake_clock) so that "sleep one
hour" is a call to advance(), not an hour of waiting. Step timeouts use real time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from .durations import parse_duration


class RealClock:
    """The host's clock corrected by its offset from the database's clock.

    Leases and wake times are compared across hosts: a host whose clock runs ahead would
    wake sleeps early, one behind would write leases that are already over. The store
    measures the offset (PostgreSQL) when a worker starts, at its heartbeats and, at most
    once a minute, when any process connects; until then it is zero. The offset errs late:
    this clock never runs ahead of the database's.
    """

    def __init__(self) -> None:
        self.offset = timedelta(0)
        self.measured_at: float | None = None  # time.monotonic() of the last measurement
        self.offset_at: float | None = None  # time.monotonic() the offset was last a bound

    def host_now(self) -> datetime:
        return datetime.now(UTC)

    def now(self) -> datetime:
        return self.host_now() + self.offset


class ControllableClock:
    """A clock that only moves when told to."""

    def __init__(self, start: datetime | None = None) -> None:
        self._now = (start or datetime.now(UTC)).astimezone(UTC)
        self._lock = threading.Lock()

    def now(self) -> datetime:
        with self._lock:
            return self._now

    def advance(self, duration: object) -> datetime:
        """Move forward by a duration (str, timedelta or milliseconds); due timers become runnable."""
        with self._lock:
            self._now += timedelta(milliseconds=parse_duration(duration))
            now = self._now
        _notify_moved()
        return now

    def set(self, instant: datetime) -> None:
        with self._lock:
            self._now = instant.astimezone(UTC)
        _notify_moved()


_clock: RealClock | ControllableClock = RealClock()
_moved_listeners: list[Callable[[], None]] = []


def get_clock() -> RealClock | ControllableClock:
    return _clock


def set_clock(clock: RealClock | ControllableClock) -> None:
    global _clock
    _clock = clock
    _notify_moved()


def now() -> datetime:
    current = _clock
    if type(current) is RealClock:  # RealClock.now() inline: two Python calls fewer
        return datetime.now(UTC) + current.offset  # (4-8 readings an instance in a herd)
    return current.now()  # a controllable clock, or a subclass with its own host_now()


def on_clock_moved(listener: Callable[[], None]) -> Callable[[], None]:
    """Call listener whenever a controllable clock jumps; returns a function that unsubscribes."""
    _moved_listeners.append(listener)
    return lambda: _moved_listeners.remove(listener) if listener in _moved_listeners else None


def _notify_moved() -> None:
    for listener in tuple(_moved_listeners):  # a copy: a listener may unsubscribe (another thread)
        listener()
