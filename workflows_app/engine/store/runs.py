"""The writes of a run: checkpoints, parking and finishing, all fenced by the run's lease.

Once an operator terminates or restarts the instance, or another worker takes it over,
the old run's writes match no row and are refused (LeaseLost).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connection, transaction
from django.db.models import Min

from ...models import (
    ErrorRecord,
    InboxEvent,
    Instance,
    Status,
    StepRecord,
    StepStatus,
)
from .. import clock, faults, retention
from ..limits import Limits
from .catalog import VERSION_MISSING
from .control import promote_queued
from .dialect import close_if_dropped, db_time, merge_json_sql, retry_while_locked
from .records import (
    INSTANCE_TABLE,
    STEP_TABLE,
    History,
    LeaseLost,
    append_history,
    close_open_steps,
    insert_history,
)

STEP_COLUMNS = (
    "instance_id",
    "name",
    "kind",
    "seq",
    "status",
    "output_json",
    "attempts",
    "max_attempts",
    "last_error_name",
    "last_error_message",
    "last_error_stack",
    "started_at",
    "completed_at",
    "wake_at",
    "event_type",
    "event_schema_json",
    "has_compensation",
    "after",
)


# One statement whether the step is new or not: a checkpoint is an upsert keyed by name
# and kind (a compensation shares the name of the step it undoes).
UPSERT_STEP_SQL = (
    f"INSERT INTO {STEP_TABLE} ({', '.join(STEP_COLUMNS)}) VALUES ({', '.join(['%s'] * len(STEP_COLUMNS))}) "
    "ON CONFLICT (instance_id, kind, name) DO UPDATE SET "
    + ", ".join(f"{c} = excluded.{c}" for c in STEP_COLUMNS[3:])
)


def fence(
    pk: int,
    token: str,
    now: datetime,
    history_count: int,
    step_seq: int | None,
    progress: bool = False,
) -> tuple[str, int]:
    """Lock the instance row if and only if this run still owns it.

    Returns (status, first history sequence number); raises LeaseLost otherwise.
    """
    sets = "history_seq = history_seq + %s, updated_at = %s"
    params: list[Any] = [history_count, db_time(now)]
    if step_seq is not None:
        sets += ", step_seq = %s"
        params.append(step_seq)
    if progress:
        sets += ", unproductive_claims = 0"
    with connection.cursor() as cursor:
        cursor.execute(
            f"UPDATE {INSTANCE_TABLE} SET {sets} WHERE id = %s AND lease_token = %s RETURNING status, history_seq",
            [*params, pk, token],
        )
        row = cursor.fetchone()
    if row is None:
        raise LeaseLost(f"instance #{pk}: lease {token[:8]} is no longer held")
    return row[0], row[1] - history_count + 1


@retry_while_locked
def write_step(
    pk: int,
    token: str,
    step: StepRecord,
    history: Sequence[History],
    consume_event: int | None = None,
    progress: bool = False,
    error: dict[str, Any] | None = None,
) -> str:
    """Upsert one step record with its history in one fenced transaction; returns the status.

    consume_event marks that inbox event consumed by this step in the same transaction, so
    an event is never both lost and checkpointed, nor consumed twice.
    """
    with transaction.atomic():
        status = _write_step(pk, token, step, history, consume_event, progress, error)
    faults.hit("after_checkpoint")
    return status


@dataclass
class StepWrite:
    """One run's checkpoint, queued for a group commit (write_steps)."""

    pk: int
    token: str
    step: StepRecord
    history: Sequence[History]
    consume_event: int | None = None
    progress: bool = False
    error: dict[str, Any] | None = None


@retry_while_locked
def write_steps(writes: Sequence[StepWrite]) -> list[str | LeaseLost]:
    """Several runs' checkpoints in one transaction: one commit instead of one each.

    Each write is fenced on its own, so a run that lost its lease gets its LeaseLost back
    while the others commit. Rows are locked in instance order, so two
    concurrent group commits can never deadlock on each other.
    """
    if len(writes) == 1:  # no savepoint needed: a LeaseLost rolls the one write back
        w = writes[0]
        try:
            with transaction.atomic():
                status = _write_step(
                    w.pk, w.token, w.step, w.history, w.consume_event, w.progress, w.error
                )
        except LeaseLost as exc:
            return [exc]
        faults.hit("after_checkpoint")
        return [status]
    close_if_dropped()
    results: dict[int, str | LeaseLost] = {}
    with transaction.atomic():
        for index in sorted(range(len(writes)), key=lambda i: writes[i].pk):
            w = writes[index]
            # The fence is a write's first statement and changes nothing when it fails;
            # only a write consuming an event can fail after changing rows: a savepoint.
            scope = (
                transaction.atomic() if w.consume_event is not None else contextlib.nullcontext()
            )
            try:
                with scope:
                    results[index] = _write_step(
                        w.pk, w.token, w.step, w.history, w.consume_event, w.progress, w.error
                    )
            except LeaseLost as exc:
                results[index] = exc
    for _ in writes:
        faults.hit("after_checkpoint")
    return [results[i] for i in range(len(writes))]


