"""Cron schedules: their rows, and firing due ticks exactly once across a fleet.

A tick fires in one transaction that moves the schedule's next_run_at on (a guarded
update: of several workers only the one whose update matched the old value goes on) and
creates the instance under an id derived from the schedule and the tick, so the unique
(workflow, instance_id) constraint is the fleet-wide key of the tick as well.
"""

from __future__ import annotations

import hashlib
import logging
import re
import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from cronsim import CronSimError
from django.db import IntegrityError, transaction
from django.db.models import Max, Min, QuerySet

from ...models import Instance, Schedule
from .. import clock
from ..cron import latest_fire_time, next_fire_time
from ..errors import (
    InstanceAlreadyExists,
    InvalidInput,
    LimitExceeded,
    ScheduleExists,
    ScheduleNotFound,
    WorkflowError,
)
from ..limits import Limits, check_instance_id
from ..registry import all_definitions
from .catalog import newer_live_versions
from .control import create_in_transaction
from .dialect import lock_rows, retry_while_locked
from .records import NewInstance

log = logging.getLogger("workflows_app.engine")

# Told (after commit) which instances schedules started; set by the app's live layer.
on_fired: Callable[[list[int]], None] | None = None

DECLARED_ACTOR = "schedule"


@dataclass(frozen=True)
class Target:
    """A registered workflow a schedule may start: its newest version and limits."""

    workflow: str
    version: int
    limits: Limits


@dataclass(frozen=True)
class Fired:
    schedule: str
    workflow: str
    instance_pk: int
    instance_id: str
    trace_id: str
    scheduled_at: datetime


def tick_instance_id(schedule: str, tick: datetime, max_length: int) -> str:
    """The id of the instance of one tick: readable, and the same in every worker.

    Within the workflow's max_instance_id_length, as every id a create stores (the one it
    makes up too): under a low limit a digest of the name keeps it unique, and below that
    form's SHORTEST_TICK_ID characters LimitExceeded (the digest form was stored anyway)."""
    stamp = tick.strftime("%Y%m%dT%H%M%SZ")
    instance_id = f"{schedule}@{stamp}"
    if len(instance_id) > max_length:
        instance_id = f"{hashlib.sha256(schedule.encode()).hexdigest()[:12]}@{stamp}"
    if len(instance_id) > max_length:
        raise LimitExceeded(
            "max_instance_id_length",
            len(instance_id),
            max_length,
            f"instance id of a tick of schedule {schedule!r}",
        )
    return instance_id


def get_schedule(name: str) -> Schedule:
    try:
        return Schedule.objects.get(name=name)
    except Schedule.DoesNotExist:
        raise ScheduleNotFound(f"no schedule named {name!r}") from None


def started_instances(name: str, workflow: str, above_pk: int | None) -> QuerySet[Instance]:
    """The instances a schedule started, newest first: of its name and workflow, and above
    its started_above_pk. Names are unique only among the schedules that exist: by name
    alone, a schedule deleted and made again for another workflow listed the old
    workflow's instances as its own; by name and workflow, one made again for the same
    workflow listed the old one's. The bound is an index condition of instance_schedule
    (schedule, id): the old one's instances are not read at all."""
    found = Instance.objects.filter(schedule=name, workflow=workflow)
    if above_pk is not None:
        found = found.filter(pk__gt=above_pk)
    return found.order_by("-id")


def schedule_that_started(instance: Instance) -> Schedule | None:
    """The schedule of the instance's `schedule` name if that one started it (by the rule
    of started_instances); None when it was deleted, even if another now has its name."""
    if not instance.schedule:
        return None
    row = Schedule.objects.filter(name=instance.schedule, workflow=instance.workflow).first()
    if row is None or (row.started_above_pk is not None and instance.pk <= row.started_above_pk):
        return None
    return row


def _greatest_instance_pk() -> int:
    return Instance.objects.aggregate(m=Max("pk"))["m"] or 0


@retry_while_locked
def create_schedule(
    name: str,
    workflow: str,
    cron: str,
    timezone: str,
    params_json: str,
    actor: str = "",
    declared: bool = False,
) -> Schedule:
    """Insert a schedule; ScheduleExists when the name is taken (the unique constraint
    decides, so two processes creating the same name cannot both succeed).

    A runtime schedule's started_above_pk is read after the insert: one that waited there
    for a delete of its name by another process to commit sees every instance the deleted
    schedule started (its ticks and triggers lock its row, which the delete waits for)."""
    now = clock.now()
    try:
        with transaction.atomic():
            row = Schedule.objects.create(
                name=name,
                workflow=workflow,
                cron=cron,
                timezone=timezone,
                params_json=params_json,
                declared=declared,
                next_run_at=next_fire_time(cron, timezone, now),
                created_by=actor,
                created_at=now,
                updated_at=now,
            )
            if not declared:
                row.started_above_pk = _greatest_instance_pk()
                row.save(update_fields=["started_above_pk"])
            return row
    except IntegrityError:
        raise ScheduleExists(f"a schedule named {name!r} already exists") from None


