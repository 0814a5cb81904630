"""Parse durations the way Cloudflare Workflows does: a number is milliseconds."""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime, timedelta

from .errors import InvalidDuration, shown

_MS_PER_UNIT = {
    "ms": 1,
    "millisecond": 1,
    "s": 1_000,
    "sec": 1_000,
    "second": 1_000,
    "m": 60_000,
    "min": 60_000,
    "minute": 60_000,
    "h": 3_600_000,
    "hour": 3_600_000,
    "d": 86_400_000,
    "day": 86_400_000,
    "w": 7 * 86_400_000,
    "week": 7 * 86_400_000,
    "month": 30 * 86_400_000,
    "y": 365 * 86_400_000,
    "year": 365 * 86_400_000,
}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*$")

# The longest duration accepted anywhere (retention, sleeps, timeouts, limits): far beyond
# any real use, and short enough that now plus it is still a date the database stores.
MAX_DURATION_YEARS = 1000
MAX_DURATION_MS = MAX_DURATION_YEARS * _MS_PER_UNIT["year"]
# The dates every database (and Python's datetime) stores.
EARLIEST_INSTANT = datetime(1, 1, 2, tzinfo=UTC)
LATEST_INSTANT = datetime(9999, 12, 31, tzinfo=UTC)
INSTANT_RANGE = f"{EARLIEST_INSTANT.date().isoformat()} … {LATEST_INSTANT.date().isoformat()} UTC"

Duration = str | int | float | timedelta


def parse_duration(value: object) -> int:
    """Return the duration in whole milliseconds, or raise InvalidDuration naming the value."""
    if isinstance(value, bool):
        raise InvalidDuration(
            f"invalid duration {shown(value)}: expected milliseconds, a string or a timedelta"
        )
    if isinstance(value, timedelta):
        ms = value / timedelta(milliseconds=1)
    elif isinstance(value, int) and not -MAX_DURATION_MS <= value <= MAX_DURATION_MS:
        # Refused as an integer: float() of one past ~1e308 raises OverflowError.
        ms = float(MAX_DURATION_MS + 1 if value > 0 else -1)
    elif isinstance(value, (int, float)):
        ms = float(value)
    elif isinstance(value, str):
        match = _PATTERN.match(value)
        if not match:
            raise InvalidDuration(
                f'invalid duration "{value}": expected e.g. "250 ms", "10 seconds", "2 hours"'
            )
        unit = match.group(2).lower()
        factor = _MS_PER_UNIT.get(unit) or (
            _MS_PER_UNIT.get(unit[:-1]) if unit.endswith("s") else None
        )
        if factor is None:
            raise InvalidDuration(f'invalid duration "{value}": unknown unit "{match.group(2)}"')
        ms = float(match.group(1)) * factor
    else:
        raise InvalidDuration(
            f"invalid duration {shown(value)} of type {type(value).__name__}: expected milliseconds, a string or a timedelta"
        )
    if not math.isfinite(ms):
        raise InvalidDuration(f"invalid duration {shown(value)}: not a finite number")
    if ms < 0:
        raise InvalidDuration(f"invalid duration {shown(value)}: must not be negative")
    if ms > MAX_DURATION_MS:
        raise InvalidDuration(
            f"invalid duration {shown(value)}: longer than the longest duration wfdash stores, "
            f"{MAX_DURATION_YEARS} years ({MAX_DURATION_MS} ms)"
        )
    return round(ms)


def parse_instant(value: object) -> datetime:
    """An aware datetime, or epoch milliseconds, as an aware UTC datetime.

    Refused (InvalidDuration) outside the dates the database stores, EARLIEST_INSTANT to
    LATEST_INSTANT."""
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise InvalidDuration(
                f"invalid instant {shown(value)}: the datetime must be timezone-aware"
            )
        try:
            instant = value.astimezone(UTC)
        except OverflowError:
            instant = None
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            instant = datetime.fromtimestamp(value / 1000, tz=UTC)
        except (OverflowError, OSError, ValueError):
            instant = None
    else:
        raise InvalidDuration(
            f"invalid instant {shown(value)}: expected an aware datetime or epoch milliseconds"
        )
    if instant is None or not EARLIEST_INSTANT <= instant <= LATEST_INSTANT:
        raise InvalidDuration(
            f"invalid instant {shown(value)}: outside the dates wfdash stores, {INSTANT_RANGE}"
        )
    return instant


def add_duration(instant: datetime, ms: int) -> datetime:
    """instant + ms, at most LATEST_INSTANT: a duration stored before durations were
    bounded (a retention of 8000 years) must not make every finish fail for ever."""
    try:
        return min(instant + timedelta(milliseconds=ms), LATEST_INSTANT)
    except OverflowError:
        return LATEST_INSTANT
