"""The writes of a run: checkpoints, parking and finishing, all fenced by the run's lease.

Once an operator terminates or restarts the instance, or another worker takes it over,
the old run's writes match no row and are refused (LeaseLost).
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import Case, Min, Q, Value, When

from ...models import (
    ErrorRecord,
    InboxEvent,
    Instance,
    InstanceAttribute,
    Status,
    StepRecord,
    StepStatus,
)
from .. import clock, faults, retention
from ..attributes import MAX_ATTRIBUTES
from ..durations import LATEST_INSTANT
from ..errors import LimitExceeded
from ..limits import Limits
from .catalog import ABSENT_VERSION_RECHECK, VERSION_LIVE, VERSION_MISSING
from .control import end_awaited_children, promote_queued
from .dialect import (
    array_literal,
    close_if_dropped,
    compact_json_of,
    db_time,
    from_db_time,
    lock_rows,
    merge_json_sql,
    pipeline,
    recordset_columns,
    retry_while_locked,
    sql_cursor,
    statement_cursor,
    typed_placeholders,
    writes_in_one_statement,
)
from .leases import VERSION_RECHECK
from .records import (
    ERROR_TABLE,
    FINISHED_BEFORE_STEP,
    HISTORY_TABLE,
    INBOX_TABLE,
    INSTANCE_TABLE,
    OPEN_STEP_STATUSES,
    STEP_TABLE,
    History,
    LeaseLost,
    append_history,
    close_open_steps,
    compact_json,
    fit_waiting_reason,
    insert_history,
    insert_history_rows,
    wake_parent,
)
from .search import upsert_attributes

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


# An error record's columns besides its keys and time: a raw INSERT sets every one (a
# default of the model is not a default of the table).
ERROR_FIELDS = [
    f
    for f in ErrorRecord._meta.concrete_fields
    if f.column not in ("id", "instance_id", "created_at")
]
ERROR_COLUMNS = tuple(f.column for f in ERROR_FIELDS)


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
    with sql_cursor() as cursor:
        cursor.execute(
            f"UPDATE {INSTANCE_TABLE} SET {sets} WHERE id = %s AND lease_token = %s RETURNING status, history_seq",
            [*params, pk, token],
        )
        row = cursor.fetchone()
    if row is None:
        raise LeaseLost(f"instance #{pk}: lease {token[:8]} is no longer held")
    return row[0], row[1] - history_count + 1


def cancel_pending(pk: int, token: str) -> bool:
    """Whether this run still holds the lease of an instance a cancel(compensate=True)
    marked meanwhile: its end was refused for that, not for a lost lease."""
    return Instance.objects.filter(id=pk, lease_token=token, compensate_on_cancel=True).exists()


# An end's fence besides its lease (its parameter: whether the end is a compensating
# cancel's own, `terminated`): a cancel(compensate=True) that came while the run held its
# lease refuses the run's other ends, and the run unwinds instead (Run.end).
NO_CANCEL_PENDING = "(NOT compensate_on_cancel OR %s)"


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


@dataclass
class FinishWrite:
    """A run's end (see finish) sharing a group commit with other runs' checkpoints.

    Only for what finish does in one fenced UPDATE and a few plain writes after it: no
    parent to wake and lock first, no queue to promote (flow control)."""

    pk: int
    token: str
    status: str
    limits: Limits
    output_json: str | None = None
    error: tuple[str, str, str] | None = None
    history: Sequence[History] = ()
    error_record: dict[str, Any] | None = None
    step: StepWrite | None = None  # the run's last checkpoint, written with its end


@retry_while_locked
def write_steps(writes: Sequence[StepWrite | FinishWrite]) -> list[str | bool | LeaseLost]:
    """Several runs' checkpoints (and ends) in one transaction: one commit instead of one each.

    Each write is fenced on its own, so a run that lost its lease gets its LeaseLost back
    (an end gets False) while the others commit. Rows are locked in instance order, so two
    concurrent group commits can never deadlock on each other. On PostgreSQL the group's
    checkpoints are pipelined and its ends go in one statement (_write_pipelined).
    """
    if len(writes) == 1 and isinstance(writes[0], FinishWrite):
        f = writes[0]
        return [
            finish(
                f.pk,
                f.token,
                f.status,
                f.limits,
                f.output_json,
                f.error,
                f.history,
                f.error_record,
                step=f.step,
            )
        ]
    if len(writes) == 1:  # no savepoint needed: a LeaseLost rolls the one write back
        w = writes[0]
        try:
            if writes_in_one_statement():
                status = _write_at_once(w)
            else:
                with transaction.atomic():
                    status = _write_step(
                        w.pk, w.token, w.step, w.history, w.consume_event, w.progress, w.error
                    )
        except LeaseLost as exc:
            return [exc]
        faults.hit("after_checkpoint")
        return [status]
    if writes_in_one_statement():
        return _write_pipelined(writes)
    close_if_dropped()
    results: dict[int, str | bool | LeaseLost] = {}
    with transaction.atomic():
        ends = [i for i in range(len(writes)) if isinstance(writes[i], FinishWrite)]
        if ends:  # their fence is their first statement: nothing written for a lost lease
            ended = _finish_group([writes[i] for i in ends])  # type: ignore[misc]
            results.update(zip(ends, ended))
        for index in sorted(range(len(writes)), key=lambda i: writes[i].pk):
            w = writes[index]
            if isinstance(w, FinishWrite):
                continue
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
    for w in writes:
        if not isinstance(w, FinishWrite) or w.step is not None:
            faults.hit("after_checkpoint")
    return [results[i] for i in range(len(writes))]


def _finish_group(ends: Sequence[FinishWrite]) -> list[bool]:
    """A group's ends on SQLite, inside its transaction, in a few statements for them all
    (finish's writes, each end with its held step): the ends' fenced UPDATE, their held
    steps, the steps they close, their expiry and their history. Seven statements per end
    held SQLite's write lock longer (a group of 100: 44 ms, now 28). False for an end
    whose lease is lost: nothing of it is written."""
    now = clock.now()
    rows = []
    for end in ends:
        held = end.step
        if held is not None:
            assert held.consume_event is None and held.error is None, "only plain ones are held"
            faults.hit("before_checkpoint")
        name, message, stack = end.error or ("", "", "")
        count = len(end.history) + (len(held.history) if held is not None else 0)
        step_seq = held.step.seq if held is not None else None
        progress = held is not None and held.progress
        fields = (end.pk, end.token, end.status, end.output_json, name, message, stack)
        rows.append([*fields, count, step_seq, int(progress)])
    value = "json_extract(j.value, '$[{}]')".format
    with sql_cursor() as cursor:
        cursor.execute(
            f"UPDATE {INSTANCE_TABLE} SET history_seq = history_seq + {value(7)}, "
            f"updated_at = %s, status = {value(2)}, output_json = {value(3)}, "
            f"error_name = {value(4)}, error_message = {value(5)}, error_stack = {value(6)}, "
            "finished_at = %s, compensate_on_cancel = 0, wake_at = NULL, waiting_reason = '', "
            "lease_token = NULL, lease_owner = '', lease_expires_at = NULL, "
            f"step_seq = COALESCE({value(8)}, step_seq), "
            f"unproductive_claims = CASE WHEN {value(9)} THEN 0 ELSE unproductive_claims END "
            f"FROM json_each(%s) AS j WHERE {INSTANCE_TABLE}.id = {value(0)} "
            f"AND {INSTANCE_TABLE}.lease_token = {value(1)} "
            f"AND (NOT {INSTANCE_TABLE}.compensate_on_cancel OR {value(2)} = '{Status.TERMINATED}') "
            f"RETURNING {INSTANCE_TABLE}.id, {INSTANCE_TABLE}.history_seq, "
            f"{INSTANCE_TABLE}.retention_ms, {INSTANCE_TABLE}.retention_error_ms",
            [db_time(now), db_time(now), json.dumps(rows)],
        )
        finished = {pk: rest for pk, *rest in cursor.fetchall()}
        done = [end for end in ends if end.pk in finished]
        steps = [end.step for end in done if end.step is not None]
        if steps:  # written before the open steps are closed: a held step is not open
            cursor.executemany(UPSERT_STEP_SQL, [_step_values(w.pk, w.step) for w in steps])
            for w in steps:
                w.step.instance_id = w.pk
        close_open_steps([end.pk for end in done], now)
        expiries = []
        for end in done:
            _, success_ms, error_ms = finished[end.pk]
            expiry = retention.expires_at(end.status, success_ms, error_ms, end.limits, now)
            if expiry is not None:
                expiries.append([end.pk, db_time(expiry)])
        if expiries:
            cursor.execute(
                f"UPDATE {INSTANCE_TABLE} SET expires_at = {value(1)} FROM json_each(%s) AS j "
                f"WHERE {INSTANCE_TABLE}.id = {value(0)}",
                [json.dumps(expiries)],
            )
    history = []
    for end in done:
        records = [*(end.step.history if end.step is not None else ()), *end.history]
        first = finished[end.pk][0] - len(records) + 1
        history += [(end.pk, first + n, record) for n, record in enumerate(records)]
        if end.error_record is not None:
            ErrorRecord.objects.create(instance_id=end.pk, created_at=now, **end.error_record)
    insert_history_rows(history, now)
    return [end.pk in finished for end in ends]


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
    with sql_cursor() as cursor:
        cursor.execute(UPSERT_STEP_SQL, _step_values(pk, step))
    insert_history(pk, first_seq, history, now)
    if error is not None:
        ErrorRecord.objects.create(instance_id=pk, created_at=now, **error)
    return status


def _step_values(pk: int, step: StepRecord) -> list[Any]:
    return [
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
    ]


@functools.cache
def _checkpoint_sql(
    history_count: int,
    step_seq: bool,
    progress: bool,
    consume: bool,
    error_columns: tuple[str, ...],
) -> str:
    """The statement of _write_at_once for one shape of checkpoint (cached per shape).

    Every part selects FROM the fence, so when the lease is gone nothing is written; with
    an event to consume, the fence also requires it unconsumed, and the rest requires it
    taken.
    """
    sets = "history_seq = history_seq + %s, updated_at = %s"
    if step_seq:
        sets += ", step_seq = %s"
    if progress:
        sets += ", unproductive_claims = 0"
    where = "id = %s AND lease_token = %s"
    if consume:
        where += f" AND EXISTS (SELECT 1 FROM {INBOX_TABLE} WHERE id = %s AND consumed_at IS NULL)"
    parts = [
        f"fence AS (UPDATE {INSTANCE_TABLE} SET {sets} WHERE {where} RETURNING status, history_seq)"
    ]
    source = "fence"
    if consume:
        parts.append(
            f"taken AS (UPDATE {INBOX_TABLE} SET consumed_at = %s, consumed_by = %s "
            "WHERE id = %s AND consumed_at IS NULL AND EXISTS (SELECT 1 FROM fence) RETURNING id)"
        )
        source = "fence, taken"
    parts.append(
        f"step AS (INSERT INTO {STEP_TABLE} ({', '.join(STEP_COLUMNS)}) "
        f"SELECT {', '.join(typed_placeholders(StepRecord, STEP_COLUMNS))} FROM {source} "
        + UPSERT_STEP_SQL[UPSERT_STEP_SQL.index("ON CONFLICT") :]
        + ")"
    )
    if history_count:
        rows = ", ".join(f"({n}, %s, %s, %s)" for n in range(1, history_count + 1))
        parts.append(
            f"history AS (INSERT INTO {HISTORY_TABLE} (instance_id, sequence, created_at, type, data, actor) "
            f"SELECT %s, fence.history_seq - {history_count} + v.n, CAST(%s AS timestamptz), "
            f"v.type, CAST(v.data AS jsonb), v.actor FROM {source}, "
            f"(VALUES {rows}) AS v(n, type, data, actor))"
        )
    if error_columns:
        columns = ("instance_id", "created_at", *error_columns)
        parts.append(
            f"error AS (INSERT INTO {ERROR_TABLE} ({', '.join(columns)}) "
            f"SELECT {', '.join(typed_placeholders(ErrorRecord, columns))} FROM {source})"
        )
    return "WITH " + ", ".join(parts) + " SELECT fence.status FROM " + source


def _checkpoint_statement(w: StepWrite, now: datetime) -> tuple[str, list[Any]]:
    """The one statement of a checkpoint (PostgreSQL) and its parameters."""
    error_columns = ERROR_COLUMNS if w.error is not None else ()
    sql = _checkpoint_sql(
        len(w.history),
        w.step.seq is not None,
        w.progress,
        w.consume_event is not None,
        error_columns,
    )
    params: list[Any] = [len(w.history), db_time(now)]
    if w.step.seq is not None:
        params.append(w.step.seq)
    params += [w.pk, w.token]
    if w.consume_event is not None:
        params += [w.consume_event, db_time(now), w.step.name, w.consume_event]
    params += _step_values(w.pk, w.step)
    if w.history:
        params += [w.pk, db_time(now)]
        for record in w.history:
            params += [record.type, compact_json(record.data), record.actor]
    if w.error is not None:
        params += [
            w.pk,
            db_time(now),
            *(w.error.get(f.name, f.get_default()) for f in ERROR_FIELDS),
        ]
    return sql, params


def _checkpoint_outcome(w: StepWrite, row: Any) -> str | LeaseLost:
    """The instance's status, or LeaseLost when the fence matched nothing."""
    if row is None:
        if w.consume_event is not None:
            return LeaseLost(
                f"instance #{w.pk}: lease {w.token[:8]} is no longer held, "
                f"or event #{w.consume_event} was consumed by another run"
            )
        return LeaseLost(f"instance #{w.pk}: lease {w.token[:8]} is no longer held")
    w.step.instance_id = w.pk
    return str(row[0])


def _write_at_once(w: StepWrite) -> str:
    """_write_step as one autocommit statement (PostgreSQL): one round trip per checkpoint."""
    faults.hit("before_checkpoint")
    sql, params = _checkpoint_statement(w, clock.now())
    with statement_cursor() as cursor:
        cursor.execute(sql, params)
        outcome = _checkpoint_outcome(w, cursor.fetchone())
    if isinstance(outcome, LeaseLost):
        raise outcome
    return outcome


LOCK_IN_ORDER_SQL = (
    f"SELECT id FROM {INSTANCE_TABLE} WHERE id = ANY(CAST(%s AS bigint[])) "
    "ORDER BY id FOR NO KEY UPDATE"
)


def _write_pipelined(writes: Sequence[StepWrite | FinishWrite]) -> list[str | bool | LeaseLost]:
    """A group commit on PostgreSQL: the checkpoints' statements go down the wire at once
    (psycopg's pipeline mode) in one transaction, with the ends among them in one more
    statement (_finish_many_sql), so N writes cost two round trips and one commit. A
    fenced-out write matches nothing and fails no other; an error fails the group, and
    each run then writes its checkpoint again (Run._write_again), never running its step
    again."""
    now = clock.now()
    steps = [i for i, w in enumerate(writes) if isinstance(w, StepWrite)]
    steps.sort(key=lambda i: writes[i].pk)  # lock order: no deadlock
    ends = [i for i, w in enumerate(writes) if isinstance(w, FinishWrite)]
    statements = {i: _checkpoint_statement(writes[i], now) for i in steps}  # type: ignore[arg-type]
    checkpoints = sum(1 for w in writes if isinstance(w, StepWrite) or w.step is not None)
    close_if_dropped()
    with transaction.atomic():
        for _ in range(checkpoints):
            faults.hit("before_checkpoint")
        cursors = {}
        with pipeline():
            if steps and ends:  # every row locked in instance order first (see write_steps)
                statement_cursor().execute(LOCK_IN_ORDER_SQL, [sorted(w.pk for w in writes)])
            for i in steps:
                cursor = statement_cursor()  # Django's wrapper: counted, logged like any
                cursor.execute(*statements[i])
                cursors[i] = cursor
            if ends:
                finished = statement_cursor()
                ended = [writes[i] for i in ends]
                finished.execute(_finish_many_sql(), _finish_many_params(ended, now))  # type: ignore[arg-type]
        results: list[str | bool | LeaseLost] = [False] * len(writes)
        for i in steps:
            results[i] = _checkpoint_outcome(writes[i], cursors[i].fetchone())  # type: ignore[arg-type]
        if ends:
            done = {pk for (pk,) in finished.fetchall()}
            for i in ends:
                end = writes[i]
                results[i] = end.pk in done
                if results[i] and end.step is not None:  # type: ignore[union-attr]
                    end.step.step.instance_id = end.pk  # type: ignore[union-attr]
    for _ in range(checkpoints):
        faults.hit("after_checkpoint")
    return results


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
    parent_pk: int | None = None,
    step: StepWrite | None = None,
    end_children: bool = False,
    unwound: bool = False,
) -> bool:
    """End the instance (complete, errored, terminated), free its place, start queued ones.

    A child wakes its parent in the same transaction; parent_pk (the child's parent, when
    the caller knows it) is locked first, the order every parent-and-child change keeps.
    `step`: the run's last checkpoint, not written yet (Run.write's hold), goes with the
    end: in its one statement (PostgreSQL) or its transaction. `end_children`: the run
    ends while a step.invoke of it waits for its child, which is terminated in the same
    transaction (end_awaited_children); only such a run pays for the look. `unwound`: the
    end of the run that unwound a cancel(compensate=True), errored when a compensation
    failed for good, passes the fence that refuses other ends while that cancel is pending.
    """
    # What both ways of finishing write, in _finish_rows' order.
    end = (pk, token, status, limits, clock.now(), output_json, error or ("", "", ""))
    at_once = (
        writes_in_one_statement()
        and parent_pk is None
        and not limits.flow_controlled
        and not end_children
        and not unwound
    )
    if at_once and step is not None:
        faults.hit("before_checkpoint")
    if at_once and _finish_at_once(*end, history, error_record, step):
        if step is not None:
            faults.hit("after_checkpoint")
        return True
    # Under flow control the finish and the promotion of the queue share a transaction;
    # a child's finish wakes its parent in it. (Also the answer when the lease is lost.)
    with transaction.atomic():
        if parent_pk is not None:  # issue 15 (children): parent before child
            list(lock_rows(Instance.objects.filter(id=parent_pk)).values_list("id", flat=True))
        if step is not None and not _write_held_step(step):
            return False
        finished = _finish_rows(*end, history, error_record, unwound)
        if finished and end_children:
            end_awaited_children(pk, end[4])
    if finished and step is not None:
        faults.hit("after_checkpoint")
    return finished


