"""The instance lifecycle, written once: which operator action applies to which status and
what it leads to, and which statuses hold a place under max_concurrent_instances.

The store enforces it (under the row lock), and the dashboard, admin and API read it, so
"can I pause this?" has one answer everywhere. The engine's own moves (claim, park,
finish) are in the store next to the writes that make them.
"""

from __future__ import annotations

from ..models import Status
from .errors import InvalidTransition

FINISHED = frozenset({Status.COMPLETE, Status.ERRORED, Status.TERMINATED})
LIVE = frozenset(Status.values) - FINISHED
# Admitted statuses take a place under max_concurrent_instances until the instance ends.
# A paused instance takes one only if it was admitted before (started_at is set): pausing
# a queued instance must not let it skip the queue on resume.
HOLDS_PLACE = frozenset(
    {Status.RUNNING, Status.WAITING, Status.WAITING_FOR_PAUSE, Status.COMPENSATING, Status.PAUSED}
)

PAUSE, RESUME, TERMINATE, CANCEL, RESTART, SEND_EVENT = (
    "pause",
    "resume",
    "terminate",
    "cancel",
    "restart",
    "send_event",
)

# (action, status) -> the status it leads to. Two outcomes depend on more than the status:
# pausing an instance a run holds right now waits for the step boundary (waitingForPause),
# and resuming an instance that was never admitted goes back to the queue.
TRANSITIONS: dict[tuple[str, str], str] = {
    (PAUSE, Status.QUEUED): Status.PAUSED,
    (PAUSE, Status.RUNNING): Status.PAUSED,
    (PAUSE, Status.WAITING): Status.PAUSED,
    (PAUSE, Status.WAITING_FOR_PAUSE): Status.PAUSED,
    (RESUME, Status.PAUSED): Status.RUNNING,
    (RESUME, Status.WAITING_FOR_PAUSE): Status.RUNNING,
    **{(TERMINATE, s): Status.TERMINATED for s in LIVE},
    # Compensation shows compensating first when a completed step has an undo.
    **{(CANCEL, s): Status.TERMINATED for s in LIVE},
    # Restart admits again (or queues) from any status.
    **{(RESTART, s): Status.RUNNING for s in Status.values},
    # Events are stored for any live instance; they never change its status.
    **{(SEND_EVENT, s): s for s in LIVE},
}

# Said after "cannot <action> instance 'x': it is <status>".
WHY_NOT = {
    PAUSE: "; only queued, running or waiting instances can be paused",
    RESUME: ", not paused",
}


def holds_place(status: str, started: bool) -> bool:
    """Whether an instance takes a place under max_concurrent_instances (see HOLDS_PLACE)."""
    return status in HOLDS_PLACE and (status != Status.PAUSED or started)


def can(action: str, status: str) -> bool:
    """Whether `action` applies to an instance in `status`."""
    return (action, status) in TRANSITIONS


def statuses_allowing(action: str) -> frozenset[str]:
    return frozenset(s for (a, s) in TRANSITIONS if a == action)


def after(
    action: str, status: str, instance_id: str, *, held_by_run: bool = False, admitted: bool = True
) -> str:
    """The status `action` leads to, or InvalidTransition naming why it does not apply.

    held_by_run: a worker's run holds the instance now (its lease is live).
    admitted: the instance was started once (not only queued), so it holds a place.
    """
    if not can(action, status):
        verb = action.replace("_", " ")
        state = f"already {status}" if status in FINISHED else status
        raise InvalidTransition(
            f"cannot {verb} instance {instance_id!r}: it is {state}{WHY_NOT.get(action, '')}"
        )
    target = TRANSITIONS[(action, status)]
    if action == PAUSE and held_by_run and status in (Status.RUNNING, Status.WAITING_FOR_PAUSE):
        return Status.WAITING_FOR_PAUSE  # takes effect at the run's next step boundary
    if action == RESUME and status == Status.PAUSED and not admitted:
        return Status.QUEUED  # paused while queued: back in line, not past it
    return target
