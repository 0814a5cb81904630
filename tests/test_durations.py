from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from workflows_app.engine.durations import (
    LATEST_INSTANT,
    MAX_DURATION_MS,
    parse_duration,
    parse_instant,
)
from workflows_app.engine.errors import InvalidDuration, WorkflowError
from workflows_app.engine.step import RetryPolicy


@pytest.mark.parametrize(
    ("value", "ms"),
    [
        (0, 0),
        (1500, 1500),
        ("250 ms", 250),
        ("250ms", 250),
        ("1 second", 1_000),
        ("10 seconds", 10_000),
        ("10s", 10_000),
        ("5 minutes", 300_000),
        ("1 minute", 60_000),
        ("2 hours", 7_200_000),
        ("3 days", 3 * 86_400_000),
        ("1 week", 7 * 86_400_000),
        ("1 month", 30 * 86_400_000),
        ("2 months", 60 * 86_400_000),
        ("1 year", 365 * 86_400_000),
        (timedelta(seconds=1.5), 1_500),
    ],
)
def test_it_parses_every_documented_duration_form(value, ms):
    assert parse_duration(value) == ms


@pytest.mark.parametrize(
    "value", ["", "soon", "10 parsecs", "-5 seconds", -1, None, True, [1], float("nan"), "1.2.3 s"]
)
def test_it_refuses_anything_else_naming_the_value(value):
    with pytest.raises(InvalidDuration) as caught:
        parse_duration(value)
    assert isinstance(caught.value, WorkflowError)
    assert repr(value)[:5].strip("'\"") in str(caught.value) or str(value) in str(caught.value)


def test_sleep_until_takes_aware_datetimes_and_epoch_milliseconds():
    instant = datetime(2027, 1, 1, tzinfo=UTC)
    assert parse_instant(instant) == instant
    assert parse_instant(int(instant.timestamp() * 1000)) == instant
    with pytest.raises(InvalidDuration, match="timezone-aware"):
        parse_instant(datetime(2027, 1, 1))
    with pytest.raises(InvalidDuration):
        parse_instant("tomorrow")


@pytest.mark.parametrize("value", ["8000 years", "1001 years", 9e18, 1e20, timedelta.max])
def test_a_duration_past_the_calendar_is_refused_naming_the_value_and_the_limit(value):
    with pytest.raises(InvalidDuration) as caught:
        parse_duration(value)
    assert repr(value) in str(caught.value)
    assert "longer than the longest duration wfdash stores, 1000 years (31536000000000 ms)" in str(
        caught.value
    )
    assert parse_duration("1000 years") == 1000 * 365 * 86_400_000


@pytest.mark.parametrize(
    "value", [1e20, 9e18, -9e18, datetime(9999, 12, 31, 23, tzinfo=timezone(timedelta(hours=-5)))]
)
def test_an_instant_outside_the_stored_dates_is_refused_naming_the_range(value):
    with pytest.raises(InvalidDuration) as caught:
        parse_instant(value)
    assert repr(value) in str(caught.value)
    assert "outside the dates wfdash stores, 0001-01-02 … 9999-12-31 UTC" in str(caught.value)


def test_a_long_backoff_waits_at_most_the_longest_duration_wfdash_stores():
    daily = RetryPolicy(limit=100, delay_ms=parse_duration("1 day"), backoff="exponential")
    assert daily.delay_after(2) == 2 * 86_400_000
    assert daily.delay_after(60) == MAX_DURATION_MS  # 2**59 days would overflow any date
    assert (
        datetime(2030, 1, 1, tzinfo=UTC) + timedelta(milliseconds=daily.delay_after(60))
        < LATEST_INSTANT
    )
    linear = RetryPolicy(limit=10**6, delay_ms=parse_duration("1000 years"), backoff="linear")
    assert linear.delay_after(10**6) == MAX_DURATION_MS