@retry_while_locked
def set_paused(name: str, paused: bool) -> Schedule:
    """Pause (no tick fires) or resume (the next tick after now; ticks missed while paused
    do not fire).

    Under the row's lock: the next tick is computed from the cron as it is when written.
    Read unlocked, a deploy that changed the cron meanwhile (sync_declared) was left with
    the old cron's next tick (a yearly cron made every 5 minutes fired nothing until new
    year), and a delete meanwhile failed the save instead of saying ScheduleNotFound."""
    now = clock.now()
    with transaction.atomic():
        row = lock_rows(Schedule.objects.filter(name=name)).first()
        if row is None:
            raise ScheduleNotFound(f"no schedule named {name!r}")
        if row.paused != paused:
            row.paused = paused
            row.next_run_at = None if paused else next_fire_time(row.cron, row.timezone, now)
            row.updated_at = now
            row.save(update_fields=["paused", "next_run_at", "updated_at"])
    return row


def declared_in_code(row: Schedule) -> bool:
    """A declared schedule goes with its declaration; one whose workflow left the code may
    be deleted by hand (no worker syncs it any more)."""
    return row.declared and any(d.name == row.workflow for d in all_definitions())


@retry_while_locked
def delete_schedule(name: str) -> None:
    row = get_schedule(name)
    if declared_in_code(row):
        raise InvalidInput(
            f"schedule {name!r} is declared in code by register({row.workflow!r}, schedules=[...]); "
            "remove it there, or pause it"
        )
    Schedule.objects.filter(pk=row.pk).delete()


def due_schedules(workflows: Sequence[str], now: datetime) -> list[Schedule]:
    return list(
        Schedule.objects.filter(
            next_run_at__lte=now, paused=False, workflow__in=list(workflows)
        ).order_by("next_run_at")
    )


def next_tick_at(
    workflows: Sequence[str], left: Collection[str] = (), unreadable: Collection[int] = ()
) -> datetime | None:
    """The earliest next tick of the schedules this worker can fire: its idle wait ends there.
    left: workflows whose declared schedules a newer version's workers fire (fire_due);
    unreadable: schedules (pks) whose cron, time zone or stored next tick this process
    cannot evaluate (fire_due)."""
    rows = Schedule.objects.filter(paused=False, workflow__in=list(workflows))
    if left:
        rows = rows.exclude(declared=True, workflow__in=list(left))
    if unreadable:
        rows = rows.exclude(pk__in=list(unreadable))
    return rows.aggregate(m=Min("next_run_at"))["m"]


def fire_due(targets: Sequence[Target]) -> tuple[list[Fired], datetime | None]:
    """Fire every due tick of the schedules of these workflows; returns what fired and the
    earliest next tick. After downtime only the most recent missed tick of each fires."""
    now = clock.now()
    by_name = {t.workflow: t for t in targets}
    fired = []
    due = due_schedules(list(by_name), now)
    # The declared schedules of a workflow of which a newer version is deployed are that
    # version's workers' to fire, as they are theirs to sync (sync_declared): fired here,
    # a tick of the new declarations started an instance of this process's old code.
    left = newer_live_versions({r.workflow: by_name[r.workflow].version for r in due if r.declared})
    unreadable = []
    waits = []  # the next tick, by this process's rules, of a schedule stored by others'
    for row in due:
        if row.declared and row.workflow in left:
            continue
        try:
            tick = latest_fire_time(row.cron, row.timezone, now)
            if tick is None or row.next_run_at is None or tick < row.next_run_at:
                # The stored next tick is not a tick of the cron as this process reads the
                # zone's rules: its tzdata differs from that of the process that computed
                # it (a country moved or dropped its daylight-saving time, and the update
                # is not everywhere yet, or came after). Left as it is, for a process with
                # the same rules to fire (rewritten here, that one's tick was lost); this
                # process waits for its own next tick of it. Answered as the next tick,
                # the past time made every worker poll the schedules without pause.
                unreadable.append(row.pk)
                wait = next_fire_time(row.cron, row.timezone, now)
                if wait is not None:
                    waits.append(wait)
                continue
            started = fire_tick(row, by_name[row.workflow], now)
        except (InvalidInput, CronSimError, ValueError) as exc:
            # A cron or time zone this process cannot read, though the one that stored it
            # could (a tzdata without the zone, another cronsim): logged (each look at the
            # schedules, no traceback), and the other schedules fire. Raised out of the
            # loop, it kept every schedule after it (by next tick) from firing.
            log.error(
                "schedule %r (cron %r, time zone %r) cannot be evaluated by this process, "
                "its ticks do not fire here: %s",
                row.name,
                row.cron,
                row.timezone,
                exc,
            )
            unreadable.append(row.pk)
            continue
        if started is not None:
            fired.append(started)
    if fired and on_fired is not None:
        on_fired([f.instance_pk for f in fired])
    next_tick = next_tick_at(list(by_name), left, unreadable)
    return fired, min([t for t in (next_tick, *waits) if t is not None], default=None)


