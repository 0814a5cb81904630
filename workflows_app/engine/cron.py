"""Cron expressions and time zones of schedules: validation and fire times.

Parsing and iteration are cronsim's (the evaluator healthchecks uses, Debian cron's
rules, daylight-saving changes handled as Debian cron does); this module only checks
input, names what is wrong, and converts between the schedule's zone and UTC.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

from .errors import InvalidInput

MAX_CRON_LENGTH = 200
# The shortest instance id a schedule's tick gets: "<12 hex digits of a digest of the
# schedule's name>@<the tick, 16 characters>" (store.schedules.tick_instance_id). A
# workflow's max_instance_id_length below it holds no tick's instance.
SHORTEST_TICK_ID = 29
SCHEDULE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:-]{0,79}$")


def check_schedule_name(name: object) -> str:
    """Schedule names go into URLs and instance ids: a short, plain slug."""
    if not isinstance(name, str) or not SCHEDULE_NAME.match(name):
        raise InvalidInput(
            f"schedule name must match {SCHEDULE_NAME.pattern} (1-80 letters, digits, _ . : -), "
            f"got {name!r}"
        )
    return name


# Names the zone database answers that are no place's clock, refused for a new schedule:
# "localtime" is each host's own zone (workers in different zones would fire one schedule
# at different instants), "Factory" has no offset of its own ("-00"), and the "right/"
# zones count leap seconds (their times are ~27 s away from everyone else's).
NOT_A_PLACE = re.compile(r"^(localtime|Factory|posixrules|right/.*)$")


def zone(timezone: object) -> ZoneInfo:
    """An IANA time zone by name ("UTC", "Europe/Paris"); InvalidInput naming it otherwise."""
    if not isinstance(timezone, str) or not timezone or len(timezone) > 64:
        raise InvalidInput(f"timezone must be an IANA time zone name, got {timezone!r}")
    try:
        return ZoneInfo(timezone)
    except (ZoneInfoNotFoundError, ValueError):
        raise InvalidInput(
            f"unknown time zone {timezone!r} (use an IANA name such as 'Europe/Paris')"
        ) from None


def check_zone(timezone: object) -> ZoneInfo:
    """zone() for a new schedule, which must also be a place's. A stored schedule in such a
    zone (accepted before) still fires: refusing it there would stop it at an upgrade."""
    if isinstance(timezone, str) and NOT_A_PLACE.match(timezone):
        raise InvalidInput(
            f"time zone {timezone!r} is not a place's clock (the host's own zone, a "
            "placeholder or a leap-second clock); use an IANA name such as 'Europe/Paris'"
        )
    return zone(timezone)


def check_cron(cron: object) -> str:
    """A 5-field cron expression (minute hour day month weekday), or 6 fields with a
    leading seconds field; InvalidInput naming the expression when it does not parse."""
    if not isinstance(cron, str) or not cron.strip() or len(cron) > MAX_CRON_LENGTH:
        raise InvalidInput(
            f"cron must be a non-empty string of at most {MAX_CRON_LENGTH} characters, got {cron!r}"
        )
    if len(cron.split()) not in (5, 6):
        raise InvalidInput(
            f"cron expression {cron!r} does not parse: it needs 5 fields "
            "(minute hour day-of-month month day-of-week)"
        )
    try:
        CronSim(cron, datetime(2000, 1, 1, tzinfo=UTC))
    except (CronSimError, ValueError) as exc:
        raise InvalidInput(f"cron expression {cron!r} does not parse: {exc}") from None
    return " ".join(cron.split())


def fire_times(cron: str, timezone: str, after: datetime) -> Iterator[datetime]:
    """The fire times strictly after `after`, in UTC.

    cronsim reads a local time in the repeated hour of an autumn change as its first
    pass: from 02:10 of the second pass it starts at the first, an hour earlier, and its
    first tick (02:30 of the first pass, fired already) is in the past. Such ticks are
    passed over.

    The times end with the calendar (year 9999): a rare expression ("0 0 * 2 1#5", a
    fifth Monday in February, about four a century) runs out of years within the
    thousand times next_runs may ask for, where cronsim raises OverflowError."""
    tz = zone(timezone)
    ticks = iter(CronSim(cron, after.astimezone(tz)))
    while True:
        try:
            fires = next(ticks).astimezone(UTC)
        except (OverflowError, StopIteration):
            return
        if fires > after:
            yield fires


def next_fire_time(cron: str, timezone: str, after: datetime) -> datetime | None:
    """The first fire time strictly after `after` (None for an expression that never fires)."""
    try:
        return next(fire_times(cron, timezone, after))
    except StopIteration:
        return None


def latest_fire_time(cron: str, timezone: str, at_or_before: datetime) -> datetime | None:
    """The most recent fire time at or before the instant: after downtime, the one that fires."""
    tz = zone(timezone)
    # Iterating backwards yields times strictly before the start, to the whole second.
    start = at_or_before.replace(microsecond=0) + timedelta(seconds=1)
    try:
        latest = next(iter(CronSim(cron, start.astimezone(tz), reverse=True))).astimezone(UTC)
    except StopIteration:
        return None
    # In the second pass of a repeated hour cronsim starts from the first, an hour early,
    # and misses the ticks of that hour: the forward ticks from its answer find them.
    for _, fires in zip(range(MAX_TICKS_IN_AN_HOUR), fire_times(cron, timezone, latest)):
        if fires > at_or_before:
            break
        latest = fires
    return latest


MAX_TICKS_IN_AN_HOUR = 3601  # a 6-field expression may fire every second