def _write_held_step(w: StepWrite) -> bool:
    """A run's held checkpoint in its end's transaction; False when the lease is lost."""
    try:
        _write_step(w.pk, w.token, w.step, w.history, w.consume_event, w.progress, w.error)
    except LeaseLost:
        return False
    return True


def _finish_rows(
    pk: int,
    token: str,
    status: str,
    limits: Limits,
    now: datetime,
    output_json: str | None,
    error: tuple[str, str, str],
    history: Sequence[History],
    error_record: dict[str, Any] | None,
    unwound: bool = False,
) -> bool:
    """finish's writes, inside the caller's transaction; the first statement is the fence."""
    name, message, stack = error
    with sql_cursor() as cursor:
        cursor.execute(
            f"UPDATE {INSTANCE_TABLE} SET history_seq = history_seq + %s, updated_at = %s, status = %s, "
            "output_json = %s, error_name = %s, error_message = %s, error_stack = %s, finished_at = %s, "
            "compensate_on_cancel = %s, wake_at = NULL, waiting_reason = '', lease_token = NULL, "
            "lease_owner = '', lease_expires_at = NULL "
            f"WHERE id = %s AND lease_token = %s AND {NO_CANCEL_PENDING} "
            "RETURNING history_seq, retention_ms, retention_error_ms, workflow, "
            "parent_id, parent_step, concurrency_key",
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
                status == Status.TERMINATED or unwound,
            ],
        )
        row = cursor.fetchone()
    if row is None:
        return False
    last_seq, success_ms, error_ms, workflow, parent_id, parent_step, key = row
    close_open_steps(pk, now)
    if parent_id is not None:  # issue 15 (children)
        wake_parent(parent_id, parent_step, now)
    expiry = retention.expires_at(status, success_ms, error_ms, limits, now)
    if expiry is not None:
        with sql_cursor() as cursor:
            cursor.execute(
                f"UPDATE {INSTANCE_TABLE} SET expires_at = %s WHERE id = %s",
                [db_time(expiry), pk],
            )
    insert_history(pk, last_seq - len(history) + 1, history, now)
    if error_record is not None:
        ErrorRecord.objects.create(instance_id=pk, created_at=now, **error_record)
    if limits.flow_controlled:  # queues form only under flow control (issue 15)
        promote_queued(workflow, limits, now, freed_keys=[key])
    return True


