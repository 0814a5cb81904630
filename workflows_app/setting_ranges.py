"""What each numeric wfdash setting may be: one table, read both where wfdash/settings.py
reads a WFDASH_* variable and where the system checks (checks.py) look at a host project's
own settings.WFDASH, so a value refused in one is refused in the other, in the same words.

Every maximum keeps the engine's arithmetic in range: a lease, prune or lockout past what a
datetime holds (year 9999) was an OverflowError at the first claim, prune or lockout, and
an integer float() cannot take (10**400) one at the first use, naming no setting.
No Django import here: wfdash/settings.py reads this before Django is set up."""

from __future__ import annotations

import math
from dataclasses import dataclass

DAY_SECONDS = 86_400
YEAR_SECONDS = 365 * DAY_SECONDS


@dataclass(frozen=True)
class Range:
    """Numbers from minimum to maximum, whole ones only when whole."""

    minimum: float
    maximum: float = math.inf
    whole: bool = True

    def describe(self) -> str:
        """'a whole number from 1 to 100000', bounds as written (31536000, not 3.1536e+07)."""
        kind = "a whole number" if self.whole else "a number"
        if self.maximum < math.inf:
            return f"{kind} from {_plain(self.minimum)} to {_plain(self.maximum)}"
        return f"{kind} of at least {_plain(self.minimum)}"

    def admits(self, value: object) -> bool:
        """Whether a value from a settings file is one of these numbers. True is no number
        (it would count as 1), nor is "30": the engine's int()/float() took both silently,
        or failed at its first use of them. Compared exactly: 10**400 raises nothing."""
        if isinstance(value, bool):
            return False
        if not isinstance(value, int) and (self.whole or not isinstance(value, float)):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        return self.minimum <= value <= self.maximum


def _plain(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else f"{bound:g}"


# settings.WFDASH[key] -> its range. The WFDASH_* variable of the same name (if any) is
# read with the same range.
SETTING_RANGES: dict[str, Range] = {
    # Heartbeats renew a lease: a day is far past any use.
    "LEASE_SECONDS": Range(0.1, DAY_SECONDS, whole=False),
    "WORKER_CONCURRENCY": Range(1, 100_000),
    "POLL_SECONDS": Range(0.01, DAY_SECONDS, whole=False),
    "DRAIN_SECONDS": Range(0, DAY_SECONDS, whole=False),
    "START_WAIT_SECONDS": Range(0, DAY_SECONDS, whole=False),
    "SLEEP_IN_PROCESS_MS": Range(0, DAY_SECONDS * 1000),
    "LOOP_STALL_RENEW_SECONDS": Range(0, DAY_SECONDS, whole=False),
    # 0: only `wf prune` prunes.
    "PRUNE_SECONDS": Range(0, YEAR_SECONDS, whole=False),
    # 0: no metrics port (None too).
    "METRICS_PORT": Range(0, 65_535),
    # Far past any real page count; float() of it is each user's connect bucket.
    "MAX_SOCKETS_PER_USER": Range(1, 100_000),
    "API_MAX_BODY_BYTES": Range(1, 1 << 30),
    "API_FAILURE_LIMIT": Range(1, 1_000_000),
    "API_LOCKOUT_SECONDS": Range(1, YEAR_SECONDS),
}

# settings.WFDASH[key] read as a switch: True or False only ("False", a string, was on).
SWITCHES = (
    "EMBEDDED_WORKER",
    "DEMO",
    "TRACING",
    "METRICS",
    "STRICT_VERSIONS",
    "PG_PREPARE",
    "GC_TUNING",
    "GROUP_COMMIT",
    "WAKE_NOTIFY",
)

# WFDASH_LOGIN_LOCKOUT_SECONDS, and AXES_COOLOFF_TIME in seconds where wfdash answers the
# lockout (throttle.login_locked_out): 10**14 s was an OverflowError.
LOGIN_LOCKOUT_SECONDS = Range(1, YEAR_SECONDS)