def _write_step(
    pk: int,
    token: str,
    step: StepRecord,
    history: Sequence[History],
    consume_event: int | None,
    progress: bool,
    error: dict[str, Any] | None,
) -> str:
    faults.hit("before_checkpoint")
    now = clock.now()
    status, first_seq = fence(pk, token, now, len(history), step.seq, progress)
    if consume_event is not None:
        taken = InboxEvent.objects.filter(id=consume_event, consumed_at__isnull=True).update(
            consumed_at=now, consumed_by=step.name
        )
        if not taken:
            raise LeaseLost(f"event #{consume_event} was consumed by another run")
    step.instance_id = pk
    with connection.cursor() as cursor:
        cursor.execute(
            UPSERT_STEP_SQL,
            [
                pk,
                step.name,
                step.kind,
                step.seq,
                step.status,
                step.output_json,
                step.attempts,
                step.max_attempts,
                step.last_error_name,
                step.last_error_message,
                step.last_error_stack,
                db_time(step.started_at),
                db_time(step.completed_at),
                db_time(step.wake_at),
                step.event_type,
                step.event_schema_json,
                step.has_compensation,
                step.after,
            ],
        )
    insert_history(pk, first_seq, history, now)
    if error is not None:
        ErrorRecord.objects.create(instance_id=pk, created_at=now, **error)
    return status


@retry_while_locked
def rewrite_step(w: StepWrite) -> str:
    """Write a checkpoint again after a transient error, unless the first try landed.

    The error may have come after the commit (the connection dropped before the answer):
    the step row then already holds this write's status and attempt, and writing it again
    would duplicate its history. The fence makes both paths safe: a lost lease raises.
    """
    with transaction.atomic():
        held = (
            Instance.objects.filter(id=w.pk, lease_token=w.token)
            .values_list("status", flat=True)
            .first()
        )
        if held is None:
            raise LeaseLost(f"instance #{w.pk}: lease {w.token[:8]} is no longer held")
        stored = (
            StepRecord.objects.filter(instance_id=w.pk, kind=w.step.kind, name=w.step.name)
            .values_list("status", "attempts")
            .first()
        )
        if stored == (w.step.status, w.step.attempts):
            return held
        status = _write_step(w.pk, w.token, w.step, w.history, w.consume_event, w.progress, w.error)
    faults.hit("after_checkpoint")
    return status


@retry_while_locked
def finish(
    pk: int,
    token: str,
    status: str,
    limits: Limits,
    output_json: str | None = None,
    error: tuple[str, str, str] | None = None,
    history: Sequence[History] = (),
    error_record: dict[str, Any] | None = None,
) -> bool:
    """End the instance (complete, errored, terminated), free its place, start queued ones."""
    now = clock.now()
    name, message, stack = error or ("", "", "")
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(
                f"UPDATE {INSTANCE_TABLE} SET history_seq = history_seq + %s, updated_at = %s, status = %s, "
                "output_json = %s, error_name = %s, error_message = %s, error_stack = %s, finished_at = %s, "
                "compensate_on_cancel = %s, wake_at = NULL, waiting_reason = '', lease_token = NULL, "
                "lease_owner = '', lease_expires_at = NULL "
                "WHERE id = %s AND lease_token = %s "
                "RETURNING history_seq, retention_ms, retention_error_ms, workflow",
                [
                    len(history),
                    db_time(now),
                    status,
                    output_json,
                    name,
                    message,
                    stack,
                    db_time(now),
                    False,
                    pk,
                    token,
                ],
            )
            row = cursor.fetchone()
        if row is None:
            return False
        last_seq, success_ms, error_ms, workflow = row
        close_open_steps(pk, now)
        expiry = retention.expires_at(status, success_ms, error_ms, limits, now)
        if expiry is not None:
            Instance.objects.filter(id=pk).update(expires_at=expiry)
        insert_history(pk, last_seq - len(history) + 1, history, now)
        if error_record is not None:
            ErrorRecord.objects.create(instance_id=pk, created_at=now, **error_record)
        if limits.max_concurrent_instances is not None:  # queues exist only under a limit
            promote_queued(workflow, limits, now)
    return True