@functools.cache
def _finish_sql(
    history_count: int,
    with_error: bool,
    own_retention: str,
    step: tuple[bool, bool] | None = None,
) -> str:
    """The statement of _finish_at_once for one shape (cached per shape). `step`: the held
    checkpoint's shape (whether it sets step_seq, whether it counts as progress), upserted
    FROM done and left out of the steps the end closes; its history comes first."""
    extra_sets = ""
    if step is not None and step[0]:
        extra_sets += ", step_seq = %s"
    if step is not None and step[1]:
        extra_sets += ", unproductive_claims = 0"
    parts = [
        f"done AS (UPDATE {INSTANCE_TABLE} SET history_seq = history_seq + %s, updated_at = %s, "
        "status = %s, output_json = %s, error_name = %s, error_message = %s, error_stack = %s, "
        "finished_at = %s, compensate_on_cancel = false, wake_at = NULL, waiting_reason = '', "
        "lease_token = NULL, lease_owner = '', lease_expires_at = NULL, "
        # retention.expires_at in SQL: the instance's retention for its outcome, else the
        # default (settings, then the limit); 0 keeps it for ever; at most LATEST_INSTANT.
        f"expires_at = CASE WHEN COALESCE({own_retention}, %s) > 0 THEN LEAST(CAST(%s AS timestamptz) "
        f"+ make_interval(secs => LEAST(COALESCE({own_retention}, %s), 1e15) / 1000.0), "
        f"CAST(%s AS timestamptz)) ELSE expires_at END{extra_sets} "
        f"WHERE id = %s AND lease_token = %s AND parent_id IS NULL AND {NO_CANCEL_PENDING} "
        "RETURNING history_seq)",
        f"closed AS (UPDATE {STEP_TABLE} SET status = %s, wake_at = NULL, completed_at = %s, "
        "last_error_name = %s, last_error_message = %s "
        "WHERE instance_id = %s AND status IN (%s, %s, %s) "
        # Two parts of one statement must not both change a row: the held step is its own.
        + ("AND NOT (kind = %s AND name = %s) " if step is not None else "")
        + "AND EXISTS (SELECT 1 FROM done))",
    ]
    if step is not None:
        parts.append(
            f"step AS (INSERT INTO {STEP_TABLE} ({', '.join(STEP_COLUMNS)}) "
            f"SELECT {', '.join(typed_placeholders(StepRecord, STEP_COLUMNS))} FROM done "
            + UPSERT_STEP_SQL[UPSERT_STEP_SQL.index("ON CONFLICT") :]
            + ")"
        )
    if history_count:
        rows = ", ".join(f"({n}, %s, %s, %s)" for n in range(1, history_count + 1))
        parts.append(
            f"history AS (INSERT INTO {HISTORY_TABLE} (instance_id, sequence, created_at, type, data, actor) "
            f"SELECT %s, done.history_seq - {history_count} + v.n, CAST(%s AS timestamptz), "
            f"v.type, CAST(v.data AS jsonb), v.actor FROM done, "
            f"(VALUES {rows}) AS v(n, type, data, actor))"
        )
    if with_error:
        columns = ("instance_id", "created_at", *ERROR_COLUMNS)
        parts.append(
            f"error AS (INSERT INTO {ERROR_TABLE} ({', '.join(columns)}) "
            f"SELECT {', '.join(typed_placeholders(ErrorRecord, columns))} FROM done)"
        )
    return "WITH " + ", ".join(parts) + " SELECT history_seq FROM done"


