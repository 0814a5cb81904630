"""Named fault points, so tests can make crash windows exact.

    WFDASH_FAULTS="after_side_effect=kill"            # die between a step's work and its checkpoint
    WFDASH_FAULTS="after_checkpoint=drop_connection"  # lose the connection right after a commit
    WFDASH_FAULTS="after_claim=sleep:5,after_checkpoint=kill@3"   # @N: only the N-th time
    WFDASH_FAULTS="before_checkpoint=raise@1-3"       # @N-M: the N-th to the M-th time

Points: after_claim (instances leased, before their runs), after_side_effect (a step's
callable returned, before its checkpoint), before_checkpoint (inside a checkpoint's
transaction, before it writes), after_checkpoint (a checkpoint committed),
before_release (a worker gives back the leases of runs cut short), start_checks (each try of
the start-up checks of runworker, runserver and daphne's embedded worker).
Actions: kill (os._exit(137), like SIGKILL), sleep:SECONDS, drop_connection (close this
thread's database connection), terminate_backend (PostgreSQL ends this thread's connection
under it; elsewhere: raise), raise (an OperationalError).
Unused, a fault point costs one dictionary lookup.
"""

from __future__ import annotations

import os
import threading
import time

from django.db import OperationalError

_plan: dict[str, tuple[str, tuple[int, int] | None]] = {}
_hits: dict[str, int] = {}
_lock = threading.Lock()


def configure(spec: str | None = None) -> None:
    """Read the plan from `spec` or from WFDASH_FAULTS."""
    _plan.clear()
    _hits.clear()
    spec = os.environ.get("WFDASH_FAULTS", "") if spec is None else spec
    for item in filter(None, (part.strip() for part in spec.split(","))):
        point, _, action = item.partition("=")
        action, _, nth = action.partition("@")
        first, _, last = nth.partition("-")
        _plan[point.strip()] = (action.strip(), (int(first), int(last or first)) if nth else None)


class InjectedFault(OperationalError):
    """Raised by the `raise` action: a database failure the engine must survive."""


def hit(point: str) -> None:
    if not _plan:
        return
    planned = _plan.get(point)
    if planned is None:
        return
    action, nth = planned
    with _lock:
        _hits[point] = _hits.get(point, 0) + 1
        count = _hits[point]
    if nth is not None and not nth[0] <= count <= nth[1]:
        return
    if action == "kill":
        os._exit(137)
    elif action.startswith("sleep:"):
        time.sleep(float(action.split(":", 1)[1]))
    elif action == "drop_connection":
        from django.db import connection

        connection.close()
    elif action == "terminate_backend":
        _terminate_backend(point)
    elif action == "raise":
        raise InjectedFault(f"fault injected at {point}")


def _terminate_backend(point: str) -> None:
    """The server ends this thread's connection, as a restart or pg_terminate_backend
    would: the call fails as a dropped connection fails (SQLite: an OperationalError)."""
    from django.db import connection

    if connection.vendor != "postgresql":
        raise InjectedFault(f"fault injected at {point}")
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")


configure()
