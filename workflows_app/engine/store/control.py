"""Admission and operator control: creating instances, the queue under
max_concurrent_instances, pause, resume, terminate, restart, skip sleep, send event, cancel.

Each action is one transaction under the instance's row lock; the lifecycle table
(engine/lifecycle.py) says which action applies to which status.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import Q

from ...models import (
    HistoryRecord,
    InboxEvent,
    Instance,
    Status,
    StepKind,
    StepRecord,
    StepStatus,
    WorkflowVersion,
)
from .. import clock, lifecycle, retention
from ..errors import (
    InstanceAlreadyExists,
    InstanceNotFound,
    InvalidInput,
    InvalidTransition,
)
from ..limits import Limits
from ..registry import limits_for
from .dialect import lock_rows, retry_while_locked
from .records import (
    History,
    NewInstance,
    append_histories,
    append_history,
    clear_lease,
    close_open_steps,
    locked_instance,
)

# Told (after commit) which queued instances a transaction started; set by the app's live layer.
on_promoted: Callable[[list[int]], None] | None = None


def lock_workflow(name: str) -> None:
    """Serialise admission decisions of one workflow (PostgreSQL: row locks on its catalog)."""
    list(WorkflowVersion.objects.select_for_update().filter(name=name).values_list("id", flat=True))


def holding_places(instances: Any) -> Any:
    """The instances of a queryset that hold a place under max_concurrent_instances."""
    return instances.filter(
        Q(status__in=lifecycle.HOLDS_PLACE - {Status.PAUSED})
        | Q(status=Status.PAUSED, started_at__isnull=False)
    )


def _free_slots(name: str, limits: Limits) -> int | None:
    """Places left under max_concurrent_instances, or None for no limit."""
    if limits.max_concurrent_instances is None:
        return None
    active = holding_places(Instance.objects.filter(workflow=name)).count()
    return max(0, limits.max_concurrent_instances - active)


@retry_while_locked
def create_instances(
    name: str, version: int, limits: Limits, items: Sequence[NewInstance], actor: str = ""
) -> list[tuple[Instance, bool]]:
    """Insert instances all-or-nothing; an idempotency key already used returns its instance.

    Returns (instance, created) pairs in the order of items.
    """
    for attempt in range(3):
        try:
            with transaction.atomic():
                return _create_instances(name, version, limits, items, actor)
        except IntegrityError as exc:
            # A concurrent create with the same idempotency key or id won the race; the
            # next attempt sees its row. Anything else is a real conflict.
            if attempt == 2:
                raise InstanceAlreadyExists(
                    f"could not create instances of {name!r}: {exc}"
                ) from None
    raise AssertionError("unreachable")


def _create_instances(
    name: str, version: int, limits: Limits, items: Sequence[NewInstance], actor: str
) -> list[tuple[Instance, bool]]:
    now = clock.now()
    keys = [i.idempotency_key for i in items if i.idempotency_key]
    existing_by_key = (
        {
            inst.idempotency_key: inst
            for inst in Instance.objects.filter(
                workflow=name, version=version, idempotency_key__in=keys
            )
        }
        if keys
        else {}
    )
    fresh = [i for i in items if not (i.idempotency_key and i.idempotency_key in existing_by_key)]
    ids = [i.instance_id for i in fresh]
    if len(set(ids)) != len(ids):
        raise InvalidInput("a batch names the same instance id twice")
    taken = list(
        Instance.objects.filter(workflow=name, instance_id__in=ids).values_list(
            "instance_id", flat=True
        )
    )
    if taken:
        raise InstanceAlreadyExists(
            f"workflow {name!r} already has an instance with id {taken[0]!r}"
        )
    if limits.max_concurrent_instances is not None:
        lock_workflow(name)
    slots = _free_slots(name, limits)
    if slots is not None and Instance.objects.filter(workflow=name, status=Status.QUEUED).exists():
        slots = 0  # earlier queued instances go first: creation order
    rows = []
    for item in fresh:
        admitted = slots is None or slots > 0
        if slots is not None and admitted:
            slots -= 1
        rows.append(
            Instance(
                workflow=name,
                instance_id=item.instance_id,
                version=version,
                status=Status.RUNNING if admitted else Status.QUEUED,
                params_json=item.params_json,
                idempotency_key=item.idempotency_key,
                created_by=actor,
                created_at=now,
                updated_at=now,
                started_at=now if admitted else None,
                wake_at=now if admitted else None,
                retention_ms=item.retention_ms,
                retention_error_ms=item.retention_error_ms,
                attributes=item.attributes,
                history_seq=1,
                trace_id=uuid.uuid4().hex,
            )
        )
    Instance.objects.bulk_create(rows)
    HistoryRecord.objects.bulk_create(
        HistoryRecord(
            instance_id=row.pk,
            sequence=1,
            created_at=now,
            type="instance.created",
            data={"version": version, "status": row.status},
            actor=actor,
        )
        for row in rows
    )
    created = iter(rows)
    return [
        (existing_by_key[i.idempotency_key], False)
        if i.idempotency_key and i.idempotency_key in existing_by_key
        else (next(created), True)
        for i in items
    ]


def promote_queued(name: str, limits: Limits, now: datetime) -> list[int]:
    """Start queued instances of a workflow, oldest first, while there is room."""
    if not Instance.objects.filter(workflow=name, status=Status.QUEUED).exists():
        return []
    lock_workflow(name)
    slots = _free_slots(name, limits)
    queue = Instance.objects.filter(workflow=name, status=Status.QUEUED).order_by("id")
    pks = list((queue if slots is None else queue[:slots]).values_list("id", flat=True))
    if pks:
        Instance.objects.filter(id__in=pks, status=Status.QUEUED).update(
            status=Status.RUNNING, wake_at=now, started_at=now, updated_at=now
        )
        for pk in pks:
            append_history(pk, [History("instance.started", {"from": "queued"})], now)
        if on_promoted is not None:
            callback = on_promoted
            transaction.on_commit(lambda: callback(pks))
    return pks


@retry_while_locked
def promote_all_queued(workflows: Sequence[tuple[str, Limits]]) -> int:
    """At worker start: queued instances start wherever there is room (after a restart too)."""
    now = clock.now()
    total = 0
    for name, limits in workflows:
        with transaction.atomic():
            total += len(promote_queued(name, limits, now))
    return total


def get_instance(name: str, instance_id: str) -> Instance:
    try:
        return Instance.objects.get(workflow=name, instance_id=instance_id)
    except Instance.DoesNotExist:
        raise InstanceNotFound(f"workflow {name!r} has no instance {instance_id!r}") from None


@retry_while_locked
def pause(name: str, instance_id: str, actor: str = "") -> str:
    now = clock.now()
    with transaction.atomic():
        inst = locked_instance(name, instance_id)
        held = (
            inst.lease_token is not None
            and inst.lease_expires_at is not None
            and inst.lease_expires_at > now
        )
        new_status = lifecycle.after(lifecycle.PAUSE, inst.status, instance_id, held_by_run=held)
        updates: dict[str, Any] = {"status": new_status, "updated_at": now}
        if new_status == Status.PAUSED:
            updates.update(wake_at=None, **clear_lease())
        Instance.objects.filter(id=inst.pk).update(**updates)
        if new_status == Status.PAUSED:
            append_history(inst.pk, [History("instance.paused", {"from": inst.status}, actor)], now)
        else:
            append_history(inst.pk, [History("instance.pause_requested", {}, actor)], now)
    return new_status


@retry_while_locked
def resume(name: str, instance_id: str, limits: Limits, actor: str = "") -> str:
    """Resume a paused instance; one paused while still queued goes back through admission."""
    now = clock.now()
    with transaction.atomic():
        inst = locked_instance(name, instance_id)
        new_status = lifecycle.after(
            lifecycle.RESUME, inst.status, instance_id, admitted=inst.started_at is not None
        )
        if new_status == Status.QUEUED:
            Instance.objects.filter(id=inst.pk).update(
                status=Status.QUEUED, wake_at=None, updated_at=now
            )
            append_history(
                inst.pk, [History("instance.resumed", {"to": Status.QUEUED}, actor)], now
            )
            if inst.pk in promote_queued(name, limits, now):
                new_status = Status.RUNNING
        elif inst.status == Status.WAITING_FOR_PAUSE:
            Instance.objects.filter(id=inst.pk).update(status=Status.RUNNING, updated_at=now)
            append_history(inst.pk, [History("instance.resumed", {}, actor)], now)
        else:
            Instance.objects.filter(id=inst.pk).update(
                status=Status.RUNNING, wake_at=now, updated_at=now
            )
            append_history(inst.pk, [History("instance.resumed", {}, actor)], now)
    return new_status


@retry_while_locked
def terminate(
    name: str, instance_id: str, limits: Limits, actor: str = "", reason: str = ""
) -> bool:
    """Terminate a live instance; returns False if it had already finished."""
    with transaction.atomic():
        inst = locked_instance(name, instance_id)
        if not lifecycle.can(lifecycle.TERMINATE, inst.status):
            return False
        _terminate_locked([inst], lambda _: limits, actor, reason, clock.now())
    return True


def terminate_batch(pks: Sequence[int], actor: str = "", reason: str = "") -> list[Instance]:
    """Terminate the live instances among pks as terminate() does each, with a few
    statements for the lot (inside the caller's transaction: a bulk job's batch); returns
    the instances terminated. Rows are locked in id order, as every multi-row lock is."""
    rows = list(
        lock_rows(Instance.objects.filter(id__in=list(pks)).order_by("id")).only(
            "id", "workflow", "version", "status", "retention_ms", "retention_error_ms"
        )
    )
    live = [row for row in rows if lifecycle.can(lifecycle.TERMINATE, row.status)]
    if live:
        _terminate_locked(
            live, lambda inst: limits_for(inst.workflow, inst.version), actor, reason, clock.now()
        )
    return live


def _terminate_locked(
    insts: Sequence[Instance],
    limits_of: Callable[[Instance], Limits],
    actor: str,
    reason: str,
    now: datetime,
) -> None:
    """End live, locked instances: one UPDATE per distinct expiry, their open steps closed,
    a history record each, and queued instances of their workflows started in their place."""
    by_expiry: dict[datetime | None, list[int]] = {}
    for inst in insts:
        expiry = retention.expires_at(
            Status.TERMINATED, inst.retention_ms, inst.retention_error_ms, limits_of(inst), now
        )
        by_expiry.setdefault(expiry, []).append(inst.pk)
    for expiry, pks in by_expiry.items():
        Instance.objects.filter(id__in=pks).update(
            status=Status.TERMINATED,
            wake_at=None,
            finished_at=now,
            updated_at=now,
            waiting_reason="",
            compensate_on_cancel=False,
            expires_at=expiry,
            **clear_lease(),
        )
    pks = [inst.pk for inst in insts]
    close_open_steps(pks[0] if len(pks) == 1 else pks, now)
    append_histories(
        {
            inst.pk: History("instance.terminated", {"from": inst.status, "reason": reason}, actor)
            for inst in insts
        },
        now,
    )
    for workflow, inst in {inst.workflow: inst for inst in insts}.items():
        promote_queued(workflow, limits_of(inst), now)


@retry_while_locked
def restart(
    name: str, instance_id: str, limits: Limits, from_step: str | None = None, actor: str = ""
) -> str:
    """Drop checkpoints (all, or from_step and every step started after it) and run again."""
    now = clock.now()
    with transaction.atomic():
        inst = locked_instance(name, instance_id)
        steps = StepRecord.objects.filter(instance_id=inst.pk)
        if from_step is not None:
            anchor = (
                steps.exclude(kind=StepKind.COMPENSATE)
                .filter(name=from_step)
                .values_list("seq", flat=True)
                .first()
            )
            if anchor is None:
                raise InvalidInput(f"instance {instance_id!r} has no step named {from_step!r}")
            steps = steps.filter(Q(seq__gte=anchor) | ~Q(status=StepStatus.COMPLETE))
        dropped = steps.count()
        steps.delete()
        was_active = lifecycle.holds_place(inst.status, inst.started_at is not None)
        if limits.max_concurrent_instances is not None:
            lock_workflow(name)
        slots = _free_slots(name, limits)
        admitted = was_active or slots is None or slots > 0
        Instance.objects.filter(id=inst.pk).update(
            status=Status.RUNNING if admitted else Status.QUEUED,
            wake_at=now if admitted else None,
            started_at=(inst.started_at or now) if admitted else None,
            output_json=None,
            error_name="",
            error_message="",
            error_stack="",
            finished_at=None,
            expires_at=None,
            waiting_reason="",
            updated_at=now,
            unproductive_claims=0,
            compensate_on_cancel=False,
            **clear_lease(),
        )
        append_history(
            inst.pk,
            [
                History(
                    "instance.restarted",
                    {"from_step": from_step, "dropped_steps": dropped, "from": inst.status},
                    actor,
                )
            ],
            now,
        )
    return Status.RUNNING if admitted else Status.QUEUED


@retry_while_locked
def skip_sleep(name: str, instance_id: str, actor: str = "") -> int:
    """Make the current sleeps of an instance due now; returns how many were woken."""
    now = clock.now()
    with transaction.atomic():
        inst = locked_instance(name, instance_id)
        woken = StepRecord.objects.filter(
            instance_id=inst.pk,
            kind__in=(StepKind.SLEEP, StepKind.SLEEP_UNTIL),
            status=StepStatus.WAITING,
        ).update(wake_at=now)
        if not woken:
            raise InvalidTransition(
                f"instance {instance_id!r} is not sleeping (it is {inst.status})"
            )
        if inst.status in (Status.WAITING, Status.RUNNING):
            Instance.objects.filter(id=inst.pk).update(wake_at=now, updated_at=now)
        append_history(inst.pk, [History("sleep.skipped", {"count": woken}, actor)], now)
    return woken


@retry_while_locked
def send_event(
    name: str,
    instance_id: str,
    event_type: str,
    payload_json: str,
    validate: Any = None,
    actor: str = "",
) -> InboxEvent:
    """Store an event for an instance and make it due if it is running or waiting.

    validate(schema_json) is called with the schema of the step waiting for this type
    (if any) before anything is written; it raises to refuse the payload.
    """
    now = clock.now()
    with transaction.atomic():
        inst = locked_instance(name, instance_id)
        if not lifecycle.can(lifecycle.SEND_EVENT, inst.status):
            raise InvalidTransition(
                f"cannot send event {event_type!r} to instance {instance_id!r}: it is {inst.status}"
            )
        if validate is not None:
            schema = (
                StepRecord.objects.filter(
                    instance_id=inst.pk,
                    kind=StepKind.WAIT_FOR_EVENT,
                    status=StepStatus.WAITING,
                    event_type=event_type,
                    event_schema_json__isnull=False,
                )
                .order_by("seq")
                .values_list("event_schema_json", flat=True)
                .first()
            )
            if schema is not None:
                validate(schema)
        event = InboxEvent.objects.create(
            instance_id=inst.pk,
            type=event_type,
            payload_json=payload_json,
            created_at=now,
            actor=actor,
        )
        if inst.status in (Status.WAITING, Status.RUNNING):
            Instance.objects.filter(id=inst.pk).update(wake_at=now, updated_at=now)
        append_history(
            inst.pk, [History("event.sent", {"type": event_type, "event_id": event.pk}, actor)], now
        )
    return event


@retry_while_locked
def cancel(name: str, instance_id: str, limits: Limits, compensate: bool, actor: str = "") -> str:
    """Cancel: terminate at once, or first run the compensations of completed steps."""
    now = clock.now()
    with transaction.atomic():
        inst = locked_instance(name, instance_id)
        lifecycle.after(lifecycle.CANCEL, inst.status, instance_id)
        compensable = (
            compensate
            and StepRecord.objects.filter(
                instance_id=inst.pk,
                kind=StepKind.DO,
                status=StepStatus.COMPLETE,
                has_compensation=True,
            ).exists()
        )
        if not compensable:
            append_history(
                inst.pk, [History("instance.cancelled", {"compensate": compensate}, actor)], now
            )
            _terminate_locked([inst], lambda _: limits, actor, "cancelled", now)
            return Status.TERMINATED
        # The next run replays to collect the compensations, then runs them newest first.
        Instance.objects.filter(id=inst.pk).update(
            status=Status.COMPENSATING,
            compensate_on_cancel=True,
            wake_at=now,
            updated_at=now,
            waiting_reason="",
            **clear_lease(),
        )
        append_history(inst.pk, [History("compensation.started", {"reason": "cancel"}, actor)], now)
        return Status.COMPENSATING