# The ends of a group commit (PostgreSQL) in one statement: each row of the JSON parameter
# is one run's end (_finish_many_params), fenced by its lease as _finish_sql's one is.
# Rows are locked in id order first, as every group commit locks them (no deadlock).
@functools.cache
def _finish_many_sql() -> str:
    own = "CASE WHEN r.status = %(complete)s THEN i.retention_ms ELSE i.retention_error_ms END"
    step_columns = ", ".join(f"x.{c}" for c in STEP_COLUMNS)
    error_columns = ", ".join(f"(e).{c}" for c in ERROR_COLUMNS)
    return (
        "WITH r AS MATERIALIZED (SELECT * FROM json_to_recordset(CAST(%(rows)s AS json)) AS r("
        "pk bigint, token text, status text, output text, error_name text, error_message text, "
        "error_stack text, hcount int, default_ms double precision, step_seq int, "
        "progress boolean, step_kind text, step_name text, history json, error json)), "
        # The held steps as typed columns: json_populate_record per row cost ~0.09 ms each.
        f"held AS MATERIALIZED (SELECT * FROM json_to_recordset(CAST(%(steps)s AS json)) AS x("
        f"{recordset_columns(StepRecord, STEP_COLUMNS)})), "
        # "= ANY(ARRAY(...))": the generic plan looks the rows up by id whatever its guess
        # of the batch's size (a join scanned every instance without a parent). No test
        # of parent_id: a child's end never joins a group (Run.end_in_group).
        f"locked AS (SELECT i.id FROM {INSTANCE_TABLE} i JOIN r ON r.pk = i.id "
        "WHERE i.id = ANY(ARRAY(SELECT pk FROM r)) AND i.lease_token = r.token "
        "AND (NOT i.compensate_on_cancel OR r.status = %(terminated)s) "
        "ORDER BY i.id FOR NO KEY UPDATE OF i), "
        f"done AS (UPDATE {INSTANCE_TABLE} i SET history_seq = i.history_seq + r.hcount, "
        "updated_at = %(now)s, status = r.status, output_json = r.output, "
        "error_name = r.error_name, error_message = r.error_message, error_stack = r.error_stack, "
        "finished_at = %(now)s, compensate_on_cancel = false, wake_at = NULL, waiting_reason = '', "
        "lease_token = NULL, lease_owner = '', lease_expires_at = NULL, "
        f"expires_at = CASE WHEN COALESCE({own}, r.default_ms) > 0 THEN LEAST("
        f"CAST(%(now)s AS timestamptz) + make_interval(secs => LEAST(COALESCE({own}, r.default_ms), "
        "1e15) / 1000.0), CAST(%(latest)s AS timestamptz)) ELSE i.expires_at END, "
        "step_seq = COALESCE(r.step_seq, i.step_seq), "
        "unproductive_claims = CASE WHEN r.progress THEN 0 ELSE i.unproductive_claims END "
        "FROM r WHERE i.id = r.pk AND i.id = ANY(ARRAY(SELECT id FROM locked)) "
        "RETURNING i.id, i.history_seq), "
        f"closed AS (UPDATE {STEP_TABLE} s SET status = %(failed)s, wake_at = NULL, "
        "completed_at = %(now)s, last_error_name = %(closed_name)s, "
        "last_error_message = %(closed_message)s FROM done d JOIN r ON r.pk = d.id "
        "WHERE s.instance_id = d.id AND s.status IN (%(waiting)s, %(retrying)s, %(running)s) "
        "AND NOT (r.step_kind IS NOT NULL AND s.kind = r.step_kind AND s.name = r.step_name)), "
        f"step AS (INSERT INTO {STEP_TABLE} ({', '.join(STEP_COLUMNS)}) "
        f"SELECT {step_columns} FROM held x JOIN done d ON d.id = x.instance_id "
        + UPSERT_STEP_SQL[UPSERT_STEP_SQL.index("ON CONFLICT") :]
        + "), "
        f"history AS (INSERT INTO {HISTORY_TABLE} (instance_id, sequence, created_at, type, data, actor) "
        "SELECT d.id, d.history_seq - r.hcount + h.n, %(now)s, h.type, CAST(h.data AS jsonb), h.actor "
        "FROM done d JOIN r ON r.pk = d.id, ROWS FROM (json_to_recordset(r.history) "
        "AS (type text, data json, actor text)) WITH ORDINALITY AS h(type, data, actor, n)), "
        f"error AS (INSERT INTO {ERROR_TABLE} (instance_id, created_at, {', '.join(ERROR_COLUMNS)}) "
        f"SELECT d.id, %(now)s, {error_columns} FROM done d JOIN r ON r.pk = d.id, "
        f"LATERAL (SELECT json_populate_record(NULL::{ERROR_TABLE}, r.error) AS e) AS p "
        "WHERE r.error IS NOT NULL) "
        "SELECT id FROM done"
    )