@retry_while_locked
def fire_tick(row: Schedule, target: Target, now: datetime) -> Fired | None:
    """Fire the latest due tick of one schedule, unless another worker fired it first."""
    guarded = Schedule.objects.filter(pk=row.pk, paused=False, next_run_at=row.next_run_at)
    tick = latest_fire_time(row.cron, row.timezone, now)
    if tick is None or row.next_run_at is None or tick < row.next_run_at:
        return None  # not a tick by this process's rules (see fire_due)

    def move_on(last_instance_id: str) -> bool:
        """The guarded update: True for the one process that moves this tick on."""
        return bool(
            guarded.update(
                next_run_at=next_fire_time(row.cron, row.timezone, now),
                last_tick_at=tick,
                last_instance_id=last_instance_id,
                updated_at=now,
            )
        )

    instance_id = ""
    try:
        instance_id = tick_instance_id(row.name, tick, target.limits.max_instance_id_length)
        with transaction.atomic():
            if not move_on(instance_id):
                return None  # fired (or paused, or changed) by another process meanwhile
            instance = create_in_transaction(
                target.workflow,
                target.version,
                target.limits,
                NewInstance(instance_id, row.params_json, schedule=row.name, scheduled_at=tick),
                f"{DECLARED_ACTOR}:{row.name}",
            )
    except InstanceAlreadyExists:
        # A schedule of this name fired this tick before it was deleted and created again
        # (their clocks apart): the tick starts nothing, and that instance is not this
        # schedule's last one (named so, it showed as this one's last run everywhere).
        with transaction.atomic():
            move_on(row.last_instance_id)
        return None
    except WorkflowError:
        # The instance cannot be created (its params, or its id, break a limit lowered
        # since): skip the tick rather than retry it at every turn of every worker's loop.
        log.exception("schedule %r could not start its tick %s; skipped", row.name, tick)
        with transaction.atomic():
            move_on("")
        return None
    return Fired(row.name, row.workflow, instance.pk, instance_id, instance.trace_id, tick)


@retry_while_locked
def trigger(name: str, target: Target, actor: str = "") -> Instance:
    """Start one instance of the schedule now, outside its ticks.

    Under the schedule row's lock, as a tick is: a delete of the schedule waits for it,
    so one made again under its name afterwards has its started_above_pk above this
    instance. Read unlocked, a trigger racing a delete and a create started an instance
    the new schedule listed as its own."""
    now = clock.now()
    # Held to max_instance_id_length as the id a create makes up is.
    instance_id = check_instance_id(str(uuid.uuid4()), target.limits)
    with transaction.atomic():
        row = lock_rows(Schedule.objects.filter(name=name)).first()
        if row is None:
            raise ScheduleNotFound(f"no schedule named {name!r}")
        instance = create_in_transaction(
            target.workflow,
            target.version,
            target.limits,
            NewInstance(instance_id, row.params_json, schedule=row.name, scheduled_at=now),
            actor or f"{DECLARED_ACTOR}:{row.name}",
        )
        Schedule.objects.filter(pk=row.pk).update(
            last_instance_id=instance.instance_id, updated_at=now
        )
    return instance


DECLARED_SLUG_LENGTH = 70  # of a schedule name's 80 characters, with ":<n>"


def declared_name(workflow: str, position: int) -> str:
    """`<workflow>:<n>` for the n-th cron of register(schedules=[...]), as a schedule name.
    A workflow name that is not a slug as it stands (other characters, or too long) gets a
    hash of itself: "a/b" and "a-b", or two long names alike in their first 70
    characters, would otherwise share (and take turns rewriting) one schedule."""
    slug = re.sub(r"[^A-Za-z0-9_.-]", "-", workflow)
    if slug != workflow or len(slug) > DECLARED_SLUG_LENGTH:
        digest = hashlib.sha256(workflow.encode()).hexdigest()[:8]
        slug = f"{slug[: DECLARED_SLUG_LENGTH - 9]}~{digest}"
    return f"{slug}:{position}"


def _unhashed_declared_name(workflow: str, position: int) -> str:
    """declared_name before it hashed odd names: such rows are renamed, keeping their state."""
    slug = re.sub(r"[^A-Za-z0-9_.-]", "-", workflow)[:DECLARED_SLUG_LENGTH] or "workflow"
    return f"{slug}:{position}"