@retry_while_locked
def park(
    pk: int,
    token: str,
    pause: bool,
    awaited_types: Sequence[str],
    reason: str = "",
    events_seen: int = 0,
) -> str:
    """Free the worker: store when the instance is due next and release the lease.

    The wake time is read from the step rows (sleep ends, retry times, event timeouts), so
    a skip_sleep that landed during the run is honoured. An event of an awaited type that
    arrived during the run (id above events_seen) makes the instance due at once: no
    wake-up is lost. The row, not the run, says whether a pause holds: a run that stopped
    early (for a pause resumed meanwhile, or its worker shutting down) is due at once.
    """
    now = clock.now()
    with transaction.atomic():
        status, _ = fence(pk, token, now, 0, None)
        if status in (Status.WAITING_FOR_PAUSE, Status.PAUSED):
            new_status, wake_at = Status.PAUSED, None
        elif pause:  # stopped early (a pause resumed meanwhile, a worker draining): due at once
            new_status = Status.COMPENSATING if status == Status.COMPENSATING else Status.WAITING
            wake_at = now
        else:
            new_status = Status.COMPENSATING if status == Status.COMPENSATING else Status.WAITING
            wake_at = StepRecord.objects.filter(
                instance_id=pk, status__in=(StepStatus.WAITING, StepStatus.RETRYING)
            ).aggregate(m=Min("wake_at"))["m"]
            # Only events the run did not see: one it saw and passed over (a typed wait's
            # schema refused it) must not make the instance due again and again.
            if (
                awaited_types
                and InboxEvent.objects.filter(
                    instance_id=pk,
                    consumed_at__isnull=True,
                    type__in=list(awaited_types),
                    id__gt=events_seen,
                ).exists()
            ):
                wake_at = now
        Instance.objects.filter(id=pk).update(
            status=new_status,
            wake_at=wake_at,
            waiting_reason=reason,
            lease_token=None,
            lease_owner="",
            lease_expires_at=None,
        )
        if new_status == Status.PAUSED:
            append_history(pk, [History("instance.paused", {"at": "step boundary"})], now)
    return new_status


@retry_while_locked
def begin_compensation(pk: int, token: str, data: dict[str, Any]) -> None:
    """A run failed and unwinds: show the instance compensating, record why, once.

    A replay that fails the same way finds the row compensating already and adds nothing.
    """
    now = clock.now()
    with transaction.atomic():
        status, _ = fence(pk, token, now, 0, None)
        if status == Status.COMPENSATING:
            return
        Instance.objects.filter(id=pk).update(status=Status.COMPENSATING)
        append_history(pk, [History("compensation.started", data)], now)


@retry_while_locked
def park_unrunnable(pk: int, token: str, reason: str) -> None:
    """Park an instance this process cannot run (its version is not registered here)."""
    with transaction.atomic():
        try:
            fence(pk, token, clock.now(), 0, None)
        except LeaseLost:
            return
        Instance.objects.filter(id=pk).update(
            status=Status.WAITING,
            wake_at=None,
            waiting_reason=VERSION_MISSING + reason,
            lease_token=None,
            lease_owner="",
            lease_expires_at=None,
        )


@retry_while_locked
def merge_attributes(pk: int, token: str, attributes: dict[str, Any]) -> None:
    """step.set_attributes: upsert keys into the instance's search attributes, fenced by the
    run's lease (a run that lost its instance changes nothing). Idempotent, so a repeat
    after a crash before the step's checkpoint writes the same values again."""
    with transaction.atomic():
        fence(pk, token, clock.now(), 0, None)
        with connection.cursor() as cursor:
            cursor.execute(
                f"UPDATE {INSTANCE_TABLE} SET attributes = {merge_json_sql('attributes')} "
                "WHERE id = %s",
                [json.dumps(attributes, separators=(",", ":")), pk],
            )