def _finish_many_params(ends: Sequence[FinishWrite], now: datetime) -> dict[str, Any]:
    rows, steps = [], []
    for end in ends:
        history = list(end.history)
        row: dict[str, Any] = {"pk": end.pk, "token": end.token, "status": end.status}
        row["output"] = end.output_json
        row["error_name"], row["error_message"], row["error_stack"] = end.error or ("", "", "")
        row["default_ms"] = retention.retention_ms(end.status, None, None, end.limits)
        held = end.step
        if held is not None:
            assert held.consume_event is None and held.error is None, "only plain ones are held"
            history = [*held.history, *history]
            record = held.step
            row["step_seq"], row["progress"] = record.seq, held.progress
            row["step_kind"], row["step_name"] = record.kind, record.name
            steps.append(dict(zip(STEP_COLUMNS, _step_values(end.pk, record))))
        row["hcount"] = len(history)
        row["history"] = [{"type": h.type, "data": h.data, "actor": h.actor} for h in history]
        if end.error_record is not None:
            row["error"] = {
                f.column: end.error_record.get(f.name, f.get_default()) for f in ERROR_FIELDS
            }
        rows.append(row)
    name, message = FINISHED_BEFORE_STEP
    return {
        "rows": compact_json_of(rows, _json_default),
        "steps": compact_json_of(steps, _json_default),
        "now": db_time(now),
        "latest": db_time(LATEST_INSTANT),
        "complete": Status.COMPLETE,
        "terminated": Status.TERMINATED,
        "failed": StepStatus.FAILED,
        "closed_name": name,
        "closed_message": message,
        "waiting": StepStatus.WAITING,
        "retrying": StepStatus.RETRYING,
        "running": StepStatus.RUNNING,
    }


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _finish_at_once(
    pk: int,
    token: str,
    status: str,
    limits: Limits,
    now: datetime,
    output_json: str | None,
    error: tuple[str, str, str],
    history: Sequence[History],
    error_record: dict[str, Any] | None,
    step: StepWrite | None = None,
) -> bool:
    """finish as one autocommit statement (PostgreSQL), for workflows without a queue;
    False, writing nothing, for a lost lease or a child (whose parent must wake with it).
    `step`: a held checkpoint (no event to consume, no error record) written in it too."""
    when = db_time(now)
    default = retention.retention_ms(status, None, None, limits)
    shape = None
    if step is not None:
        assert step.consume_event is None and step.error is None, "only plain checkpoints are held"
        shape = (step.step.seq is not None, step.progress)
        history = [*step.history, *history]
    params: list[Any] = [len(history), when, status, output_json, *error, when]
    params += [default, when, default, db_time(LATEST_INSTANT)]
    if step is not None and step.step.seq is not None:
        params.append(step.step.seq)
    params += [pk, token, status == Status.TERMINATED]
    params += [StepStatus.FAILED, when, *FINISHED_BEFORE_STEP, pk, *OPEN_STEP_STATUSES]
    if step is not None:
        params += [step.step.kind, step.step.name, *_step_values(pk, step.step)]
    if history:
        params += [pk, when]
        for record in history:
            params += [record.type, compact_json(record.data), record.actor]
    if error_record is not None:
        params += [pk, when, *(error_record.get(f.name, f.get_default()) for f in ERROR_FIELDS)]
    with statement_cursor() as cursor:
        own = "retention_ms" if status == Status.COMPLETE else "retention_error_ms"
        cursor.execute(_finish_sql(len(history), error_record is not None, own, shape), params)
        row = cursor.fetchone()
    if row is not None and step is not None:
        step.step.instance_id = pk
    return row is not None