def _rename_unhashed(workflow: str, position: int, name: str) -> Schedule | None:
    """This workflow's row under its unhashed name, renamed to `name` with the instances
    it started (its pause, next tick and last instance go with it)."""
    old = _unhashed_declared_name(workflow, position)
    if old == name:
        return None
    row = (
        Schedule.objects.select_for_update()
        .filter(name=old, workflow=workflow, declared=True)
        .first()
    )
    if row is None:
        return None
    row.name = name
    row.save(update_fields=["name"])
    Instance.objects.filter(schedule=old, workflow=workflow).update(schedule=name)
    return row


MOVING_STATE = ("paused", "next_run_at", "last_tick_at", "last_instance_id")
FRESH_STATE: dict[str, Any] = {"paused": False, "last_tick_at": None, "last_instance_id": ""}


def _moved_crons(
    workflow: str, wanted: dict[str, str], existing: dict[str, Schedule]
) -> tuple[dict[str, dict[str, Any]], set[str]]:
    """Crons of this workflow's declared rows that a deploy moves to another position (one
    before them was removed, or the list reordered): the state each new position takes
    over, by name, and the names of the rows that gave theirs up. A pause belongs to the
    cron an operator paused, not to the position `<workflow>:<n>` it had in register()."""
    giving: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for row in (
        Schedule.objects.select_for_update()
        .filter(workflow=workflow, declared=True)
        .order_by("name")
    ):
        if wanted.get(row.name) != row.cron:
            state = {field: getattr(row, field) for field in MOVING_STATE}
            giving.setdefault(row.cron, []).append((row.name, state))
    taken: dict[str, dict[str, Any]] = {}
    gave: set[str] = set()
    for name, cron in wanted.items():
        row = existing.get(name)
        if (row is None or row.cron != cron) and giving.get(cron):
            source, taken[name] = giving[cron].pop(0)
            gave.add(source)
    return taken, gave


@retry_while_locked
def sync_declared(declared: Sequence[tuple[str, int, Sequence[str]]]) -> None:
    """Keep the declared schedules of these workflows (name, this process's newest
    version, its crons) in step with their code: create new ones, update a changed cron
    (keeping paused), delete those no longer declared. A workflow of which a newer version
    is deployed is left to that version's workers: an old worker restarting in a rolling
    deploy must not put back what the new code changed (after a rollback the newer
    version's workers are gone, and the old declarations come back)."""
    now = clock.now()
    newer = newer_live_versions({workflow: version for workflow, version, _ in declared})
    for workflow, version in newer.items():
        log.info(
            "declared schedules of workflow %r left to its version %s (this process has an older one)",
            workflow,
            version,
        )
    ours = [(workflow, crons) for workflow, _, crons in declared if workflow not in newer]
    # Most workflows declare none: one read for them all, and a write only if one used to.
    undeclared = Schedule.objects.filter(
        workflow__in=[workflow for workflow, crons in ours if not crons], declared=True
    )
    if undeclared.exists():
        with transaction.atomic():
            undeclared.delete()
    for workflow, crons in ours:
        if not crons:
            continue
        with transaction.atomic():
            wanted = {declared_name(workflow, i): cron for i, cron in enumerate(crons)}
            existing = {
                s.name: s
                for s in Schedule.objects.select_for_update().filter(
                    name__in=list(wanted), declared=True
                )
            }
            for position, name in enumerate(wanted):
                if name not in existing:
                    renamed = _rename_unhashed(workflow, position, name)
                    if renamed is not None:
                        existing[name] = renamed
            taken, gave = _moved_crons(workflow, wanted, existing)
            Schedule.objects.filter(workflow=workflow, declared=True).exclude(
                name__in=list(wanted)
            ).delete()
            for name, cron in wanted.items():
                row = existing.get(name)
                state = taken.get(name)
                if row is None:
                    try:
                        create_schedule(
                            name, workflow, cron, "UTC", "null", DECLARED_ACTOR, declared=True
                        )
                    except ScheduleExists:
                        log.warning(
                            "schedule %r of workflow %r is not declared: a schedule of that name "
                            "exists already",
                            name,
                            workflow,
                        )
                    else:
                        if state is not None:
                            Schedule.objects.filter(name=name).update(**state)
                elif row.cron != cron or row.workflow != workflow:
                    if state is None and name in gave:  # its cron, pause and ticks moved on
                        state = {**FRESH_STATE, "next_run_at": next_fire_time(cron, "UTC", now)}
                    elif state is None:  # the cron at this position changed: paused stays paused
                        state = {
                            "next_run_at": None if row.paused else next_fire_time(cron, "UTC", now)
                        }
                    row.cron, row.workflow, row.updated_at = cron, workflow, now
                    for field, value in state.items():
                        setattr(row, field, value)
                    row.save(update_fields=["cron", "workflow", "updated_at", *MOVING_STATE])
