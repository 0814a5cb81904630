"""How long a finished instance is kept, by outcome.

`create(retention=…)` takes a duration (every outcome) or {"success": …, "error": …}
("error" also covers terminated instances). Without one, settings.WFDASH["RETENTION"]
(same forms) decides, then the workflow's max_retention limit. 0 keeps forever.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from django.conf import settings

from ..models import Status
from .durations import add_duration, parse_duration
from .errors import InvalidInput
from .limits import Limits

OUTCOMES = ("success", "error")


def parse_retention(value: Any, what: str = "retention") -> tuple[int | None, int | None]:
    """(success ms, error ms), each None when not given."""
    if value is None:
        return None, None
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(OUTCOMES))
        if unknown:
            raise InvalidInput(
                f"{what}: unknown outcome(s) {unknown}; use {', '.join(OUTCOMES)} "
                '(e.g. {"success": "7 days", "error": "30 days"})'
            )
        success, error = value.get("success"), value.get("error")
        return (
            None if success is None else parse_duration(success),
            None if error is None else parse_duration(error),
        )
    ms = parse_duration(value)
    return ms, ms


def settings_retention() -> tuple[int | None, int | None]:
    return parse_retention(
        getattr(settings, "WFDASH", {}).get("RETENTION"), 'settings.WFDASH["RETENTION"]'
    )


def retention_ms(status: str, success_ms: int | None, error_ms: int | None, limits: Limits) -> int:
    """The retention of an instance that just ended with `status` (0: keep forever)."""
    own = success_ms if status == Status.COMPLETE else error_ms
    if own is not None:
        return own
    default_success, default_error = settings_retention()
    default = default_success if status == Status.COMPLETE else default_error
    return default if default is not None else limits.max_retention


def expires_at(
    status: str, success_ms: int | None, error_ms: int | None, limits: Limits, now: datetime
) -> datetime | None:
    ms = retention_ms(status, success_ms, error_ms, limits)
    return add_duration(now, ms) if ms else None