@retry_while_locked
def park(
    pk: int,
    token: str,
    pause: bool,
    awaited_types: Sequence[str],
    reason: str = "",
    events_seen: Mapping[str, int] | None = None,
    unwinding: bool = False,
) -> tuple[str, datetime | None]:
    """Free the worker: store when the instance is due next and release the lease.

    The wake time is read from the step rows (sleep ends, retry times, event timeouts), so
    a skip_sleep that landed during the run is honoured. An event of an awaited type that
    arrived during the run (id above events_seen's for its type) makes the instance due at once: no
    wake-up is lost. The row, not the run, says whether a pause holds: a run that stopped
    early (for a pause resumed meanwhile, or its worker shutting down) is due at once.
    Returns the new status and when the instance is due next (None: when told). A
    cancel(compensate=True) that came while the run held the lease (and the run is not
    its unwinding) makes it due at once too: the next run compensates.
    """
    now = clock.now()
    # The newest event id the run read, per awaited type: one read of another type saw
    # newer ids, and an event of this type that came meanwhile is still unseen.
    seen = {t: (events_seen or {}).get(t, 0) for t in awaited_types}
    if writes_in_one_statement():
        parked = _park_at_once(pk, token, pause, awaited_types, reason, seen, now, unwinding)
        if parked is not None:
            return parked
        # A lost lease, a pause that holds, or a cancel: the transaction below says which.
    with transaction.atomic():
        status, _ = fence(pk, token, now, 0, None)
        cancelled = (
            status == Status.COMPENSATING
            and not unwinding
            and Instance.objects.filter(id=pk, compensate_on_cancel=True).exists()
        )
        if status in (Status.WAITING_FOR_PAUSE, Status.PAUSED):
            new_status, wake_at = Status.PAUSED, None
        elif pause or cancelled:  # stopped early (a pause resumed meanwhile, a worker
            # draining, a cancel): due at once
            new_status = Status.COMPENSATING if status == Status.COMPENSATING else Status.WAITING
            wake_at = now
        else:
            new_status = Status.COMPENSATING if status == Status.COMPENSATING else Status.WAITING
            wake_at = StepRecord.objects.filter(
                instance_id=pk, status__in=(StepStatus.WAITING, StepStatus.RETRYING)
            ).aggregate(m=Min("wake_at"))["m"]
            # Only events the run did not see: one it saw and passed over (a typed wait's
            # schema refused it) must not make the instance due again and again.
            unseen = Q()
            for event_type, last in seen.items():
                unseen |= Q(type=event_type, id__gt=last)
            if (
                seen
                and InboxEvent.objects.filter(
                    unseen, instance_id=pk, consumed_at__isnull=True
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
    return new_status, wake_at


def _park_at_once(
    pk: int,
    token: str,
    pause: bool,
    awaited_types: Sequence[str],
    reason: str,
    events_seen: dict[str, int],
    now: datetime,
    unwinding: bool,
) -> tuple[str, datetime | None] | None:
    """park in two statements sent at once (PostgreSQL): the row locked, then the fence,
    the wake time read from the steps, the look for an unseen event and the release in
    one; two round trips with the commit instead of six. None, with nothing written, when
    the lease is lost, a pause holds (the row's status is waitingForPause or paused) or a
    cancel that compensates came during a run that is not its unwinding.

    The lock comes first, in a statement of its own: a statement reads what was committed
    when it began, so an event sent while the park waited for the row (a send_event holds
    it until it commits) would be missed by a look in the same statement, and the send's
    wake-up overwritten by the park's wake time."""
    with transaction.atomic():
        with pipeline():
            statement_cursor().execute(LOCK_IN_ORDER_SQL, [[pk]])
            cursor = statement_cursor()
            cursor.execute(
                PARK_SQL,
                {
                    "pk": pk,
                    "token": token,
                    "now": db_time(now),
                    "due_now": pause,
                    # A list, not array_literal: an event type "null" would read as NULL.
                    "types": list(events_seen),
                    "seen": list(events_seen.values()),
                    "reason": reason,
                    "waiting": Status.WAITING,
                    "compensating": Status.COMPENSATING,
                    "held": array_literal([Status.WAITING_FOR_PAUSE, Status.PAUSED]),
                    "step_waiting": StepStatus.WAITING,
                    "step_retrying": StepStatus.RETRYING,
                    "unwinding": unwinding,
                },
            )
        row = cursor.fetchone()
    return None if row is None else (row[0], from_db_time(row[1]))


# park's writes in one statement: the row is fenced by its lease token and left alone
# (no row returned) when a pause holds or a cancel that compensates is pending. Its wake time: at once for a run that stopped
# early or an event of an awaited type it did not see, else the first step's.
PARK_SQL = f"""
WITH due AS (
    SELECT MIN(wake_at) AS at FROM {STEP_TABLE}
    WHERE instance_id = %(pk)s AND status IN (%(step_waiting)s, %(step_retrying)s)
), unseen AS (
    SELECT EXISTS (
        SELECT 1 FROM {INBOX_TABLE} AS e
        JOIN unnest(CAST(%(types)s AS text[]), CAST(%(seen)s AS bigint[])) AS t(type, seen)
          ON e.type = t.type AND e.id > t.seen
        WHERE e.instance_id = %(pk)s AND e.consumed_at IS NULL
    ) AS found
)
UPDATE {INSTANCE_TABLE} AS i SET
    status = CASE WHEN i.status = %(compensating)s THEN %(compensating)s ELSE %(waiting)s END,
    wake_at = CASE WHEN %(due_now)s OR unseen.found THEN CAST(%(now)s AS timestamptz)
        ELSE due.at END,
    waiting_reason = %(reason)s,
    updated_at = %(now)s,
    lease_token = NULL,
    lease_owner = '',
    lease_expires_at = NULL
FROM due, unseen
WHERE i.id = %(pk)s AND i.lease_token = %(token)s
  AND i.status <> ALL(CAST(%(held)s AS text[]))
  AND (%(unwinding)s OR NOT i.compensate_on_cancel)
RETURNING i.status, i.wake_at
"""


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
def park_unrunnable(
    pk: int, token: str, reason: str, prefix: str = VERSION_MISSING, absent: bool = False
) -> None:
    """Park an instance this process cannot run (its version is not registered here; with
    prefix "", a stored value its payload codec cannot decode), to be looked at again later:
    after VERSION_RECHECK, or ABSENT_VERSION_RECHECK when no worker has run its version for
    VERSION_LIVE (`absent`: the caller looks that up once per version for a claim pass,
    store.absent_versions). One statement, fenced by the lease: a pass of N instances of a
    version no worker runs cost 4N (a fence, a re-read of the workflow and version the
    caller had, a version look-up each, the update)."""
    now = clock.now()
    recheck = VERSION_RECHECK
    if prefix == VERSION_MISSING and absent:
        recheck = ABSENT_VERSION_RECHECK
        reason += (
            f"; no worker has run it for {VERSION_LIVE.total_seconds() / 60:g} min: looked at again "
            "hourly, and at once when a worker that has it starts"
        )
    # A pause asked for before (its run crashed at the boundary) holds: paused, no wake.
    pausing = Q(status=Status.WAITING_FOR_PAUSE)
    Instance.objects.filter(id=pk, lease_token=token).update(
        status=Case(When(pausing, then=Value(Status.PAUSED)), default=Value(Status.WAITING)),
        # Looked at again later: a live worker with the version (busy until now) takes it
        # first then; one starting with it wakes it at once (wake_registered_versions).
        wake_at=Case(When(pausing, then=None), default=Value(now + recheck)),
        waiting_reason=fit_waiting_reason(prefix + reason),
        updated_at=now,
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
        # The keys kept plus the keys set: at most MAX_ATTRIBUTES per instance, as at create.
        kept = (
            InstanceAttribute.objects.filter(instance_id=pk)
            .exclude(key__in=list(attributes))
            .count()
        )
        if kept + len(attributes) > MAX_ATTRIBUTES:
            raise LimitExceeded(
                "max attributes",
                f"{kept + len(attributes)} ({kept} kept, {len(attributes)} set)",
                MAX_ATTRIBUTES,
                f"attributes of instance #{pk}",
            )
        with sql_cursor() as cursor:
            cursor.execute(
                f"UPDATE {INSTANCE_TABLE} SET attributes = {merge_json_sql('attributes')} "
                "WHERE id = %s",
                [json.dumps(attributes, separators=(",", ":")), pk],
            )
        upsert_attributes(pk, attributes)
